/* The GGUF block formats eyas's weight kernels read (quant_gemm.c, q8_gemm.c): type ids, row sizes and the
   shared scalar decoders. Include after <immintrin.h> where F16C is on. */
#ifndef EYAS_GGUF_BLOCKS_H
#define EYAS_GGUF_BLOCKS_H
#include <stdint.h>
#include <string.h>

typedef uint8_t v16u8 __attribute__((vector_size(16)));

/* 16 bytes of a block as a vector (any alignment) */
static inline v16u8 bytes16(const uint8_t *p) {
    v16u8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* GGML's type numbers; I8_ROW (one int8 per weight, a float32 scale per output row) is eyas's own */
enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, I8_ROW = 1000 };
/* X(type) for every format whose weights are integers times scales (all but F16 and BF16) */
#define INTEGER_FORMATS(X) X(Q4_0) X(Q4_1) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K) X(I8_ROW)

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        exp = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* bytes of one row of K weights */
static int64_t row_bytes(int type, int64_t k) {
    switch (type) {
    case F16: case BF16: return 2 * k;
    case Q4_0: return k / 32 * 18;
    case Q4_1: return k / 32 * 20;
    case Q8_0: return k / 32 * 34;
    case Q4_K: return k / 256 * 144;
    case Q5_K: return k / 256 * 176;
    case Q6_K: return k / 256 * 210;
    case I8_ROW: return k;
    default: return -1;
    }
}

static int block_size(int type) {
    switch (type) {
    case Q4_K: case Q5_K: case Q6_K: return 256;
    case F16: case BF16: case I8_ROW: case Q4_0: case Q4_1: case Q8_0: return 32;
    default: return 0;
    }
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
#endif
