/* The row-parallel linear layers (o_proj, down_proj): one reduction order at every tensor-parallel
 * size, TP = 1 included (docs/ARCHITECTURE.md, "Tensor and pipeline parallel").
 *
 * K is cut into G groups of kg = K / G columns (G fixed per model: kernels/linear.py
 * reduction_groups). Each group is one linear layer of its own on the group's columns of x and
 * of W, in gemm.c's or quant_gemm.c's fixed order, into an fp32 partial sum [m, n]. The G partials
 * are then folded in one order, out = ((p0 + p1) + p2) + ... + p(G-1), rounded once to out's dtype.
 * A rank that holds groups [g0, g1) computes only their partials; after the gather (concatenation
 * in rank order) every rank folds the same G partials in the same order, so the bits do not depend
 * on how many ranks computed them. A single process (no gather) runs row_parallel_linear: gemm.c's
 * weights in one pass over K that folds each group's chain into a running fp32 total in registers
 * (linear_groups_into), the same bits without the partials' memory and the G calls; quantized weights
 * with int8 activations (every format quant_linear_int8 takes, the K-quants included) fold each tile's G
 * partials in registers (quant_dot.c's quant_linear_int8_groups), to the same end; fp32 activations on
 * quantized weights take the partials and their fold.
 *
 * The local groups' weights lie one after the other, each packed (gemm.c) or as rows of blocks
 * (quant_gemm.c) of its own [n, kg], row_parallel_group_bytes apart. No bias: none of the
 * architectures served has one on o_proj or down_proj. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

int64_t row_parallel_group_bytes(int fmt, int64_t n, int64_t kg, int is_bf16) {
    return fmt == 0 ? gemm_packed_bytes(n, kg, is_bf16) : n * quant_row_bytes(fmt, kg);
}

/* partials[g] [m, n] fp32 = x[:, g kg : (g + 1) kg] W_g^T for the `groups` local groups; x in its
 * dtype (row stride ldx). `next`: the weight the caller multiplies after these (gemm.c warms it). */
int row_parallel_partials(const void *x, int64_t ldx, const void *w, int fmt, int64_t groups, int64_t m, int64_t n,
                          int64_t kg, int is_bf16, float *partials, int num_threads, const NextWeight *next) {
    const int64_t bytes = row_parallel_group_bytes(fmt, n, kg, is_bf16), elem = is_bf16 ? 2 : 4;
    if (bytes <= 0)
        return KERNEL_BAD_SHAPE;
    for (int64_t g = 0; g < groups; g++) {
        const void *xg = (const char *)x + g * kg * elem;
        const char *wg = (const char *)w + g * bytes;
        float *pg = partials + g * m * n;
        if (fmt != 0) {
            const int status = quant_linear_into(xg, ldx, wg, fmt, NULL, pg, n, m, n, kg, is_bf16, 0, num_threads);
            if (status != KERNEL_OK)
                return status;
            continue;
        }
        const NextWeight following = {wg + bytes, n, kg}, none = {NULL, 0, 0};
        const NextWeight *after = g + 1 < groups ? &following : (next != NULL ? next : &none);
        linear_into(xg, ldx, wg, NULL, pg, n, m, n, kg, is_bf16, 0, num_threads, after);
    }
    return KERNEL_OK;
}

int row_parallel_linear(const void *x, int64_t ldx, const void *w, int fmt, int64_t groups, int64_t m, int64_t n,
                        int64_t kg, int is_bf16, void *out, int64_t ldo, float *partials, int num_threads,
                        const NextWeight *next) {
    if (fmt == 0) {
        linear_groups_into(x, ldx, w, groups, out, ldo, m, n, kg, is_bf16, is_bf16, num_threads, next);
        return KERNEL_OK;
    }
    if (fmt & QUANT_ACT_INT8) { /* the groups' tiles folded in registers (quant_dot.c) */
        const int fused = quant_linear_int8_groups(x, ldx, w, fmt & ~QUANT_ACT_INT8, groups, m, n, kg, is_bf16, out, ldo,
                                                   num_threads);
        if (fused != KERNEL_BAD_SHAPE)
            return fused;
    }
    const int status = row_parallel_partials(x, ldx, w, fmt, groups, m, n, kg, is_bf16, partials, num_threads, next);
    if (status == KERNEL_OK)
        fold_partials(partials, groups, m, n, out, ldo, is_bf16, num_threads);
    return status;
}

/* out[m, n] (row stride ldo, bf16 or fp32) = the G partials [G, m, n] folded in the order 0..G-1 */
void fold_partials(const float *partials, int64_t groups, int64_t m, int64_t n, void *out, int64_t ldo, int out_bf16,
                   int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < m; r++) {
        float row[n];
        memcpy(row, partials + r * n, sizeof(float) * (size_t)n);
        for (int64_t g = 1; g < groups; g++) {
            const float *pg = partials + (g * m + r) * n;
            for (int64_t c = 0; c < n; c++)
                row[c] += pg[c];
        }
        if (out_bf16) {
            uint16_t *dst = (uint16_t *)out + r * ldo;
            for (int64_t c = 0; c < n; c++)
                dst[c] = float_to_bf16(row[c]);
        } else {
            memcpy((float *)out + r * ldo, row, sizeof(float) * (size_t)n);
        }
    }
}
