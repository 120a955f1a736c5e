/* exp of 8 and of 16 float lanes, shared by the kernels that need a vector exp (softmax, SiLU, the log
   normaliser of a vocabulary row). */
#pragma once
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp of the lanes of VF x (VI: the int32 vector of its width) for inputs x <= 0, within 1 ulp
 * (measured: relative error at most 8.3e-8 over [-100, 0]): x = n ln2 + r with |r| <= ln2 / 2, exp(r)
 * from the polynomial of Cephes' expf, times 2^n through the exponent bits. Lanes below -87.3 (where
 * expf leaves the normal floats) and -inf give 0. Scalar expf costs about 20 cycles a lane. Every lane
 * takes the same operations at either width, so exp8 and exp16 agree bit for bit. */
#define EYAS_VECTOR_EXP(NAME, VF, VI)                                                              \
    static inline VF NAME(VF x) {                                                                  \
        const VI under = x < -87.3f; /* -1 in lanes whose result flushes to 0 */                   \
        const VF floor_x = (VF){0} - 87.3f;                                                        \
        x = (VF)(((VI)x & ~under) | ((VI)floor_x & under));                                        \
        VF t = x * 1.44269504088896341f + 0.5f;                                                    \
        VI n = __builtin_convertvector(t, VI);          /* truncates toward 0 */                   \
        n += (VI)(__builtin_convertvector(n, VF) > t);  /* -1 where that rounded up: floor */      \
        VF nf = __builtin_convertvector(n, VF);                                                    \
        VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln2 split in two: an exact product */ \
        VF p = (VF){0} + 1.9875691500e-4f;                                                         \
        p = p * r + 1.3981999507e-3f;                                                              \
        p = p * r + 8.3334519073e-3f;                                                              \
        p = p * r + 4.1665795894e-2f;                                                              \
        p = p * r + 1.6666665459e-1f;                                                              \
        p = p * r + 5.0000001201e-1f;                                                              \
        p = p * r * r + r + 1.0f;                                                                  \
        VI bits = (VI)p + (n << 23);                                                               \
        return (VF)(bits & ~under);                                                                \
    }

EYAS_VECTOR_EXP(exp8, v8f, v8i)
EYAS_VECTOR_EXP(exp16, v16f, v16i)
