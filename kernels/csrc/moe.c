/* A mixture-of-experts layer's MLP in one call (services/worker/models/moe.py, MoE.forward):
 *
 *   logits = h router^T                      gemm.c's linear, in h's dtype, then fp32
 *   weights, experts = moe_route(logits)     softmax, top-k, renormalised where the model does
 *   rows = h[pair's token] by expert          every (token, slot) pair, grouped by expert
 *   gate_up = experts' gate_up(rows)         quant_experts_int8: one region for every chosen expert
 *   act = silu_and_mul(gate_up)
 *   down = experts' down(act)                quant_experts_int8, the K groups folded as row_parallel_linear
 *   out[t] = sum over slots (ascending expert id) of down[pair] * weight[pair], each op rounded to h's dtype
 *
 * The layer-by-layer path (moe.py) and the one-call stack (decoder.c) both run this function, so
 * they agree by construction; moe.py's own path for the weights this does not take (fp32 activations,
 * mixed formats, tensor ranks) routes through moe_route and adds the pairs in the same order, so its
 * bits are the same too. What goes is ~20 torch ops and ctypes calls a layer (~0.2 ms at decode).
 *
 * The route (moe_route) is this file's own and tier-invariant: exp by vec.h's exp16 (unfused, as
 * silu's), the softmax's sum in index order, ties in the top-k to the lower expert id, the k weights
 * summed in the order picked. A token's route and output depend on its own row only.
 */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

/* logits [T, E] fp32 -> experts [T, k] (each token's k picks in ascending id) and their weights [T, k] fp32:
 * softmax over the E logits, the k largest (ties: the lower id first), divided by their sum where normalize.
 * E <= MOE_MAX_EXPERTS, 1 <= k <= E; else KERNEL_BAD_SHAPE. */
int moe_route(const float *logits, int64_t num_tokens, int64_t num_experts, int64_t k, int normalize,
              int64_t *experts, float *weights) {
    if (num_experts < 1 || num_experts > MOE_MAX_EXPERTS || k < 1 || k > num_experts)
        return KERNEL_BAD_SHAPE;
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = logits + t * num_experts;
        float probs[MOE_MAX_EXPERTS + LANES];
        float top = row[0];
        for (int64_t e = 1; e < num_experts; e++)
            top = row[e] > top ? row[e] : top;
        for (int64_t e = 0; e < num_experts; e += LANES) {
            float chunk[LANES];
            for (int i = 0; i < LANES; i++)
                chunk[i] = e + i < num_experts ? row[e + i] - top : -INFINITY;
            vf v;
            memcpy(&v, chunk, sizeof v);
            v = exp16(v);
            memcpy(&probs[e], &v, sizeof v);
        }
        float sum = 0.0f;
        for (int64_t e = 0; e < num_experts; e++)
            sum += probs[e];
        for (int64_t e = 0; e < num_experts; e++)
            probs[e] /= sum;
        int64_t picked[MOE_MAX_EXPERTS];
        float value[MOE_MAX_EXPERTS], total = 0.0f;
        char taken[MOE_MAX_EXPERTS] = {0};
        for (int64_t j = 0; j < k; j++) { /* the largest left; NaN never wins, so a row of NaN picks 0, 1, ... */
            int64_t best = -1;
            for (int64_t e = 0; e < num_experts; e++)
                if (!taken[e] && (best < 0 || probs[e] > probs[best]))
                    best = e;
            taken[best] = 1, picked[j] = best, value[j] = probs[best], total += probs[best];
        }
        for (int64_t j = 0; j < k; j++)
            value[j] = normalize ? value[j] / total : value[j];
        for (int64_t j = 1; j < k; j++) /* ascending id: the order a token's outputs are added in */
            for (int64_t i = j; i > 0 && picked[i - 1] > picked[i]; i--) {
                const int64_t e = picked[i];
                const float w = value[i];
                picked[i] = picked[i - 1], value[i] = value[i - 1];
                picked[i - 1] = e, value[i - 1] = w;
            }
        for (int64_t j = 0; j < k; j++)
            experts[t * k + j] = picked[j], weights[t * k + j] = value[j];
    }
    return KERNEL_OK;
}

static void *carve(char **at, size_t bytes) {
    void *p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

/* h [T, hidden] (row stride ldh) -> out [T, hidden] (row stride ldo), as the header says. Returns a KERNEL_*
 * status (quant_experts_int8's, or KERNEL_BAD_SHAPE for a router that is not gemm.c's or too many experts). */
int moe_forward(const MoeLayer *m, const void *h, int64_t ldh, int64_t num_tokens, int is_bf16, void *out,
                int64_t ldo, int num_threads) {
    const int64_t E = m->num_experts, k = m->top_k, hidden = m->hidden, inter = m->inter;
    const int64_t pairs = num_tokens * k, elem = is_bf16 ? 2 : 4;
    if (num_tokens == 0)
        return KERNEL_OK;
    if (E < 1 || E > MOE_MAX_EXPERTS || k < 1 || k > E || m->router_format != 0)
        return KERNEL_BAD_SHAPE;
    const size_t sizes[] = {(size_t)(num_tokens * E * elem), (size_t)(num_tokens * E * 4), (size_t)pairs * 8,
                            (size_t)pairs * 4, (size_t)pairs * 8, (size_t)pairs * 8, (size_t)E * 16, (size_t)E * 8,
                            (size_t)(pairs * hidden * elem), (size_t)(pairs * 2 * inter * elem),
                            (size_t)(pairs * inter * elem), (size_t)(pairs * hidden * elem)};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        total += (sizes[i] + 63) / 64 * 64;
    char *at = scratch_take(SCRATCH_MOE, total);
    if (at == NULL)
        return KERNEL_OUT_OF_MEMORY;
    void *logits = carve(&at, sizes[0]);
    float *probs = carve(&at, sizes[1]);
    int64_t *experts = carve(&at, sizes[2]);
    float *weights = carve(&at, sizes[3]);
    int64_t *order = carve(&at, sizes[4]); /* order[i]: the pair (token k + slot) of grouped row i */
    int64_t *row_of = carve(&at, sizes[5]); /* row_of[pair]: its grouped row */
    int64_t *spans = carve(&at, sizes[6]), *addresses = carve(&at, sizes[7]);
    char *rows = carve(&at, sizes[8]), *gate_up = carve(&at, sizes[9]), *act = carve(&at, sizes[10]);
    char *down = carve(&at, sizes[11]);

    linear(h, ldh, m->router, NULL, logits, E, num_tokens, E, hidden, is_bf16, num_threads);
    for (int64_t i = 0; i < num_tokens * E; i++)
        probs[i] = is_bf16 ? bf16_to_float(((const uint16_t *)logits)[i]) : ((const float *)logits)[i];
    int status = moe_route(probs, num_tokens, E, k, m->normalize, experts, weights);
    if (status != KERNEL_OK)
        goto done;
    for (int64_t i = 0; i < pairs; i++) /* moe.py: the weights in h's dtype */
        weights[i] = is_bf16 ? bf16_to_float(float_to_bf16(weights[i])) : weights[i];
    /* group the pairs by expert (a stable counting sort: tokens ascending within an expert) */
    int64_t count[MOE_MAX_EXPERTS] = {0}, start[MOE_MAX_EXPERTS];
    for (int64_t i = 0; i < pairs; i++)
        count[experts[i]]++;
    int64_t spent = 0, chosen = 0;
    for (int64_t e = 0; e < E; e++) {
        start[e] = spent;
        if (count[e] > 0) {
            spans[2 * chosen] = spent, spans[2 * chosen + 1] = spent + count[e];
            addresses[chosen] = m->gate_up[e];
            chosen++;
        }
        spent += count[e];
    }
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t row = start[experts[i]]++;
        order[row] = i, row_of[i] = row;
    }
    for (int64_t r = 0; r < pairs; r++)
        memcpy(rows + r * hidden * elem, (const char *)h + order[r] / k * ldh * elem, (size_t)(hidden * elem));
    status = quant_experts_int8(rows, hidden, spans, addresses, chosen, m->gate_up_format, 1, pairs, 2 * inter,
                                hidden, is_bf16, gate_up, 2 * inter, num_threads);
    if (status != KERNEL_OK)
        goto done;
    silu_and_mul(gate_up, 2 * inter, act, pairs, inter, is_bf16, num_threads);
    for (int64_t i = 0, c = 0; i < E; i++)
        if (count[i] > 0) /* the chosen experts, in the gate_up call's order */
            addresses[c++] = m->down[i];
    status = quant_experts_int8(act, inter, spans, addresses, chosen, m->down_format, m->down_groups, pairs, hidden,
                                inter, is_bf16, down, hidden, num_threads);
    if (status != KERNEL_OK)
        goto done;
    /* each token's pairs in slot order (ascending expert id): (0 + d0 w0) + d1 w1 + ..., each op in h's dtype */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (pairs * hidden >= 1 << 16)
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t c = 0; c < hidden; c += LANES) {
            vf sum = {0};
            for (int64_t s = 0; s < k; s++) {
                const vf d = row_load(down, is_bf16, row_of[t * k + s] * hidden + c, hidden - c);
                sum = round16(sum + round16(d * weights[t * k + s], is_bf16), is_bf16);
            }
            row_store(out, is_bf16, t * ldo + c, hidden - c, sum);
        }
done:
    scratch_give(SCRATCH_MOE);
    return status;
}
