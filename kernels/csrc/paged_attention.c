/* Paged attention for the CPU: one query token (all its heads) per work item.
 *
 * Every work item reads its own sequence's keys and values in place, through the block
 * table, row after row (a row holds every KV head, so reads are contiguous within a block),
 * and reduces them in one fixed order that depends only on the token's own context length:
 * dot products over head_dim in 16-lane vectors folded by a fixed tree, an exact two-pass
 * softmax in fp32 (max, then a vector exp and a 16-lane sum), and values accumulated key by
 * key. No work item reads another's results and the thread count only
 * decides who runs an item, so a token gets the same bits alone or in any batch, in a
 * prefill chunk or in decode (docs/ARCHITECTURE.md, rule 4). GCC vector extensions keep it portable:
 * the key and value loops run on vectors of AW lanes, 16 where a register holds 16 floats
 * (AVX-512) and 8 elsewhere (one AVX2 register, two NEON or SSE ones). Each 16-lane chunk of a dot
 * product is then two 8-lane halves, each its own chain, added as fold's first level, so both widths
 * make the same sums in the same order. The products of a chain are fused into it (vec.h's fma, the
 * instruction or libm's fmaf), the first one of a dot product not, and exp is vec.h's exp with fused
 * multiply-adds: the same bits on every tier (avx512, avx2, generic, aarch64).
 *
 * Layouts (all contiguous):
 *   q            [T, H, D] fp32 or bf16 (io_bf16), heads contiguous, token stride q_stride;
 *                multiplied by `scale` in fp32 here (as torch's q.float() * scale)
 *   k/v cache    [num_blocks, block_size, KVH, D], fp32 or bf16 (is_bf16)
 *   block_tables [S, max_blocks] int64
 *   token_seq    [T] int64, each token's sequence; token_pos [T] int64, its position
 *   out          [T, H, D] in q's dtype (bf16 rounded to nearest even, as torch's .to())
 * Token t attends to keys 0..token_pos[t] of its sequence. H = KVH * group, D % 16 == 0,
 * head_dim <= 16 * MAX_CHUNKS, H <= MAX_HEADS.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "vec.h"

/* At 16 lanes on AVX2 every vector is a pair of the 16 ymm registers: the key and value loops
 * spilled them to the stack (300-360 stack accesses per 32 floating-point instructions) and
 * attention took 7x as long as on AVX-512. */
#if defined(__AVX512F__)
#define AW 16
typedef vf av;
typedef vu au;
#else
#define AW 8
typedef vf8 av;
typedef vu8 au;
#endif
#define HALVES (LANES / AW) /* AW-lane pieces of a 16-lane chunk */

/* the key and value chains' fused multiply-add (vec.h), and exp with its multiply-adds fused */
#if AW == 16
#define fma_aw fma16
#define exp_aw exp16_fused
#define fold_lanes fold
#else
#define fma_aw fma8
#define exp_aw exp8_fused
/* fold's last three levels (+4, +2, +1) on the sum of its first */
static inline __attribute__((always_inline)) float fold_lanes(av v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}
#endif

/* every lane = s (a broadcast) */
static inline __attribute__((always_inline)) av splat_aw(float s) {
    av v;
    for (int l = 0; l < AW; l++) v[l] = s;
    return v;
}

/* AW elements from fp32 or bf16 memory as fp32 (load16 at AW = 16) */
static inline __attribute__((always_inline)) av load_aw(const void *base, int is_bf16, int64_t index) {
#if AW == 16
    return load16(base, is_bf16, index);
#else
#if defined(__AVX2__)
    if (is_bf16) { /* one widening load and a shift, as load16 on AVX-512 */
        const __m256i bits =
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)((const uint16_t *)base + index))), 16);
        av value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
#endif
    if (is_bf16) {
        typedef uint16_t half_aw __attribute__((vector_size(AW * sizeof(uint16_t))));
        half_aw half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        return (av)(__builtin_convertvector(half, au) << 16);
    }
    av value;
    memcpy(&value, (const float *)base + index, sizeof value);
    return value;
#endif
}

/* store16 at AW lanes (bf16 by vec.h's float_to_bf16, the same rounding as bf16_bits16) */
static inline __attribute__((always_inline)) void store_aw(void *base, int is_bf16, int64_t index, av value) {
#if AW == 16
    store16(base, is_bf16, index, value);
#else
    if (is_bf16)
        for (int l = 0; l < AW; l++) ((uint16_t *)base)[index + l] = float_to_bf16(value[l]);
    else
        memcpy((float *)base + index, &value, sizeof value);
#endif
}

#define MAX_HEADS 256
#define MAX_CHUNKS 16 /* head_dim <= 256 */
#define VALUES_WARMED (256 << 10) /* bytes of values the key pass warms: a quarter of a Zen 4/5 core's L2 */

/* Warm L1 with a whole block: its rows (all KV heads) are one contiguous region (the value pass, one block ahead). */
static inline __attribute__((always_inline)) void prefetch_block(const void *cache, int is_bf16, int64_t block,
                                                                 int block_size, int64_t row_stride) {
    const int64_t elem = is_bf16 ? 2 : 4, bytes = block_size * row_stride * elem;
    const char *first = (const char *)cache + block * bytes;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(first + line);
}

/* Row r's share of a block's cache lines, into L2 (1/block_size of them). The key pass calls it
 * once per key it reads, so the prefetches trickle out beside the arithmetic: a whole block's
 * worth at once (the burst prefetch_block issues) fills the core's miss queue, stalls the
 * loop, and memory and compute take turns. Spread like this, bf16 attention at 16 tokens x
 * 200 keys went from 4.3-5.1 to 2.7-3.5 ms for 30 layers (fp32: 6.9-7.0 -> 5.4-5.5). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *cache, int is_bf16, int64_t block, int64_t r,
                                                                int block_size, int64_t row_stride) {
    const int64_t elem = is_bf16 ? 2 : 4, bytes = block_size * row_stride * elem;
    const char *first = (const char *)cache + block * bytes;
    const int64_t lines = bytes / 64, per_row = (lines + block_size - 1) / block_size;
    for (int64_t line = r * per_row; line < (r + 1) * per_row && line < lines; line++)
        __builtin_prefetch(first + 64 * line, 0, 2);
}

static inline __attribute__((always_inline)) int64_t keys_in_block(int64_t num_keys, int64_t block, int block_size) {
    const int64_t left = num_keys - block * block_size;
    return left < block_size ? left : block_size;
}

/* lane i of the result = fold(s[i]) with fold's own tree (vec.h), so the same bits: each level
 * adds the same lane pairs, for 16 vectors at once (15 shuffle-add steps instead of 64, and no
 * long chain per key). */
static inline __attribute__((always_inline)) vf fold16(const vf *s) {
    vf t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(s[2 * i], s[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* fold16 for 8 keys whose vectors already hold fold's first level (lane l = lanes l + l+8 of the
 * 16-lane sum): the other three levels, the same lane pairs in the same order */
static inline __attribute__((always_inline)) av fold_aw(const av *s) {
#if AW == 16
    return fold16(s);
#else
    av t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(s[2 * i], s[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* out for query heads g .. g+heads-1 of KV head h, AW-lane chunks c0 .. c0+cols-1 of head_dim:
 * (sum_j p_head,j v_j) / denom_head, keys in order (each element one chain, whatever the slice).
 * The first pass (h = 0, g = 0, c0 = 0) warms the cache with each next block, all KV heads. */
static inline __attribute__((always_inline)) void weigh_values(
    const int heads, const int cols, int h, int g, int c0, const void *v_cache, const int is_bf16,
    const int64_t *table, int64_t num_keys, int block_size, int64_t first_block, int64_t num_blocks,
    int64_t row_stride, const float *scores, int64_t padded_keys, const float *denom, void *out, int out_bf16,
    int group, int head_dim) {
    const int first = h * group + g;
    av a[4][MAX_CHUNKS * HALVES];
    for (int t = 0; t < heads; t++)
        for (int c = 0; c < cols; c++) a[t][c] = (av){0};
    for (int64_t b = first_block; b < num_blocks; b++) {
        if (h == 0 && g == 0 && c0 == 0 && b + 1 < num_blocks)
            prefetch_block(v_cache, is_bf16, table[b + 1], block_size, row_stride);
        for (int64_t r = 0, keys = keys_in_block(num_keys, b, block_size); r < keys; r++) {
            const int64_t j = b * block_size + r;
            const int64_t row = (table[b] * block_size + r) * row_stride + (int64_t)h * head_dim + (int64_t)c0 * AW;
            av p[4];
            for (int t = 0; t < heads; t++) p[t] = splat_aw(scores[(first + t) * padded_keys + j]);
            for (int c = 0; c < cols; c++) {
                const av v = load_aw(v_cache, is_bf16, row + c * AW);
                for (int t = 0; t < heads; t++) a[t][c] = fma_aw(p[t], v, a[t][c]);
            }
        }
    }
    for (int t = 0; t < heads; t++)
        for (int c = 0; c < cols; c++)
            store_aw(out, out_bf16, (int64_t)(first + t) * head_dim + (c0 + c) * AW, a[t][c] / denom[first + t]);
}

/* One token, all its heads, keys first_key .. num_keys - 1 (a sliding window starts past 0: the
 * keys before it score -inf, weigh 0 and are not read): the keys are read row by row, each row (all
 * KV heads) once and in block order; the values once per few query heads of a KV head (weigh_values; after the first
 * pass they come from L2). scores holds num_heads x padded_keys floats (num_keys rounded up to
 * LANES); acc holds num_heads x AW vectors (the products of AW keys per head, for fold_aw). */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *k_cache, const void *v_cache, const int is_bf16, const int64_t *table,
    int64_t first_key, int64_t num_keys, void *out, int out_bf16, int num_kv_heads, int group, int head_dim,
    int block_size, float *scores, av *acc, const int fused_pair, const float *sinks) {
    const int chunks = head_dim / LANES, num_heads = num_kv_heads * group;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
    const int64_t padded_keys = (num_keys + LANES - 1) / LANES * LANES;
    av kv[MAX_CHUNKS * HALVES], qv;
    av *sums = acc;
    /* the values of the first blocks are warmed during the key pass, up to VALUES_WARMED bytes
     * (more would leave L2 before the value pass reads them) */
    const int64_t warmed_value_blocks = VALUES_WARMED / (block_size * row_stride * (is_bf16 ? 2 : 4));
    /* scores[head * padded_keys + j] = q_head . k_j, AW keys at a time: each key's per-head
     * products go to sums, then fold_aw reduces AW keys of a head at once (the same tree as fold) */
    const int64_t start = first_key / AW * AW; /* AW keys at a time, from the window's first chunk */
    for (int64_t j0 = start, b = start / block_size, r = start % block_size; j0 < num_keys; j0 += AW) {
        const int64_t j1 = j0 + AW < num_keys ? j0 + AW : num_keys;
        for (int64_t j = j0; j < j1; j++, r++) {
            if (r == block_size) r = 0, b++;
            if (j == 0) /* the first block of keys has nothing to hide behind */
                for (int first_rows = 0; first_rows < block_size; first_rows++)
                    prefetch_rows(k_cache, is_bf16, table[0], first_rows, block_size, row_stride);
            if (b + 1 < num_blocks) prefetch_rows(k_cache, is_bf16, table[b + 1], r, block_size, row_stride);
            if (b < warmed_value_blocks) prefetch_rows(v_cache, is_bf16, table[b], r, block_size, row_stride);
            const int64_t row = (table[b] * block_size + r) * row_stride;
            for (int h = 0; h < num_kv_heads; h++) {
                for (int c = 0; c < chunks * HALVES; c++) kv[c] = load_aw(k_cache, is_bf16, row + h * head_dim + c * AW);
                for (int g = 0; g < group; g++) {
                    const float *q_head = q + (int64_t)(h * group + g) * head_dim;
                    /* lane l of half `half`: one chain over the 16-lane chunks, as lane
                     * half * AW + l of a 16-lane sum */
                    av part[HALVES];
                    const int paired = fused_pair && chunks > 1; /* chunks 0 and 1 as fma(q0, k0, q1 k1) */
                    for (int half = 0; half < HALVES; half++) {
                        memcpy(&qv, q_head + half * AW, sizeof qv);
                        if (paired) {
                            av qv1;
                            memcpy(&qv1, q_head + LANES + half * AW, sizeof qv1);
                            part[half] = fma_aw(qv, kv[half], qv1 * kv[HALVES + half]);
                        } else {
                            part[half] = qv * kv[half];
                        }
                    }
                    for (int c = 1 + paired; c < chunks; c++)
                        for (int half = 0; half < HALVES; half++) {
                            memcpy(&qv, q_head + c * LANES + half * AW, sizeof qv);
                            part[half] = fma_aw(qv, kv[c * HALVES + half], part[half]);
                        }
                    av sum = part[0];
                    for (int half = 1; half < HALVES; half++) sum += part[half]; /* fold's first level */
                    sums[(h * group + g) * AW + (j - j0)] = sum;
                }
            }
        }
        for (int head = 0; head < num_heads; head++) {
            for (int64_t j = j1; j < j0 + AW; j++) sums[head * AW + (j - j0)] = (av){0};
            const av folded = fold_aw(sums + head * AW);
            memcpy(scores + head * padded_keys + j0, &folded, sizeof folded);
        }
    }
    /* exact softmax per head: the max, then exp and a 16-lane sum, key j in lane j % 16 (at 8
     * lanes: two sums, keys j % 16 < 8 and the others, added as fold's first level) */
    float denom[MAX_HEADS];
    for (int head = 0; head < num_heads; head++) {
        float *scores_row = scores + head * padded_keys;
        for (int64_t j = 0; j < first_key; j++) scores_row[j] = -INFINITY;
        for (int64_t j = num_keys; j < padded_keys; j++) scores_row[j] = -INFINITY;
        av max = (av){0} - INFINITY, sum[HALVES] = {{0}}, chunk;
        for (int64_t j = 0; j < padded_keys; j += AW) {
            memcpy(&chunk, scores_row + j, sizeof chunk);
            max = LANE_SELECT(av, au, chunk > max, chunk, max);
        }
        float top = max[0];
        for (int l = 1; l < AW; l++) top = max[l] > top ? max[l] : top;
        if (sinks != NULL && sinks[head] > top) top = sinks[head]; /* the sink: one more key, value zero */
        for (int64_t j = 0; j < padded_keys; j += LANES)
            for (int half = 0; half < HALVES; half++) {
                memcpy(&chunk, scores_row + j + half * AW, sizeof chunk);
                chunk = exp_aw(chunk - top);
                sum[half] += chunk;
                memcpy(scores_row + j + half * AW, &chunk, sizeof chunk);
            }
        for (int half = 1; half < HALVES; half++) sum[0] += sum[half];
        denom[head] = fold_lanes(sum[0]) + (sinks != NULL ? expf(sinks[head] - top) : 0.0f);
    }
    /* out_head = (sum_j p_head,j v_j) / denom_head, key by key: a few query heads of one KV head
     * at a time, their sums for `cols` chunks of head_dim in registers while that KV head's values
     * stream past. AVX-512 (32 registers): all of head_dim, 4 heads (2 past 64 lanes); 8 lanes
     * (16 ymm): 4 chunks (32 lanes) of 3 heads, 12 sums + a value + 3 weights. */
    const int all = chunks * HALVES;
    const int cols = AW == 16 ? all : (all < 4 ? all : 4), tile = AW == 16 ? (chunks <= 4 ? 4 : 2) : 3;
    for (int h = 0; h < num_kv_heads; h++)
        for (int g = 0; g < group; g += tile)
            for (int c0 = 0; c0 < all; c0 += cols) {
                const int heads = group - g < tile ? group - g : tile, width = all - c0 < cols ? all - c0 : cols;
#define WEIGH(HEADS)                                                                                                  \
    weigh_values(HEADS, width, h, g, c0, v_cache, is_bf16, table, num_keys, block_size, first_key / block_size,      \
                 num_blocks, row_stride, scores, padded_keys, denom, out, out_bf16, group, head_dim)
                switch (heads) { /* each count its own unrolled loop */
                case 4: WEIGH(4); break;
                case 3: WEIGH(3); break;
                case 2: WEIGH(2); break;
                default: WEIGH(1);
                }
#undef WEIGH
            }
}

/* window > 0: a token at position p attends to keys p - window + 1 .. p only (a sliding-window layer);
 * sinks (NULL: none), [num_heads] fp32: each head's softmax denominator also holds exp(sink) (gpt-oss) */
int paged_attention_window(const void *q, int64_t q_stride, int io_bf16, float scale, const void *k_cache,
                           const void *v_cache, int is_bf16, const int64_t *block_tables, int64_t max_blocks,
                           const int64_t *token_seq, const int64_t *token_pos, void *out, int64_t num_tokens,
                           int num_heads, int num_kv_heads, int head_dim, int block_size, int64_t window,
                           const float *sinks, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % LANES != 0 || head_dim / LANES > MAX_CHUNKS || num_heads > MAX_HEADS ||
        group * num_kv_heads != num_heads)
        return KERNEL_BAD_SHAPE;
    int64_t max_keys = 0;
    for (int64_t t = 0; t < num_tokens; t++) max_keys = token_pos[t] + 1 > max_keys ? token_pos[t] + 1 : max_keys;
    const size_t score_floats = (size_t)num_heads * (size_t)((max_keys + LANES - 1) / LANES * LANES);
    const size_t acc_vectors = (size_t)num_heads * AW; /* the QK products of AW keys per head */
    const int64_t width = (int64_t)num_heads * head_dim;
    int status = KERNEL_OK;
#pragma omp parallel num_threads(num_threads)
    {
        /* this thread's sums, scaled q and scores, one buffer kept between calls (scratch.c): the sums
         * and q first, each a whole number of 64-byte vectors */
        const size_t acc_bytes = sizeof(av) * acc_vectors, scaled_bytes = (sizeof(float) * (size_t)width + 63) / 64 * 64;
        char *base = scratch_take(SCRATCH_ATTENTION, acc_bytes + scaled_bytes + sizeof(float) * score_floats);
        av *acc = (av *)base;
        float *scaled = base != NULL ? (float *)(base + acc_bytes) : NULL;
        float *scores = base != NULL ? (float *)(base + acc_bytes + scaled_bytes) : NULL;
        if (base == NULL) status = KERNEL_OUT_OF_MEMORY;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tokens; t++) {
            if (base == NULL) continue;
            for (int64_t i = 0; i < width; i += LANES) {
                const vf value = load16(q, io_bf16, t * q_stride + i) * scale;
                memcpy(scaled + i, &value, sizeof value);
            }
            void *token_out = (char *)out + t * width * (io_bf16 ? 2 : 4);
            const int64_t *table = block_tables + token_seq[t] * max_blocks;
            const int64_t first_key = window > 0 && token_pos[t] >= window ? token_pos[t] + 1 - window : 0;
#define ATTEND(BF16, HEAD_DIM, PAIR)                                                                               \
    attend(scaled, k_cache, v_cache, BF16, table, first_key, token_pos[t] + 1, token_out, io_bf16, num_kv_heads,   \
           group, HEAD_DIM, block_size, scores, acc, PAIR, sinks)
            /* the common head widths as constants: the chunk loops unroll and a key stays in registers.
             * Their dot products start fma(q0, k0, q1 k1), the others' q0 k0 then fma(q1, k1, ..): so GCC
             * fused them when it contracted on the FMA tiers (before -ffp-contract=off), written out so
             * that those tiers keep their bits and every other tier has them too. */
            if (head_dim == 64)
                is_bf16 ? ATTEND(1, 64, 1) : ATTEND(0, 64, 1);
            else if (head_dim == 128)
                is_bf16 ? ATTEND(1, 128, 1) : ATTEND(0, 128, 1);
            else
                is_bf16 ? ATTEND(1, head_dim, 0) : ATTEND(0, head_dim, 0);
#undef ATTEND
        }
        scratch_give(SCRATCH_ATTENTION);
    }
    return status;
}

int paged_attention(const void *q, int64_t q_stride, int io_bf16, float scale, const void *k_cache,
                    const void *v_cache, int is_bf16, const int64_t *block_tables, int64_t max_blocks,
                    const int64_t *token_seq, const int64_t *token_pos, void *out, int64_t num_tokens, int num_heads,
                    int num_kv_heads, int head_dim, int block_size, int num_threads) {
    return paged_attention_window(q, q_stride, io_bf16, scale, k_cache, v_cache, is_bf16, block_tables, max_blocks,
                                  token_seq, token_pos, out, num_tokens, num_heads, num_kv_heads, head_dim,
                                  block_size, 0, NULL, num_threads);
}
