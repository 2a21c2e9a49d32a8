/* Row-wise kernels for the CPU with the PyTorch references' numerics (kernels/norm.py,
 * rotary.py, activation.py, cache.py): every row is computed on its own, in one fixed order,
 * so its bits do not depend on the batch. For bf16 tensors every intermediate that the
 * reference rounds to bf16 is rounded here at the same point (round to nearest even); sums
 * (fixed 16-lane order) and exp (vec.h) may round their fp32 values differently from torch.
 * One call replaces the 4-10 small torch ops of its reference.
 */
/* a * b + c as two roundings, like the references' separate torch ops (no fused multiply-add) */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

/* Threads for a call of num_rows rows of `width` elements: the call's own thread where the rows
 * are too few to share (one row cannot be split; a few thousand elements take less than the
 * fork and join of a parallel region, ~1-3 us, or a whole time slice when another process holds
 * a core). A row's result never depends on the thread that computes it. */
#define PARALLEL_MIN_ELEMENTS 8192
INLINE int share(int64_t num_rows, int64_t width) { return num_rows > 1 && num_rows * width >= PARALLEL_MIN_ELEMENTS; }

/* out = weight * norm(x + residual); new_residual = x + residual (residual may be NULL: then
 * the norm is of x and new_residual is not written). x, out, new_residual: [T, N] with row
 * strides; weight: [N]. Sum of squares: element i in lane i % 16, lanes folded by a fixed tree. */
void rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride, const void *weight,
              void *out, void *new_residual, int64_t num_rows, int64_t n, float eps, int is_bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (share(num_rows, n))
    for (int64_t t = 0; t < num_rows; t++) {
        const void *source = residual != NULL ? new_residual : x;
        const int64_t source_row = residual != NULL ? t * n : t * x_stride;
        vf squares = {0};
        for (int64_t i = 0; i < n; i += LANES) {
            vf v = row_load(x, is_bf16, t * x_stride + i, n - i);
            if (residual != NULL) {
                v = round16(v + row_load(residual, is_bf16, t * residual_stride + i, n - i), is_bf16);
                row_store(new_residual, is_bf16, t * n + i, n - i, v);
            }
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(fold(squares) / (float)n + eps);
        for (int64_t i = 0; i < n; i += LANES) {
            const vf normed = round16(row_load(source, is_bf16, source_row + i, n - i) * inv, is_bf16);
            row_store(out, is_bf16, t * n + i, n - i, row_load(weight, is_bf16, i, n - i) * normed);
        }
    }
}

/* Rotate one head into out: out_i = x_i cos_i + rot(x)_i sin_i, rot(x) = [-x2, x1], each product
 * rounded to the tensors' dtype before the sum, as the reference's separate ops do. */
static inline void rotate_head(const void *x, int64_t x_offset, void *out, int64_t out_offset, const void *cache,
                               int cache_is_bf16, int64_t row, int half, int is_bf16) {
    for (int j = 0; j < half; j += LANES) { /* a last chunk under 16 lanes is padded, as in the row kernels */
        const int left = half - j;
        const vf c = round16(row_load(cache, cache_is_bf16, row + j, left), is_bf16);
        const vf s = round16(row_load(cache, cache_is_bf16, row + half + j, left), is_bf16);
        const vf x1 = row_load(x, is_bf16, x_offset + j, left), x2 = row_load(x, is_bf16, x_offset + half + j, left);
        row_store(out, is_bf16, out_offset + j, left, round16(x1 * c, is_bf16) + round16(-x2 * s, is_bf16));
        row_store(out, is_bf16, out_offset + half + j, left, round16(x2 * c, is_bf16) + round16(x1 * s, is_bf16));
    }
}

/* q [T, H, D] and k [T, KVH, D] (row strides q_stride, k_stride; heads contiguous) ->
 * q_out [T, H, D], k_out [T, KVH, D]; cache [max_positions, D] (cos | sin), fp32 or bf16. */
void apply_rotary(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const int64_t *positions,
                  const void *cache, int cache_is_bf16, void *q_out, void *k_out, int64_t num_tokens, int num_heads,
                  int num_kv_heads, int head_dim, int is_bf16, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (share(num_tokens, (int64_t)(num_heads + num_kv_heads) * head_dim))
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t row = positions[t] * head_dim;
        for (int h = 0; h < num_heads; h++)
            rotate_head(q, t * q_stride + h * head_dim, q_out, (t * num_heads + h) * head_dim, cache, cache_is_bf16,
                        row, half, is_bf16);
        for (int h = 0; h < num_kv_heads; h++)
            rotate_head(k, t * k_stride + h * head_dim, k_out, (t * num_kv_heads + h) * head_dim, cache,
                        cache_is_bf16, row, half, is_bf16);
    }
}

/* x [T, 2I] (row stride x_stride) -> out [T, I] = silu(x[:, :I]) * x[:, I:], silu(g) = g / (1 + exp(-g)) */
void silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t num_rows, int64_t inter, int is_bf16,
                  int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (share(num_rows, 2 * inter))
    for (int64_t t = 0; t < num_rows; t++)
        for (int64_t i = 0; i < inter; i += LANES) {
            const vf gate = row_load(x, is_bf16, t * x_stride + i, inter - i);
            const vf up = row_load(x, is_bf16, t * x_stride + inter + i, inter - i);
            const vf silu = round16(gate / (1.0f + exp16(-gate)), is_bf16);
            row_store(out, is_bf16, t * inter + i, inter - i, silu * up);
        }
}

/* k, v [T, KVH, D] (row strides) -> the cache rows named by slot_mapping (negative: skip);
 * caches [num_slots, KVH, D], same dtype as k and v. */
void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
              const int64_t *slot_mapping, int64_t num_tokens, int64_t row_elems, int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy((char *)k_cache + slot * row_elems * elem, (const char *)k + t * k_stride * elem, row_elems * elem);
        memcpy((char *)v_cache + slot * row_elems * elem, (const char *)v + t * v_stride * elem, row_elems * elem);
    }
}

/* The index of the first element of row[0..n) that equals target (NaN target: the first NaN). */
static int64_t first_match(const float *row, int64_t n, float target) {
    const int find_nan = target != target;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 wanted = _mm512_set1_ps(target);
    for (; i + LANES <= n; i += LANES) {
        const __m512 v = _mm512_loadu_ps(row + i);
        const __mmask16 hit =
            find_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, wanted, _CMP_EQ_OQ);
        if (hit)
            return i + __builtin_ctz(hit);
    }
#else
    const vf wanted = (vf){0} + target;
    for (; i + LANES <= n; i += LANES) {
        vf v;
        memcpy(&v, row + i, sizeof v);
        /* target is the row's largest value and the row has no NaN unless target is one:
         * v equals it where it is not below it (0.0 and -0.0 tie, as in torch) */
        const vi hit = find_nan ? is_nan16(v) : ~greater16(wanted, v);
        uint64_t words[LANES / 2], any = 0;
        memcpy(words, &hit, sizeof words);
        for (int w = 0; w < LANES / 2; w++)
            any |= words[w];
        if (any)
            for (int lane = 0; lane < LANES; lane++)
                if (hit[lane])
                    return i + lane;
    }
#endif
    for (; i < n; i++)
        if (find_nan ? row[i] != row[i] : row[i] == target)
            return i;
    return 0; /* not reached: target is an element of the row */
}

/* out[t] = the index of the largest element of row t of x [T, n] (fp32, row stride x_stride, n >= 1),
 * as torch.argmax gives it: the first one on ties, the first NaN if the row has one. Exact, so a
 * row's answer does not depend on the batch; ~20x faster than torch's argmax on 49152-wide rows. */
void argmax_rows(const float *x, int64_t x_stride, int64_t *out, int64_t num_rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (share(num_rows, n))
    for (int64_t t = 0; t < num_rows; t++) {
        const float *row = x + t * x_stride;
        vf best = (vf){0} - INFINITY, v;
        vi nan = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            memcpy(&v, row + i, sizeof v);
            nan |= is_nan16(v);
            best = select16(greater16(v, best), v, best);
        }
        float top = -INFINITY;
        int has_nan = 0;
        for (int lane = 0; lane < LANES; lane++) {
            has_nan |= nan[lane] != 0;
            top = best[lane] > top ? best[lane] : top;
        }
        for (; i < n; i++) {
            has_nan |= row[i] != row[i];
            top = row[i] > top ? row[i] : top;
        }
        out[t] = first_match(row, n, has_nan ? NAN : top);
    }
}
