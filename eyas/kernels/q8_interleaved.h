/* Q4_0, Q4_1 and Q8_0 weights interleaved 16 rows at a time for matmul precision "low": the layout
   (eyas_q8_interleave makes it once, in place, at load, and undoes it), and q8_gemm.c's product on it, which
   gives the same bits as its product on the GGUF rows (the order of the top of q8_gemm.c).

   Layout (type R16 + the GGUF type, e.g. Q4_1_R16 = 2003): the rows in groups of 16, the last group holding the
   R = N mod 16 left over; a group keeps the bytes its rows had, [16 g rb, (16 g + R) rb). Inside a group, one
   record of R * BB bytes a block (BB: the format's block bytes), the blocks in lane order b = 0, 8, 16, ...,
   1, 9, 17, ..., 7, 15, ..., so the blocks one float lane sums (b = l mod 8) are read one after another. A record:
       d   [R] float16          the R rows' block scales
       m   [R] float16          the R rows' block mins (Q4_1 only)
       qs  [C][R][4] bytes      C = 4 (Q4_0, Q4_1) or 8 (Q8_0): chunk c of row r is bytes 4c..4c+3 of its quants
   So one load of a chunk is 4 quant bytes of each of 16 rows: a vpdpbusd lane an output row, against 4 bytes of
   the activations broadcast to every lane. A Q4 byte i holds weight i in its low nibble and weight 16 + i in its
   high one, so chunk c gives weights 4c..4c+3 (q & 15) and 16+4c..16+4c+3 (q >> 4 & 15): every chunk vector j
   (Q4: j = c for the low nibbles, 4 + c for the high ones; Q8_0: j = c) pairs with activation bytes 4j..4j+3.
   Example, Q4_1 with R = 16: a record is 32 (d) + 32 (m) + 4 x 64 (qs) = 320 = 16 x 20 bytes; row 5's block
   bytes 4..11 (its quant bytes 0..7) go to qs[0][5] and qs[1][5], at 64 + 20 and 64 + 84. The size is that of
   the GGUF rows, so memory stays as it was; the bytes are only moved, so the layout is undone exactly.

   The product, per group: a vector lane per output row (W = 16 of them with AVX512-VNNI; 8 in the 256-bit builds,
   AVX-VNNI and AVX2's vpmaddubsw, and in C, which take a group in two halves). Lane l of the fixed order is one
   pass over its contiguous records with one float accumulator per row of x; the 8 passes' results are summed
   ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) across registers. Each block's weight vectors are loaded and
   unpacked once for up to MR rows of x. Q8_0's signed quants go into vpdpbusd as q + 128 (xor 0x80), and 128 sx
   comes off the integer sum (exact: both are integers below 2^24 in float); AVX2 moves their signs onto x. The AMX
   build (EYAS_AMX) takes products of 16 rows of x and more to q8_amx.h, which gets each block's integers of 16
   rows from one tile multiply and adds the same terms in the same order. */
#ifndef EYAS_Q8_INTERLEAVED_H
#define EYAS_Q8_INTERLEAVED_H

enum { R16 = 2000, GROUP = 16 };

static inline int interleaves(int type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }

#if defined(EYAS_VNNI512)
#define W 16 /* output rows a vector */
#define MR 8 /* rows of x a pass over a block's weight vectors */
#else
#define W 8
#define MR 4
#endif
typedef float vwf __attribute__((vector_size(4 * W)));
typedef int32_t vwi __attribute__((vector_size(4 * W)));
typedef uint8_t vwb __attribute__((vector_size(4 * W))); /* 4 quant bytes of each of W rows */

static inline int block_bytes(int type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }
static inline int chunks(int type) { return type == Q8_0 ? 8 : 4; }
static inline int halves(int type) { return type == Q4_1 ? 2 : 1; } /* float16 fields of a block: d (and m) */

/* where block b sits among a group's records: after every block of a lower lane, then b / 8 into its own */
static inline int64_t record_of(int64_t b, int64_t nsub) {
    int64_t l = b % LANES, before = 0;
    for (int64_t j = 0; j < l && j < nsub; j++) before += (nsub - 1 - j) / LANES + 1;
    return before + b / LANES;
}

/* copies row r's block between its GGUF bytes blk and its places in record rec of an R-row group (to rec when
   pack, else back) */
static void move_block(int type, int pack, uint8_t *blk, uint8_t *rec, int64_t R, int64_t r) {
    int nh = halves(type);
    for (int h = 0; h < nh; h++)
        memcpy(pack ? rec + 2 * (h * R + r) : blk + 2 * h, pack ? blk + 2 * h : rec + 2 * (h * R + r), 2);
    for (int c = 0; c < chunks(type); c++) {
        uint8_t *g = blk + 2 * nh + 4 * c, *q = rec + 2 * nh * R + 4 * (c * R + r);
        memcpy(pack ? q : g, pack ? g : q, 4);
    }
}

/* Interleaves (pack) or restores the N rows of weight (GGUF type Q4_0, Q4_1 or Q8_0, K a multiple of 32) in
   place, a group at a time through a copy of it (once at load: about a memcpy's speed); -1 for another type or K,
   or no memory. */
int eyas_q8_interleave(uint8_t *weight, int type, int64_t n_len, int64_t k_len, int pack) {
    if (!interleaves(type) || k_len % SUB != 0) return -1;
    int64_t nsub = k_len / SUB, bb = block_bytes(type), rb = nsub * bb;
    uint8_t *copy = malloc((size_t)(GROUP * rb));
    if (!copy) return -1;
    for (int64_t g = 0; g * GROUP < n_len; g++) {
        int64_t R = n_len - GROUP * g < GROUP ? n_len - GROUP * g : GROUP;
        uint8_t *grp = weight + GROUP * g * rb;
        memcpy(copy, grp, (size_t)(R * rb));
        for (int64_t r = 0; r < R; r++)
            for (int64_t b = 0; b < nsub; b++) {
                int64_t rec = record_of(b, nsub) * R * bb;
                if (pack) move_block(type, 1, copy + r * rb + b * bb, grp + rec, R, r);
                else move_block(type, 0, grp + r * rb + b * bb, copy + rec, R, r);
            }
    }
    free(copy);
    return 0;
}

/* The GGUF bytes of rows rows_[0..count) of an interleaved weight -> out [count, rb] (an embedding lookup) */
int eyas_q8_interleaved_rows(const uint8_t *weight, int type, int64_t n_len, int64_t k_len, const int64_t *rows_,
                             int64_t count, uint8_t *out) {
    if (!interleaves(type) || k_len % SUB != 0) return -1;
    int64_t nsub = k_len / SUB, bb = block_bytes(type), rb = nsub * bb;
    for (int64_t i = 0; i < count; i++) {
        int64_t g = rows_[i] / GROUP, R = n_len - GROUP * g < GROUP ? n_len - GROUP * g : GROUP;
        uint8_t *grp = (uint8_t *)weight + GROUP * g * rb;
        for (int64_t b = 0; b < nsub; b++)
            move_block(type, 0, out + i * rb + b * bb, grp + record_of(b, nsub) * R * bb, R, rows_[i] % GROUP);
    }
    return 0;
}

/* A last group of R < 16 rows -> the records of a full group (rows R..15 zero), so one loop reads both */
static void widen_group(int type, const uint8_t *grp, int64_t R, int64_t nsub, uint8_t *wide) {
    int64_t bb = block_bytes(type);
    memset(wide, 0, (size_t)(nsub * GROUP * bb));
    for (int64_t p = 0; p < nsub; p++) {
        const uint8_t *src = grp + p * R * bb;
        uint8_t *dst = wide + p * GROUP * bb;
        for (int f = 0; f < halves(type) + chunks(type); f++) { /* the fields: 2 bytes (halves) or 4 a row */
            int size = f < halves(type) ? 2 : 4;
            int64_t at = f < halves(type) ? 2 * f : 2 * halves(type) + 4 * (f - halves(type));
            memcpy(dst + at * GROUP, src + at * R, (size_t)(size * R));
        }
    }
}

static inline vwb load_w(const uint8_t *p) {
    vwb v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* W float16 values -> float (exact) */
static inline vwf load_halves(const uint8_t *p) {
#if defined(EYAS_VNNI512)
    return (vwf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vwf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vwf v;
    for (int i = 0; i < W; i++) v[i] = half_to_float(p + 2 * i);
    return v;
#endif
}

/* acc + in each lane the dot product of its 4 weight bytes w (unsigned: Q4, or Q8_0 + 128 in the VNNI builds;
   signed: Q8_0 elsewhere) with the 4 activation bytes at x */
static inline vwi dot4(const int type, vwi acc, vwb w, const int8_t *x) {
    (void)type;
#if defined(EYAS_VNNI512)
    /* x's 4 bytes as the instruction's own broadcast operand ({1to16}): from _mm512_set1_epi32 GCC makes a
       vpbroadcastd before each vpdpbusd, one vector instruction more in 9 (a prefill of 16 chat prompts on the
       default model, one Zen 4 thread: 2.06 -> 1.94 s; the same bits) */
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
#elif defined(EYAS_VNNI256)
    int32_t x4;
    memcpy(&x4, x, 4);
    return (vwi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(x4));
#elif defined(__AVX2__) /* pairs of products fit int16: at most 2 * 128 * 127 with Q8_0's signs moved onto x */
    int32_t x4;
    memcpy(&x4, x, 4);
    __m256i xv = _mm256_set1_epi32(x4), wv = (__m256i)w;
    if (type == Q8_0) {
        xv = _mm256_sign_epi8(xv, wv);
        wv = _mm256_abs_epi8(wv);
    }
    return acc + (vwi)_mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), _mm256_set1_epi16(1));
#else
    for (int i = 0; i < W; i++)
        for (int j = 0; j < 4; j++) acc[i] += (type == Q8_0 ? (int32_t)(int8_t)w[4 * i + j] : w[4 * i + j]) * x[j];
    return acc;
#endif
}

#if defined(EYAS_VNNI512) || defined(EYAS_VNNI256)
#define Q8_BIASED 1 /* Q8_0's quants go in as q + 128 */
#else
#define Q8_BIASED 0
#endif

/* Lanes lo..lo+W-1 of a full group (16-row records) against rows 0..mr-1 of the quantized x: res[i] = those
   outputs of row i, each the fixed-order sum of its blocks' terms dx * (sw * i_b + ow * sx) */
static inline __attribute__((always_inline)) void group_rows(const int type, const int mr, const uint8_t *grp,
                                                           int lo, int64_t nsub, const int8_t *qx, const float *dx,
                                                           const float *sx, int64_t kq, int64_t np, vwf *res) {
    const int64_t rec_bytes = GROUP * block_bytes(type), qs = 2 * GROUP * halves(type);
    const int64_t ahead = nsub * rec_bytes;
    vwf lanes[LANES][MR];
    const uint8_t *rec = grp;
    for (int l = 0; l < LANES; l++) {
        vwf acc[MR];
        for (int i = 0; i < mr; i++) acc[i] = (vwf){0};
        for (int64_t b = l; b < nsub; b += LANES, rec += rec_bytes) {
            /* the next group, non-temporal: a step reads each weight once, so its lines need not push what steps
               reuse (the KV cache, a drafter's weights) out of L3. One Zen 4 thread, 3 interleaved pairs: the
               shipped EAGLE-3 drafter's passes 3.31-3.50 -> 3.24-3.29 ms for 3 (k = 3); a batch-1 step 6.05-6.31 ->
               6.04-6.23 ms; batch 16 and prefill level */
            for (int64_t o = 0; o < rec_bytes; o += 64) __builtin_prefetch(rec + ahead + o, 0, 0);
            vwf sw = load_halves(rec + 2 * lo), ow = {0};
            if (type == Q4_0) ow = -8.0f * sw;
            if (type == Q4_1) ow = load_halves(rec + 2 * GROUP + 2 * lo);
            vwb w[8];
            for (int c = 0; c < chunks(type); c++) {
                vwb q = load_w(rec + qs + 4 * GROUP * c + 4 * lo);
                if (type == Q8_0) {
                    w[c] = Q8_BIASED ? q ^ 0x80 : q;
                } else {
                    w[c] = q & 15;
                    w[c + 4] = q >> 4;
                }
            }
#pragma GCC unroll 8
            for (int i = 0; i < mr; i++) {
                const int8_t *x = qx + i * kq + SUB * b;
                vwi i0 = {0}, i1 = {0}; /* two chains of 4 */
                for (int j = 0; j < 4; j++) {
                    i0 = dot4(type, i0, w[j], x + 4 * j);
                    i1 = dot4(type, i1, w[j + 4], x + 4 * j + 16);
                }
                vwf fi = __builtin_convertvector(i0 + i1, vwf);
                float s = sx[i * np + b];
                if (type == Q8_0 && Q8_BIASED) fi = fi - 128.0f * s;
                vwf v = sw * fi;
                if (type != Q8_0) v = v + ow * s;
                acc[i] = acc[i] + dx[i * np + b] * v;
            }
        }
        for (int i = 0; i < mr; i++) lanes[l][i] = acc[i];
    }
    for (int i = 0; i < mr; i++)
        res[i] = ((lanes[0][i] + lanes[4][i]) + (lanes[1][i] + lanes[5][i])) +
                 ((lanes[2][i] + lanes[6][i]) + (lanes[3][i] + lanes[7][i]));
}

/* rows of x one sweep over the groups takes, in both loops (a multiple of MR and of AMX's 16): their quantized
   values, 147 KB at K = 576, stay in L2 while every group passes over them. Sweeping every row of a 2048-token prefill
   step at once (4096 split), they came from L3 for each group of 16 outputs: 12.0 us a row for a layer's q/k/v
   against 10.5 in panels (Zen 4, one thread), 37.0 against 33.7 for the layer's four products. */
enum { PANEL = 256 };

#if defined(EYAS_AMX)
#include "q8_amx.h"
#else
static inline int amx_tiles(int type, int64_t m_len) { return (void)type, (void)m_len, 0; }
int eyas_q8_tiled_rows(void) { return 0; }
#endif

/* rows m0..m0+mr-1 of x against lanes lo..lo+W-1 of a full group: a call for each count of rows below MR, so
   the loops over rows unroll */
static inline __attribute__((always_inline)) void group_block(const int type, int mr, const uint8_t *grp, int lo,
                                                            int64_t nsub, const int8_t *x, const float *d,
                                                            const float *s, int64_t kq, int64_t np, vwf *res) {
    switch (mr) {
    case 1: group_rows(type, 1, grp, lo, nsub, x, d, s, kq, np, res); break;
    case 2: group_rows(type, 2, grp, lo, nsub, x, d, s, kq, np, res); break;
    case 3: group_rows(type, 3, grp, lo, nsub, x, d, s, kq, np, res); break;
#if MR == 8
    case 4: group_rows(type, 4, grp, lo, nsub, x, d, s, kq, np, res); break;
    case 5: group_rows(type, 5, grp, lo, nsub, x, d, s, kq, np, res); break;
    case 6: group_rows(type, 6, grp, lo, nsub, x, d, s, kq, np, res); break;
    case 7: group_rows(type, 7, grp, lo, nsub, x, d, s, kq, np, res); break;
#endif
    default: group_rows(type, MR, grp, lo, nsub, x, d, s, kq, np, res); break;
    }
}

/* One thread's share of the product on interleaved weights (called by every thread of a parallel region; the
   threads split the groups, the same ones for every panel of rows): on AMX (tiled, q8_amx.h) a group's blocks
   multiply 16 rows of x at once, else MR rows at a time; the same bits either way. pairs (not tiled): rows 2i and
   2i + 1 of x are the two int8 rows of a split row (q8_gemm.c), and out row i gets the sum of their outputs (one
   rounding, as the split product's own sum) without a trip through memory: a pass's MR rows, like a panel's,
   start at an even row. Sets *failed when out of memory. */
static inline __attribute__((always_inline)) void r16_thread(const int type, int tiled, int pairs, const int8_t *qx,
                                                           const float *dx, const float *sx, const uint8_t *weight,
                                                           float *out, int64_t ldo, int64_t m_len, int64_t n_len,
                                                           int64_t k_len, int *failed) {
#if defined(EYAS_AMX)
    if (tiled) {
        amx_thread(type, qx, dx, sx, weight, out, ldo, m_len, n_len, k_len, failed);
        return;
    }
#else
    (void)tiled;
#endif
    int64_t nsub = k_len / SUB, np = padded(nsub), rb = nsub * block_bytes(type);
    int64_t groups = (n_len + GROUP - 1) / GROUP;
    uint8_t *wide = NULL; /* the last group widened, once, by the thread that takes it */
    for (int64_t p0 = 0; p0 < m_len; p0 += PANEL) {
        const int64_t p1 = m_len - p0 < PANEL ? m_len : p0 + PANEL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            int64_t R = n_len - GROUP * g < GROUP ? n_len - GROUP * g : GROUP;
            const uint8_t *grp = weight + GROUP * g * rb;
            if (R < GROUP) {
                if (!wide && (wide = malloc((size_t)(GROUP * rb))) != NULL) widen_group(type, grp, R, nsub, wide);
                if (!wide) {
#pragma omp atomic write
                    *failed = 1;
                    continue;
                }
                grp = wide;
            }
            for (int lo = 0; lo < R; lo += W)
                for (int64_t m0 = p0; m0 < p1; m0 += MR) {
                    int mr = p1 - m0 < MR ? (int)(p1 - m0) : MR;
                    vwf res[MR];
                    group_block(type, mr, grp, lo, nsub, qx + m0 * k_len, dx + m0 * np, sx + m0 * np, k_len, np, res);
                    if (pairs)
                        for (int i = 0; i < mr; i += 2)
                            for (int j = 0; j < W && lo + j < R; j++)
                                out[(m0 + i) / 2 * ldo + GROUP * g + lo + j] = res[i][j] + res[i + 1][j];
                    else
                        for (int i = 0; i < mr; i++)
                            for (int j = 0; j < W && lo + j < R; j++) out[(m0 + i) * ldo + GROUP * g + lo + j] = res[i][j];
                }
        }
    }
    free(wide);
}

/* the region is opened here (on two threads or more), with TYPE a constant in it (OpenMP outlines a region before
   constants propagate) */
#define GEMM_R16_FOR(TYPE)                                                                                     \
    static int gemm_r16_##TYPE(const int8_t *qx, const float *dx, const float *sx, const uint8_t *weight,     \
                               float *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len,         \
                               int num_threads, int pairs) {                                                \
        int failed = 0, tiled = amx_tiles(R16 + TYPE, m_len);                                               \
        PARALLEL_CALL(r16_thread(TYPE, tiled, pairs, qx, dx, sx, weight, out, ldo, m_len, n_len, k_len, &failed)); \
        return failed ? -1 : 0;                                                                             \
    }
GEMM_R16_FOR(Q4_0)
GEMM_R16_FOR(Q4_1)
GEMM_R16_FOR(Q8_0)
#undef GEMM_R16_FOR
#endif
