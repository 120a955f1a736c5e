/* The interleaved product (q8_interleaved.h) for 16 rows of x and more on AMX-INT8 (EYAS_AMX builds): the same
   bits, the block integers from tile multiplies instead of vpdpbusd.

   Per group of 16 outputs and per block b, the integers i_b of 16 rows of x (a "token tile") times the 16 outputs
   are one tdpbssd (signed bytes times signed bytes, exact int32 sums):
       A  16 rows x 32 bytes    the rows' quantized block b, straight from qx (row stride K)
       B  8 rows x 64 bytes     row k: weights 4k..4k+3 of each of the 16 outputs (VNNI order)
       C  16 x 16 int32         C[i][j] = i_b of row i and output j
   B is the record's chunks as they are stored: chunk c is weights 4c..4c+3 of the 16 rows, so a Q8_0 record's 8
   chunks are B itself (no bias: tdpbssd takes signed weights); a Q4 record's 4 chunks give B's rows c (q & 15) and
   4 + c (q >> 4), unpacked once per group and panel into a thread's buffer and used by every token tile. C goes
   through memory (16 rows of 64 bytes: EMR has no move from a tile to a vector register), and each row of x adds
   its block term dx * (sw * i_b + ow * sx) to its lane's accumulator register: the same float operations, in the
   same order, as group_rows, so the same bits. Example, K = 576 (18 blocks), 100 rows of x: a group stages 18 B
   tiles (9 KB), then runs 7 token tiles (the last one 4 rows of x and 12 zero rows), each 8 lanes of 3, 3, 2, 2,
   2, 2, 2, 2 blocks: 18 tdpbssd a token tile, where vpdpbusd takes 16 x 18 x 8.

   What the time goes to (Emerald Rapids, measured): the tile multiplies are cheap; the float terms (6 vector
   operations a row of x and block, as with vpdpbusd) and the trip of C through memory are most of it. So:
   - record p + 1's multiply is issued (tiles 0/2/4 or 1/3/5 in turn) before record p's terms are added;
   - the rows of x go in panels of PANEL, whose quantized values stay in L2 while every group passes over them;
   - the outputs are streamed (non-temporal stores, whole 64-byte lines): plain stores that missed the cache
     held back the tile loads and stores behind them (the model's products at 256 rows ran 0.8-1.05x vpdpbusd's
     speed with them, 1.5-1.8x without).
   Linux hands out tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process); where it
   refuses, the product stays on vpdpbusd. */
#ifndef EYAS_Q8_AMX_H
#define EYAS_Q8_AMX_H
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AMX_INT8__) || !defined(EYAS_VNNI512)
#error "EYAS_AMX needs -mamx-tile -mamx-int8 and the EYAS_VNNI512 build"
#endif

enum { AMX_ROWS = 16 }; /* rows of x from which a product takes the tiles (measured: docs/cpu-weights.md) */
enum { TOKENS = 16 };   /* rows of x a tile */

/* Whether this process may use the tile registers: asked for once (the answer is the process's) */
static int amx_permitted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* whether a product of m_len rows of x on weights of this type takes the tiles */
static inline int amx_tiles(int type, int64_t m_len) {
    return type > R16 && interleaves(type - R16) && m_len >= AMX_ROWS && amx_permitted();
}

/* The rows of x from which the interleaved products take the tiles here; 0: never (the OS refuses) */
int eyas_q8_tiled_rows(void) { return amx_tiles(R16 + Q4_0, AMX_ROWS) ? AMX_ROWS : 0; }

/* this thread's tile shapes (palette 1): A 16 x 32 bytes, B 8 x 64, C 16 x 64 */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg = {.palette = 1};
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = t < 2 ? TOKENS : t < 4 ? SUB / 4 : TOKENS;
        cfg.colsb[t] = t < 2 ? SUB : 64;
    }
    _tile_loadconfig(&cfg);
}

/* A Q4 group's B tiles: record p's 4 chunks -> stage + 512 p, rows c (low nibbles) and 4 + c (high) */
static void amx_stage(const int type, const uint8_t *grp, int64_t nsub, uint8_t *stage) {
    const int64_t rec_bytes = GROUP * block_bytes(type), qs = 2 * GROUP * halves(type);
    for (int64_t p = 0; p < nsub; p++)
        for (int c = 0; c < 4; c++) {
            vwb q = load_w(grp + p * rec_bytes + qs + 4 * GROUP * c), lo = q & 15, hi = q >> 4;
            memcpy(stage + 512 * p + 64 * c, &lo, 64);
            memcpy(stage + 512 * p + 64 * (4 + c), &hi, 64);
        }
}

/* adds the terms of block b (record rec, its integers in c [16][16]) of the 16 rows to acc */
static inline __attribute__((always_inline)) void amx_terms(const int type, const uint8_t *rec, const int32_t *c,
                                                           int64_t b, const float *dx, const float *sx, int64_t np,
                                                           vwf *acc) {
    vwf sw = load_halves(rec), ow = {0};
    if (type == Q4_0) ow = -8.0f * sw;
    if (type == Q4_1) ow = load_halves(rec + 2 * GROUP);
#pragma GCC unroll 16
    for (int i = 0; i < TOKENS; i++) {
        vwi iv;
        memcpy(&iv, c + 16 * i, sizeof iv);
        vwf v = sw * __builtin_convertvector(iv, vwf);
        if (type != Q8_0) v = v + ow * sx[i * np + b];
        acc[i] = acc[i] + dx[i * np + b] * v;
    }
}

/* block b's integers of the 16 rows into C tile tc (A tile ta, B tile tb from bt; the tiles' numbers literals) */
#define AMX_MULTIPLY(ta, tb, tc, b, bt)                                                                        \
    do {                                                                                                       \
        _tile_loadd(ta, qx + SUB * (b), kq);                                                                   \
        _tile_loadd(tb, bt, 64);                                                                               \
        _tile_zero(tc);                                                                                        \
        _tile_dpbssd(tc, ta, tb);                                                                              \
    } while (0)

/* One full group (16-row records grp; B tiles at stage for Q4) against 16 rows of x (qx, dx, sx at the token
   tile's first row): res[i] = the 16 outputs of row i, in the fixed order of group_rows. The records are taken in
   turn (lane order), and record p + 1's multiply is issued before record p's terms are added, into the other
   set of tiles, so the tile unit works while the vector unit adds. */
static inline __attribute__((always_inline)) void amx_group_tile(const int type, const uint8_t *grp,
                                                                const uint8_t *stage, int64_t nsub,
                                                                const int8_t *qx, const float *dx, const float *sx,
                                                                int64_t kq, int64_t np, int64_t ahead, vwf *res) {
    const int64_t rec_bytes = GROUP * block_bytes(type), qs = 2 * GROUP * halves(type);
    _Alignas(64) int32_t c[2][TOKENS * 16];
    vwf lanes[LANES][TOKENS];
#define B_TILE(p) (type == Q8_0 ? grp + (p) * rec_bytes + qs : stage + 512 * (p))
    AMX_MULTIPLY(0, 2, 4, 0, B_TILE(0));
    int64_t p = 0; /* record of block b */
    for (int l = 0; l < LANES; l++) {
        vwf acc[TOKENS];
        for (int i = 0; i < TOKENS; i++) acc[i] = (vwf){0};
        for (int64_t b = l; b < nsub; b += LANES, p++) {
            int64_t next = b + LANES < nsub ? b + LANES : l + 1 < LANES && l + 1 < nsub ? l + 1 : -1;
            if (p & 1) {
                _tile_stored(5, c[1], 64);
                if (next >= 0) AMX_MULTIPLY(0, 2, 4, next, B_TILE(p + 1));
            } else {
                _tile_stored(4, c[0], 64);
                if (next >= 0) AMX_MULTIPLY(1, 3, 5, next, B_TILE(p + 1));
            }
            if (ahead) /* the next group's record p, into L2 */
                for (int64_t o = 0; o < rec_bytes; o += 64) _mm_prefetch(grp + ahead + p * rec_bytes + o, _MM_HINT_T1);
            amx_terms(type, grp + p * rec_bytes, c[p & 1], b, dx, sx, np, acc);
        }
        for (int i = 0; i < TOKENS; i++) lanes[l][i] = acc[i];
    }
#undef B_TILE
    for (int i = 0; i < TOKENS; i++)
        res[i] = ((lanes[0][i] + lanes[4][i]) + (lanes[1][i] + lanes[5][i])) +
                 ((lanes[2][i] + lanes[6][i]) + (lanes[3][i] + lanes[7][i]));
}

/* One full group against every row of x (m_len of them, padded to whole tiles): outputs out[m][0..R); the next
   group's records (ahead bytes on, 0: none) are asked for while the first tile runs */
static inline __attribute__((always_inline)) void amx_group(const int type, const uint8_t *grp, uint8_t *stage,
                                                           int64_t nsub, const int8_t *qx, const float *dx,
                                                           const float *sx, int64_t kq, int64_t np, int64_t m_len,
                                                           int64_t ahead, float *out, int64_t ldo, int64_t R) {
    if (type != Q8_0) amx_stage(type, grp, nsub, stage);
    for (int64_t t0 = 0; t0 < m_len; t0 += TOKENS) {
        vwf res[TOKENS];
        amx_group_tile(type, grp, stage, nsub, qx + t0 * kq, dx + t0 * np, sx + t0 * np, kq, np, t0 ? 0 : ahead, res);
        for (int64_t i = 0; i < TOKENS && t0 + i < m_len; i++) {
            float *o = out + (t0 + i) * ldo;
            if (R == GROUP && ((uintptr_t)o & 63) == 0) _mm512_stream_ps(o, (__m512)res[i]);
            else memcpy(o, &res[i], 4 * R);
        }
    }
}

/* One thread's share of a product on AMX (every thread of the parallel region calls it): the rows of x in panels
   of PANEL, and in each panel the threads split the groups as group_rows's loop does. Sets *failed when out of
   memory. */
static inline __attribute__((always_inline)) void amx_thread(const int type, const int8_t *qx, const float *dx,
                                                           const float *sx, const uint8_t *weight, float *out,
                                                           int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len,
                                                           int *failed) {
    int64_t nsub = k_len / SUB, np = padded(nsub), rb = nsub * block_bytes(type);
    int64_t groups = (n_len + GROUP - 1) / GROUP;
    uint8_t *stage = malloc((size_t)(nsub * 512 + GROUP * rb)); /* the B tiles, then the last group widened */
    uint8_t *wide = stage ? stage + nsub * 512 : NULL;
    if (!stage) {
#pragma omp atomic write
        *failed = 1;
    }
    amx_configure();
    for (int64_t m0 = 0; m0 < m_len; m0 += PANEL) {
        int64_t rows = m_len - m0 < PANEL ? m_len - m0 : PANEL;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            int64_t R = n_len - GROUP * g < GROUP ? n_len - GROUP * g : GROUP;
            const uint8_t *grp = weight + GROUP * g * rb;
            if (*failed) continue;
            if (R < GROUP) {
                widen_group(type, grp, R, nsub, wide);
                grp = wide;
            }
            amx_group(type, grp, stage, nsub, qx + m0 * k_len, dx + m0 * np, sx + m0 * np, k_len, np, rows,
                      g + 1 < groups && R == GROUP ? GROUP * rb : 0, out + m0 * ldo + GROUP * g, ldo, R);
        }
    }
    _tile_release();
    _mm_sfence(); /* the streamed outputs, before the region's end lets other threads read them */
    free(stage);
}
#endif
