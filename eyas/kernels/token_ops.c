/* Per-token float32 operations of a decoder layer, each one call where PyTorch takes several ops:
   RMSNorm, the rotary embedding and the SiLU gate of a gated MLP.

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

#include "exp8.h"

typedef float v16f __attribute__((vector_size(64)));

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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
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
    }
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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * heads * d >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
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
    }
    return 0;
}

/* silu(g) * u of 8 lanes; silu(g) = g / (1 + exp(-g)), computed with e = exp(-|g|) <= 1, which cannot
   overflow: g / (1 + e) for g >= 0, g * e / (1 + e) below. */
static inline v8f silu_mul8(v8f g, v8f u) {
    const v8i sign = (v8i){0} + INT32_MIN;
    v8i negative = g < 0.0f;
    v8f e = exp8((v8f)((v8i)g | sign)); /* -|g| */
    v8f num = (v8f)(((v8i)g & ~negative) | ((v8i)(g * e) & negative));
    return num / (1.0f + e) * u;
}

/* out[t, i] = silu(gate) * up with gate = gu[t, i], up = gu[t, n + i]: gu [tokens, 2n] (the fused gate/up
   product), out [tokens, n]. The n % 8 tail goes through the same 8 lanes, zero-padded. */
int eyas_silu_mul(const float *gu, float *out, int64_t tokens, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens * n >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *gate = gu + t * 2 * n, *up = gate + n;
        float *o = out + t * n;
        int64_t i = 0;
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
    }
    return 0;
}
