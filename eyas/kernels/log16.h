/* Natural log of 16 float lanes, for the kernels that need a vector log (Gumbel noise). */
#pragma once
#include <stdint.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* log of 16 lanes for positive normal inputs, within 1 ulp of the true value over the uniforms of
 * eyas.sampling.noise and their -log: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) from the
 * polynomial of Cephes' logf in f = m - 1, plus e ln2 (ln2 split in two for an exact product). Every
 * lane takes the same operations, so a value's log does not depend on its lane or its neighbours. */
static inline v16f log16(v16f x) {
    v16i bits = (v16i)x;
    v16i e = ((bits >> 23) & 0xff) - 126;                       /* x = m 2^e, m in [0.5, 1) */
    v16f m = (v16f)((bits & 0x007fffff) | 0x3f000000);
    v16i small = m < 0.707106781186547524f;                     /* -1 in lanes that take 2m, e - 1 */
    e += small;
    v16f f = m + (v16f)((v16i)m & small) - 1.0f;                /* m in [sqrt(1/2), sqrt(2)) minus 1 */
    v16f ef = __builtin_convertvector(e, v16f);
    v16f z = f * f;
    v16f p = (v16f){0} + 7.0376836292e-2f;
    p = p * f - 1.1514610310e-1f;
    p = p * f + 1.1676998740e-1f;
    p = p * f - 1.2420140846e-1f;
    p = p * f + 1.4249322787e-1f;
    p = p * f - 1.6668057665e-1f;
    p = p * f + 2.0000714765e-1f;
    p = p * f - 2.4999993993e-1f;
    p = p * f + 3.3333331174e-1f;
    v16f y = p * f * z + ef * -2.12194440e-4f - 0.5f * z;
    return f + y + ef * 0.693359375f;
}
