/* out = x @ weight^T for a few rows of x, float32, reading the weight in its own row-major layout.

   x [M, K], weight [N, K] (nn.Linear's layout), out [M, N]; meant for M up to a few dozen (decode,
   batched decode, verification), where the weight's bytes, not the arithmetic, set the time.

   The weight is cut into tiles of TILE_N rows; threads take tiles (static split), so every output
   element is summed by one thread in one fixed order: the same bits on any thread count, and
   row m of out does not depend on the other rows of x (batch invariance: a request's logits do
   not change with the batch it is in). Within a tile, rows of x go TILE_M at a time; each pass
   over the tile keeps TILE_N x TILE_M sums of 8 lanes in registers (12 of the 16 AVX2 registers),
   so the tile is read from memory once and from L1 for the later passes. While a tile is worked
   on, the next tile is prefetched, so the memory stream does not stall on the arithmetic.

   Products are summed with explicit fused multiply-adds (the compiler's own contraction differs
   between the tile variants it inlines, which would break batch invariance); lane sums are
   reduced in one fixed tree, then the K % 8 tail is added in order. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__)
#include <immintrin.h>
#else
#pragma GCC optimize("fp-contract=off")
#endif

#define TILE_N 4
#define TILE_M 3

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__FMA__)
static inline v8f fma8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8f fma8(v8f a, v8f b, v8f c) { return a * b + c; }  /* never contracted: same in every variant */
#endif

static inline float lane_sum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* out[m, j] = sum_k x[m, k] * w[j, k] for j < NB, m < MB; next: the tile to prefetch (or NULL). */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, const float *next, float *out,
                                                       int64_t k_len, int64_t n_len, const int NB, const int MB) {
    v8f acc[TILE_N][TILE_M];
    for (int j = 0; j < NB; j++)
        for (int m = 0; m < MB; m++) acc[j][m] = (v8f){0};
    int64_t k = 0;
    for (; k + 8 <= k_len; k += 8) {
        if (next && (k & 15) == 0)  /* one prefetch per 64-byte line of each next row */
            for (int j = 0; j < TILE_N; j++) __builtin_prefetch(next + j * k_len + k, 0, 0);
        v8f wv[TILE_N];
        for (int j = 0; j < NB; j++) wv[j] = load8(w + j * k_len + k);
        for (int m = 0; m < MB; m++) {
            v8f xv = load8(x + m * k_len + k);
            for (int j = 0; j < NB; j++) acc[j][m] = fma8(wv[j], xv, acc[j][m]);
        }
    }
    for (int j = 0; j < NB; j++)
        for (int m = 0; m < MB; m++) {
            float s = lane_sum(acc[j][m]);
            for (int64_t t = k; t < k_len; t++) s = fmaf(x[m * k_len + t], w[j * k_len + t], s);
            out[m * n_len + j] = s;
        }
}

#define ROWS_OF_X(NB)                                                                        \
    switch (mb) {                                                                           \
    case 3: tile(x + m * k_len, w, next, out + m * n_len + n0, k_len, n_len, NB, 3); break; \
    case 2: tile(x + m * k_len, w, next, out + m * n_len + n0, k_len, n_len, NB, 2); break; \
    default: tile(x + m * k_len, w, next, out + m * n_len + n0, k_len, n_len, NB, 1);       \
    }

/* Returns 0; all arrays contiguous float32. */
int eyas_small_gemm(const float *x, const float *weight, float *out, int64_t m_len, int64_t n_len, int64_t k_len,
                    int num_threads) {
    int64_t tiles = (n_len + TILE_N - 1) / TILE_N;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * TILE_N;
        const float *w = weight + n0 * k_len;
        const float *next = t + 2 < tiles ? w + TILE_N * k_len : NULL;  /* only whole tiles are prefetched */
        int nb = n_len - n0 < TILE_N ? (int)(n_len - n0) : TILE_N;
        for (int64_t m = 0; m < m_len; m += TILE_M) {
            int mb = m_len - m < TILE_M ? (int)(m_len - m) : TILE_M;
            switch (nb) {
            case 4: ROWS_OF_X(4) break;
            case 3: ROWS_OF_X(3) break;
            case 2: ROWS_OF_X(2) break;
            default: ROWS_OF_X(1)
            }
        }
    }
    return 0;
}
