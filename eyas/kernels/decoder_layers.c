/* Llama's decoder layers and final norm in one call: the loop of eyas/model/llama.py's DecoderLayer.forward
   written in C, calling the same compiled kernels the modules call, in the same order, on the same
   buffers. The result equals the module-by-module forward bit for bit; what goes away is Python's
   share of a decode step (about 30 us a layer: a dozen module calls, tensor allocations and ctypes
   crossings, 0.9 ms of a 9 ms batch-1 step on 2 threads).

   The kernels are not linked in: the caller passes their entry points (quant_gemm.c's product for
   each weight part, token_ops.c's norm, rotary and SiLU gate, paged_attention.c's attention), so each
   stays built once, for the instruction set it was built for.

   One layer, with T tokens, hidden size E, H query heads, KVH KV heads of width D, intermediate I:
     xn  = rms_norm(h, input_norm)                       [T, E]
     qkv = xn @ Wqkv^T (one product per weight part)      [T, (H + 2 KVH) D]
     qk  = rotary(qkv[:, :H + KVH])                      [T, H + KVH, D]
     att = attention(q = qk[:, :H], k = qk[:, H:], v = qkv[:, H + KVH:])   [T, H D] (zeros first if zero_fill)
     h  += att @ Wo^T                                    (into tmp, then added: h + o, as PyTorch rounds it)
     xn  = rms_norm(h, post_norm)
     gu  = xn @ Wgate_up^T                               [T, 2 I]
     act = silu(gu[:, :I]) * gu[:, I:]                   [T, I]
     h  += act @ Wdown^T

   The plan: LAYER_WORDS int64 per layer (pointers as integers), laid out as the PLAN_* offsets say;
   each of the four products is PARTS_MAX slots of (entry point, weight, type, row scale, output rows),
   unused slots with output rows 0. */
#include <stdint.h>
#include <string.h>

typedef int (*gemm_fn)(const float *x, int64_t ldx, const uint8_t *weight, int type, const float *row_scale,
                       float *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int num_threads);
typedef int (*rms_norm_fn)(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps,
                           int num_threads);
typedef int (*rotary_fn)(const float *x, int64_t ldx, const float *cos_, const float *sin_, float *out, int64_t tokens,
                         int64_t heads, int64_t d, int num_threads);
typedef int (*silu_mul_fn)(const float *gu, float *out, int64_t tokens, int64_t n, int num_threads);
typedef int (*attention_fn)(const float *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                            int64_t v_stride, void *kv_cache, int64_t num_slots, int cache_dtype, float *out,
                            int64_t num_heads, int64_t num_kv_heads, int64_t d, float scale,
                            const int64_t *slot_mapping, int64_t num_tokens, const int64_t *table, int64_t table_width,
                            int64_t block_size, const int64_t *requests, int64_t num_reqs, int64_t window,
                            int num_threads);

/* What does not change between calls: the model's shapes and the kernels' entry points. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    attention_fn attention;
} model_t;

enum { PARTS_MAX = 3, PART_WORDS = 5, LINEAR_WORDS = PARTS_MAX * PART_WORDS };
enum { PLAN_INPUT_NORM, PLAN_POST_NORM, PLAN_KV_CACHE, PLAN_NUM_SLOTS, PLAN_QKV, PLAN_O = PLAN_QKV + LINEAR_WORDS,
       PLAN_GATE_UP = PLAN_O + LINEAR_WORDS, PLAN_DOWN = PLAN_GATE_UP + LINEAR_WORDS,
       LAYER_WORDS = PLAN_DOWN + LINEAR_WORDS };

/* out [T, ldo] = x [T, k] @ W^T, each part of W into its own columns; nonzero when a product fails */
static int linear(const int64_t *parts, const float *x, int64_t tokens, int64_t k, float *out, int64_t ldo,
                  int num_threads) {
    int64_t column = 0;
    for (int p = 0; p < PARTS_MAX; p++) {
        const int64_t *part = parts + p * PART_WORDS;
        int64_t n = part[4];
        if (n == 0) break;
        gemm_fn gemm = (gemm_fn)(intptr_t)part[0];
        if (gemm(x, k, (const uint8_t *)(intptr_t)part[1], (int)part[2], (const float *)(intptr_t)part[3],
                 out + column, ldo, tokens, n, k, num_threads))
            return -1;
        column += n;
    }
    return 0;
}

static void add_into(float *h, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) h[i] = h[i] + y[i];
}

/* The work buffer's floats for T tokens: xn, qkv, qk, att, tmp, gu, act. */
int64_t eyas_decoder_work_floats(const model_t *m, int64_t tokens) {
    int64_t e = m->hidden, d = m->head_dim, h = m->heads, kvh = m->kv_heads;
    return tokens * (2 * e + (h + 2 * kvh) * d + (h + kvh) * d + h * d + 3 * m->intermediate);
}

/* aux [T, num_aux, E]: slot j of every token gets h [T, E] where aux_at[j] == at */
static void capture(const float *h, int64_t tokens, int64_t e, const int64_t *aux_at, int64_t num_aux, int64_t at,
                    float *aux) {
    for (int64_t j = 0; j < num_aux; j++)
        if (aux_at[j] == at)
            for (int64_t t = 0; t < tokens; t++) memcpy(aux + (t * num_aux + j) * e, h + t * e, sizeof(float) * e);
}

/* Runs the first num_layers layers of plan on h [T, E] in place, then the final norm (weight final_norm) of the
   result into normed [T, E]. The stream entering layer i (i = num_layers: the last layer's output, before the
   norm) goes to slot j of aux [T, num_aux, E] for every j with aux_at[j] == i (ids above num_layers: none). cos,
   sin [T, D / 2]. The attention arguments after them are CpuMetadata.kernel_args; the KV cache is float32 [2,
   num_slots, KVH, D]. work: at least eyas_decoder_work_floats floats. Returns 0, -1 when a product fails, -2
   when attention is out of memory. */
int eyas_decoder_layers(const model_t *m, const int64_t *plan, int64_t num_layers, float *h, int64_t tokens,
                        const float *cos_, const float *sin_, const int64_t *slot_mapping, int64_t num_slot_tokens,
                        const int64_t *table, int64_t table_width, int64_t block_size, const int64_t *requests,
                        int64_t num_reqs, int64_t window, int zero_fill, const int64_t *aux_at, int64_t num_aux,
                        float *aux, const float *final_norm, float *normed, float *work, int num_threads) {
    const int64_t e = m->hidden, d = m->head_dim, heads = m->heads, kvh = m->kv_heads, inter = m->intermediate;
    const int64_t qkv_width = (heads + 2 * kvh) * d, qk_width = (heads + kvh) * d;
    float *xn = work, *qkv = xn + tokens * e, *qk = qkv + tokens * qkv_width, *att = qk + tokens * qk_width,
          *tmp = att + tokens * heads * d, *gu = tmp + tokens * e, *act = gu + tokens * 2 * inter;
    for (int64_t l = 0; l < num_layers; l++) {
        capture(h, tokens, e, aux_at, num_aux, l, aux);
        const int64_t *layer = plan + l * LAYER_WORDS;
        m->rms_norm(h, (const float *)(intptr_t)layer[PLAN_INPUT_NORM], xn, tokens, e, m->eps, num_threads);
        if (linear(layer + PLAN_QKV, xn, tokens, e, qkv, qkv_width, num_threads)) return -1;
        m->rotary(qkv, qkv_width, cos_, sin_, qk, tokens, heads + kvh, d, num_threads);
        if (zero_fill) memset(att, 0, sizeof(float) * tokens * heads * d);
        if (m->attention(qk, qk_width, qk + heads * d, qk_width, qkv + qk_width, qkv_width,
                         (void *)(intptr_t)layer[PLAN_KV_CACHE], layer[PLAN_NUM_SLOTS], 0, att, heads, kvh, d,
                         m->scale, slot_mapping, num_slot_tokens, table, table_width, block_size, requests, num_reqs,
                         window, num_threads))
            return -2;
        if (linear(layer + PLAN_O, att, tokens, heads * d, tmp, e, num_threads)) return -1;
        add_into(h, tmp, tokens * e);
        m->rms_norm(h, (const float *)(intptr_t)layer[PLAN_POST_NORM], xn, tokens, e, m->eps, num_threads);
        if (linear(layer + PLAN_GATE_UP, xn, tokens, e, gu, 2 * inter, num_threads)) return -1;
        m->silu_mul(gu, act, tokens, inter, num_threads);
        if (linear(layer + PLAN_DOWN, act, tokens, inter, tmp, e, num_threads)) return -1;
        add_into(h, tmp, tokens * e);
    }
    capture(h, tokens, e, aux_at, num_aux, num_layers, aux);
    m->rms_norm(h, final_norm, normed, tokens, e, m->eps, num_threads);
    return 0;
}
