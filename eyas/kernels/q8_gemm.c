/* out = x @ dequant(weight)^T with the activations quantized to int8 and integer dot products on the weights'
   own block integers: matmul precision "low", the arithmetic llama.cpp runs its GGUF products in.

   x [M, K] float32 (row stride ldx), weight [N, row_bytes] in a GGUF block format (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
   Q6_K) or eyas's I8_ROW (row_scale [N]), out [M, N] float32 (row stride ldo). F16 and BF16 have no integers to
   multiply: the call returns -2 for them and the caller keeps them on quant_gemm.c.

   Activations, per block b of 32 (quantize_row): dx = max|x| / 127, qx = rint(x / dx) (nearest even), and
   sx = sum(qx), so the block is dx * qx. Split (eyas_q8_gemm_split, the attention's q/k/v): a row goes in as two
   such rows, its blocks and what they leave (r = x - dx * qx, quantized by the same rule), and its output is the
   two rows' outputs summed, one rounding: activations exact to about 2^-16 of a block's max, not 2^-8.
   Weights, per sub-block of 32: canonical int8 integers w with a float scale sw and offset ow, the weight being
   sw * w + ow (unpack_row):
     Q4_0   w = q (0..15), sw = d, ow = -8 d          Q4_1  w = q (0..15), sw = d, ow = m
     Q4_K   w = q (0..15), sw = d sc, ow = -dmin m    Q5_K  w = q (0..31), the same
     Q8_0   w = q (-128..127), sw = d                 I8_ROW  w = q, sw = 1 (the row scale multiplies the sum)
     Q6_K   w = q - 32, and the integer scales sc0, sc1 of its two halves of 16 multiply inside the block.
   Block b of output (n, m) is then t_b = dx * (sw * i_b + ow * sx) with i_b = sum(w * qx) an exact integer
   (|i_b| < 2^24, so float(i_b) is exact too), each product and sum rounded once, never fused. Example, Q4_1
   with d = 0.5, m = -1: w = (3, 0, ...), qx = (10, -4, ...) -> i = 30, sx = 6, t = dx * (15 + -6).

   One order for every build: the t_b go into 8 float lanes, lane l summing blocks l, l + 8, l + 16, ... in turn
   from 0.0, and the lanes are summed ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)). The integer i_b may be
   summed in any order (integers are exact), so each build picks its own instructions for it: 512-bit vpdpbusd
   on AVX512-VNNI (EYAS_VNNI512, two blocks an instruction), 256-bit on AVX-VNNI (EYAS_VNNI256), vpmaddubsw +
   vpmaddwd on AVX2, C loops elsewhere; every build gives the same bits. A row's result does not depend on the
   batch, the thread count or the row count: threads split the weight rows in tiles of TILE_N, each tile is
   unpacked once into a thread's buffer (canonical integers, scales), and every (row, output) pair runs the same
   loop.

   The unsigned formats go straight into vpdpbusd (unsigned weights times signed qx); the signed ones (Q8_0,
   Q6_K, I8_ROW) as |w| times qx with w's sign (vpsignb), exact since |qx| <= 127.

   Q4_0, Q4_1 and Q8_0 weights are read interleaved 16 rows at a time instead (type R16 + the GGUF type: see
   q8_interleaved.h, which also makes the layout), with the same bits: a vpdpbusd lane an output row, so no lane
   sums across a block and the scales applied to 16 outputs at once; on AMX-INT8 (EYAS_AMX), from 16 rows of x
   the block integers of 16 rows x 16 outputs come from one tdpbssd instead (q8_amx.h). On the Intel Xeon this was
   measured on (Emerald Rapids class, 1 thread, SmolLM2's shapes), the tile loop below runs a one-row product at
   0.75-0.95x the speed of quant_gemm.c's float32 FMAs; the interleaved loop at 1.3-2.6x (docs/cpu-weights.md). */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "gguf_blocks.h"
#include "parallel.h"

#if defined(EYAS_VNNI512) && !defined(__AVX512VNNI__)
#error "EYAS_VNNI512 needs -mavx512vnni"
#endif
#if defined(EYAS_VNNI256) && !defined(__AVXVNNI__)
#error "EYAS_VNNI256 needs -mavxvnni"
#endif

#define SUB 32     /* weights per block: the unit of the integer dot products */
#define LANES 8    /* float lanes of the block sums */
#define TILE_N 8   /* weight rows unpacked at a time into a thread's buffer */
#define PREFETCH_ROWS 16 /* the weight rows this far ahead are asked for while a row is unpacked */
#define SMALL_X 32768    /* bytes of quantized activations kept on the stack (decode steps) */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v32u8 __attribute__((vector_size(32)));

static inline int is_signed(int type) { return type == Q8_0 || type == Q6_K || type == I8_ROW; }
static inline int has_offset(int type) { return type == Q4_0 || type == Q4_1 || type == Q4_K || type == Q5_K; }

/* blocks rounded up to whole groups of LANES: the float planes below are zero-padded to it */
static inline int64_t padded(int64_t nsub) { return (nsub + LANES - 1) / LANES * LANES; }

/* One block of 32 values v -> q [32] int8, d and s (float, exact): the rule at the top */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Two 16-lane vectors: max |v| by vmaxps with the running maximum second (a NaN in v is skipped, as below), the
   quotients rounded by vcvtps2dq (round half to even, as rintf), narrowed by vpmovdb: the same d, q and s as the
   loops below, at about a third of their time (a prefill of 16 chat prompts quantizes 155 M values) */
static inline void quantize_block(const float *v, int8_t *q, float *d, float *s) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(b), _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(m), dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    *d = dd;
    *s = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#else
static inline void quantize_block(const float *v, int8_t *q, float *d, float *s) {
    /* max |v| as fmaxf gives it (a NaN is skipped; the max of the rest does not depend on the order), in 8 running
       maxima and then theirs: vector compares, not 32 calls to fmaxf */
    v8f m8 = {0};
    for (int i = 0; i < SUB; i += 8) {
        v8f a;
        memcpy(&a, v + i, sizeof a);
        a = (v8f)((v8i)a & 0x7fffffff);
        v8i gt = a > m8;
        m8 = (v8f)((gt & (v8i)a) | (~gt & (v8i)m8));
    }
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = m8[i] > amax ? m8[i] : amax;
    float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < SUB; i++) {
        int32_t qi = (int32_t)rintf(v[i] * id);
        q[i] = (int8_t)qi;
        sum += qi;
    }
    *d = dd;
    *s = (float)sum;
}
#endif

/* One row of x -> qx [nsub * 32] int8, dx [padded(nsub)] and sx [padded(nsub)] (float, exact; 0 past nsub).
   split: into two such rows, a (its blocks) and b (what they leave: r = x - dx * qx, the product and the difference
   each rounded once, quantized by the same rule), so x = dx qx + dr qr to half a step of max|r| / 127: about 2^-16
   of each block's max|x| instead of 2^-8. b's planes follow a's (qx + kq, dx + np, sx + np). */
static void quantize_row(const float *x, int64_t nsub, int split, int8_t *qx, float *dx, float *sx) {
    const int64_t kq = SUB * nsub, np = padded(nsub);
    for (int64_t b = nsub; b < np; b++) {
        dx[b] = sx[b] = 0.0f;
        if (split) dx[np + b] = sx[np + b] = 0.0f;
    }
    for (int64_t b = 0; b < nsub; b++) {
        const float *v = x + SUB * b;
        quantize_block(v, qx + SUB * b, dx + b, sx + b);
        if (!split) continue;
        float r[SUB];
        for (int i = 0; i < SUB; i++) r[i] = v[i] - dx[b] * (float)qx[SUB * b + i];
        quantize_block(r, qx + kq + SUB * b, dx + np + b, sx + np + b);
    }
}

static inline v32u8 load32(const uint8_t *p) {
    v32u8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q4_0 / Q4_1 / Q8_0: each block's float16 d (and Q4_1's m) as floats: sw = d, ow = -8 d (Q4_0) or m (Q4_1).
   With AVX2, 8 blocks at a time: one gather of each block's first 4 bytes, its halves converted (exact). */
static inline __attribute__((always_inline)) void block_halves(const int type, const uint8_t *row, int64_t nsub,
                                                             float *sw, float *ow) {
    const int bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    int64_t b = 0;
#if defined(__AVX2__)
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bb));
    for (; b + 8 <= nsub; b += 8) {
        __m256i v = _mm256_i32gather_epi32((const int *)(row + b * bb), at, 1); /* d | m << 16 */
        __m256i d = _mm256_and_si256(v, _mm256_set1_epi32(0xffff)), m = _mm256_srli_epi32(v, 16);
        __m128i d16 = _mm_packus_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
        __m128i m16 = _mm_packus_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        __m256 df = _mm256_cvtph_ps(d16);
        _mm256_storeu_ps(sw + b, df);
        if (type == Q4_0) _mm256_storeu_ps(ow + b, _mm256_mul_ps(_mm256_set1_ps(-8.0f), df));
        if (type == Q4_1) _mm256_storeu_ps(ow + b, _mm256_cvtph_ps(m16));
    }
#endif
    for (; b < nsub; b++) {
        sw[b] = half_to_float(row + b * bb);
        if (type == Q4_0) ow[b] = -8.0f * sw[b];
        if (type == Q4_1) ow[b] = half_to_float(row + b * bb + 2);
    }
}

/* A weight row -> its canonical integers w [nsub * 32], sw and ow [padded(nsub)] (0 past nsub) and (Q6_K) the
   half scales hs [2 * nsub] (see the top of the file) */
static inline __attribute__((always_inline)) void unpack_row(const int type, const uint8_t *row, int64_t nsub,
                                                           int8_t *w, float *sw, float *ow, int32_t *hs) {
    for (int64_t b = nsub; b < padded(nsub); b++) sw[b] = ow[b] = 0.0f;
    if (type == Q4_0 || type == Q4_1 || type == Q8_0) block_halves(type, row, nsub, sw, ow);
    for (int64_t sb = 0; sb < nsub; sb++) {
        uint8_t *out = (uint8_t *)w + SUB * sb;
        switch (type) {
        case Q4_0: case Q4_1: { /* weight i in the low nibble of byte i, weight 16 + i in its high nibble */
            const uint8_t *blk = row + sb * (type == Q4_0 ? 18 : 20);
            v16u8 q = bytes16(blk + (type == Q4_0 ? 2 : 4)), lo = q & 15, hi = q >> 4;
            memcpy(out, &lo, 16);
            memcpy(out + 16, &hi, 16);
            break;
        }
        case Q8_0:
            memcpy(out, row + sb * 34 + 2, SUB);
            break;
        case I8_ROW:
            memcpy(out, row + SUB * sb, SUB);
            sw[sb] = 1.0f;
            break;
        case Q4_K: case Q5_K: { /* sub-block j: the low (even j) or high nibbles of 32 bytes; Q5_K's bit 4 is bit j of qh */
            const uint8_t *blk = row + sb / 8 * (type == Q4_K ? 144 : 176);
            int j = sb % 8, sc, mn;
            v32u8 q = load32(blk + (type == Q4_K ? 16 : 48) + 32 * (j / 2));
            q = (j & 1) ? q >> 4 : q & 15;
            if (type == Q5_K) q |= ((load32(blk + 16) >> j) & 1) << 4;
            memcpy(out, &q, SUB);
            k_scale_min(blk + 4, j, &sc, &mn);
            sw[sb] = half_to_float(blk) * (float)sc;
            ow[sb] = -(half_to_float(blk + 2) * (float)mn);
            break;
        }
        case Q6_K: { /* group g of 32: 4 low bits from ql, 2 high bits from qh, minus 32; a scale per 16 */
            const uint8_t *blk = row + sb / 8 * 210;
            int g = sb % 8, half = g / 4, part = g % 4;
            v32u8 lo = load32(blk + 64 * half + 32 * (part & 1));
            lo = part < 2 ? lo & 15 : lo >> 4;
            v32u8 hi = (load32(blk + 128 + 32 * half) >> (2 * part)) & 3;
            v32u8 q = (lo | (hi << 4)) - 32;
            memcpy(out, &q, SUB);
            sw[sb] = half_to_float(blk + 208);
            hs[2 * sb] = ((const int8_t *)blk)[192 + 2 * g];
            hs[2 * sb + 1] = ((const int8_t *)blk)[192 + 2 * g + 1];
            break;
        }
        }
    }
}

#if defined(EYAS_VNNI512)
/* the integer dot products of blocks 0..count-1 (count <= 8) of w and x, two blocks a vpdpbusd; lanes past count
   are 0. z[p]'s lanes 0-7 hold block 2p's 4-product sums, 8-15 block 2p + 1's; a transposing tree adds them. */
static inline v8i block_dots(const int type, const int8_t *w, const int8_t *x, const int32_t *hs, int count) {
    __m512i z[4];
    for (int p = 0; p < 4; p++) {
        if (2 * p >= count) {
            z[p] = _mm512_setzero_si512();
            continue;
        }
        __mmask64 live = 2 * p + 1 < count ? ~(__mmask64)0 : (__mmask64)0xffffffff;
        __m512i wv = _mm512_maskz_loadu_epi8(live, w + 64 * p), xv = _mm512_maskz_loadu_epi8(live, x + 64 * p);
        if (is_signed(type)) {
            xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
            wv = _mm512_abs_epi8(wv);
        }
        z[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        if (type == Q6_K) /* 4-lane groups: the first and second 16 weights of each block */
            z[p] = _mm512_mullo_epi32(z[p], _mm512_permutexvar_epi32(
                _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(hs + 4 * p)))));
    }
    /* within each 128-bit quarter: [z0 + z0', z1 + z1', ...] pairs, then quads: quarter q of c = the sums of lanes
       4q..4q+3 of z0, z1, z2, z3 */
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
    __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    /* quarters 0 + 1 are blocks 0, 2, 4, 6; quarters 2 + 3 blocks 1, 3, 5, 7 */
    __m512i d = _mm512_add_epi32(c, _mm512_shuffle_i32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
    __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return (v8i)_mm512_castsi512_si256(_mm512_permutexvar_epi32(order, d));
}
#elif defined(__AVX2__)
/* the 8 int32 lanes of one block's products: lane i sums the products of bytes 4i..4i+3 */
static inline __m256i block_lanes(const int type, const int8_t *w, const int8_t *x, const int32_t *hs) {
    __m256i wv = _mm256_loadu_si256((const __m256i *)w), xv = _mm256_loadu_si256((const __m256i *)x);
    if (is_signed(type)) {
        xv = _mm256_sign_epi8(xv, wv);
        wv = _mm256_abs_epi8(wv);
    }
#if defined(EYAS_VNNI256)
    __m256i lanes = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wv, xv);
#else /* pairs of products fit int16: at most 2 * 128 * 127 */
    __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), _mm256_set1_epi16(1));
#endif
    if (type == Q6_K) /* lanes 0-3 are the first 16 weights, 4-7 the second */
        lanes = _mm256_mullo_epi32(lanes, _mm256_setr_epi32(hs[0], hs[0], hs[0], hs[0], hs[1], hs[1], hs[1], hs[1]));
    return lanes;
}

/* the integer dot products of blocks 0..count-1 (count <= 8) of w and x; lanes past count are 0 */
static inline v8i block_dots(const int type, const int8_t *w, const int8_t *x, const int32_t *hs, int count) {
    __m256i v[8];
    for (int b = 0; b < 8; b++)
        v[b] = b < count ? block_lanes(type, w + SUB * b, x + SUB * b, hs + 2 * b) : _mm256_setzero_si256();
    /* pairwise sums within 128-bit halves, then the halves: lane b = the sum of v[b]'s lanes */
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i h03 = _mm256_hadd_epi32(h01, h23), h47 = _mm256_hadd_epi32(h45, h67);
    return (v8i)_mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20), _mm256_permute2x128_si256(h03, h47, 0x31));
}
#else
static inline v8i block_dots(const int type, const int8_t *w, const int8_t *x, const int32_t *hs, int count) {
    v8i out = {0};
    for (int b = 0; b < count; b++) {
        int32_t half[2] = {0, 0};
        for (int i = 0; i < SUB; i++) half[i / 16] += (int32_t)w[SUB * b + i] * x[SUB * b + i];
        out[b] = type == Q6_K ? hs[2 * b] * half[0] + hs[2 * b + 1] * half[1] : half[0] + half[1];
    }
    return out;
}
#endif

static inline v8f load8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef struct {
    int8_t *w;   /* [TILE_N, nsub * 32] */
    float *sw, *ow; /* [TILE_N, padded(nsub)] each */
    int32_t *hs; /* [TILE_N, 2 * nsub] */
} tile_t;

/* the 8 outputs of acc[0..7] (8 lanes each), each summed ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) */
static inline v8f lane_sums(const v8f acc[8]) {
#if defined(__AVX2__) /* the same adds, 8 outputs at a time: halves added, then two pairwise adds */
    __m256 p[4];
    for (int j = 0; j < 4; j++)
        p[j] = _mm256_add_ps(_mm256_permute2f128_ps((__m256)acc[2 * j], (__m256)acc[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps((__m256)acc[2 * j], (__m256)acc[2 * j + 1], 0x31));
    __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3])); /* outputs 0 2 4 6 | 1 3 5 7 */
    return (v8f)_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
    v8f out;
    for (int j = 0; j < 8; j++) {
        v8f a = acc[j];
        out[j] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    }
    return out;
#endif
}

/* the tile's TILE_N (8) weight rows against one quantized row of x: each output's blocks t_b summed in the
   fixed order of the top of the file */
static inline __attribute__((always_inline)) v8f dot_tile(const int type, int64_t nsub, const tile_t *t,
                                                        const int8_t *qx, const float *dx, const float *sx) {
    int64_t kq = SUB * nsub, np = padded(nsub);
    v8f acc[TILE_N] = {{0}};
    for (int64_t b = 0; b < nsub; b += LANES) {
        int count = nsub - b < LANES ? (int)(nsub - b) : LANES;
        v8f d = load8f(dx + b), s = load8f(sx + b);
#pragma GCC unroll 8
        for (int j = 0; j < TILE_N; j++) {
            v8i ib = block_dots(type, t->w + j * kq + SUB * b, qx + SUB * b, t->hs + j * 2 * nsub + 2 * b, count);
            v8f v = load8f(t->sw + j * np + b) * __builtin_convertvector(ib, v8f);
            if (has_offset(type)) v = v + load8f(t->ow + j * np + b) * s;
            acc[j] = acc[j] + d * v;
        }
    }
    return lane_sums(acc);
}

/* rows n0..n0+nb-1 of the weight against every row of the quantized x (a partial tile's missing rows are zeros) */
static inline __attribute__((always_inline)) void tile_rows(const int type, const uint8_t *weight, int64_t rb,
                                                          int64_t n0, int64_t nb, int64_t n_len, int64_t nsub,
                                                          const int8_t *qx, const float *dx, const float *sx,
                                                          int64_t m_len, const float *row_scale, float *out,
                                                          int64_t ldo, tile_t *t) {
    int64_t kq = SUB * nsub, np = padded(nsub);
    for (int64_t j = 0; j < TILE_N; j++) {
        if (j >= nb) {
            memset(t->w + j * kq, 0, (size_t)kq);
            memset(t->sw + j * np, 0, sizeof(float) * (size_t)np);
            memset(t->ow + j * np, 0, sizeof(float) * (size_t)np);
            memset(t->hs + j * 2 * nsub, 0, sizeof(int32_t) * 2 * (size_t)nsub);
            continue;
        }
        int64_t ahead = n0 + j + PREFETCH_ROWS;
        if (ahead < n_len)
            for (int64_t c = 0; c < rb; c += 64) __builtin_prefetch(weight + ahead * rb + c, 0, 3);
        unpack_row(type, weight + (n0 + j) * rb, nsub, t->w + j * kq, t->sw + j * np, t->ow + j * np,
                   t->hs + j * 2 * nsub);
    }
    for (int64_t m = 0; m < m_len; m++) {
        v8f r = dot_tile(type, nsub, t, qx + m * kq, dx + m * np, sx + m * np);
        for (int64_t j = 0; j < nb; j++) out[m * ldo + n0 + j] = row_scale ? r[j] * row_scale[n0 + j] : r[j];
    }
}

#define GEMM_FOR(TYPE)                                                                                         \
    static int gemm_##TYPE(const int8_t *qx, const float *dx, const float *sx, const uint8_t *weight,         \
                           const float *row_scale, float *out, int64_t ldo, int64_t m_len, int64_t n_len,    \
                           int64_t k_len, int num_threads) {                                                \
        int64_t rb = row_bytes(TYPE, k_len), nsub = k_len / SUB, tiles = (n_len + TILE_N - 1) / TILE_N;     \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel num_threads(num_threads)")                                                    \
        {                                                                                                   \
            tile_t t;                                                                                       \
            int64_t np = padded(nsub);                                                                      \
            char *mem = malloc((size_t)(TILE_N * (nsub * (SUB + 8) + np * 8) + 64));                        \
            t.w = (int8_t *)mem;                                                                            \
            t.sw = (float *)(mem + TILE_N * nsub * SUB);                                                    \
            t.ow = t.sw + TILE_N * np;                                                                      \
            t.hs = (int32_t *)(t.ow + TILE_N * np);                                                         \
            if (!mem) {                                                                                     \
                _Pragma("omp atomic write")                                                                 \
                failed = 1;                                                                                 \
            }                                                                                               \
            _Pragma("omp barrier")                                                                          \
            _Pragma("omp for schedule(static)")                                                             \
            for (int64_t i = 0; i < tiles; i++) {                                                          \
                if (failed) continue;                                                                       \
                int64_t n0 = i * TILE_N, nb = n_len - n0 < TILE_N ? n_len - n0 : TILE_N;                   \
                tile_rows(TYPE, weight, rb, n0, nb, n_len, nsub, qx, dx, sx, m_len, row_scale, out, ldo, &t); \
            }                                                                                               \
            free(mem);                                                                                      \
        }                                                                                                   \
        return failed ? -1 : 0;                                                                             \
    }
INTEGER_FORMATS(GEMM_FOR)
#include "q8_interleaved.h"

/* x's rows quantized (two rows each when split: quantize_row), multiplied by the weight; split rows' two products
   are summed, a's + b's, into out */
static int q8_product(const float *x, int64_t ldx, const uint8_t *weight, int type, const float *row_scale, float *out,
                      int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads, int split) {
    if (type == F16 || type == BF16) return -2;
    int base = type > R16 && interleaves(type - R16) ? type - R16 : type, bs = block_size(base);
    if (bs == 0 || k_len % bs != 0 || k_len % SUB != 0 || (type == I8_ROW && row_scale == NULL)) return -1;
    int64_t nsub = k_len / SUB, np = padded(nsub), per = split ? 2 : 1, q_len = per * m_len;
    /* split on interleaved weights off AMX tiles: the product sums each row's two outputs itself (r16_thread) */
    const int pairs = split && base != type && !amx_tiles(type, q_len);
    /* x quantized: qx [rows, K] int8, then dx and sx [rows, padded(nsub)] float each; rows = M (2M split, row m's
       two at 2m and 2m + 1), or that rounded up to whole tiles of 16 rows for AMX (q8_amx.h), the rows past it
       zero; then, split (unless pairs), the products of the 2M rows [2M, N] */
    _Alignas(64) char small[SMALL_X];
    int64_t rows = amx_tiles(type, q_len) ? (q_len + 15) / 16 * 16 : q_len, bytes = rows * (k_len + 8 * np);
    int64_t products = split && !pairs ? q_len * n_len * (int64_t)sizeof(float) : 0;
    int few = bytes + products <= SMALL_X;
    char *mem = few ? small : malloc((size_t)(bytes + products));
    if (!mem) return -1;
    int8_t *qx = (int8_t *)mem;
    float *dx = (float *)(mem + rows * k_len), *sx = dx + rows * np, *parts = (float *)(mem + bytes);
    memset(qx + q_len * k_len, 0, (size_t)((rows - q_len) * k_len));
    memset(dx + q_len * np, 0, sizeof(float) * (size_t)((rows - q_len) * np));
    memset(sx + q_len * np, 0, sizeof(float) * (size_t)((rows - q_len) * np));
    /* split: b's planes one row after a's, as quantize_row puts them */
    PARALLEL_ROWS(m, m_len, !few,
                  { quantize_row(x + m * ldx, nsub, split, qx + per * m * k_len, dx + per * m * np, sx + per * m * np); });
    int status = -1;
    float *dst = split && !pairs ? parts : out;
    int64_t ldd = split && !pairs ? n_len : ldo;
#define CALL(TYPE) \
    case TYPE: status = gemm_##TYPE(qx, dx, sx, weight, row_scale, dst, ldd, q_len, n_len, k_len, num_threads); break;
#define CALL_R16(TYPE) \
    case R16 + TYPE: \
        status = gemm_r16_##TYPE(qx, dx, sx, weight, dst, ldd, q_len, n_len, k_len, num_threads, pairs); break;
    switch (type) { INTEGER_FORMATS(CALL) CALL_R16(Q4_0) CALL_R16(Q4_1) CALL_R16(Q8_0) }
#undef CALL
#undef CALL_R16
    if (split && !pairs && status == 0)
        PARALLEL_ROWS(m, m_len, !few, {
            for (int64_t j = 0; j < n_len; j++) out[m * ldo + j] = parts[2 * m * n_len + j] + parts[(2 * m + 1) * n_len + j];
        });
    if (!few) free(mem);
    return status;
}

/* Returns 0; -1 for an unknown type, a K the format cannot hold, or no memory; -2 for F16 / BF16 (no integer
   path: use quant_gemm.c). The same arguments as quant_gemm.c's eyas_quant_gemm. */
int eyas_q8_gemm(const float *x, int64_t ldx, const uint8_t *weight, int type, const float *row_scale, float *out,
                 int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads) {
    return q8_product(x, ldx, weight, type, row_scale, out, ldo, m_len, n_len, k_len, num_threads, 0);
}

/* eyas_q8_gemm with each row of x split in two int8 rows (quantize_row): about float32's accuracy at twice one
   row's integer work, for the attention's q/k/v products, whose roundings meet in the softmax */
int eyas_q8_gemm_split(const float *x, int64_t ldx, const uint8_t *weight, int type, const float *row_scale,
                       float *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads) {
    return q8_product(x, ldx, weight, type, row_scale, out, ldo, m_len, n_len, k_len, num_threads, 1);
}

/* The quantized activations of x [M, K] as the products use them (tests): qx [M, K] int8, dx and sx
   [M, K / 32 rounded up to a multiple of 8] */
int eyas_q8_quantize(const float *x, int64_t ldx, int64_t m_len, int64_t k_len, int8_t *qx, float *dx, float *sx) {
    if (k_len % SUB != 0) return -1;
    int64_t nsub = k_len / SUB, np = padded(nsub);
    for (int64_t m = 0; m < m_len; m++) quantize_row(x + m * ldx, nsub, 0, qx + m * k_len, dx + m * np, sx + m * np);
    return 0;
}
