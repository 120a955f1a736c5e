/* Per-token float32 operations of a decoder layer, each one call where PyTorch takes several ops:
   RMSNorm, the rotary embedding and the SiLU gate of a gated MLP; and the reductions over a vocabulary
   row that sampling takes (argmax, Gumbel-max, the best values, the log normaliser; eyas.sampling.row_ops).

   At batch 1 a decode step is bound by the count of operations outside its matrix products: for one
   576-wide row PyTorch's RMSNorm (power, mean, add, rsqrt, two products) takes about 8 us and the
   rotary embedding of 12 heads (chunk, four products, two sums, cat) about 8 us and the SiLU gate
   (chunk, silu, product) about 7 us on the project's CPU, against 1-2 us for a call here.

   Tokens (rows) are split among threads; a row is computed by one thread in one fixed order, so a
   result does not depend on the thread count or on the other rows. Products and sums are rounded
   one at a time (never fused): the rotary embedding equals PyTorch's ops bit for bit, RMSNorm
   differs from PyTorch's only in the order its sum of squares is added up, and the SiLU gate in its
   exp (within 1 ulp, as PyTorch's own vectorised exp is).
*/
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector_exp.h"
#include "log16.h"
#include "parallel.h"

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* ((l0 + l8) + (l4 + l12)) + ... one fixed tree */
static inline float lane_sum(v16f v) {
    float s[8];
    for (int i = 0; i < 8; i++) s[i] = v[i] + v[i + 8];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* Fewer floats than this are worked on by the calling thread alone: waking the team costs more. */
#define PARALLEL_MIN_FLOATS 32768

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for r < rows: x and out [rows, n], weight [n]. The
   squares are summed in 16 lanes, then the lanes in one fixed tree, then the n % 16 tail in order; each
   output is (x * inv) * weight, as PyTorch rounds it. */
int eyas_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps, int num_threads) {
    PARALLEL_ROWS(r, rows, rows * n >= PARALLEL_MIN_FLOATS, {
        const float *xr = x + r * n;
        float *o = out + r * n;
        v16f acc = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            v16f v = load16(xr + i);
            acc += v * v;
        }
        float sum = lane_sum(acc);
        for (; i < n; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i + 16 <= n; i += 16) store16(o + i, load16(xr + i) * inv * load16(weight + i));
        for (; i < n; i++) o[i] = xr[i] * inv * weight[i];
    });
    return 0;
}

/* The neox-layout rotary embedding (HF's rotate_half): x [tokens, heads, d] (token stride ldx, head
   stride d), cos and sin [tokens, d / 2], out [tokens, heads, d] contiguous. Weight i of a head pairs
   with weight i + d / 2:
     out[i]         = x[i] * cos[i] - x[i + d/2] * sin[i]
     out[i + d / 2] = x[i + d/2] * cos[i] + x[i] * sin[i]
   Example (d = 4, one head, angles a, b): out = [x0 cos a - x2 sin a, x1 cos b - x3 sin b,
   x2 cos a + x0 sin a, x3 cos b + x1 sin b]. */
int eyas_rotary(const float *x, int64_t ldx, const float *cos_, const float *sin_, float *out, int64_t tokens,
                int64_t heads, int64_t d, int num_threads) {
    const int64_t half = d / 2;
    PARALLEL_ROWS(t, tokens, tokens * heads * d >= PARALLEL_MIN_FLOATS, {
        const float *c = cos_ + t * half, *s = sin_ + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + t * ldx + h * d, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * d, *o2 = o1 + half;
            int64_t i = 0;
            for (; i + 16 <= half; i += 16) {
                v16f a = load16(x1 + i), b = load16(x2 + i), cv = load16(c + i), sv = load16(s + i);
                store16(o1 + i, a * cv - b * sv);
                store16(o2 + i, b * cv + a * sv);
            }
            for (; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    });
    return 0;
}

/* silu(g) * u of 8 lanes; silu(g) = g / (1 + exp(-g)), computed with e = exp(-|g|) <= 1, which cannot
   overflow: g / (1 + e) for g >= 0, g * e / (1 + e) below. */
#define EYAS_SILU_MUL(NAME, VF, VI, EXP)                                                           \
    static inline VF NAME(VF g, VF u) {                                                            \
        const VI sign = (VI){0} + INT32_MIN;                                                       \
        VI negative = g < 0.0f;                                                                    \
        VF e = EXP((VF)((VI)g | sign)); /* -|g| */                                                 \
        VF num = (VF)(((VI)g & ~negative) | ((VI)(g * e) & negative));                             \
        return num / (1.0f + e) * u;                                                               \
    }
/* the same operations at either width, lane by lane (so either gives a lane the same bits): 16 lanes take about
   half the instructions of two times 8 (a prefill chunk's 256 rows of 1,536, one Zen 4 thread: 341 -> 239 us, the same bits) */
EYAS_SILU_MUL(silu_mul8, v8f, v8i, exp8)
EYAS_SILU_MUL(silu_mul16, v16f, v16i, exp16)

/* out[t, i] = silu(gate) * up with gate = gu[t, i], up = gu[t, n + i]: gu [tokens, 2n] (the fused gate/up
   product), out [tokens, n]. The n % 8 tail goes through the same 8 lanes, zero-padded. */
int eyas_silu_mul(const float *gu, float *out, int64_t tokens, int64_t n, int num_threads) {
    PARALLEL_ROWS(t, tokens, tokens * n >= PARALLEL_MIN_FLOATS, {
        const float *gate = gu + t * 2 * n, *up = gate + n;
        float *o = out + t * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            v16f y = silu_mul16(load16(gate + i), load16(up + i));
            store16(o + i, y);
        }
        for (; i + 8 <= n; i += 8) {
            v8f g, u;
            memcpy(&g, gate + i, sizeof g);
            memcpy(&u, up + i, sizeof u);
            v8f y = silu_mul8(g, u);
            memcpy(o + i, &y, sizeof y);
        }
        if (i < n) {
            v8f g = {0}, u = {0};
            memcpy(&g, gate + i, (n - i) * sizeof(float));
            memcpy(&u, up + i, (n - i) * sizeof(float));
            v8f y = silu_mul8(g, u);
            memcpy(o + i, &y, (n - i) * sizeof(float));
        }
    });
    return 0;
}


/* The merge of 16 lanes that each kept their largest value and the index where it first appeared: the
   largest value (into *top), at the smallest index among the lanes that hold it. */
static inline int64_t merge_lanes(v16f best, v16i first, float *top) {
    float t = -INFINITY;
    int64_t at = INT64_MAX;
    for (int l = 0; l < 16; l++)
        if (best[l] > t) t = best[l];
    for (int l = 0; l < 16; l++)
        if (best[l] == t && first[l] < at) at = first[l];
    *top = t;
    return at;
}

/* The lanes where block v (its values' indices: index) is strictly larger than *best take it */
static inline void keep_larger(v16f v, v16i index, v16f *best, v16i *first) {
    v16i larger = v > *best;
    *best = (v16f)(((v16i)v & larger) | ((v16i)*best & ~larger));
    *first = (index & larger) | (*first & ~larger);
}

/* The lanes of (b_best, b_first) that beat (a_best, a_first): larger, or equal at a smaller index */
static inline void keep_better(v16f *a_best, v16i *a_first, v16f b_best, v16i b_first) {
    v16i take = (b_best > *a_best) | ((b_best == *a_best) & (b_first < *a_first));
    *a_best = (v16f)(((v16i)b_best & take) | ((v16i)*a_best & ~take));
    *a_first = (b_first & take) | (*a_first & ~take);
}

/* out[r] = torch.argmax(x[r]): the index of the largest value, the first of equal ones, or the first
   NaN where the row has one: x [rows, n]. PyTorch's CPU argmax walks a 49,152-wide row one value at a
   time (about 0.15 ms); here each lane of 4 accumulators (the 16-value blocks b with b mod 4 = a, so
   that their compare-and-keep chains run side by side: one chain waited about 6 cycles a block) keeps its
   largest value and the index where it first appeared (a later value replaces it only when strictly
   larger), then the accumulators merge lane by lane (the larger, or the smaller index of equal ones) and
   merge_lanes takes the row's. The n % 16 tail comes last, strictly larger only. A row of n < 16 is all
   tail. */
int eyas_argmax(const float *x, int64_t *out, int64_t rows, int64_t n, int num_threads) {
    PARALLEL_ROWS(r, rows, rows * n >= 4 * PARALLEL_MIN_FLOATS, {
        const float *xr = x + r * n;
        const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        v16f best[4];
        v16i first[4], index[4], nan = {0};
        for (int a = 0; a < 4; a++) {
            best[a] = (v16f){0} - INFINITY;
            first[a] = index[a] = lanes + 16 * a;
        }
        int64_t i = 0;
        for (; i + 64 <= n; i += 64)
            for (int a = 0; a < 4; a++) {
                v16f v = load16(xr + i + 16 * a);
                keep_larger(v, index[a], &best[a], &first[a]);
                nan |= v != v;
                index[a] += 64;
            }
        for (int a = 0; i + 16 <= n; i += 16, a++) { /* the last blocks, one to an accumulator */
            v16f v = load16(xr + i);
            keep_larger(v, index[a], &best[a], &first[a]);
            nan |= v != v;
        }
        keep_better(&best[0], &first[0], best[1], first[1]);
        keep_better(&best[2], &first[2], best[3], first[3]);
        keep_better(&best[0], &first[0], best[2], first[2]);
        float top = -INFINITY;
        int64_t at = i > 0 ? merge_lanes(best[0], first[0], &top) : 0;
        int any_nan = 0;
        for (int l = 0; l < 16; l++) any_nan |= nan[l];
        for (; i < n; i++) {
            any_nan |= xr[i] != xr[i];
            if (xr[i] > top) {
                top = xr[i];
                at = i;
            }
        }
        if (any_nan)
            for (at = 0; xr[at] == xr[at]; at++) {
            }
        out[r] = at;
    });
    return 0;
}

typedef uint32_t v16u __attribute__((vector_size(64)));

/* murmur3's fmix32 on 16 lanes (eyas.sampling.noise: uint32 products wrap as its "& 0xFFFFFFFF") */
static inline v16u fmix32(v16u h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

static inline uint32_t fmix32_1(uint32_t h) { return fmix32((v16u){0} + h)[0]; }

/* out[r] = argmax over v of logprobs[r, v] + gumbel(seed[r], position[r], stream[r], v), with
   eyas.sampling.noise's hash bit for bit (its row key, then u = ((fmix32(key ^ fmix32(v * 0x9E3779B1 +
   0x7F4A7C15)) >> 9) + 0.5) 2^-23) and gumbel = -log(-log(u)) with log16. A block of 16 values that are
   all -inf (what top-k and top-p leave) is skipped: their sums are -inf, which never wins. Ties and NaN
   as eyas_argmax (a row of -inf gives 0). logprobs [rows, n]; seed, position, stream [rows]. */
int eyas_gumbel_argmax(const float *logprobs, const int64_t *seed, const int64_t *position, const int64_t *stream,
                       int64_t *out, int64_t rows, int64_t n, int num_threads) {
    const v16u lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1 && rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *lp = logprobs + r * n;
        uint32_t key = fmix32_1((uint32_t)seed[r] ^ 0x9E3779B9u);
        key = fmix32_1(key ^ (uint32_t)((uint64_t)seed[r] >> 32));
        key = fmix32_1(key ^ (uint32_t)position[r]);
        key = fmix32_1(key ^ (uint32_t)((uint64_t)stream[r] * 0x632BE5ABu));
        const v16u k = (v16u){0} + key;
        v16i first = (v16i)lanes, nan = {0};
        v16f best = (v16f){0} - INFINITY;
        for (int64_t i = 0; i < n; i += 16) {
            const int64_t width = n - i < 16 ? n - i : 16;
            int any = 0;
            for (int64_t l = 0; l < width; l++) any |= lp[i + l] != -INFINITY;
            if (!any) continue;
            v16f v = (v16f){0} - INFINITY;
            memcpy(&v, lp + i, width * sizeof(float));
            v16u index = lanes + (uint32_t)i;
            v16u x = fmix32(k ^ fmix32(index * 0x9E3779B1u + 0x7F4A7C15u));
            v16f u = (__builtin_convertvector((v16i)(x >> 9), v16f) + 0.5f) * 0x1p-23f; /* x >> 9 < 2^23 */
            v16f s = v - log16(-log16(u));
            v16i larger = s > best;
            best = (v16f)(((v16i)s & larger) | ((v16i)best & ~larger));
            first = ((v16i)index & larger) | (first & ~larger);
            nan |= s != s;
        }
        float top;
        int64_t at = merge_lanes(best, first, &top);
        int any_nan = 0;
        for (int l = 0; l < 16; l++) any_nan |= nan[l];
        if (any_nan)
            for (at = 0; lp[at] == lp[at]; at++) {
            }
        out[r] = at;
    }
    return 0;
}

/* heap[0 .. size) a min-heap but for its root: sift the root down */
static void sift_down(float *heap, int64_t size, int64_t at) {
    float v = heap[at];
    for (;;) {
        int64_t child = 2 * at + 1;
        if (child >= size) break;
        if (child + 1 < size && heap[child + 1] < heap[child]) child++;
        if (!(heap[child] < v)) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = v;
}

/* heap[0 .. width) = the `width` largest values of the row xr of n in descending order
   (torch.topk(x, width).values), for 1 <= width <= n: a min-heap of the best so far, which a block of 16
   values enters only if one of them beats its root (after the first few thousand values, almost none do),
   then heap-sorted. Returns 1, with heap unspecified, if the row holds a NaN (whose place PyTorch
   defines), else 0. eyas_top_values: every row of x [rows, n] into out [rows, width]; 1 if any row held a
   NaN (the caller asks PyTorch). */
static int row_top_values(const float *xr, int64_t n, float *heap, int64_t width) {
    int nan = 0;
    for (int64_t i = 0; i < width; i++) {
        heap[i] = xr[i];
        nan |= xr[i] != xr[i];
    }
    for (int64_t i = width / 2 - 1; i >= 0; i--) sift_down(heap, width, i);
    for (int64_t i = width; i < n; i += 16) {
        const int64_t block = n - i < 16 ? n - i : 16;
        const float floor = heap[0];
        int enters = 0;
        for (int64_t l = 0; l < block; l++) {
            enters |= xr[i + l] > floor;
            nan |= xr[i + l] != xr[i + l];
        }
        if (!enters) continue;
        for (int64_t l = 0; l < block; l++)
            if (xr[i + l] > heap[0]) {
                heap[0] = xr[i + l];
                sift_down(heap, width, 0);
            }
    }
    for (int64_t size = width - 1; size > 0; size--) { /* the smallest goes last: descending */
        float smallest = heap[0];
        heap[0] = heap[size];
        heap[size] = smallest;
        sift_down(heap, size, 0);
    }
    return nan;
}

int eyas_top_values(const float *x, float *out, int64_t rows, int64_t n, int64_t width, int num_threads) {
    int nan_seen = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : nan_seen) if (rows > 1 && rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) nan_seen |= row_top_values(x + r * n, n, out + r * width, width);
    return nan_seen;
}

/* log(sum of exp(x[v])) over the values x[v] >= floor of a row of n (floor -inf: all of them), as top +
   log(sum(exp(x[v] - top))), top the largest of them: PyTorch's logsumexp of the row with the rest masked
   to -inf, in two passes where PyTorch's ops took six, with two copies. exp16 gives 0 below -87.3 where
   eyas.sampling.row_ops's tensor form adds e^-87 for each such value: at most 49,152 * 1.6e-38 on a sum of
   at least 1. The sum is taken in 16 lanes, then lane_sum, then the n % 16 tail as one more block padded
   with -inf. NaN where the row has a NaN or its largest value is infinite (every value masked or -inf, or
   one +inf), as PyTorch's formula gives. */
static float row_log_normaliser(const float *x, int64_t n, float floor) {
    v16f best = (v16f){0} - INFINITY;
    v16i nan = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16f v = load16(x + i);
        v16i larger = v > best;
        best = (v16f)(((v16i)v & larger) | ((v16i)best & ~larger));
        nan |= v != v;
    }
    float top = -INFINITY;
    int any_nan = 0;
    for (int l = 0; l < 16; l++) {
        top = best[l] > top ? best[l] : top;
        any_nan |= nan[l];
    }
    for (int64_t j = i; j < n; j++) {
        top = x[j] > top ? x[j] : top;
        any_nan |= x[j] != x[j];
    }
    if (any_nan || isinf(top) || top < floor) return NAN;
    const v16f low = (v16f){0} + floor, minus_inf = (v16f){0} - INFINITY;
    v16f acc = {0};
    for (i = 0; i + 16 <= n; i += 16) {
        v16f v = load16(x + i);
        v16i kept = v >= low;
        acc += exp16((v16f)(((v16i)v & kept) | ((v16i)minus_inf & ~kept)) - top);
    }
    if (i < n) {
        v16f tail = minus_inf;
        memcpy(&tail, x + i, (n - i) * sizeof(float));
        v16i kept = tail >= low;
        acc += exp16((v16f)(((v16i)tail & kept) | ((v16i)minus_inf & ~kept)) - top);
    }
    return top + logf(lane_sum(acc));
}

/* out[r] = row_log_normaliser of row r of x [rows, n] over its values >= floor[r] (floor NULL: all). */
int eyas_log_normaliser(const float *x, const float *floor, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1 && rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) out[r] = row_log_normaliser(x + r * n, n, floor ? floor[r] : -INFINITY);
    return 0;
}

/* In place, row r of x [rows, n]: values below floor[r] become -inf and the rest x - z, z their
   row_log_normaliser: a log_softmax over the values kept. Where z is NaN the whole row is NaN, as
   PyTorch's masked_fill then subtraction leave it. */
int eyas_log_softmax_above(float *x, const float *floor, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1 && rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        const float z = row_log_normaliser(xr, n, floor[r]);
        const v16f low = (v16f){0} + floor[r], minus_inf = (v16f){0} - INFINITY;
        int64_t i = 0;
        if (z == z)
            for (; i + 16 <= n; i += 16) {
                v16f v = load16(xr + i);
                v16i kept = v >= low;
                store16(xr + i, (v16f)(((v16i)(v - z) & kept) | ((v16i)minus_inf & ~kept)));
            }
        for (; i < n; i++) xr[i] = xr[i] >= floor[r] ? xr[i] - z : (z == z ? -INFINITY : NAN);
    }
    return 0;
}

/* Each row's top-k then top-p threshold from its best `width` values (eyas.sampling.row_ops
   nucleus_thresholds, whose tensor form states it): x [rows, n] scaled logits, k [rows] (n: top-k off),
   top_p [rows] (1: off); threshold [rows] the smallest value kept, settled [rows] whether the best `width`
   values decide it; vals [rows, width] scratch. The probabilities are exp(v - log_z) (0 below
   e^-87), added up in double and rounded to float after each value, as PyTorch's CPU cumsum does. Returns 1,
   with the outputs unspecified, if x holds a NaN (the caller asks PyTorch), else 0. */
int eyas_nucleus(const float *x, const int64_t *k, const float *top_p, float *threshold, uint8_t *settled, float *vals,
                 int64_t rows, int64_t n, int64_t width, int num_threads) {
    int nan_seen = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : nan_seen) if (rows > 1 && rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *v = vals + r * width;
        if (row_top_values(xr, n, v, width)) {
            nan_seen = 1;
            continue;
        }
        float kth = v[(k[r] - 1 < width - 1 ? k[r] - 1 : width - 1)];
        if (k[r] == n && width < n) kth = -INFINITY;
        int done = k[r] <= width || k[r] == n;
        for (int64_t i = 0; i < width; i++)
            if (v[i] < kth) v[i] = -INFINITY;
        const float log_z = row_log_normaliser(xr, n, kth);
        double sum = 0.0;
        float before = 0.0f, mass = 0.0f;
        int64_t keep = 0;
        for (int64_t i = 0; i < width; i++) {
            keep += before < top_p[r];
            const float d = v[i] - log_z;
            sum += d < -87.0f ? 0.0f : expf(d);
            mass = (float)sum;
            before = mass;
        }
        const float t_p = top_p[r] < 1.0f ? v[keep - 1] : -INFINITY;
        done &= top_p[r] >= 1.0f || mass >= top_p[r];
        threshold[r] = kth > t_p ? kth : t_p;
        settled[r] = (uint8_t)done;
    }
    return nan_seen;
}
