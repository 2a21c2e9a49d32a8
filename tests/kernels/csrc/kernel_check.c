/* A C-level check of every CPU kernel for a machine the tests cannot run Python on (aarch64
 * under qemu-user): reads inputs the host wrote, runs each kernel on the whole batch and on
 * single rows / tokens, writes the outputs for the host to compare with the PyTorch
 * references and bit for bit with each other (tests/kernels/test_cross_arch.py).
 *   kernel_check IN OUT
 * IN: 13 int64 shapes (M N K T H I HEADS KV_HEADS D BLOCK NUM_BLOCKS MAX_BLOCKS V), then the
 * arrays in the order read below; OUT: the arrays in the order written below. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static FILE *in, *out;

static void *take(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL || fread(p, 1, bytes, in) != bytes) {
        fprintf(stderr, "kernel_check: short input\n");
        exit(2);
    }
    return p;
}

static void give(const void *p, size_t bytes) { fwrite(p, 1, bytes, out); }

int main(int argc, char **argv) {
    if (argc != 3 || (in = fopen(argv[1], "rb")) == NULL || (out = fopen(argv[2], "wb")) == NULL) {
        fprintf(stderr, "usage: kernel_check IN OUT\n");
        return 2;
    }
    int64_t *dims = take(13 * sizeof(int64_t));
    const int64_t M = dims[0], N = dims[1], K = dims[2], T = dims[3], H = dims[4], I = dims[5], heads = dims[6],
                  kv_heads = dims[7], D = dims[8], block = dims[9], num_blocks = dims[10], max_blocks = dims[11],
                  V = dims[12];
    printf("kernel_check: %s\n", kernel_tier());
    /* linear, fp32 then bf16: the whole batch, each row alone, and rows 3.. as a batch */
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t elem = bf16 ? 2 : 4, pairs = (K + 1) / 2, panels = (N + 47) / 48;
        const size_t packed_bytes = (size_t)panels * 48 * (bf16 ? 2 * pairs : K) * elem;
        char *x = take(M * K * elem), *packed = take(packed_bytes), *bias = take(N * elem);
        char *full = malloc(M * N * elem), *alone = malloc(M * N * elem), *tail = malloc(M * N * elem);
        linear(x, K, packed, bias, full, N, M, N, K, bf16, 2);
        for (int64_t m = 0; m < M; m++)
            linear(x + m * K * elem, K, packed, bias, alone + m * N * elem, N, 1, N, K, bf16, 1);
        memcpy(tail, full, 3 * N * elem);
        linear(x + 3 * K * elem, K, packed, bias, tail + 3 * N * elem, N, M - 3, N, K, bf16, 1);
        give(full, M * N * elem), give(alone, M * N * elem), give(tail, M * N * elem);
    }
    /* row-wise ops, fp32 then bf16: rms_norm with a residual, silu_and_mul, rotary; whole batch and row by row */
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t elem = bf16 ? 2 : 4;
        char *x = take(T * H * elem), *res = take(T * H * elem), *w = take(H * elem);
        char *o = malloc(T * H * elem), *r = malloc(T * H * elem), *o1 = malloc(T * H * elem), *r1 = malloc(T * H * elem);
        rms_norm(x, H, res, H, w, o, r, T, H, 1e-5f, bf16, 2);
        for (int64_t t = 0; t < T; t++)
            rms_norm(x + t * H * elem, H, res + t * H * elem, H, w, o1 + t * H * elem, r1 + t * H * elem, 1, H, 1e-5f,
                     bf16, 1);
        give(o, T * H * elem), give(r, T * H * elem), give(o1, T * H * elem), give(r1, T * H * elem);
        char *gu = take(T * 2 * I * elem), *act = malloc(T * I * elem), *act1 = malloc(T * I * elem);
        silu_and_mul(gu, 2 * I, act, T, I, bf16, 2);
        for (int64_t t = 0; t < T; t++)
            silu_and_mul(gu + t * 2 * I * elem, 2 * I, act1 + t * I * elem, 1, I, bf16, 1);
        give(act, T * I * elem), give(act1, T * I * elem);
        char *q = take(T * heads * D * elem), *k = take(T * kv_heads * D * elem), *cache = take(T * D * 4);
        int64_t *pos = take(T * sizeof(int64_t));
        char *qo = malloc(T * heads * D * elem), *ko = malloc(T * kv_heads * D * elem);
        apply_rotary(q, heads * D, k, kv_heads * D, pos, cache, 0, qo, ko, T, heads, kv_heads, D, bf16, 2);
        give(qo, T * heads * D * elem), give(ko, T * kv_heads * D * elem);
    }
    /* paged attention, fp32 then bf16: one sequence's T tokens as a prefill, then each as a decode */
    for (int bf16 = 0; bf16 < 2; bf16++) {
        const int64_t elem = bf16 ? 2 : 4, cache_elems = num_blocks * block * kv_heads * D;
        char *q = take(T * heads * D * elem), *kc = take(cache_elems * elem), *vc = take(cache_elems * elem);
        int64_t *tables = take(max_blocks * sizeof(int64_t)), *seq = calloc(T, sizeof(int64_t));
        int64_t *pos = malloc(T * sizeof(int64_t));
        for (int64_t t = 0; t < T; t++) pos[t] = t;
        char *o = malloc(T * heads * D * elem), *o1 = malloc(T * heads * D * elem);
        int status = paged_attention(q, heads * D, bf16, 0.125f, kc, vc, bf16, tables, max_blocks, seq, pos, o, T,
                                     heads, kv_heads, D, block, 2);
        for (int64_t t = 0; t < T; t++)
            status |= paged_attention(q + t * heads * D * elem, heads * D, bf16, 0.125f, kc, vc, bf16, tables,
                                      max_blocks, seq, pos + t, o1 + t * heads * D * elem, 1, heads, kv_heads, D,
                                      block, 1);
        if (status != KERNEL_OK) {
            fprintf(stderr, "kernel_check: paged_attention status %d\n", status);
            return 1;
        }
        give(o, T * heads * D * elem), give(o1, T * heads * D * elem);
        /* write_kv: token t's k and v rows into slot slots[t] (one fp32/bf16 cache pair) */
        char *k = take(T * kv_heads * D * elem), *v = take(T * kv_heads * D * elem);
        int64_t *slots = take(T * sizeof(int64_t));
        write_kv(k, kv_heads * D, v, kv_heads * D, kc, vc, slots, T, kv_heads * D, bf16);
        give(kc, cache_elems * elem), give(vc, cache_elems * elem);
    }
    /* argmax over rows of V */
    float *logits = take(T * V * sizeof(float));
    int64_t *best = malloc(T * sizeof(int64_t));
    argmax_rows(logits, V, best, T, V, 2);
    give(best, T * sizeof(int64_t));
    fclose(out);
    return 0;
}
