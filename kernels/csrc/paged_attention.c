/* Paged attention for the CPU: one query token (all its heads) per work item.
 *
 * Every work item reads its own sequence's keys and values in place, through the block
 * table, row after row (a row holds every KV head, so reads are contiguous within a block),
 * and reduces them in one fixed order that depends only on the token's own context length:
 * dot products over head_dim in 16-lane vectors folded by a fixed tree, an exact two-pass
 * softmax in fp32 (max, then a vector exp and a 16-lane sum), and values accumulated key by
 * key. No work item reads another's results and the thread count only
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
 * head_dim <= 16 * MAX_CHUNKS, H <= MAX_HEADS.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_HEADS 256
#define MAX_CHUNKS 16 /* head_dim <= 256 */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
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

/* Warm the cache with the next block: its rows (all KV heads) are one contiguous region. */
static inline __attribute__((always_inline)) void prefetch_block(const void *cache, int is_bf16, int64_t block,
                                                                 int block_size, int64_t row_stride) {
    const int64_t elem = is_bf16 ? 2 : 4, bytes = block_size * row_stride * elem;
    const char *first = (const char *)cache + block * bytes;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(first + line);
}

/* mask ? a : b, lane by lane (C has no vector ?:) */
static inline __attribute__((always_inline)) vf select16(vi mask, vf a, vf b) {
    vi a_bits, b_bits;
    memcpy(&a_bits, &a, sizeof a_bits);
    memcpy(&b_bits, &b, sizeof b_bits);
    const vi bits = (a_bits & mask) | (b_bits & ~mask);
    vf result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

/* exp of 16 lanes, every lane by the same polynomial (Cephes' expf, within 2 ulp), so a value's
 * result does not depend on its lane or its neighbours. Inputs here are <= 0; below -87.3, 0. */
static inline __attribute__((always_inline)) vf exp16(vf x) {
    const vi underflow = x < -87.33654f;
    x = select16(underflow, (vf){0} - 87.33654f, x);
    vf n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + 0.5f, vi), vf);  /* toward 0 */
    n += __builtin_convertvector(n > x * 1.44269504f + 0.5f, vf);  /* -1 where that rounded up: floor */
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &scale, sizeof two_n);
    return select16(underflow, (vf){0}, p * two_n);
}

static inline __attribute__((always_inline)) int64_t keys_in_block(int64_t num_keys, int64_t block, int block_size) {
    const int64_t left = num_keys - block * block_size;
    return left < block_size ? left : block_size;
}

/* One token, all its heads: the keys and values are read row by row, each row (all KV heads)
 * once and in block order. scores holds num_heads x padded_keys floats (num_keys rounded up
 * to LANES); acc holds num_heads x head_dim floats. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *k_cache, const void *v_cache, const int is_bf16, const int64_t *table,
    int64_t num_keys, float *out, int num_kv_heads, int group, int head_dim, int block_size, float *scores,
    vf *acc) {
    const int chunks = head_dim / LANES, num_heads = num_kv_heads * group;
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t num_blocks = (num_keys + block_size - 1) / block_size;
    const int64_t padded_keys = (num_keys + LANES - 1) / LANES * LANES;
    vf kv[MAX_CHUNKS], qv;
    /* scores[head * padded_keys + j] = q_head . k_j */
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + 1 < num_blocks) prefetch_block(k_cache, is_bf16, table[b + 1], block_size, row_stride);
        for (int64_t r = 0, keys = keys_in_block(num_keys, b, block_size); r < keys; r++) {
            const int64_t row = (table[b] * block_size + r) * row_stride, j = b * block_size + r;
            for (int h = 0; h < num_kv_heads; h++) {
                for (int c = 0; c < chunks; c++) kv[c] = load16(k_cache, is_bf16, row + h * head_dim + c * LANES);
                for (int g = 0; g < group; g++) {
                    const float *q_head = q + (int64_t)(h * group + g) * head_dim;
                    memcpy(&qv, q_head, sizeof qv);
                    vf sum = qv * kv[0];
                    for (int c = 1; c < chunks; c++) {
                        memcpy(&qv, q_head + c * LANES, sizeof qv);
                        sum += qv * kv[c];
                    }
                    scores[(h * group + g) * padded_keys + j] = fold(sum);
                }
            }
        }
    }
    /* exact softmax per head: the max, then exp and a 16-lane sum, key j in lane j % 16 */
    float denom[MAX_HEADS];
    for (int head = 0; head < num_heads; head++) {
        float *scores_row = scores + head * padded_keys;
        for (int64_t j = num_keys; j < padded_keys; j++) scores_row[j] = -INFINITY;
        vf max = (vf){0} - INFINITY, sum = {0}, chunk;
        for (int64_t j = 0; j < padded_keys; j += LANES) {
            memcpy(&chunk, scores_row + j, sizeof chunk);
            max = select16(chunk > max, chunk, max);
        }
        float top = max[0];
        for (int l = 1; l < LANES; l++) top = max[l] > top ? max[l] : top;
        for (int64_t j = 0; j < padded_keys; j += LANES) {
            memcpy(&chunk, scores_row + j, sizeof chunk);
            chunk = exp16(chunk - top);
            sum += chunk;
            memcpy(scores_row + j, &chunk, sizeof chunk);
        }
        denom[head] = fold(sum);
    }
    /* out_head = (sum_j p_head,j v_j) / denom_head, key by key */
    memset(acc, 0, sizeof(vf) * num_heads * chunks);
    for (int64_t b = 0; b < num_blocks; b++) {
        if (b + 1 < num_blocks) prefetch_block(v_cache, is_bf16, table[b + 1], block_size, row_stride);
        for (int64_t r = 0, keys = keys_in_block(num_keys, b, block_size); r < keys; r++) {
            const int64_t row = (table[b] * block_size + r) * row_stride, j = b * block_size + r;
            for (int h = 0; h < num_kv_heads; h++) {
                for (int c = 0; c < chunks; c++) kv[c] = load16(v_cache, is_bf16, row + h * head_dim + c * LANES);
                for (int g = 0; g < group; g++) {
                    const float p = scores[(h * group + g) * padded_keys + j];
                    vf *a = acc + (h * group + g) * chunks;
                    for (int c = 0; c < chunks; c++) a[c] += p * kv[c];
                }
            }
        }
    }
    for (int head = 0; head < num_heads; head++)
        for (int c = 0; c < chunks; c++) {
            const vf value = acc[head * chunks + c] / denom[head];
            memcpy(out + head * head_dim + c * LANES, &value, sizeof value);
        }
}

int paged_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                    const int64_t *block_tables, int64_t max_blocks, const int64_t *token_seq,
                    const int64_t *token_pos, float *out, int64_t num_tokens, int num_heads, int num_kv_heads,
                    int head_dim, int block_size, int num_threads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % LANES != 0 || head_dim / LANES > MAX_CHUNKS || num_heads > MAX_HEADS ||
        group * num_kv_heads != num_heads)
        return BAD_SHAPE;
    int64_t max_keys = 0;
    for (int64_t t = 0; t < num_tokens; t++) max_keys = token_pos[t] + 1 > max_keys ? token_pos[t] + 1 : max_keys;
    const size_t score_floats = (size_t)num_heads * (size_t)((max_keys + LANES - 1) / LANES * LANES);
    const size_t acc_vectors = (size_t)num_heads * (size_t)(head_dim / LANES);
    int status = OK;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * score_floats);
        vf *acc = aligned_alloc(sizeof(vf), sizeof(vf) * acc_vectors);
        if (scores == NULL || acc == NULL) status = OUT_OF_MEMORY;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tokens; t++) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t offset = t * num_heads * head_dim;
            const int64_t *table = block_tables + token_seq[t] * max_blocks;
            if (is_bf16)
                attend(q + offset, k_cache, v_cache, 1, table, token_pos[t] + 1, out + offset, num_kv_heads, group,
                       head_dim, block_size, scores, acc);
            else
                attend(q + offset, k_cache, v_cache, 0, table, token_pos[t] + 1, out + offset, num_kv_heads, group,
                       head_dim, block_size, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return status;
}
