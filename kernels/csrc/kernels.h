/* The compiled CPU kernels' entry points, as kernels/cpu_kernels.py declares them to ctypes.
 * Each source file that defines or calls one includes this, so the compiler checks both sides. */
#pragma once
#include <stddef.h>
#include <stdint.h>

enum { KERNEL_OK = 0, KERNEL_OUT_OF_MEMORY = 1, KERNEL_BAD_SHAPE = 2 };
/* a quantized weight's format code (quant_gemm.c) with this bit set: the activations are rounded to
 * int8 per block of 32 and each block is an integer dot product (quant_dot.c) */
enum { QUANT_ACT_INT8 = 0x100 };
/* with QUANT_ACT_INT8 only: the weight's rows are interleaved by groups of 16 outputs (quant_dot.c's
 * header has the layout; kernels/quant.py `interleave` makes it at load) */
enum { QUANT_INTERLEAVED = 0x200 };

/* scratch.c: a thread's buffers kept between calls, one per slot (64-byte aligned, NULL when out of
 * memory; scratch_give after the call: a slot keeps at most 1 MiB). A slot is held by one call at a time. */
enum {
    SCRATCH_DECODER,   /* decoder.c: a layer's intermediates */
    SCRATCH_ATTENTION, /* paged_attention.c: a thread's scores and sums (inside its parallel region) */
    SCRATCH_ACT,       /* quant_dot.c: the quantized rows of x (every K group's) */
    SCRATCH_AMX_ROWS,  /* quant_dot.c: those rows packed for the AMX tiles */
    SCRATCH_UNPACKED,  /* quant_dot.c: a thread's unpacked Q4 blocks (inside its parallel region) */
    SCRATCH_MOE,       /* moe.c: a mixture-of-experts layer's route, grouped rows and expert outputs */
    SCRATCH_SLOTS
};
void *scratch_take(int slot, size_t bytes);
void scratch_give(int slot);

int paged_attention(const void *q, int64_t q_stride, int io_bf16, float scale, const void *k_cache,
                    const void *v_cache, int is_bf16, const int64_t *block_tables, int64_t max_blocks,
                    const int64_t *token_seq, const int64_t *token_pos, void *out, int64_t num_tokens, int num_heads,
                    int num_kv_heads, int head_dim, int block_size, int num_threads);
/* the same with a sliding window: window > 0 keeps keys pos - window + 1 .. pos; sinks: NULL, or [num_heads]
 * fp32 logits, each in its head's softmax denominator (gpt-oss) */
int paged_attention_window(const void *q, int64_t q_stride, int io_bf16, float scale, const void *k_cache,
                           const void *v_cache, int is_bf16, const int64_t *block_tables, int64_t max_blocks,
                           const int64_t *token_seq, const int64_t *token_pos, void *out, int64_t num_tokens,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, int64_t window,
                           const float *sinks, int num_threads);
void rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride, const void *weight,
              void *out, void *new_residual, int64_t num_rows, int64_t n, float eps, int is_bf16, int num_threads);
void apply_rotary(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const int64_t *positions,
                  const void *cache, int cache_is_bf16, void *q_out, void *k_out, int64_t num_tokens, int num_heads,
                  int num_kv_heads, int head_dim, int is_bf16, int num_threads);
void silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t num_rows, int64_t inter, int is_bf16,
                  int num_threads);
void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
              const int64_t *slot_mapping, int64_t num_tokens, int64_t row_elems, int is_bf16);
void argmax_rows(const float *x, int64_t x_stride, int64_t *out, int64_t num_rows, int64_t n, int num_threads);
int gemm_supported(int is_bf16);
const char *kernel_tier(void);
void linear(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo, int64_t m,
            int64_t n, int64_t k, int is_bf16, int num_threads);
/* the weight a caller multiplies next ([n, k], packed for gemm.c, the same dtype), or packed NULL */
typedef struct {
    const void *packed;
    int64_t n, k;
} NextWeight;
/* linear(), and while each thread finishes its share it warms its first panel of `next` (may be
 * NULL): decoder.c's stack, where the next weight is known, so no call starts from cold memory */
void linear_then(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo,
                 int64_t m, int64_t n, int64_t k, int is_bf16, int num_threads, const NextWeight *next);
/* linear_then with out in fp32 (out_bf16 0) or bf16, whatever x's dtype; a bias is in out's dtype */
void linear_into(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo, int64_t m,
                 int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads, const NextWeight *next);
/* linear_into over `groups` weights [n, kg] packed one after the other (gemm_packed_bytes apart) on x's
 * groups of kg columns, in one pass: each group's chain into an fp32 total folded 0..G-1, rounded once
 * (the bits of row_parallel_partials + fold_partials) */
void linear_groups_into(const void *x, int64_t ldx, const void *packed, int64_t groups, void *out, int64_t ldo,
                        int64_t m, int64_t n, int64_t kg, int is_bf16, int out_bf16, int num_threads,
                        const NextWeight *next);
int64_t gemm_packed_bytes(int64_t n, int64_t k, int is_bf16);
int64_t quant_row_bytes(int fmt, int64_t k);
int quant_linear_into(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads);
/* row_parallel.c: the row-parallel layers' partial sums per K group, and their fold in one order */
int64_t row_parallel_group_bytes(int fmt, int64_t n, int64_t kg, int is_bf16);
int row_parallel_partials(const void *x, int64_t ldx, const void *w, int fmt, int64_t groups, int64_t m, int64_t n,
                          int64_t kg, int is_bf16, float *partials, int num_threads, const NextWeight *next);
/* every group of a single process (no gather): out[m, n] in x's dtype, the bits of partials + fold; partials
 * [groups, m, n] fp32 scratch for quantized weights (gemm.c's weights fold in registers and leave it alone) */
int row_parallel_linear(const void *x, int64_t ldx, const void *w, int fmt, int64_t groups, int64_t m, int64_t n,
                        int64_t kg, int is_bf16, void *out, int64_t ldo, float *partials, int num_threads,
                        const NextWeight *next);
void fold_partials(const float *partials, int64_t groups, int64_t m, int64_t n, void *out, int64_t ldo, int out_bf16,
                   int num_threads);
int quant_linear(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                 int64_t m, int64_t n, int64_t k, int is_bf16, int num_threads);
/* quant_dot.c: quant_linear_into's path for a format with QUANT_ACT_INT8 (passed without the bit) */
int quant_linear_int8(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads);
/* quant_dot.c: 1 where quant_linear_int8 takes its AMX tiles (compiled with AMX-INT8, the CPU has it, the kernel
 * granted the tile data), else 0 */
int quant_dot_amx(void);
/* quant_dot.c: row_parallel_linear's int8-activation groups in one pass (fmt without QUANT_ACT_INT8) */
int quant_linear_int8_groups(const void *x, int64_t ldx, const void *w, int fmt, int64_t groups, int64_t m, int64_t n,
                             int64_t kg, int is_bf16, void *out, int64_t ldo, int num_threads);
/* quant_dot.c: a mixture-of-experts layer's experts, each on its rows of x, in one parallel region (fmt without
 * QUANT_ACT_INT8; spans [count, 2] the rows' start and stop, weights [count] each expert's address) */
int quant_experts_int8(const void *x, int64_t ldx, const int64_t *spans, const int64_t *weights, int64_t count,
                       int fmt, int64_t groups, int64_t m, int64_t n, int64_t k, int is_bf16, void *out, int64_t ldo,
                       int num_threads);

/* moe.c: a mixture-of-experts layer's MLP (services/worker/models/moe.py): the router (gemm.c's packed weight,
 * router_format 0) and every expert's gate_up and down at gate_up[e] and down[e], quantized with int8
 * activations in one format each (without QUANT_ACT_INT8; down in down_groups K groups, as row_parallel_linear) */
enum { MOE_MAX_EXPERTS = 512 };
typedef struct {
    const void *router;
    int64_t router_format;
    const int64_t *gate_up, *down;
    int64_t num_experts, top_k, hidden, inter, down_groups;
    int gate_up_format, down_format, normalize;
} MoeLayer;
/* logits [T, E] fp32 -> each token's k experts in ascending id [T, k] and their weights [T, k] fp32 */
int moe_route(const float *logits, int64_t num_tokens, int64_t num_experts, int64_t k, int normalize,
              int64_t *experts, float *weights);
/* h [T, hidden] -> out [T, hidden]: the layer's MLP, the route included */
int moe_forward(const MoeLayer *m, const void *h, int64_t ldh, int64_t num_tokens, int is_bf16, void *out,
                int64_t ldo, int num_threads);
