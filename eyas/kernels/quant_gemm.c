/* out = x @ dequant(weight)^T with the weight kept in a compact block format, float32 activations.

   x [M, K] float32 (row stride ldx), weight [N, row_bytes] (one quantized row per output, in the
   format's own bytes: the GGUF block layout for GGML types), out [M, N] float32 (row stride ldo).

   Formats (ids are GGML's type numbers; I8_ROW is eyas's own):
     F16, BF16   one 2-byte float per weight;
     Q4_0, Q4_1, Q8_0   blocks of 32 weights with one or two float16 scales;
     Q4_K, Q5_K, Q6_K   super-blocks of 256 with 6-bit / 8-bit sub-block scales;
     I8_ROW      one int8 per weight, times a float32 scale per output row (row_scale[N]).
   Each block is dequantized with the same float32 operations, in the same order, as the gguf
   package's numpy reference (products and sums rounded one at a time, never fused), so the
   dequantized weights equal gguf's bit for bit.

   A weight is w = s * q + o with q a small integer, s a scale and o an offset shared by a
   sub-block (32 weights; 16 for Q6_K's scales). Each sub-block is decoded to floats in registers,
   rounded exactly as gguf dequantizes (so the weights the products use are gguf's bit for bit), and
   multiplied into x with fused multiply-adds; the dequantized matrix is never stored.

   One arithmetic for every row count. Threads split the output rows into tiles of TILE_N weight
   rows (static split), computed TILE_M rows of x at a time with TILE_N x TILE_M accumulators in
   registers. Up to TILE_M rows (decode, short verification chains) decode the weights in
   registers as they stream by; more rows (batches) decode each tile once into a per-thread buffer
   and reuse it for every row group, and inputs too large for L2 (prefill) decode a panel of tiles
   at a time and sweep each row group across it (see panel()). All read the same decoded values in
   the same order.

   Every output element is one 16-lane accumulator summed over k in order with exactly rounded
   fused multiply-adds, reduced in one fixed tree: the result does not depend on the thread count,
   on the other rows of x, or on which instruction set ran it. The AVX512, AVX2 and portable builds of this file give the same
   bits (the portable build's fmaf is exact too, only slower).

   Built with EYAS_BF16_PRODUCTS (and -mavx512bf16), the products take bfloat16 inputs instead, as PyTorch's
   float32 matmul precision "medium" allows: each row of x is rounded to bfloat16 once per call, each decoded
   weight (gguf's float32 value) is rounded to bfloat16 (round to nearest even; BF16 weights and I8_ROW's
   integers stay exact), and a sub-block's 32 products are summed in pairs by one vdpbf16ps into the same 16
   float32 lanes: half the instructions of the float32 FMAs. The order is again fixed, so a row's result still does
   not depend on the batch or the thread count; it differs from the float32 build's by the bf16 roundings. */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include "gguf_blocks.h"

#if defined(EYAS_BF16_PRODUCTS) && !defined(__AVX512BF16__)
#error "EYAS_BF16_PRODUCTS needs -mavx512bf16"
#endif


#if defined(__AVX512F__)
#define TILE_N 4
#define TILE_M 4 /* 16 accumulators + 8 decoded weight vectors + x, of 32 zmm registers */
#elif defined(__AVX2__)
#define TILE_N 2
#define TILE_M 2 /* a 16-lane vector is two ymm registers: 8 accumulator + 8 weight registers of 16 */
#else
#define TILE_N 2
#define TILE_M 2
#endif
#define SUB 32 /* weights per sub-block: the unit of decoding */

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v16i8 __attribute__((vector_size(16)));

/* A 16-lane vector from two 8-lane halves, through memory of the same widths (a 32-byte store then a 32-byte
   load of the same place forwards). __builtin_shufflevector between 8 and 16 lanes is lowered on AVX2 into
   one scalar store per lane and a reload that cannot forward: the AVX2 build ran 20x slower than AVX512. */
static inline v16f cat8(v8f lo, v8f hi) {
    v16f r;
    memcpy(&r, &lo, sizeof lo);
    memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
    return r;
}

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* s in every lane, exactly (-0.0 stays -0.0). A 16-lane vector times a scalar is lowered through the stack on
   AVX2 (its halves are built in memory and reloaded, stalling store forwarding), so broadcast explicitly. */
static inline v16f splat(float s) {
#if defined(__AVX512F__)
    return (v16f)_mm512_set1_ps(s);
#elif defined(__AVX2__)
    v8f h = (v8f)_mm256_set1_ps(s);
    return cat8(h, h);
#else
    v16f v;
    for (int i = 0; i < 16; i++) v[i] = s;
    return v;
#endif
}

/* 16 unsigned / signed bytes -> 16 int32 lanes: one widening shuffle (Q4 nibbles are then split with
   integer ops on the lanes) */
#if defined(__AVX512F__)
#define WIDEN(NAME, BYTES, CVT512, CVT256) \
    static inline v16i NAME(BYTES q) { return (v16i)CVT512((__m128i)q); }
#elif defined(__AVX2__)
#define WIDEN(NAME, BYTES, CVT512, CVT256)                                                            \
    static inline v16i NAME(BYTES q) {                                                               \
        v8i lo = (v8i)CVT256((__m128i)q), hi = (v8i)CVT256(_mm_srli_si128((__m128i)q, 8));           \
        v16i r;                                                                                      \
        memcpy(&r, &lo, sizeof lo);                                                                  \
        memcpy((char *)&r + sizeof lo, &hi, sizeof hi);                                              \
        return r;                                                                                    \
    }
#else
#define WIDEN(NAME, BYTES, CVT512, CVT256) \
    static inline v16i NAME(BYTES q) { return __builtin_convertvector(q, v16i); }
#endif
WIDEN(u8_to_i32, v16u8, _mm512_cvtepu8_epi32, _mm256_cvtepu8_epi32)
WIDEN(i8_to_i32, v16i8, _mm512_cvtepi8_epi32, _mm256_cvtepi8_epi32)

static inline v16f i32_to_f(v16i v) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtepi32_ps((__m512i)v);
#else
    return __builtin_convertvector(v, v16f);
#endif
}
static inline v16f u8_to_f(v16u8 q) { return i32_to_f(u8_to_i32(q)); }
static inline v16f i8_to_f(const uint8_t *p) {
    v16i8 q;
    memcpy(&q, p, sizeof q);
    return i32_to_f(i8_to_i32(q));
}


/* 16 float16 / bfloat16 values -> 16 floats */
static inline v16f f16_to_f(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
    return cat8((v8f)lo, (v8f)hi);
#else
    v16f v;
    for (int i = 0; i < 16; i++) v[i] = half_to_float(p + 2 * i);
    return v;
#endif
}
/* a bfloat16 is the high half of its float32: widen each 16-bit value and shift it up (exact). Lane by lane
   it ran at 3 G weights/s on one Zen 4 core, a quarter of Q4_1's decoding. */
static inline v16f bf16_to_f(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), 16);
    return cat8((v8f)lo, (v8f)hi);
#else
    v16f v;
    for (int i = 0; i < 16; i++) {
        uint32_t bits = (uint32_t)(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
        memcpy((float *)&v + i, &bits, 4);
    }
    return v;
#endif
}

static inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    v16f r;
    for (int i = 0; i < 16; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

/* The sum of a 16-lane vector l in one fixed tree, ((l0 + l8) + (l4 + l12)) + ...: s[i] = l[i] + l[i + 8], then
   ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)). half_sum takes s. Written as vector halvings: as a loop
   over floats, gcc spilled each accumulator to the stack and added the lanes one by one, which cost a third
   of a 1586-row product's time (K = 576: 36 multiply-adds per output against about 30 reduction ops). */
static inline float half_sum(v8f s) {
    v4f a, b;
    memcpy(&a, &s, sizeof a);
    memcpy(&b, (const char *)&s + sizeof a, sizeof b);
    v4f u = a + b;                                       /* s0 + s4, s1 + s5, s2 + s6, s3 + s7 */
    v4f w = u + __builtin_shufflevector(u, u, 1, 0, 3, 2); /* lanes 0 and 2: (s0 + s4) + (s1 + s5), (s2 + s6) + (s3 + s7) */
    return w[0] + w[2];
}

static inline float lane_sum(v16f v) {
#if defined(__AVX512F__)
    __m512 z = (__m512)v;
    v8f lo = (v8f)_mm512_castps512_ps256(z), hi = (v8f)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
#else
    v8f lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
#endif
    return half_sum(lo + hi);
}


/* whether the format has a per-sub-block offset (w = s * q + o with o != 0) */
static inline int has_offset(int type) { return type == Q4_1 || type == Q4_K || type == Q5_K; }


/* One decoded sub-block: weights [16 * h + i] = s[h] * q[h][i] + o. For F16/BF16/I8_ROW q holds the
   weights (or the int8 values) and s is unused. */
typedef struct {
    v16f q[2];
    float s[2], o;
} __attribute__((aligned(64))) sub_t;

/* The scales and offsets of one row as floats, in three planes of nsub: sc[sb] = s[0], sc[nsub + sb] = o and
   sc[2 * nsub + sb] = s[1] of sub-block sb (s[1] is Q6_K's own; the other formats use s[0] for both halves).
   Gathered before the row is decoded, so the hot loop loads them (a broadcast from memory) instead of
   converting a float16 per sub-block on the shuffle port. */
static void row_scales(const int type, const uint8_t *row, int64_t nsub, float *sc) {
    float *scale = sc, *offset = sc + nsub, *scale1 = sc + 2 * nsub;
    switch (type) {
    case Q4_0: case Q4_1: case Q8_0: {
        int64_t bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34, b = 0;
#if defined(__AVX512F__)
        /* 16 blocks at a time: one gather of each block's first 4 bytes (d, and Q4_1's m), split into halves */
        const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)bb));
        for (; b < nsub; b += 16) {
            __mmask16 live = nsub - b >= 16 ? 0xffff : (__mmask16)((1u << (nsub - b)) - 1);
            __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, row + b * bb, 1);
            _mm512_mask_storeu_ps(scale + b, live, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
            _mm512_mask_storeu_ps(offset + b, live, type == Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)))
                                                                 : _mm512_setzero_ps());
        }
#endif
        for (; b < nsub; b++) {
            scale[b] = half_to_float(row + b * bb);
            offset[b] = type == Q4_1 ? half_to_float(row + b * bb + 2) : 0.0f;
        }
        return;
    }
    case Q4_K: case Q5_K:
        for (int64_t b = 0; b < nsub / 8; b++) {
            const uint8_t *blk = row + b * (type == Q4_K ? 144 : 176);
            float d = half_to_float(blk), dmin = half_to_float(blk + 2);
            for (int j = 0; j < 8; j++) {
                int sc6, min6;
                k_scale_min(blk + 4, j, &sc6, &min6);
                scale[8 * b + j] = d * (float)sc6;
                offset[8 * b + j] = -(dmin * (float)min6);
            }
        }
        return;
    case Q6_K:
        for (int64_t b = 0; b < nsub / 8; b++) {
            const uint8_t *blk = row + b * 210;
            float d = half_to_float(blk + 208);
            const int8_t *sc8 = (const int8_t *)(blk + 192);
            for (int g = 0; g < 8; g++) {
                scale[8 * b + g] = d * (float)sc8[2 * g];
                scale1[8 * b + g] = d * (float)sc8[2 * g + 1];
                offset[8 * b + g] = 0.0f;
            }
        }
        return;
    }
}

/* the integers (or float values) of sub-block sb, with its scales and offset from row_scales */
static inline __attribute__((always_inline)) void decode(const int type, const uint8_t *row, int64_t sb,
                                                       int64_t nsub, const float *sc, sub_t *d) {
    if (type != F16 && type != BF16 && type != I8_ROW) {
        d->s[0] = sc[sb];
        d->s[1] = type == Q6_K ? sc[2 * nsub + sb] : d->s[0];
        d->o = sc[nsub + sb];
    }
    switch (type) {
    case F16:
        d->q[0] = f16_to_f(row + 64 * sb);
        d->q[1] = f16_to_f(row + 64 * sb + 32);
        return;
    case BF16:
        d->q[0] = bf16_to_f(row + 64 * sb);
        d->q[1] = bf16_to_f(row + 64 * sb + 32);
        return;
    case I8_ROW:
        d->q[0] = i8_to_f(row + 32 * sb);
        d->q[1] = i8_to_f(row + 32 * sb + 16);
        return;
    case Q4_0: {
        const uint8_t *blk = row + sb * 18;
        v16i q = u8_to_i32(bytes16(blk + 2));
        d->q[0] = i32_to_f((q & 15) - 8);
        d->q[1] = i32_to_f((q >> 4) - 8);
        return;
    }
    case Q4_1: {
        const uint8_t *blk = row + sb * 20;
        v16i q = u8_to_i32(bytes16(blk + 4));
        d->q[0] = i32_to_f(q & 15);
        d->q[1] = i32_to_f(q >> 4);
        return;
    }
    case Q8_0: {
        const uint8_t *blk = row + sb * 34;
        d->q[0] = i8_to_f(blk + 2);
        d->q[1] = i8_to_f(blk + 18);
        return;
    }
    case Q4_K:
    case Q5_K: {
        const uint8_t *blk = row + sb / 8 * (type == Q4_K ? 144 : 176);
        int j = sb % 8;
        const uint8_t *qs = blk + (type == Q4_K ? 16 : 48) + 32 * (j / 2);
        for (int h = 0; h < 2; h++) {
            v16u8 q = bytes16(qs + 16 * h);
            q = (j & 1) ? q >> 4 : q & 15;
            if (type == Q5_K) q |= ((bytes16(blk + 16 + 16 * h) >> j) & 1) << 4;
            d->q[h] = u8_to_f(q);
        }
        return;
    }
    case Q6_K: {
        const uint8_t *blk = row + sb / 8 * 210;
        int g = sb % 8, half = g / 4, part = g % 4;
        for (int h = 0; h < 2; h++) {
#if defined(__AVX512F__) /* split in int32 lanes (x86 has no byte shifts): 1.5x faster here, 3x slower on AVX2 */
            v16i lo = u8_to_i32(bytes16(blk + 64 * half + 32 * (part & 1) + 16 * h));
            lo = part < 2 ? lo & 15 : lo >> 4;
            v16i hi = (u8_to_i32(bytes16(blk + 128 + 32 * half + 16 * h)) >> (2 * part)) & 3;
            d->q[h] = i32_to_f(lo | (hi << 4)) - 32.0f;
#else
            v16u8 lo = bytes16(blk + 64 * half + 32 * (part & 1) + 16 * h);
            lo = part < 2 ? lo & 15 : lo >> 4;
            v16u8 hi = (bytes16(blk + 128 + 32 * half + 16 * h) >> (2 * part)) & 3;
            d->q[h] = u8_to_f(lo | (hi << 4)) - 32.0f;
#endif
        }
        return;
    }
    }
}

/* The sub-block's 32 weights, rounded as the gguf package dequantizes: w = s * q, then + o (two roundings,
   never fused). F16 / BF16 hold them already; I8_ROW keeps q (its row scale multiplies the dot product). */
typedef struct {
    v16f w[2];
} wsub_t;

static inline __attribute__((always_inline)) void weights(const int type, const uint8_t *row, int64_t sb,
                                                        int64_t nsub, const float *sc, wsub_t *out) {
#if defined(__AVX512F__)
    /* Q4_0, Q4_1, Q4_K (4-bit q) and Q5_K (5-bit q): a sub-block's 16 (32) possible weights are made once,
       with the same two roundings (s * q, then + o), and each weight is looked up by its q: one permute
       instead of a convert, a multiply and an add per 16 weights. The same bits as below. */
    if (type == Q4_0 || type == Q4_1 || type == Q4_K || type == Q5_K) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 scale = _mm512_set1_ps(sc[sb]), offset = _mm512_set1_ps(sc[nsub + sb]);
        __m512 lo = _mm512_mul_ps(type == Q4_0 ? _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)) : iota, scale);
        __m512 hi = _mm512_mul_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), scale);
        if (has_offset(type)) {
            lo = _mm512_add_ps(lo, offset);
            hi = _mm512_add_ps(hi, offset);
        }
        v16i n[2];
        if (type == Q4_0 || type == Q4_1) { /* one widening of the 16 bytes, nibbles split in the lanes */
            v16i b = u8_to_i32(bytes16(row + sb * (type == Q4_0 ? 18 : 20) + (type == Q4_0 ? 2 : 4)));
            n[0] = b; /* vpermps reads an index's low 4 bits: here the low nibble, unmasked */
            n[1] = b >> 4;
        } else { /* the sub-block's 32 nibbles sit in 32 bytes: one widening per 16 */
            const uint8_t *blk = row + sb / 8 * (type == Q4_K ? 144 : 176);
            int j = sb % 8;
            const uint8_t *qs = blk + (type == Q4_K ? 16 : 48) + 32 * (j / 2);
            for (int h = 0; h < 2; h++) {
                v16i q = u8_to_i32(bytes16(qs + 16 * h));
                n[h] = (j & 1) ? q >> 4 : type == Q5_K ? q & 15 : q; /* Q4_K: the low nibble unmasked, as above */
                if (type == Q5_K) n[h] |= ((u8_to_i32(bytes16(blk + 16 + 16 * h)) >> j) & 1) << 4;
            }
        }
        for (int h = 0; h < 2; h++)
            out->w[h] = (v16f)(type == Q5_K ? _mm512_permutex2var_ps(lo, (__m512i)n[h], hi)
                                            : _mm512_permutexvar_ps((__m512i)n[h], lo));
        return;
    }
#endif
    sub_t d;
    decode(type, row, sb, nsub, sc, &d);
    for (int h = 0; h < 2; h++) {
        v16f w = (type == F16 || type == BF16 || type == I8_ROW) ? d.q[h] : d.q[h] * splat(d.s[h]);
        out->w[h] = has_offset(type) ? w + splat(d.o) : w;
    }
}

/* What the products read: activations (x) and a sub-block's 32 weights, float32 or (EYAS_BF16_PRODUCTS) bfloat16. */
#if defined(EYAS_BF16_PRODUCTS)
typedef uint16_t act_t; /* bfloat16 bits */
typedef struct {
    __m512bh w; /* weights 0..31 of the sub-block, in order */
} __attribute__((aligned(64))) wprod_t;
#else
typedef float act_t;
typedef wsub_t wprod_t;
#endif

static inline __attribute__((always_inline)) void prod_weights(const int type, const uint8_t *row, int64_t sb,
                                                             int64_t nsub, const float *sc, wprod_t *out) {
#if defined(EYAS_BF16_PRODUCTS)
    wsub_t d;
    weights(type, row, sb, nsub, sc, &d);
    out->w = _mm512_cvtne2ps_pbh((__m512)d.w[1], (__m512)d.w[0]); /* d.w[0] -> elements 0..15 */
#else
    weights(type, row, sb, nsub, sc, out);
#endif
}

/* out[m, j] for j < NB weight rows (stride rb) and m < MB rows of x (stride ldx). The weight rows are
   decoded here (pre == NULL) or were decoded into pre[j * nsub + sb]: the values, and so the
   arithmetic, are the same either way. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 accumulates each 16-lane sum as two native 8-lane halves (lane i of the pair is lane i of the
   16-lane vector), so nothing is carried through memory; the arithmetic is the same lane for lane. */
typedef v8f acc_t;
#define GROUPS 2
static inline acc_t acc_fma(const float *w, const float *x, acc_t c) {
    v8f a, b;
    memcpy(&a, w, sizeof a);
    memcpy(&b, x, sizeof b);
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
typedef v16f acc_t;
#define GROUPS 1
#endif
#define GROUP_LANES (16 / GROUPS)

/* Sub-block sb's share (``share`` bytes, whole lines) of the bytes [pf, pf + bytes), asked for ahead of their
   use with a hint to keep them in every cache level (a non-temporal hint made a decode step's products twice as
   slow). Spread over the decoding of a tile, a tile ahead is asked for a few lines at a time: asked for all at
   once, the prefetches stalled on the full line-fill buffers (see rows()). The share is fixed per tile: working
   it out per sub-block took two 64-bit divisions, which made a one-row product 15% slower. */
static inline __attribute__((always_inline)) void prefetch_share(const uint8_t *pf, int64_t bytes, int64_t sb,
                                                               int64_t share) {
    int64_t end = (sb + 1) * share < bytes ? (sb + 1) * share : bytes;
    for (int64_t b = sb * share; b < end; b += 64)
        __builtin_prefetch(pf + b, 0, 3);
}

/* the share of prefetch_share that covers ``bytes`` in nsub sub-blocks */
static inline int64_t line_share(int64_t bytes, int64_t nsub) { return (bytes + 64 * nsub - 1) / (64 * nsub) * 64; }

#if defined(__AVX512F__)
/* The 16 sums of a whole tile's accumulators at once, each in lane_sum's tree (the same additions of the same
   operands, so the same bits), with 30 shuffles and 15 additions instead of 16 lane_sums' 64 and 64: summed one
   by one they cost about a fifth of a 16-row product at K = 576. Accumulator i = 4 j + m. Level by level, a
   vector holds the partial sums of more accumulators: s (8 lanes each) of 2, u (4) of 4, w0 and w2 of 8, then
   lane 4 m + j holds the sum of accumulator (j, m), so 128-bit lane m is row m's four outputs. Rows m >= MB
   (a tile of 3 rows) are summed as zeros and not stored: 30 shuffles against 3 rows' 48. */
static inline __attribute__((always_inline)) void reduce_tile(v16f acc[TILE_N][TILE_M][1], const int MB,
                                                             const float *row_scale, float *out, int64_t ldo) {
    __m512 s[8], u[4], w[2];
#define ACC(i) ((i) % 4 < MB ? (__m512)acc[(i) / 4][(i) % 4][0] : _mm512_setzero_ps())
    for (int p = 0; p < 8; p++) { /* [s_a[0..8] | s_b[0..8]], s[i] = l[i] + l[i + 8] */
        __m512 a = ACC(2 * p), b = ACC(2 * p + 1);
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    }
    for (int q = 0; q < 4; q++) /* 128-bit lane L: u[0..4] of accumulator 4 q + L, u[i] = s[i] + s[i + 4] */
        u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xdd));
    for (int r = 0; r < 2; r++) /* lane L: w0, w2 of accumulator 8 r + L, then of 8 r + 4 + L (w0 = u0 + u1, w2 = u2 + u3) */
        w[r] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * r], u[2 * r + 1], 0x88), _mm512_shuffle_ps(u[2 * r], u[2 * r + 1], 0xdd));
    /* lane L: w0 + w2 of accumulators L, 4 + L, 8 + L, 12 + L, i.e. j = 0..3 of row m = L */
    __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
    if (row_scale) sum = _mm512_mul_ps(sum, _mm512_broadcast_f32x4(_mm_loadu_ps(row_scale)));
#undef ACC
    _mm_storeu_ps(out, _mm512_castps512_ps128(sum));
    _mm_storeu_ps(out + ldo, _mm512_extractf32x4_ps(sum, 1));
    _mm_storeu_ps(out + 2 * ldo, _mm512_extractf32x4_ps(sum, 2));
    if (MB > 3) _mm_storeu_ps(out + 3 * ldo, _mm512_extractf32x4_ps(sum, 3));
}
#endif

static inline __attribute__((always_inline)) void tile(const int type, const int NB, const int MB, const act_t *x,
                                                     int64_t ldx, int64_t nsub, const uint8_t *w, int64_t rb,
                                                     const float *sc, const wprod_t *pre, wprod_t *keep,
                                                     const float *row_scale, float *out, int64_t ldo,
                                                     const uint8_t *pf, int64_t pf_bytes) {
    acc_t acc[TILE_N][TILE_M][GROUPS];
    for (int j = 0; j < NB; j++)
        for (int m = 0; m < MB; m++)
            for (int g = 0; g < GROUPS; g++) acc[j][m][g] = (acc_t){0};
    const int64_t share = line_share(pf_bytes, nsub);
    for (int64_t sb = 0; sb < nsub; sb++) {
        prefetch_share(pf, pf_bytes, sb, share); /* nothing when pf_bytes is 0 */
        wprod_t fresh[TILE_N];
        const wprod_t *d[TILE_N];
        for (int j = 0; j < NB; j++) {
            if (pre) {
                d[j] = pre + j * nsub + sb;
            } else {
                prod_weights(type, w + j * rb, sb, nsub, sc + j * 3 * nsub, &fresh[j]);
                if (keep) keep[j * nsub + sb] = fresh[j];
                d[j] = &fresh[j];
            }
        }
        for (int m = 0; m < MB; m++) {
            const act_t *xs = x + m * ldx + SUB * sb;
#if defined(EYAS_BF16_PRODUCTS)
            __m512bh xb = (__m512bh)_mm512_loadu_si512((const void *)xs);
            for (int j = 0; j < NB; j++) acc[j][m][0] = (v16f)_mm512_dpbf16_ps((__m512)acc[j][m][0], d[j]->w, xb);
#elif GROUPS == 1
            v16f x0 = load16(xs), x1 = load16(xs + 16);
            for (int j = 0; j < NB; j++) acc[j][m][0] = fma16(d[j]->w[1], x1, fma16(d[j]->w[0], x0, acc[j][m][0]));
#else
            for (int j = 0; j < NB; j++) {
                const float *w0 = (const float *)&d[j]->w[0], *w1 = (const float *)&d[j]->w[1];
                for (int g = 0; g < GROUPS; g++)
                    acc[j][m][g] = acc_fma(w1 + GROUP_LANES * g, xs + 16 + GROUP_LANES * g,
                                           acc_fma(w0 + GROUP_LANES * g, xs + GROUP_LANES * g, acc[j][m][g]));
            }
#endif
        }
    }
#if defined(__AVX512F__)
    if (NB == TILE_N && MB >= 3) {
        reduce_tile(acc, MB, type == I8_ROW ? row_scale : NULL, out, ldo);
        return;
    }
#endif
    for (int j = 0; j < NB; j++)
        for (int m = 0; m < MB; m++) {
#if GROUPS == 1
            float s = lane_sum(acc[j][m][0]);
#else
            float s = half_sum(acc[j][m][0] + acc[j][m][1]); /* the halves: lanes 0-7 and 8-15 */
#endif
            out[m * ldo + j] = type == I8_ROW ? s * row_scale[j] : s;
        }
}

/* tile() over mb <= TILE_M rows of x in one pass (the rows left after whole groups too: a k = 1 or k = 2
   verification without the buffer decodes the tile once, not once per row) */
static inline __attribute__((always_inline)) void tile_rows(const int type, const int NB, int64_t mb, const act_t *x,
                                                          int64_t ldx, int64_t nsub, const uint8_t *w, int64_t rb,
                                                          const float *sc, const wprod_t *pre, const float *row_scale,
                                                          float *out, int64_t ldo, const uint8_t *pf, int64_t pf_bytes) {
    switch (mb) {
    case TILE_M: tile(type, NB, TILE_M, x, ldx, nsub, w, rb, sc, pre, NULL, row_scale, out, ldo, pf, pf_bytes); break;
#if TILE_M > 3
    case 3: tile(type, NB, 3, x, ldx, nsub, w, rb, sc, pre, NULL, row_scale, out, ldo, pf, pf_bytes); break;
#endif
#if TILE_M > 2
    case 2: tile(type, NB, 2, x, ldx, nsub, w, rb, sc, pre, NULL, row_scale, out, ldo, pf, pf_bytes); break;
#endif
    default: tile(type, NB, 1, x, ldx, nsub, w, rb, sc, pre, NULL, row_scale, out, ldo, pf, pf_bytes); /* one row */
    }
}

/* a weight row decoded into buf [nsub], from its scales sc (row_scales) */
static inline __attribute__((always_inline)) void decode_row(const int type, const uint8_t *row, int64_t nsub,
                                                           const float *sc, wprod_t *buf) {
    for (int64_t sb = 0; sb < nsub; sb++) prod_weights(type, row, sb, nsub, sc, &buf[sb]);
}

/* a thread's working memory: decoded tiles (row counts past TILE_M: one tile, or a panel), row scales */
typedef struct {
    wprod_t *buf;
    float *sc;
} scratch_t;

/* Tiles of a panel: as many as fit PANEL_BYTES decoded (a share of L2), at most PANEL_TILES_MAX. Panels serve
   inputs x of more than PANEL_MIN_X_BYTES, which a tile-by-tile sweep would stream from beyond L2 for every
   tile; below it tiles are faster (decoded in L1 as the weights stream in, prefetched): 3072x576 Q4_1 on 2
   threads, tiles -> panels: 16 rows 323 -> 354 us, 256 rows 4084 -> 3982 us, 1586 rows 72 -> 27 ms. */
#define PANEL_MIN_X_BYTES (512 * 1024)
#define PANEL_BYTES (256 * 1024)
#define PANEL_TILES_MAX 32
static int64_t panel_tiles(int64_t nsub) {
    int64_t fit = PANEL_BYTES / ((int64_t)sizeof(wprod_t) * TILE_N * nsub);
    return fit < 1 ? 1 : fit > PANEL_TILES_MAX ? PANEL_TILES_MAX : fit;
}

/* tiles: how many decoded tiles buf holds (0: none, the few-rows regime) */
static int scratch_alloc(scratch_t *s, int64_t nsub, int64_t tiles) {
    s->buf = tiles ? aligned_alloc(64, sizeof(wprod_t) * TILE_N * nsub * tiles) : NULL;
    s->sc = malloc(sizeof(float) * 3 * TILE_N * nsub);
    return (tiles && !s->buf) || !s->sc;
}

static void scratch_free(scratch_t *s) {
    free(s->buf);
    free(s->sc);
}

/* NB weight rows against all rows of x, TILE_M at a time. The first TILE_M rows decode the weights in
   registers as they go (each weight byte is read once either way); with more rows that pass also keeps
   the decoded tile in buf, and the other rows reuse it. Decoding the whole tile into buf first, then
   every row group from buf, left the decoding without products to overlap with and the prefetch without
   a tile in registers to spread over: SmolLM2-135M's 120 layer products (Q4_1, bfloat16 products, 2
   threads, from memory, medians of 15 interleaved runs) at 5, 8, 16 rows took 1.68x, 2.00x, 2.87x the
   one-row time that way, 1.59x, 1.87x, 2.71x this way (float32 products: 2.34x, 2.93x, 4.62x -> 2.09x,
   2.69x, 4.41x), the same sums of the same values.

   The tile PREFETCH_TILES ahead (of the next_rows rows after this tile; rb bytes each) is asked for
   while this one decodes, a share per sub-block: decoding otherwise stalls on the first touch of every
   cache line (in row_scales, which reads each block's scales first). With the hardware prefetcher
   alone a batch-1 decode step's 121 products took 13.3 ms, with the next tile prefetched 10.9 ms (1
   thread, SmolLM2-135M's Q4_1 layers and Q8_0 head streamed from memory, medians of 5 interleaved
   runs). One tile ahead is about 150 ns of decoding at one row, about a memory latency; two tiles
   ahead took the engine's batch-1 step from 15.3 to 13.7-14.1 ms (1 thread) and 9.2 to 8.6 ms (2
   threads). Those prefetches were asked for a row at a time as its scales were gathered; for rows
   of many bytes (bf16: 18 lines a row at K = 576) that stalled on the full line-fill buffers, and a
   one-row bf16 product streamed from memory at 8 GB/s on one Zen 4 core. Spread over the sub-blocks
   of a tile decoded in registers (up to TILE_M rows) it reads 22-26 GB/s, and the bf16-mode engine
   step went from 19.8 to 9.5 ms (2 threads). */
#define PREFETCH_TILES 2
static inline __attribute__((always_inline)) void rows(const int type, const int NB, const act_t *x, int64_t ldx,
                                                     int64_t m_len, int64_t nsub, const uint8_t *w, int64_t rb,
                                                     int64_t next_rows, scratch_t *scratch, const float *row_scale,
                                                     float *out, int64_t ldo) {
    int64_t ahead_rows = next_rows - (PREFETCH_TILES - 1) * NB; /* rows of the tile PREFETCH_TILES ahead */
    ahead_rows = ahead_rows < 0 ? 0 : ahead_rows > NB ? NB : ahead_rows;
    const uint8_t *pf = w + PREFETCH_TILES * NB * rb;
    for (int j = 0; j < NB; j++) row_scales(type, w + j * rb, nsub, scratch->sc + j * 3 * nsub);
    if (m_len <= TILE_M) {
        tile_rows(type, NB, m_len, x, ldx, nsub, w, rb, scratch->sc, NULL, row_scale, out, ldo, pf, ahead_rows * rb);
        return;
    }
    /* the first TILE_M rows decode the tile in registers as above, keeping it in buf for the rest */
    tile(type, NB, TILE_M, x, ldx, nsub, w, rb, scratch->sc, NULL, scratch->buf, row_scale, out, ldo, pf,
         ahead_rows * rb);
    for (int64_t m = TILE_M; m < m_len; m += TILE_M)
        tile_rows(type, NB, m_len - m < TILE_M ? m_len - m : TILE_M, x + m * ldx, ldx, nsub, w, rb, scratch->sc,
                  scratch->buf, row_scale, out + m * ldo, ldo, NULL, 0);
}

/* Many rows (prefill, batches): a panel of np tiles (np * TILE_N weight rows) is decoded into buf once,
   then every TILE_M rows of x go through all of its tiles, so a row group is read from memory once per
   panel and stays in L1 while the panel (in L2) is swept. Tile by tile instead, all of x streamed past
   every tile from L3: a 1586-row prefill product ran at 20 GMAC/s on one core. Each output is the
   same tile() sum as in rows(), so the bits do not change. */
static inline __attribute__((always_inline)) void panel(const int type, int64_t np, const act_t *x, int64_t ldx,
                                                      int64_t m_len, int64_t nsub, const uint8_t *w, int64_t rb,
                                                      scratch_t *scratch, const float *row_scale, float *out,
                                                      int64_t ldo) {
    for (int64_t j = 0; j < np * TILE_N; j++) {
        row_scales(type, w + j * rb, nsub, scratch->sc);
        decode_row(type, w + j * rb, nsub, scratch->sc, scratch->buf + j * nsub);
    }
    for (int64_t m = 0; m < m_len; m += TILE_M) {
        int64_t mb = m_len - m < TILE_M ? m_len - m : TILE_M;
        for (int64_t p = 0; p < np; p++) {
            const wprod_t *pre = scratch->buf + p * TILE_N * nsub;
            const float *rs = row_scale ? row_scale + p * TILE_N : NULL;
            float *o = out + m * ldo + p * TILE_N;
            tile_rows(type, TILE_N, mb, x + m * ldx, ldx, nsub, NULL, rb, NULL, pre, rs, o, ldo, NULL, 0);
        }
    }
}

#define GEMM_FOR(TYPE)                                                                                           \
    static int gemm_##TYPE(const act_t *x, int64_t ldx, const uint8_t *weight, const float *row_scale,         \
                           float *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len,              \
                           int num_threads) {                                                                 \
        int64_t rb = row_bytes(TYPE, k_len), nsub = k_len / SUB, tiles = (n_len + TILE_N - 1) / TILE_N;        \
        int failed = 0;                                                                                       \
        _Pragma("omp parallel num_threads(num_threads)")                                                      \
        {                                                                                                     \
            scratch_t scratch;                                                                                \
            int64_t np_max = m_len * k_len * (int64_t)sizeof(act_t) > PANEL_MIN_X_BYTES ? panel_tiles(nsub) : 0; \
            if (scratch_alloc(&scratch, nsub, np_max ? np_max : m_len > TILE_M)) { /* rows(): one tile */      \
                _Pragma("omp atomic write")                                                                   \
                failed = 1;                                                                                   \
            }                                                                                                 \
            _Pragma("omp barrier") /* all allocations settled before failed is read */            \
            if (np_max && !failed) { /* each thread's share of the whole tiles, panel by panel */            \
                int64_t whole = n_len / TILE_N, tid = omp_get_thread_num(), nth = omp_get_num_threads();       \
                int64_t t1 = whole * (tid + 1) / nth;                                                         \
                for (int64_t t = whole * tid / nth; t < t1; t += np_max) {                                    \
                    int64_t np = t1 - t < np_max ? t1 - t : np_max;                                           \
                    panel(TYPE, np, x, ldx, m_len, nsub, weight + t * TILE_N * rb, rb, &scratch,              \
                          row_scale ? row_scale + t * TILE_N : NULL, out + t * TILE_N, ldo);                  \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("omp for schedule(static)")                                                               \
            for (int64_t t = np_max ? n_len / TILE_N : 0; t < tiles; t++) { /* many rows: only the partial tile is left */ \
                if (failed) continue;                                                                         \
                int64_t n0 = t * TILE_N;                                                                      \
                const float *rs = row_scale ? row_scale + n0 : NULL;                                          \
                if (n0 + TILE_N <= n_len) {                                                                    \
                    rows(TYPE, TILE_N, x, ldx, m_len, nsub, weight + n0 * rb, rb, n_len - n0 - TILE_N, &scratch, rs, \
                         out + n0, ldo);                                                                      \
                } else {                                                                                      \
                    for (int64_t n = n0; n < n_len; n++)                                                      \
                        rows(TYPE, 1, x, ldx, m_len, nsub, weight + n * rb, rb, 0, &scratch, rs ? rs + (n - n0) : NULL, \
                             out + n, ldo);                                                                   \
                }                                                                                             \
            }                                                                                                 \
            scratch_free(&scratch);                                                                           \
        }                                                                                                     \
        return failed ? -1 : 0;                                                                               \
    }
GEMM_FOR(F16)
GEMM_FOR(BF16)
INTEGER_FORMATS(GEMM_FOR)

#define SMALL_X 16384 /* bfloat16 activations converted on the stack (32 KiB): up to 8 rows of K = 2048 */

/* Returns 0, or -1 for an unknown type, a K the format cannot hold, or no memory. */
int eyas_quant_gemm(const float *x, int64_t ldx, const uint8_t *weight, int type, const float *row_scale, float *out,
                    int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads) {
    int bs = block_size(type);
    if (bs == 0 || k_len % bs != 0 || (type == I8_ROW && row_scale == NULL)) return -1;
#if defined(EYAS_BF16_PRODUCTS)
    /* x rounded to bfloat16, row stride K: a few rows (decode steps) on the stack, converted here; more in a
       buffer, converted by the threads (a parallel region and an allocation cost more than a row's conversion) */
    _Alignas(64) act_t small[SMALL_X];
    int few = m_len * k_len <= SMALL_X;
    act_t *xb = few ? small : aligned_alloc(64, (size_t)(m_len * k_len * 2 + 64));
    if (!xb) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (!few)
    for (int64_t m = 0; m < m_len; m++)
        for (int64_t k = 0; k < k_len; k += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + k + 16), _mm512_loadu_ps(x + m * ldx + k));
            _mm512_storeu_si512((void *)(xb + m * k_len + k), (__m512i)v);
        }
    const act_t *xa = xb;
    ldx = k_len;
#else
    const act_t *xa = x;
#endif
    int status = -1;
    switch (type) {
    case F16: status = gemm_F16(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case BF16: status = gemm_BF16(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case I8_ROW: status = gemm_I8_ROW(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case Q4_0: status = gemm_Q4_0(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case Q4_1: status = gemm_Q4_1(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case Q8_0: status = gemm_Q8_0(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case Q4_K: status = gemm_Q4_K(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case Q5_K: status = gemm_Q5_K(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    case Q6_K: status = gemm_Q6_K(xa, ldx, weight, row_scale, out, ldo, m_len, n_len, k_len, num_threads); break;
    }
#if defined(EYAS_BF16_PRODUCTS)
    if (!few) free(xb);
#endif
    return status;
}

/* out[i, 0..K) = the dequantized row rows[i] of weight, w = s * q + o rounded as gguf does (an
   embedding lookup); -1 for a bad type or K */
int eyas_quant_rows(const uint8_t *weight, int type, const float *row_scale, const int64_t *rows_, int64_t count,
                    int64_t k_len, float *out, int num_threads) {
    int bs = block_size(type);
    if (bs == 0 || k_len % bs != 0 || (type == I8_ROW && row_scale == NULL)) return -1;
    int64_t rb = row_bytes(type, k_len), nsub = k_len / SUB;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
    scratch_t scratch;
    if (scratch_alloc(&scratch, nsub, 0)) {
#pragma omp atomic write
        failed = 1;
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; i++) {
        if (failed) continue;
        const uint8_t *row = weight + rows_[i] * rb;
        row_scales(type, row, nsub, scratch.sc);
        for (int64_t sb = 0; sb < nsub; sb++) {
            wsub_t d = {0};
            switch (type) { /* inlined per format */
            case F16: weights(F16, row, sb, nsub, scratch.sc, &d); break;
            case BF16: weights(BF16, row, sb, nsub, scratch.sc, &d); break;
            case I8_ROW: weights(I8_ROW, row, sb, nsub, scratch.sc, &d); break;
            case Q4_0: weights(Q4_0, row, sb, nsub, scratch.sc, &d); break;
            case Q4_1: weights(Q4_1, row, sb, nsub, scratch.sc, &d); break;
            case Q8_0: weights(Q8_0, row, sb, nsub, scratch.sc, &d); break;
            case Q4_K: weights(Q4_K, row, sb, nsub, scratch.sc, &d); break;
            case Q5_K: weights(Q5_K, row, sb, nsub, scratch.sc, &d); break;
            case Q6_K: weights(Q6_K, row, sb, nsub, scratch.sc, &d); break;
            }
            for (int h = 0; h < 2; h++) {
                v16f w = type == I8_ROW ? d.w[h] * row_scale[rows_[i]] : d.w[h];
                memcpy(out + i * k_len + SUB * sb + 16 * h, &w, sizeof w);
            }
        }
    }
    scratch_free(&scratch);
    }
    return failed ? -1 : 0;
}

#if defined(EYAS_BF16_PRODUCTS)
/* Multiply-add throughput of one core, for choosing the default matmul precision: n rounds of 12 independent
   chains (more than the FMA units' latency x throughput) of vdpbf16ps (bf16 != 0: 32 multiply-adds an
   instruction) or of float32 FMAs (16). *out gets a value every chain feeds, so no chain is optimised away;
   the caller times the call. */
int eyas_mac_probe(int bf16, int64_t n, float *out) {
    __m512 acc[12];
    for (int c = 0; c < 12; c++) acc[c] = _mm512_set1_ps((float)c);
    const __m512 f = _mm512_set1_ps(0x1p-20f), g = _mm512_set1_ps(1.0f + 0x1p-20f); /* g != 1: no add in its place */
    const __m512bh b = _mm512_cvtne2ps_pbh(f, f);
    for (int64_t i = 0; i < n; i++)
        for (int c = 0; c < 12; c++)
            acc[c] = bf16 ? _mm512_dpbf16_ps(acc[c], b, b) : _mm512_fmadd_ps(acc[c], g, f);
    __m512 sum = acc[0];
    for (int c = 1; c < 12; c++) sum = _mm512_add_ps(sum, acc[c]);
    *out = _mm512_reduce_add_ps(sum);
    return 0;
}
#endif
