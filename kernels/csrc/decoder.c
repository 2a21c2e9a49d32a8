/* The whole decoder stack of a Llama-family model in one call: every layer's kernels, in the
 * order and with the buffers that services/worker/models/llama.py gives them one Python call
 * at a time. The same functions run on the same inputs, so the bits are the same as the
 * layer-by-layer path's; what goes is ~10 ctypes calls, ~12 tensor allocations and views per
 * layer (3-6 us each, a few ms per decode step at batch 1-16).
 *
 * Per layer (x: the layer's input, res: the residual stream, both [T, hidden]):
 *   h, res = rms_norm(x, input_norm, res)       the first layer: h = rms_norm(x), res = x
 *   q, k, v = linear(h, qkv, qkv_bias)           one packed weight, [T, q + 2 kv]
 *   q, k = rms_norm per head (q_norm, k_norm)    Qwen3 only
 *   q, k = apply_rotary(q, k)
 *   write_kv(k, v); a = paged_attention(q)
 *   h, res = rms_norm(linear(a, o), post_attn_norm, res)
 *   x = linear(silu_and_mul(linear(h, gate_up)), down)   or, a mixture of experts: x = moe_forward(h) (moe.c)
 * and at the end out = rms_norm(x, final_norm, res).
 *
 * o and down are row-parallel (row_parallel.c): the partial sums of the rank's K groups, the
 * gather (a callback into the worker group's transport; none in a single process), the fold in
 * the one order. A pipeline stage runs its own range of layers: one after the first takes the
 * residual stream in (res_in), one before the last gives x and the residual out (res_out) and
 * skips the final norm.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

typedef struct {
    const void *input_norm, *post_attn_norm; /* [hidden] */
    const void *qkv, *qkv_bias;              /* packed (gemm.c) [q + 2 kv, hidden]; bias [q + 2 kv] or NULL */
    const void *q_norm, *k_norm;             /* [head_dim], or NULL: no per-head q/k norm */
    const void *o, *gate_up, *down;          /* packed [hidden, q], [2 inter, hidden], [hidden, inter] */
    void *k_cache, *v_cache;                 /* [num_blocks, block_size, KVH, D] */
    int64_t formats[4];                      /* qkv, o, gate_up, down: 0 packed for gemm.c, else quant_gemm.c's */
    const MoeLayer *moe;                     /* a mixture of experts (moe.c) in place of gate_up and down, or NULL */
} DecoderLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    int is_bf16;                   /* weights, activations and cache: all bf16, or all fp32 */
    int rotary_is_bf16;            /* the cos | sin cache [max_positions, head_dim] */
    const void *rotary_cache;
    const void *final_norm;        /* [hidden] */
    const DecoderLayer *layers;    /* [num_layers] */
    int64_t groups, local_groups;  /* the row-parallel layers' K groups: the model's, and this rank's */
    /* the worker group's gather of the partials (local [local_groups, T, hidden] -> all [groups, T, hidden],
     * buffers the caller passes to decoder_stack); NULL in a single process. Returns 0 on success. */
    int (*gather)(int64_t layer, int64_t which);
} DecoderStack;

enum { KERNEL_GATHER_FAILED = 3 };

/* Weight `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer i, its [n, k], and its format. */
typedef struct {
    const void *w;
    int64_t n, k, format;
} Weight;

static Weight layer_weight(const DecoderStack *m, int64_t i, int which) {
    const DecoderLayer *layer = &m->layers[i];
    const int64_t q = m->num_heads * m->head_dim, qkv = q + 2 * m->num_kv_heads * m->head_dim;
    const void *w[] = {layer->qkv, layer->o, layer->gate_up, layer->down};
    const int64_t n[] = {qkv, m->hidden, 2 * m->inter, m->hidden}, k[] = {m->hidden, q, m->hidden, m->inter};
    const Weight weight = {w[which], n[which], k[which], layer->formats[which]};
    return weight;
}

/* One linear layer on weight `which` of layer i: gemm.c's packed weight, or quant_gemm.c's rows
 * of blocks. gemm.c warms the first panels of the weight that comes next (the next layer's qkv
 * after down) while it finishes this one, so no call starts from cold memory. */
typedef struct {
    float *local, *all; /* [local_groups, T, hidden] and [groups, T, hidden] (the same buffer without a gather) */
} Partials;

static int layer_linear(const DecoderStack *m, int64_t i, int which, const void *x, int64_t ldx, const void *bias,
                        void *out, int64_t ldo, int64_t num_tokens, int num_threads, const Partials *partials) {
    const Weight weight = layer_weight(m, i, which);
    NextWeight next = {NULL, 0, 0};
    if (which < 3 || i + 1 < m->num_layers) {
        const Weight after = layer_weight(m, which < 3 ? i : i + 1, (which + 1) % 4);
        if (after.format == 0)
            next = (NextWeight){after.w, after.n, after.k};
    }
    if (which == 1 || which == 3) { /* row-parallel: o, down */
        const int64_t kg = weight.k / m->local_groups;
        if (m->gather == NULL) /* a single process: every group here, folded in one pass where it can */
            return row_parallel_linear(x, ldx, weight.w, (int)weight.format, m->groups, num_tokens, weight.n, kg,
                                       m->is_bf16, out, ldo, partials->all, num_threads, &next);
        int status = row_parallel_partials(x, ldx, weight.w, (int)weight.format, m->local_groups, num_tokens, weight.n,
                                           kg, m->is_bf16, partials->local, num_threads, &next);
        if (status == KERNEL_OK && m->gather != NULL && m->gather(i, which) != 0)
            status = KERNEL_GATHER_FAILED;
        if (status == KERNEL_OK)
            fold_partials(partials->all, m->groups, num_tokens, weight.n, out, ldo, m->is_bf16, num_threads);
        return status;
    }
    if (weight.format != 0)
        return quant_linear(x, ldx, weight.w, (int)weight.format, bias, out, ldo, num_tokens, weight.n, weight.k,
                            m->is_bf16, num_threads);
    linear_then(x, ldx, weight.w, bias, out, ldo, num_tokens, weight.n, weight.k, m->is_bf16, num_threads, &next);
    return KERNEL_OK;
}

/* Aligned scratch rows for every intermediate of a layer, one buffer (kept between calls: scratch.c). */
typedef struct {
    char *base;
    void *res, *h, *qkv, *qn, *kn, *q, *k, *attn, *x, *gate_up, *act;
} Scratch;

static int scratch_alloc(Scratch *s, const DecoderStack *m, int64_t num_tokens) {
    const int64_t q = m->num_heads * m->head_dim, kv = m->num_kv_heads * m->head_dim, elem = m->is_bf16 ? 2 : 4;
    const int64_t widths[] = {m->hidden, m->hidden, q + 2 * kv, q, kv, q, kv, q, m->hidden, 2 * m->inter, m->inter};
    void **slots[] = {&s->res, &s->h, &s->qkv, &s->qn, &s->kn, &s->q, &s->k, &s->attn, &s->x, &s->gate_up, &s->act};
    size_t total = 0, sizes[11];
    for (int i = 0; i < 11; i++) {
        sizes[i] = ((size_t)(num_tokens * widths[i] * elem) + 63) / 64 * 64;
        total += sizes[i];
    }
    s->base = scratch_take(SCRATCH_DECODER, total);
    if (s->base == NULL)
        return KERNEL_OUT_OF_MEMORY;
    size_t offset = 0;
    for (int i = 0; i < 11; i++) {
        *slots[i] = s->base + offset;
        offset += sizes[i];
    }
    return KERNEL_OK;
}

/* x [T, hidden] (the embeddings, or with res_in the previous stage's x) -> out [T, hidden], the
 * final norm applied (with res_out: the last layer's x, and its residual stream in res_out).
 * partials_local / partials_all: fp32 [local_groups, T, hidden] / [groups, T, hidden], the
 * second the gather's destination (the same buffer without one). Returns a KERNEL_* status; the
 * shapes are checked first (the kernels' own limits), so nothing is written on KERNEL_BAD_SHAPE.
 * The weights' shapes are the caller's (kernels/decoder.py). */
int decoder_stack(const DecoderStack *m, const void *x, const void *res_in, void *out, void *res_out,
                  int64_t num_tokens, const int64_t *positions, const int64_t *slots, const int64_t *tables,
                  int64_t max_blocks, const int64_t *token_seq, const int64_t *token_pos, float *partials_local,
                  float *partials_all, int num_threads) {
    const int64_t hidden = m->hidden, heads = m->num_heads, kv_heads = m->num_kv_heads, dim = m->head_dim;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim, qkv_size = q_size + 2 * kv_size;
    const int64_t elem = m->is_bf16 ? 2 : 4;
    const int bf16 = m->is_bf16;
    if (num_tokens == 0)
        return KERNEL_OK;
    if (m->num_layers < 1 || kv_heads < 1 || heads > 256 || heads % kv_heads != 0 || dim % 16 != 0 || dim > 256)
        return KERNEL_BAD_SHAPE; /* paged_attention's MAX_HEADS and MAX_CHUNKS */
    if (m->local_groups < 1 || m->groups < m->local_groups || q_size % m->local_groups || m->inter % m->local_groups)
        return KERNEL_BAD_SHAPE;
    const Partials partials = {partials_local, partials_all};
    Scratch s;
    if (scratch_alloc(&s, m, num_tokens) != KERNEL_OK)
        return KERNEL_OUT_OF_MEMORY;
    memcpy(s.res, res_in != NULL ? res_in : x, (size_t)(num_tokens * hidden * elem));
    if (res_in != NULL) /* a later pipeline stage: the previous stage's last x */
        memcpy(s.x, x, (size_t)(num_tokens * hidden * elem));
    int status = KERNEL_OK;
    for (int64_t i = 0; i < m->num_layers && status == KERNEL_OK; i++) {
        const DecoderLayer *layer = &m->layers[i];
        if (i == 0 && res_in == NULL) /* the embedding is the residual stream */
            rms_norm(s.res, hidden, NULL, 0, layer->input_norm, s.h, NULL, num_tokens, hidden, m->eps, bf16,
                     num_threads);
        else
            rms_norm(s.x, hidden, s.res, hidden, layer->input_norm, s.h, s.res, num_tokens, hidden, m->eps, bf16,
                     num_threads);
        layer_linear(m, i, 0, s.h, hidden, layer->qkv_bias, s.qkv, qkv_size, num_tokens, num_threads, &partials);
        const char *q = s.qkv, *k = q + q_size * elem, *v = k + kv_size * elem;
        int64_t q_stride = qkv_size, k_stride = qkv_size;
        if (layer->q_norm != NULL) { /* per head: rows of head_dim, each token's heads contiguous */
            for (int64_t t = 0; t < num_tokens; t++) {
                memcpy((char *)s.qn + t * q_size * elem, q + t * qkv_size * elem, (size_t)(q_size * elem));
                memcpy((char *)s.kn + t * kv_size * elem, k + t * qkv_size * elem, (size_t)(kv_size * elem));
            }
            rms_norm(s.qn, dim, NULL, 0, layer->q_norm, s.qn, NULL, num_tokens * heads, dim, m->eps, bf16, num_threads);
            rms_norm(s.kn, dim, NULL, 0, layer->k_norm, s.kn, NULL, num_tokens * kv_heads, dim, m->eps, bf16,
                     num_threads);
            q = s.qn, k = s.kn, q_stride = q_size, k_stride = kv_size;
        }
        apply_rotary(q, q_stride, k, k_stride, positions, m->rotary_cache, m->rotary_is_bf16, s.q, s.k, num_tokens,
                     (int)heads, (int)kv_heads, (int)dim, bf16, num_threads);
        write_kv(s.k, kv_size, v, qkv_size, layer->k_cache, layer->v_cache, slots, num_tokens, kv_size, bf16);
        status = paged_attention(s.q, q_size, bf16, m->scale, layer->k_cache, layer->v_cache, bf16, tables,
                                 max_blocks, token_seq, token_pos, s.attn, num_tokens, (int)heads, (int)kv_heads,
                                 (int)dim, (int)m->block_size, num_threads);
        if (status != KERNEL_OK)
            break;
        status = layer_linear(m, i, 1, s.attn, q_size, NULL, s.x, hidden, num_tokens, num_threads, &partials);
        if (status != KERNEL_OK)
            break;
        rms_norm(s.x, hidden, s.res, hidden, layer->post_attn_norm, s.h, s.res, num_tokens, hidden, m->eps, bf16,
                 num_threads);
        if (layer->moe != NULL) { /* the experts, route and sum included (moe.c) */
            status = moe_forward(layer->moe, s.h, hidden, num_tokens, bf16, s.x, hidden, num_threads);
            continue;
        }
        layer_linear(m, i, 2, s.h, hidden, NULL, s.gate_up, 2 * m->inter, num_tokens, num_threads, &partials);
        silu_and_mul(s.gate_up, 2 * m->inter, s.act, num_tokens, m->inter, bf16, num_threads);
        status = layer_linear(m, i, 3, s.act, m->inter, NULL, s.x, hidden, num_tokens, num_threads, &partials);
    }
    if (status == KERNEL_OK && res_out != NULL) { /* a pipeline stage before the last */
        memcpy(out, s.x, (size_t)(num_tokens * hidden * elem));
        memcpy(res_out, s.res, (size_t)(num_tokens * hidden * elem));
    } else if (status == KERNEL_OK) {
        rms_norm(s.x, hidden, s.res, hidden, m->final_norm, out, s.res, num_tokens, hidden, m->eps, bf16, num_threads);
    }
    scratch_give(SCRATCH_DECODER);
    return status;
}
