/* Paged attention on the CPU, reading K/V in place from the block-paged cache: decodes, verification chains
 * and prefill chunks alike.
 *
 * One call writes the step's new K/V into the cache (so a layer's attention is one call, not three
 * ops), then attends every listed request. Request n owns query tokens q_start[n] ..
 * q_start[n] + q_len[n] - 1, the last q_len[n] of its seq_len[n] context positions; its K/V for
 * position p live in cache slot table[row[n] * table_width + p / block_size] * block_size +
 * p % block_size. Query j of the request (at position seq_len - q_len + j) sees the keys
 * lo .. seq_len - q_len + j, with lo = 0, or for a sliding window of w keys
 * max(0, position - w + 1).
 *
 * A work item is one (request, KV head, chunk of at most Q_CHUNK of its queries): the G query heads of that KV head
 * times the chunk's tokens make R rows that share every K/V row, so K/V are read from the cache once per item. Where
 * head dims are whole 16-lane vectors and the build has AVX-512 (attend_heads16), and the batch has two requests per
 * thread or more (or one thread runs every item), an item spans every KV head of the request: its cache rows are read
 * whole. A long prefill query is thus spread over the threads in chunks. Keys are visited a cache block at a time with
 * an online softmax (a running maximum m and sum l per row): scores of the block, then rescale the accumulators if the
 * maximum moved, then add p * V. A block's K/V are prefetched before its rows read them, and the next block's beside
 * their work (prefetch_slots): the blocks sit anywhere in the cache, and a decode's rows would otherwise wait on each
 * block's lines in turn. Beside an item's last block, the next item's first one (an item of every KV head: the next
 * request's). Everything is summed in float32; the cache may hold float32, bfloat16 or float16 values (cache_dtype 0,
 * 1, 2), widened exactly on load.
 *
 * Example: block_size 4, one request with q_len 2, seq_len 6 and table row [7, 3]: its two
 * queries sit at positions 4 and 5, the keys of positions 0..3 live in slots 28..31 and those of
 * 4..5 in slots 12..13; query 0 sees positions 0..4, query 1 sees 0..5.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_exp.h"

#define Q_CHUNK 64 /* query tokens of a request per work item */

/* attend_heads16 needs 16-lane vectors: on a build without AVX-512, GCC lowers its 16-lane shuffles to one insert
 * a lane, and it ran 3-5x slower than attend_item (SmolLM2-135M's shape, one Zen 4 thread built for AVX2 alone:
 * B = 16 decodes at 256 keys 2,200 -> 680 us a layer, a 512-token prefill 59 -> 15 ms, a 5-token verification
 * over 512 keys 1,140 -> 220 us). Such a build takes attend_item for every head dim; its bits differ from the
 * AVX-512 build's, and within either build every row's arithmetic is fixed. */
#ifdef __AVX512F__
#define HEADS16_BUILD 1
#else
#define HEADS16_BUILD 0
#endif

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

#define MAX_VEC_D 128 /* head dims up to this (multiples of 8) keep a row in registers; others take scalar tails */

static inline float hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* s[t] = q . k[t] for t < n (d-wide rows). */
static inline void dots(const float *q, const float *const *k, int64_t n, int64_t d, float *s) {
    if (d % 8 == 0 && d <= MAX_VEC_D) {
        v8f qv[MAX_VEC_D / 8];
        for (int64_t i = 0; i < d / 8; i++) qv[i] = load8(q + 8 * i);
        for (int64_t t = 0; t < n; t++) {
            v8f a = {0}, b = {0};
            int64_t i = 0;
            for (; i + 2 <= d / 8; i += 2) {
                a += qv[i] * load8(k[t] + 8 * i);
                b += qv[i + 1] * load8(k[t] + 8 * i + 8);
            }
            if (i < d / 8) a += qv[i] * load8(k[t] + 8 * i);
            s[t] = hsum(a + b);
        }
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        float a = 0.0f;
        for (int64_t i = 0; i < d; i++) a += q[i] * k[t][i];
        s[t] = a;
    }
}

/* y += sum_t p[t] * v[t] over t < n (d-wide rows). */
static inline void accumulate(float *y, const float *p, const float *const *v, int64_t n, int64_t d) {
    if (d % 8 == 0 && d <= MAX_VEC_D) {
        v8f yv[MAX_VEC_D / 8];
        for (int64_t i = 0; i < d / 8; i++) yv[i] = load8(y + 8 * i);
        for (int64_t t = 0; t < n; t++) {
            if (p[t] == 0.0f) continue; /* hidden key */
            for (int64_t i = 0; i < d / 8; i++) yv[i] += p[t] * load8(v[t] + 8 * i);
        }
        for (int64_t i = 0; i < d / 8; i++) store8(y + 8 * i, yv[i]);
        return;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) y[i] += p[t] * v[t][i];
}

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign; /* zero */
    } else { /* subnormal: value = man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Pointers to n consecutive cache rows as float32: the rows themselves for float32 caches, else
 * copies widened into buf [n, d]. */
static inline void rows_f32(const void *base, int64_t index, int64_t stride, int64_t n, int dtype, int64_t d,
                            float *buf, const float **rows) {
    for (int64_t t = 0; t < n; t++) {
        int64_t at = index + t * stride;
        if (dtype == 0) {
            rows[t] = (const float *)base + at;
            continue;
        }
        const uint16_t *src = (const uint16_t *)base + at;
        float *dst = buf + t * d;
        if (dtype == 1) {
            for (int64_t i = 0; i < d; i++) {
                uint32_t bits = (uint32_t)src[i] << 16;
                memcpy(dst + i, &bits, 4);
            }
        } else {
            for (int64_t i = 0; i < d; i++) dst[i] = half_to_float(src[i]);
        }
        rows[t] = dst;
    }
}

/* Prefetches the cache lines of bytes from .. from + bytes - 1 into L1 (to_l1) or L2. */
static inline void prefetch_range(const char *from, int64_t bytes, int to_l1) {
    const char *p = (const char *)((uintptr_t)from & ~(uintptr_t)63), *end = from + bytes;
    if (to_l1)
        for (; p < end; p += 64) __builtin_prefetch(p, 0, 3);
    else
        for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}

/* Brings slots s0 .. s1 - 1 of a cache block's K and V rows toward the core: into L1 (the block about to be
 * read: in address order, so the whole block streams in at once, where the rows' own loads would walk it a head's
 * slice at a time) or into L2 (the next block, a share of it beside each row's work). A row is `bytes` long and
 * rows are `stride` bytes apart. Nothing is computed from them: results do not depend on it. B = 16 decode rows of
 * SmolLM2-135M's shape at 230 keys, every layer's cache cold as in a step (AMD Zen 4): 913 -> 410-440 us a layer on
 * one thread, 450 -> 255 us on two; one request of 230 keys 28-32 -> 23 us. Either prefetch alone does less (one
 * thread: 890 with the L1 one alone, 560 with the L2 one alone), and the L2 one two blocks ahead does less too (475). */
static inline void prefetch_slots(const char *k, const char *v, int64_t s0, int64_t s1, int64_t stride, int64_t bytes,
                                  int to_l1) {
    if (bytes == stride) { /* whole slot rows (an item of every KV head): one range each */
        prefetch_range(k + s0 * stride, (s1 - s0) * stride, to_l1);
        prefetch_range(v + s0 * stride, (s1 - s0) * stride, to_l1);
        return;
    }
    for (int64_t s = s0; s < s1; s++) {
        prefetch_range(k + s * stride, bytes, to_l1);
        prefetch_range(v + s * stride, bytes, to_l1);
    }
}

/* The cache element of position start's block's first slot, offset values into its row (the block-table walk) */
static inline int64_t slot_at(const int64_t *table, int64_t start, int64_t block_size, int64_t slot_stride,
                              int64_t offset) {
    return table[start / block_size] * block_size * slot_stride + offset;
}

/* Slots of the block after the one at start that hold positions below seq_len (0: none). */
static inline int64_t next_slots(int64_t start, int64_t block_size, int64_t seq_len) {
    int64_t left = seq_len - start - block_size;
    return left <= 0 ? 0 : left < block_size ? left : block_size;
}

/* An item's rows: row r is token q_start + r / per's head head0 + r % per. Its scaled query goes to qs, and
 * its accumulator, running max and running sum start empty. */
static inline void start_rows(const float *q, int64_t q_stride, int64_t q_start, int64_t rows, int64_t per,
                              int64_t head0, int64_t d, float scale, float *qs, float *acc, float *m, float *l) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = q + (q_start + r / per) * q_stride + (head0 + r % per) * d;
        for (int64_t i = 0; i < d; i++) qs[r * d + i] = src[i] * scale;
        memset(acc + r * d, 0, d * sizeof(float));
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
}

/* The rows of start_rows, each accumulator over its sum, into out [num_tokens, num_heads, d]. */
static inline void finish_rows(float *out, int64_t q_start, int64_t rows, int64_t per, int64_t head0,
                               int64_t num_heads, int64_t d, const float *acc, const float *l) {
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + ((q_start + r / per) * num_heads + head0 + r % per) * d;
        float inv = 1.0f / l[r];
        for (int64_t i = 0; i < d; i++) dst[i] = acc[r * d + i] * inv;
    }
}

/* One (request, KV head) item. Always inlined, and called with a constant d for common head dims
 * (the switch in eyas_paged_attention), so the loops over d unroll and keep a query or accumulator
 * row in registers. */
static inline __attribute__((always_inline)) void attend_item(
        const float *q, int64_t q_stride, float *out, const void *k_cache, const void *v_cache, int cache_dtype,
        int64_t slot_stride, const int64_t *table, int64_t block_size, int64_t q_start, int64_t q_len, int64_t seq_len,
        int64_t kv_head, int64_t groups, int64_t num_heads, const int64_t d, int64_t window, float scale, float *work) {
    const int64_t rows = groups * q_len;
    float *qs = work;                      /* [rows, d] scaled queries */
    float *acc = qs + rows * d;            /* [rows, d] */
    float *m = acc + rows * d;             /* [rows] running max */
    float *l = m + rows;                   /* [rows] running sum */
    float *s = l + rows;                   /* [rows, block_size] scores, then probabilities */
    float *kbuf = s + rows * block_size;   /* [block_size, d] widened K rows */
    float *vbuf = kbuf + block_size * d;   /* [block_size, d] widened V rows */
    /* [block_size] row pointers, 8-byte aligned (the floats before them are even in number) */
    const float **kp = (const float **)(vbuf + block_size * d + (rows * block_size) % 2);
    const float **vp = kp + block_size;
    const int64_t esz = cache_dtype == 0 ? 4 : 2, stride = slot_stride * esz; /* bytes of a value, of a slot row */
    int64_t first = seq_len - q_len; /* position of query 0 */
    int64_t lo_all = window > 0 ? first - window + 1 : 0;
    if (lo_all < 0) lo_all = 0;
    start_rows(q, q_stride, q_start, rows, groups, kv_head * groups, d, scale, qs, acc, m, l);
    for (int64_t start = lo_all - lo_all % block_size; start < seq_len; start += block_size) {
        int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        int64_t nn = next_slots(start, block_size, seq_len);
        int64_t at = slot_at(table, start, block_size, slot_stride, kv_head * d);
        int64_t next = nn ? slot_at(table, start + block_size, block_size, slot_stride, kv_head * d) : at;
        const char *next_k = (const char *)k_cache + next * esz, *next_v = (const char *)v_cache + next * esz;
        prefetch_slots((const char *)k_cache + at * esz, (const char *)v_cache + at * esz, 0, n, stride, d * esz, 1);
        rows_f32(k_cache, at, slot_stride, n, cache_dtype, d, kbuf, kp);
        rows_f32(v_cache, at, slot_stride, n, cache_dtype, d, vbuf, vp);
        for (int64_t r = 0; r < rows; r++) {
            prefetch_slots(next_k, next_v, nn * r / rows, nn * (r + 1) / rows, stride, d * esz, 0);
            int64_t qpos = first + r / groups;
            int64_t lo = window > 0 ? qpos - window + 1 : 0; /* visible positions lo..qpos */
            int64_t t0 = lo > start ? lo - start : 0, t1 = qpos - start + 1 < n ? qpos - start + 1 : n;
            if (t0 >= t1) continue; /* no key of this block visible to the row */
            float *sr = s + r * block_size, mx = -INFINITY;
            dots(qs + r * d, kp + t0, t1 - t0, d, sr);
            for (int64_t t = 0; t < t1 - t0; t++) mx = sr[t] > mx ? sr[t] : mx;
            if (mx > m[r]) {
                float alpha = expf(m[r] - mx); /* 0 on the first visible block */
                l[r] *= alpha;
                for (int64_t i = 0; i < d; i++) acc[r * d + i] *= alpha;
                m[r] = mx;
            }
            float sum = 0.0f;
            int64_t t = 0;
            for (; t + 8 <= t1 - t0; t += 8) {
                v8f e = exp8(load8(sr + t) - m[r]);
                store8(sr + t, e);
                sum += hsum(e);
            }
            for (; t < t1 - t0; t++) {
                sr[t] = expf(sr[t] - m[r]);
                sum += sr[t];
            }
            l[r] += sum;
            accumulate(acc + r * d, sr, vp + t0, t1 - t0, d);
        }
    }
    finish_rows(out, q_start, rows, groups, kv_head * groups, num_heads, d, acc, l);
}

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Lane t of the result: the sum of a[t]'s 16 lanes, in one fixed tree for every t (lanes i and i + 8, then
 * i and i + 4, i and i + 2, i and i + 1), so a key's score never depends on the keys beside it. Summed 16
 * vectors at a time it takes 15 additions and 30 shuffles, against 16 horizontal sums' 64 and 64. */
static inline v16f lane_sums16(const v16f a[16]) {
    v16f s[8], u[4], w[2];
    for (int p = 0; p < 8; p++) /* lanes 0-7: a[2p] folded to 8 partial sums, lanes 8-15: a[2p + 1] */
        s[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                         30, 31);
    for (int q = 0; q < 4; q++) /* groups of 4 lanes: a[4q .. 4q + 4) folded to 4 partial sums each */
        u[q] = __builtin_shufflevector(s[2 * q], s[2 * q + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(s[2 * q], s[2 * q + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                         31);
    for (int r = 0; r < 2; r++) /* pairs of lanes: a[8r .. 8r + 8) folded to 2 partial sums each */
        w[r] = __builtin_shufflevector(u[2 * r], u[2 * r + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
               + __builtin_shufflevector(u[2 * r], u[2 * r + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                         31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* q . k as 16 lanes: lane j sums q[16 i + j] * k[16 i + j] over i = 0 .. nv - 1, in that order. */
static inline v16f lane_products(const float *q, const float *k, int64_t nv) {
    v16f p = load16(q) * load16(k);
    for (int64_t i = 1; i < nv; i++) p += load16(q + 16 * i) * load16(k + 16 * i);
    return p;
}

static inline v16f vmax16(v16f a, v16f b) {
    v16i gt = a > b;
    return (v16f)(((v16i)a & gt) | ((v16i)b & ~gt));
}

/* One row's online softmax step over 16 keys' scores sc (hidden keys -inf, at least one visible): moves the row's
 * running max m and sum l, rescales its accumulator ar [d] when the max moved, and gives the keys' weights p. */
static inline __attribute__((always_inline)) void softmax16(v16f sc, float *m, float *l, float *ar, const int64_t d,
                                                            float p[16]) {
    v16f mx = sc; /* the maximum into every lane (exact in any order) */
    mx = vmax16(mx, __builtin_shufflevector(mx, mx, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    mx = vmax16(mx, __builtin_shufflevector(mx, mx, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    mx = vmax16(mx, __builtin_shufflevector(mx, mx, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    mx = vmax16(mx, __builtin_shufflevector(mx, mx, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    if (mx[0] > *m) {
        float alpha = expf(*m - mx[0]); /* 0 on the first visible keys */
        *l *= alpha;
        for (int64_t i = 0; i < d; i++) ar[i] *= alpha;
        *m = mx[0];
    }
    v16f e = exp16(sc - *m);
    /* each half's sum as hsum takes it: ((e0 + e4) + (e1 + e5)) + ((e2 + e6) + (e3 + e7)) */
    v16f a = e + __builtin_shufflevector(e, e, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    a += __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    *l += a[0] + a[8];
    memcpy(p, &e, sizeof e);
}

/* One row over keys c .. c + 15 of a block, of which t0 .. t1 - 1 are visible: its scores as lane_products and
 * lane_sums16 sum them, softmax16, then p * V added key by key. */
static inline __attribute__((always_inline)) void attend_row16(const float *qr, float *ar, float *m, float *l,
                                                               const float *const *kp, const float *const *vp,
                                                               int64_t off, int64_t c, int64_t t0, int64_t t1,
                                                               const int64_t d) {
    const int64_t nv = d / 16;
    v16f part[16], sc;
    if (c >= t0 && c + 16 <= t1) { /* all 16 keys visible: the partial sums stay in registers */
        for (int t = 0; t < 16; t++) part[t] = lane_products(qr, kp[c + t] + off, nv);
        sc = lane_sums16(part);
    } else {
        for (int t = 0; t < 16; t++) {
            part[t] = (v16f){0};
            if (c + t >= t0 && c + t < t1) part[t] = lane_products(qr, kp[c + t] + off, nv);
        }
        sc = lane_sums16(part);
        for (int t = 0; t < 16; t++)
            if (c + t < t0 || c + t >= t1) sc[t] = -INFINITY; /* hidden keys */
    }
    float p[16];
    softmax16(sc, m, l, ar, d, p);
    v16f y[MAX_VEC_D / 16];
    for (int64_t i = 0; i < nv; i++) y[i] = load16(ar + 16 * i);
    int64_t tb = c < t0 ? t0 : c, te = c + 16 < t1 ? c + 16 : t1;
    for (int64_t t = tb; t < te; t++)
        for (int64_t i = 0; i < nv; i++) y[i] += p[t - c] * load16(vp[t] + off + 16 * i);
    for (int64_t i = 0; i < nv; i++) memcpy(ar + 16 * i, &y[i], sizeof y[i]);
}

/* Transposes 16 rows of 16 lanes in place (r[t][j] -> r[j][t]): four passes, each swapping one bit of the row
 * number with the same bit of the lane number. */
static inline __attribute__((always_inline)) void transpose16(v16f r[16]) {
#define SWAP_BIT(b, ...) for (int t = 0; t < 16; t++) if (!(t & b)) { \
        v16f lo = __builtin_shufflevector(r[t], r[t + b], __VA_ARGS__); \
        r[t + b] = __builtin_shufflevector(r[t], r[t + b], SWAP_HI_##b); \
        r[t] = lo; \
    }
#define SWAP_HI_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define SWAP_HI_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SWAP_HI_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define SWAP_HI_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
    SWAP_BIT(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
    SWAP_BIT(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
    SWAP_BIT(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
    SWAP_BIT(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#undef SWAP_BIT
#undef SWAP_HI_1
#undef SWAP_HI_2
#undef SWAP_HI_4
#undef SWAP_HI_8
}

/* kt [width / 16 * 16, 16]: the 16 rows rows[t] (width values each, a multiple of 16) transposed, value i of row t
 * at kt[16 * i + t]; for a chunk's K rows, KV head h's [d, 16] start at kt + 16 * h * d. */
static inline __attribute__((always_inline)) void transpose_rows(const float *const *rows, int64_t width, float *kt) {
    for (int64_t i0 = 0; i0 < width; i0 += 16) {
        v16f r[16];
        for (int t = 0; t < 16; t++) r[t] = load16(rows[t] + i0);
        transpose16(r);
        for (int j = 0; j < 16; j++) memcpy(kt + (i0 + j) * 16, &r[j], sizeof r[j]);
    }
}

#define TILE_ROWS 4 /* rows of one KV head that attend a 16-key chunk together (attend_tile) */
#define TILE_MIN 8  /* an item's rows per KV head from which its full chunks take attend_tile */

/* a[g] = lane j of row g's lane_products over kt [d, 16] (key t's value i at kt[16 * i + t]): lane t of the
 * result is key t's. The same products in the same order: q[j] * k[j], then + q[16 i + j] * k[16 i + j]. */
static inline __attribute__((always_inline)) void tile_lane(const float *const *qr, const float *kt, const int64_t nv,
                                                            int j, v16f a[TILE_ROWS]) {
    v16f k = load16(kt + 16 * j);
    for (int g = 0; g < TILE_ROWS; g++) a[g] = qr[g][j] * k;
    for (int64_t i = 1; i < nv; i++) {
        k = load16(kt + 16 * (16 * i + j));
        for (int g = 0; g < TILE_ROWS; g++) a[g] += qr[g][16 * i + j] * k;
    }
}

/* x[g] = (lane j + lane j + 8) + (lane j + 4 + lane j + 12): lane_sums16's first two levels, for every key at once */
static inline __attribute__((always_inline)) void tile_pairs(const float *const *qr, const float *kt, const int64_t nv,
                                                             int j, v16f x[TILE_ROWS]) {
    v16f a[TILE_ROWS], b[TILE_ROWS];
    tile_lane(qr, kt, nv, j, a);
    tile_lane(qr, kt, nv, j + 8, b);
    for (int g = 0; g < TILE_ROWS; g++) x[g] = a[g] + b[g];
    tile_lane(qr, kt, nv, j + 4, a);
    tile_lane(qr, kt, nv, j + 12, b);
    for (int g = 0; g < TILE_ROWS; g++) x[g] += a[g] + b[g];
}

/* TILE_ROWS rows of one KV head over 16 keys, K given transposed (kt [d, 16]): each K and V vector loaded serves
 * every row. Row g sees keys lo[g] .. hi[g] - 1 of the 16 (a chunk on the causal diagonal, or at a window's edge,
 * is seen in part). Row by row the same arithmetic as attend_row16: a key's score is summed over lanes in
 * lane_sums16's tree (levels of lane j with j + 8, j + 4, j + 2, j + 1), here with whole vectors of 16 keys, and
 * a hidden key's is -inf; its weight is then exactly 0, and adding 0 * v leaves a row's sums as they were (v
 * finite: every key of the chunk is in the context). */
static inline __attribute__((always_inline)) void attend_tile(const float *const *qr, float *const *ar, float *m,
                                                              float *l, const int64_t *row, const int *lo,
                                                              const int *hi, const float *kt, const float *const *vp,
                                                              int64_t off, const int64_t d) {
    const int64_t nv = d / 16;
    v16f u[TILE_ROWS], w[TILE_ROWS];
    tile_pairs(qr, kt, nv, 0, u);
    tile_pairs(qr, kt, nv, 2, w);
    for (int g = 0; g < TILE_ROWS; g++) u[g] += w[g];
    tile_pairs(qr, kt, nv, 1, w);
    v16f z[TILE_ROWS];
    tile_pairs(qr, kt, nv, 3, z);
    for (int g = 0; g < TILE_ROWS; g++) u[g] += w[g] + z[g];
    for (int g = 0; g < TILE_ROWS; g++)
        for (int t = 0; t < 16; t++)
            if (t < lo[g] || t >= hi[g]) u[g][t] = -INFINITY;
    float p[TILE_ROWS][16];
    for (int g = 0; g < TILE_ROWS; g++) softmax16(u[g], m + row[g], l + row[g], ar[g], d, p[g]);
    v16f y[TILE_ROWS][MAX_VEC_D / 16];
    for (int g = 0; g < TILE_ROWS; g++)
        for (int64_t i = 0; i < nv; i++) y[g][i] = load16(ar[g] + 16 * i);
    for (int t = 0; t < 16; t++)
        for (int64_t i = 0; i < nv; i++) {
            v16f v = load16(vp[t] + off + 16 * i);
            for (int g = 0; g < TILE_ROWS; g++) y[g][i] += p[g][t] * v;
        }
    for (int g = 0; g < TILE_ROWS; g++)
        for (int64_t i = 0; i < nv; i++) memcpy(ar[g] + 16 * i, &y[g][i], sizeof y[g][i]);
}

/* KV heads kv0 .. kv0 + nkv - 1 of one request (all of them when the batch has two requests per thread or
 * more, or on one thread), for head dims that are whole 16-lane vectors (D = 64 and 128 as constants): the same
 * online softmax as attend_item, with a cache block's 16 keys scored at once. An item with every KV head reads
 * a block's cache rows whole (a slot's KV heads sit in one row of num_kv_heads * d values), not a head's slice
 * at a time. Row by row (a token's head), each key's q . k is summed as 16 lanes over d in order, the block's 16
 * lane sums come from lane_sums16, and the block's maximum, exponentials and sum are taken on that vector; V rows
 * are added in key order. Every row's arithmetic is the same whatever the other rows (a verification's tokens,
 * the other heads), the batch or the thread count, as in attend_item. Against attend_item, B = 16 decode rows
 * of SmolLM2-135M's shape (9 heads, 3 KV heads, d = 64) on 2 threads: 438-467 -> 375-409 us a layer at 256
 * keys, 763-766 -> 600-617 us at 384 (Sapphire Rapids; in cache, one request: 142 -> 118 us at 1024 keys).
 * after_k, after_v (NULL: none): the first of after_n slots of the block the next item reads first, prefetched into
 * L2 beside this item's last block as a next block of its own would be. Every layer's cache cold, one Zen 4
 * thread: B = 16 at 230 keys 437-453 -> 399-431 us a layer, B = 32 at 120 keys 501 -> 436, B = 8 at 500 keys
 * 446 -> 423 (a request's first block had waited on memory whole).
 * Tiles: where an item has TILE_MIN rows per KV head or more (a prefill chunk, a verification of 3 tokens or more
 * with 3 query heads a KV head), each full 16-key chunk's K is transposed once per KV head, and the rows that see
 * the whole chunk take it TILE_ROWS at a time (attend_tile): a score is a vector over the 16 keys, summed in
 * lane_sums16's tree, and every K and V vector loaded serves 4 rows; a row that sees the chunk in part (the causal
 * diagonal, a window's edge) masks the keys it does not see (a prefill of 16 chat prompts on one Zen 4 thread, side
 * by side: 1.815-1.854 -> 1.792-1.803 s, where those rows went one by one). The bits are attend_row16's. Rows
 * left over from a chunk's last tile go row by row. One Zen 4 thread, float32 cache,
 * SmolLM2-135M's shape, us a layer (the commit before, then with tiles and the vector maximum and sums of softmax16):
 * one 2,048-token prefill 101,700 -> 75,900; a 5-token verification over 512 keys 156 -> 138; B = 16 decodes at
 * 256 keys, every layer's cache cold, 434 -> 394. */
static inline __attribute__((always_inline)) void attend_heads16(
        const float *q, int64_t q_stride, float *out, const void *k_cache, const void *v_cache, int cache_dtype,
        int64_t slot_stride, const int64_t *table, int64_t block_size, int64_t q_start, int64_t q_len, int64_t seq_len,
        int64_t kv0, int64_t nkv, int64_t groups, int64_t num_heads, const int64_t d, int64_t window, float scale,
        float *work, const char *after_k, const char *after_v, int64_t after_n) {
    const int64_t heads = nkv * groups, rows = heads * q_len, width = nkv * d;
    float *qs = work;                      /* [rows, d] scaled queries; row r = token r / heads, head kv0 * groups + r % heads */
    float *acc = qs + rows * d;            /* [rows, d] */
    float *m = acc + rows * d;             /* [rows] running max */
    float *l = m + rows;                   /* [rows] running sum */
    float *kbuf = l + rows;                /* [block_size, width] widened K rows of the item's KV heads */
    float *vbuf = kbuf + block_size * width; /* [block_size, width] widened V rows */
    float *kt = vbuf + block_size * width; /* [nkv, d, 16] a chunk's K, transposed per KV head (attend_tile) */
    /* [block_size] row pointers, 8-byte aligned: every count of floats before them is even */
    const float **kp = (const float **)(kt + 16 * width);
    const float **vp = kp + block_size;
    const int64_t esz = cache_dtype == 0 ? 4 : 2, stride = slot_stride * esz;
    const int tiles = groups * q_len >= TILE_MIN; /* rows per KV head enough to pay for transposing a chunk's K */
    int64_t first = seq_len - q_len;
    int64_t lo_all = window > 0 ? first - window + 1 : 0;
    if (lo_all < 0) lo_all = 0;
    start_rows(q, q_stride, q_start, rows, heads, kv0 * groups, d, scale, qs, acc, m, l);
    for (int64_t start = lo_all - lo_all % block_size; start < seq_len; start += block_size) {
        int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        int64_t nn = next_slots(start, block_size, seq_len);
        int64_t at = slot_at(table, start, block_size, slot_stride, kv0 * d);
        int64_t next = nn ? slot_at(table, start + block_size, block_size, slot_stride, kv0 * d) : at;
        const char *next_k = (const char *)k_cache + next * esz, *next_v = (const char *)v_cache + next * esz;
        if (!nn && after_k) { /* the item's last block: the next item's first is the one to bring in */
            next_k = after_k;
            next_v = after_v;
            nn = after_n;
        }
        prefetch_slots((const char *)k_cache + at * esz, (const char *)v_cache + at * esz, 0, n, stride, width * esz,
                       1);
        rows_f32(k_cache, at, slot_stride, n, cache_dtype, width, kbuf, kp);
        rows_f32(v_cache, at, slot_stride, n, cache_dtype, width, vbuf, vp);
        for (int64_t c = 0; c < n; c += 16) { /* the block's chunks of 16 keys (block_size is a multiple of 16) */
            const int full = tiles && c + 16 <= n;
            if (full) transpose_rows(kp + c, width, kt);
            int64_t fetched = 0, share = 0; /* the next block's slots prefetched so far, spread over the rows */
            for (int64_t h = 0; h < nkv; h++) { /* rows of KV head h: token s's heads h * groups .. + groups - 1 */
                /* the rows gathered for a tile: queries, accumulators, row numbers, the keys of the chunk each sees */
                const float *tile_q[TILE_ROWS];
                float *tile_acc[TILE_ROWS];
                int64_t tile_row[TILE_ROWS], gathered = 0;
                int tile_lo[TILE_ROWS], tile_hi[TILE_ROWS];
                for (int64_t s = 0; s < q_len; s++)
                    for (int64_t g = 0; g < groups; g++) {
                        const int64_t r = s * heads + h * groups + g;
                        if (c == 0) { /* after the k-th row, floor(k * nn / rows) slots */
                            int64_t upto = fetched;
                            for (share += nn; share >= rows; share -= rows) upto++;
                            prefetch_slots(next_k, next_v, fetched, upto, stride, width * esz, 0);
                            fetched = upto;
                        }
                        int64_t qpos = first + s, lo = window > 0 ? qpos - window + 1 : 0;
                        int64_t t0 = lo > start ? lo - start : 0, t1 = qpos - start + 1 < n ? qpos - start + 1 : n;
                        if (t0 >= t1 || t0 >= c + 16 || t1 <= c) continue; /* no key of the chunk visible */
                        if (full) { /* into a tile, with the keys of the chunk the row sees */
                            tile_q[gathered] = qs + r * d;
                            tile_acc[gathered] = acc + r * d;
                            tile_lo[gathered] = t0 > c ? (int)(t0 - c) : 0;
                            tile_hi[gathered] = t1 < c + 16 ? (int)(t1 - c) : 16;
                            tile_row[gathered++] = r;
                            if (gathered == TILE_ROWS) {
                                attend_tile(tile_q, tile_acc, m, l, tile_row, tile_lo, tile_hi, kt + h * d * 16,
                                            vp + c, h * d, d);
                                gathered = 0;
                            }
                            continue;
                        }
                        attend_row16(qs + r * d, acc + r * d, m + r, l + r, kp, vp, h * d, c, t0, t1, d);
                    }
                for (int64_t g = 0; g < gathered; g++) /* a tile's worth not reached: row by row */
                    attend_row16(tile_q[g], tile_acc[g], m + tile_row[g], l + tile_row[g], kp, vp, h * d, c,
                                 c + tile_lo[g], c + tile_hi[g], d);
            }
        }
    }
    finish_rows(out, q_start, rows, heads, kv0 * groups, num_heads, d, acc, l);
}

/* A work item: request n's KV heads g .. g + per_item - 1 over its queries c0 .. c0 + len - 1, whose context ends at
 * the chunk's last query (ctx keys). Items are numbered request by request: item0[n] is request n's first. */
typedef struct {
    int64_t n, g, c0, len, ctx;
} item_t;

static inline item_t item_at(int64_t item, const int64_t *item0, int64_t num_reqs, const int64_t *q_len,
                             const int64_t *seq_len, int64_t items, int64_t per_item) {
    int64_t lo = 0, hi = num_reqs; /* the request n with item0[n] <= item < item0[n + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (item0[mid] <= item) lo = mid; else hi = mid;
    }
    const int64_t local = item - item0[lo], c0 = local / items * Q_CHUNK;
    const int64_t len = q_len[lo] - c0 < Q_CHUNK ? q_len[lo] - c0 : Q_CHUNK;
    return (item_t){lo, local % items * per_item, c0, len, seq_len[lo] - q_len[lo] + c0 + len};
}

/* First writes this step's K/V into the cache: token t's k and v rows ([num_kv_heads, d] each, in the
 * cache's dtype, token strides k_stride / v_stride elements) go to slot slot_mapping[t]. Then attends
 * every listed request: q [num_tokens, num_heads, d] float32 (token stride q_stride), out [num_tokens,
 * num_heads, d] float32 contiguous. kv_cache [2, num_slots, num_kv_heads, d] of cache_dtype, contiguous
 * (K, then V). table: [*, table_width] int64. requests: [4, num_reqs] int64, rows q_start, q_len, seq_len
 * and block-table row. window <= 0: no sliding window. Returns 0, or -1 when out of memory. */
int eyas_paged_attention(const float *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                         int64_t v_stride, void *kv_cache, int64_t num_slots, int cache_dtype, float *out,
                         int64_t num_heads, int64_t num_kv_heads, int64_t d, float scale, const int64_t *slot_mapping,
                         int64_t num_tokens, const int64_t *table, int64_t table_width, int64_t block_size,
                         const int64_t *requests, int64_t num_reqs, int64_t window, int num_threads) {
    const int64_t groups = num_heads / num_kv_heads, slot_stride = num_kv_heads * d;
    const int64_t *q_start = requests, *q_len = requests + num_reqs, *seq_len = requests + 2 * num_reqs,
                  *row = requests + 3 * num_reqs;
    const size_t elem = cache_dtype == 0 ? 4 : 2, kv_row = (size_t)slot_stride * elem;
    char *k_cache = kv_cache, *v_cache = k_cache + num_slots * kv_row;
    int64_t max_q = 1;
    for (int64_t n = 0; n < num_reqs; n++) max_q = q_len[n] > max_q ? q_len[n] : max_q;
    max_q = max_q < Q_CHUNK ? max_q : Q_CHUNK;
    const int vec16 = HEADS16_BUILD && block_size % 16 == 0 && d % 16 == 0 && d <= MAX_VEC_D; /* attend_heads16 */
    /* KV heads per item: all of a request's when every thread gets two requests, or when one thread takes every
       item anyway, else one (more items to share). A lone thread's items of one KV head each read a block's cache
       rows a head's slice at a time: bench_attention.py --threads 1, batch 1, us a layer, one KV head an item ->
       all: a decode at 400 keys 66-70 -> 57-59, at 2,048 keys 293-314 -> 230-237; 9-token verifications at 400
       and 512 keys and a 2,048-token prefill level (75 ms). */
    const int64_t per_item = vec16 && (num_threads == 1 || num_reqs >= 2 * num_threads) ? num_kv_heads : 1;
    const int64_t items = num_kv_heads / per_item;
    const int64_t max_rows = per_item * groups * max_q, row_width = per_item * d;
    /* floats: qs, acc, m, l, s (attend_item), kbuf, vbuf, kt (attend_heads16), then 2 * block_size pointers (2 floats
       each, at most) */
    const int64_t work_floats = 2 * max_rows * d + 2 * max_rows + max_rows * block_size + 2 * block_size * row_width
                                + 16 * row_width
                                + 4 * block_size + 1;
    /* the work items of requests 0..n-1: (chunks of Q_CHUNK queries) x items each */
    int64_t *item0 = malloc((num_reqs + 1) * sizeof(int64_t));
    if (item0 == NULL) return -1;
    item0[0] = 0;
    for (int64_t n = 0; n < num_reqs; n++) item0[n + 1] = item0[n] + (q_len[n] + Q_CHUNK - 1) / Q_CHUNK * items;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; t++) { /* the barrier after it: every write lands before any read */
            memcpy(k_cache + slot_mapping[t] * slot_stride * elem, (const char *)k + t * k_stride * elem, kv_row);
            memcpy(v_cache + slot_mapping[t] * slot_stride * elem, (const char *)v + t * v_stride * elem, kv_row);
        }
        float *work = num_reqs ? malloc(work_floats * sizeof(float)) : NULL;
        if (num_reqs && work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < item0[num_reqs]; item++) {
            if (work == NULL) continue;
            const item_t it = item_at(item, item0, num_reqs, q_len, seq_len, items, per_item);
            const int64_t q0 = q_start[it.n] + it.c0, len = it.len, ctx = it.ctx, g = it.g;
            const int64_t *tbl = table + row[it.n] * table_width;
#define ITEM(D) attend_item(q, q_stride, out, k_cache, v_cache, cache_dtype, slot_stride, tbl, block_size, q0, len, \
                            ctx, g, groups, num_heads, D, window, scale, work)
            const char *after_k = NULL, *after_v = NULL; /* items of every KV head: the next one's first block */
            int64_t after_n = 0;
            if (vec16 && per_item == num_kv_heads && item + 1 < item0[num_reqs]) {
                const item_t nx = item_at(item + 1, item0, num_reqs, q_len, seq_len, items, per_item);
                int64_t lo = window > 0 ? nx.ctx - nx.len - window + 1 : 0; /* its first visible key */
                lo = lo < 0 ? 0 : lo - lo % block_size;
                const int64_t first = slot_at(table + row[nx.n] * table_width, lo, block_size, slot_stride, 0);
                after_k = k_cache + first * elem;
                after_v = v_cache + first * elem;
                after_n = nx.ctx - lo < block_size ? nx.ctx - lo : block_size;
            }
#define HEADS16(D) attend_heads16(q, q_stride, out, k_cache, v_cache, cache_dtype, slot_stride, tbl, block_size, \
                                  q0, len, ctx, g, per_item, groups, num_heads, D, window, scale, work, after_k, \
                                  after_v, after_n)
            if (vec16) {
                switch (d) { /* common head dims get a copy specialised for them */
                    case 64: HEADS16(64); break;
                    case 128: HEADS16(128); break;
                    default: HEADS16(d);
                }
            } else {
                ITEM(d);
            }
#undef ITEM
#undef HEADS16
        }
        free(work);
    }
    free(item0);
    return failed ? -1 : 0;
}
