/* Paged attention for the CPU: one query token and one KV head per work item.
 *
 * Every work item reads its own sequence's keys and values in place, through the block
 * table, and reduces them in one fixed order that depends only on the token's own
 * context length: dot products over head_dim in 16-lane vectors folded by a fixed tree,
 * an exact two-pass softmax in fp32 (max, then exp and a 16-lane sum), and values
 * accumulated key by key. No work item reads another's results and the thread count only
 * decides who runs an item, so a token gets the same bits alone or in any batch, in a
 * prefill chunk or in decode (DESIGN rule 4). GCC vector extensions keep it portable:
 * the compiler maps the 16-lane vectors to AVX-512, AVX2 or SSE.
 *
 * Layouts (all contiguous):
 *   q            [T, H, D] fp32, already multiplied by the softmax scale
 *   k/v cache    [num_blocks, block_size, KVH, D], fp32 or bf16 (is_bf16)
 *   block_tables [S, max_blocks] int64
 *   token_seq    [T] int64, each token's sequence; token_pos [T] int64, its position
 *   out          [T, H, D] fp32
 * Token t attends to keys 0..token_pos[t] of its sequence. H = KVH * group, D % 16 == 0,
 * head_dim <= 16 * MAX_CHUNKS, group <= MAX_GROUP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16
#define MAX_CHUNKS 16 /* head_dim <= 256 */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));

enum { OK = 0, OUT_OF_MEMORY = 1, BAD_SHAPE = 2 };

/* 16 cache elements as fp32: a bf16 value is the top half of its fp32 value */
static inline __attribute__((always_inline)) vf load16(const void *base, int is_bf16, int64_t index) {
    if (is_bf16) {
        vh half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        vu wide = __builtin_convertvector(half, vu) << 16;
        vf value;
        memcpy(&value, &wide, sizeof value);
        return value;
    }
    vf value;
    memcpy(&value, (const float *)base + index, sizeof value);
    return value;
}

static inline __attribute__((always_inline)) float fold(vf v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* Warm the cache with the rows of the next block this head will read. */
static inline __attribute__((always_inline)) void prefetch_block(const void *cache, int is_bf16, int64_t first_row,
                                                                 int block_size, int64_t row_stride, int head_dim) {
    const int64_t elem = is_bf16 ? 2 : 4, row_bytes = head_dim * elem;
    for (int r = 0; r < block_size; r++)
        for (int64_t line = 0; line < row_bytes; line += 64)
            __builtin_prefetch((const char *)cache + (first_row + r * row_stride) * elem + line);
}

static inline __attribute__((always_inline)) void attend(
    const float *q, const void *k_cache, const void *v_cache, const int is_bf16, const int64_t *table,
    int64_t num_keys, float *out, int64_t head_offset, int group, int head_dim, int block_size, int64_t row_stride,
    float *scores) {
    const int chunks = head_dim / LANES;
    const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
    /* scores[g * num_keys + j] = q_g . k_j, block by block */
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t first_row = table[b] * block_size * row_stride + head_offset;
        if (b + 1 < num_blocks)
            prefetch_block(k_cache, is_bf16, table[b + 1] * block_size * row_stride + head_offset, block_size,
                           row_stride, head_dim);
        const int64_t first_key = b * block_size;
        const int64_t keys = num_keys - first_key < block_size ? num_keys - first_key : block_size;
        for (int64_t r = 0; r < keys; r++) {
            const int64_t offset = first_row + r * row_stride;
            for (int g = 0; g < group; g++) {
                vf sum = {0};
                for (int c = 0; c < chunks; c++) {
                    vf qv;
                    memcpy(&qv, q + g * head_dim + c * LANES, sizeof qv);
                    sum += qv * load16(k_cache, is_bf16, offset + c * LANES);
                }
                scores[g * num_keys + first_key + r] = fold(sum);
            }
        }
    }
    /* exact softmax per query head: the max, then exp and a fixed-order sum */
    float denom[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *row = scores + g * num_keys;
        float max = row[0];
        for (int64_t j = 1; j < num_keys; j++) max = row[j] > max ? row[j] : max;
        float lanes[LANES] = {0};
        for (int64_t j = 0; j < num_keys; j++) {
            row[j] = expf(row[j] - max);
            lanes[j % LANES] += row[j];
        }
        vf total;
        memcpy(&total, lanes, sizeof total);
        denom[g] = fold(total);
    }
    /* out_g = (sum_j p_gj v_j) / denom_g, key by key */
    vf acc[MAX_GROUP * MAX_CHUNKS];
    memset(acc, 0, sizeof(vf) * group * chunks);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t first_row = table[b] * block_size * row_stride + head_offset;
        if (b + 1 < num_blocks)
            prefetch_block(v_cache, is_bf16, table[b + 1] * block_size * row_stride + head_offset, block_size,
                           row_stride, head_dim);
        const int64_t first_key = b * block_size;
        const int64_t keys = num_keys - first_key < block_size ? num_keys - first_key : block_size;
        for (int64_t r = 0; r < keys; r++) {
            const int64_t offset = first_row + r * row_stride;
            for (int c = 0; c < chunks; c++) {
                const vf v = load16(v_cache, is_bf16, offset + c * LANES);
                for (int g = 0; g < group; g++) acc[g * chunks + c] += scores[g * num_keys + first_key + r] * v;
            }
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) {
            const vf value = acc[g * chunks + c] / denom[g];
            memcpy(out + g * head_dim + c * LANES, &value, sizeof value);
        }
}

int paged_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                    const int64_t *block_tables, int64_t max_blocks, const int64_t *token_seq,
                    const int64_t *token_pos, float *out, int64_t num_tokens, int num_heads, int num_kv_heads,
                    int head_dim, int block_size, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % LANES != 0 || head_dim / LANES > MAX_CHUNKS || group > MAX_GROUP || group * num_kv_heads != num_heads) return BAD_SHAPE;
    const int64_t num_items = num_tokens * num_kv_heads, row_stride = (int64_t)num_kv_heads * head_dim;
    int status = OK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t t = item / num_kv_heads, kv_head = item % num_kv_heads, num_keys = token_pos[t] + 1;
        float *scores = malloc(sizeof(float) * (size_t)(group * num_keys));
        if (scores == NULL) {
            status = OUT_OF_MEMORY;
            continue;
        }
        const int64_t q_offset = (t * num_heads + kv_head * group) * head_dim;
        const int64_t *table = block_tables + token_seq[t] * max_blocks;
        if (is_bf16)
            attend(q + q_offset, k_cache, v_cache, 1, table, num_keys, out + q_offset, kv_head * head_dim, group,
                   head_dim, block_size, row_stride, scores);
        else
            attend(q + q_offset, k_cache, v_cache, 0, table, num_keys, out + q_offset, kv_head * head_dim, group,
                   head_dim, block_size, row_stride, scores);
        free(scores);
    }
    return status;
}
