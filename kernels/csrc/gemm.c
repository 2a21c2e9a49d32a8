/* Linear layers for the CPU: out = x W^T (+ bias), on a weight packed once (kernels/linear.py).
 *
 * Batch-invariant by construction: output element (m, n) is one chain of fused multiply-adds
 * over k = 0, 1, ..., K-1 in one vector lane, started from 0 and rounded once at the end.
 * Which tile, row slot, lane or thread computes it, and how many rows share the call, never
 * changes that chain, so a row's bits do not depend on the batch or the thread count.
 *
 * One source, one build per tier (kernels/cpu_kernels.py), the code path chosen by the
 * compiler's target macros:
 *   AVX-512 (__AVX512F__)        fp32: 16-lane FMA tiles of 8 rows x 48 features (tile_f32).
 *     with AVX-512 BF16          bf16: dot products of bf16 pairs into fp32 (tile_bf16): the
 *                                chain takes k in pairs, as the instruction does.
 *     without it                 bf16: the widening tiles below, at 16 lanes.
 *   AVX2 + FMA (x86-64-v3)       the widening tiles at 8 lanes.
 *   anything else (generic)      the widening tiles at 4 lanes in GCC vector extensions
 *                                (vec.h's fma4: NEON's fused multiply-add on aarch64, libm's
 *                                correctly rounded fmaf on a baseline x86-64).
 * The widening tiles read bf16 weights and inputs as bf16 and widen them to fp32 in registers
 * (a bf16 value is the top half of its fp32 value), so bf16 halves the bytes a decode step
 * reads on every CPU; the chain is then the fp32 chain over the widened values, k by k.
 * Every fp32 chain is the same fused chain k by k on every tier, so fp32 GEMM gives the same bits on
 * all of them, and bf16 too except on AVX-512 BF16 (k in pairs), which differs from the others.
 *
 * It streams the weight once per call at small M (decode), where a library's GEMM falls back
 * to kernels with other bits or reads the weight at a third of the memory bandwidth, and it
 * keeps a panel of the weight in L2 across the rows at large M (prefill, big batches), while
 * the tiles prefetch the next panel (Warm) so that streaming overlaps computing.
 *
 * K groups (row_parallel.c): linear_groups_into runs G weights of [N, kg] packed one after the
 * other on G column groups of x in one pass: each output element's chain is restarted at every
 * group boundary, and the group's fp32 result is folded into a running fp32 total in the order
 * 0..G-1 (total = p0, then total + p1, ...), rounded once. That is, bit for bit, G separate calls
 * into fp32 partials and their fold (fold_partials), without the partials' memory or G passes.
 *
 * Packed layout, PANEL = 48 output features per panel (the last one padded with zeros), the
 * same in every tier:
 *   fp32: [panels][K][48]                element (p, k, j) = W[48 p + j][k]
 *   bf16: [panels][ceil(K / 2)][48][2]   element (p, i, j, h) = W[48 p + j][2 i + h] (0 past K)
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "kernels.h"
#include "vec.h"

#define PANEL 48    /* output features per panel: 3 vectors of 16 */
#define ROW_BLOCK 96 /* rows per pass over the panels: the panel stays in L2 across its tiles */
#define WARM_ROWS 16 /* rows from which the tiles warm the next panel (see Warm); below, memory-bound anyway */

/* The tier's vectors for the widening tiles: WL fp32 lanes, FMA(a, b, c) = a * b + c lane by
 * lane, fused (vec.h's fma of that width); ROWS rows of x per tile, each tile ROW_VECTORS vectors wide (a single row: ONE_VECTORS,
 * so the decode path reads each k row of the panel whole). Accumulators + weights + 1 broadcast
 * + the bf16 mask fit the register file: AVX-512 8x3 + 3 + 1 + 1 of 32, AVX2 6x2 + 2 + 1 of 16
 * for fp32 and 4x2 + 2 + 1 + 1 for bf16 (BF16_ROWS; at 4x3 or 6x2 GCC spilled accumulators to
 * the stack, which halved bf16's speed), NEON 4x6 + 6 + 1 + 1 of 32. */
#if defined(__AVX512F__)
#define WL 16
#define ROWS 8
#define ROW_VECTORS 3
#define ONE_VECTORS 3
#define FMA fma16
#define SPLAT(s) ((wv)_mm512_set1_ps(s))
#elif defined(__AVX2__) && defined(__FMA__)
#define WL 8
#define ROWS 6
#define BF16_ROWS 4
#define ROW_VECTORS 2
#define ONE_VECTORS 6
#define FMA fma8
#define SPLAT(s) ((wv)_mm256_set1_ps(s))
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define WL 4
#define ROWS 4
#define ROW_VECTORS 6
#define ONE_VECTORS 12
#define FMA fma4
#define SPLAT(s) ((wv)vdupq_n_f32(s))
#else
#define WL 4
#define ROWS 4
#define ROW_VECTORS 3
#define ONE_VECTORS 3
#define FMA fma4 /* libm's fmaf per lane (vec.h): the FMA tiers' bits */
#define SPLAT(s) ((wv){(s), (s), (s), (s)})
#endif
#define MAX_VECTORS (ONE_VECTORS > ROW_VECTORS ? ONE_VECTORS : ROW_VECTORS)
#ifndef BF16_ROWS
#define BF16_ROWS ROWS /* rows per widening bf16 tile: fewer where widening needs the registers */
#endif

#if defined(__AVX512F__)
#define HAVE_AVX512_F32 1
#else
#define HAVE_AVX512_F32 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#else
#define HAVE_AVX512_BF16 0
#endif

/* every tier has the kernel for both dtypes (kept for the caller's check: 0 would send it to F.linear) */
int gemm_supported(int is_bf16) {
    (void)is_bf16;
    return 1;
}

/* the code path this build took, for the tests and the benchmarks' reports */
const char *kernel_tier(void) {
#if HAVE_AVX512_BF16
    return "avx512+bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return "generic-neon";
#else
    return "generic";
#endif
}

/* Where a pass over a panel warms L2 with a share of the next panel: `count` cache lines from
 * `lines`, `per_group` of them at the first k step of each group of WARM_GROUP steps (lines NULL:
 * none). At M > ROWS the tiles of a panel are compute-bound on data already in L2; without this
 * the next panel would only start coming from memory at its first tile, and streaming and
 * computing would take turns instead of overlapping. Every pass over the panel (each tile, and
 * each slice of a widening tile) takes an equal share, so the prefetches are spread over the
 * whole panel's time rather than bunched into the first slices; and once per group, not per
 * step, because the bookkeeping cost a third of the instructions of AVX2's 6 x 2 tile. */
typedef struct {
    const char *lines;
    int64_t count, per_group;
} Warm;

#define WARM_GROUP 8

/* The K groups a tile runs one after the other (linear_groups_into): `count` weights of k_len columns
 * each, the next one `stride` bytes after the last; x's columns follow on. One group: plain linear. */
typedef struct {
    int64_t count, stride;
} Groups;

/* share `part` of `parts` of the `count` lines from `lines`, warmed over `steps` k steps */
static inline Warm warm_share(const char *lines, int64_t count, int64_t part, int64_t parts, int64_t steps) {
    const int64_t share = (count + parts - 1) / parts, groups = (steps + WARM_GROUP - 1) / WARM_GROUP;
    const int64_t first = share * part < count ? share * part : count;
    const int64_t mine = (first + share < count ? first + share : count) - first;
    const Warm warm = {lines != NULL && mine > 0 ? lines + 64 * first : NULL, mine, (mine + groups - 1) / groups};
    return warm;
}

/* a tile's k steps: k, or pairs of k in bf16 (each step reads PANEL 4-byte words of the panel) */
static inline int64_t k_steps(int64_t k, int is_bf16) {
    return is_bf16 ? (k + 1) / 2 : k;
}

INLINE void warm_step(const Warm *warm, int64_t step) {
    if (warm->lines == NULL || step % WARM_GROUP != 0)
        return;
    const int64_t line = step / WARM_GROUP * warm->per_group, end = line + warm->per_group;
    for (int64_t l = line; l < end && l < warm->count; l++)
        __builtin_prefetch(warm->lines + 64 * l, 0, 2); /* prefetcht1 on x86 */
}

#if HAVE_AVX512_F32
/* rows x PANEL accumulators to out (+ bias), rounded to out's dtype; columns past n are not stored */
INLINE void store_tile(const int rows, __m512 acc[ROWS][3], const void *bias, void *out, int64_t ldo, int64_t n0,
                       int64_t n, int is_bf16) {
    for (int j = 0; j < 3; j++) {
        const int64_t col = n0 + 16 * j, left = n - col;
        if (left <= 0)
            break;
        vf b = {0};
        if (bias != NULL)
            b = left >= LANES ? load16(bias, is_bf16, col) : load16_partial(bias, is_bf16, col, (int)left);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            vf v;
            memcpy(&v, &acc[r][j], sizeof v);
            if (bias != NULL)
                v += b;
            if (left >= LANES)
                store16(out, is_bf16, r * ldo + col, v);
            else
                store16_partial(out, is_bf16, r * ldo + col, (int)left, v);
        }
    }
}

INLINE void tile_f32(const int rows, const float *x, int64_t ldx, const float *panel, const Warm *warm,
                     int64_t k_len, const Groups *groups, const void *bias, void *out, int64_t ldo, int64_t n0,
                     int64_t n) {
    __m512 acc[ROWS][3], total[ROWS][3];
    for (int64_t g = 0; g < groups->count; g++) {
        const float *wg = (const float *)((const char *)panel + g * groups->stride), *xg = x + g * k_len;
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
        for (int64_t k = 0; k < k_len; k++) {
            const float *w = wg + k * PANEL;
            warm_step(warm, g * k_len + k);
            const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const __m512 a = _mm512_set1_ps(xg[r * ldx + k]);
                acc[r][0] = (__m512)fma16((vf)a, (vf)w0, (vf)acc[r][0]);
                acc[r][1] = (__m512)fma16((vf)a, (vf)w1, (vf)acc[r][1]);
                acc[r][2] = (__m512)fma16((vf)a, (vf)w2, (vf)acc[r][2]);
            }
        }
        if (groups->count > 1)
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < 3; j++)
                    total[r][j] = g == 0 ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
    }
    store_tile(rows, groups->count > 1 ? total : acc, bias, out, ldo, n0, n, 0);
}
#endif

#if HAVE_AVX512_BF16
/* x[r][2i], x[r][2i+1] as one 32-bit lane (the second 0 past the row's end) */
INLINE __m512bh pair(const uint16_t *row, int64_t i, int64_t k_len) {
    uint32_t bits = row[2 * i];
    if (2 * i + 1 < k_len)
        bits |= (uint32_t)row[2 * i + 1] << 16;
    return (__m512bh)_mm512_set1_epi32((int)bits);
}

INLINE void tile_bf16(const int rows, const uint16_t *x, int64_t ldx, const uint16_t *panel, const Warm *warm,
                      int64_t k_len, const Groups *groups, const void *bias, void *out, int64_t ldo, int64_t n0,
                      int64_t n, int out_bf16) {
    __m512 acc[ROWS][3], total[ROWS][3];
    const int64_t full = k_len / 2, pairs = (k_len + 1) / 2;
    for (int64_t g = 0; g < groups->count; g++) {
        const uint16_t *wg = (const uint16_t *)((const char *)panel + g * groups->stride), *xg = x + g * k_len;
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++)
            acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
        for (int64_t i = 0; i < pairs; i++) {
            const uint16_t *w = wg + i * PANEL * 2;
            warm_step(warm, g * pairs + i);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                           w2 = (__m512bh)_mm512_loadu_si512(w + 64);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                __m512bh a;
                if (i < full) {
                    uint32_t bits;
                    memcpy(&bits, xg + r * ldx + 2 * i, sizeof bits);
                    a = (__m512bh)_mm512_set1_epi32((int)bits);
                } else {
                    a = pair(xg + r * ldx, i, k_len);
                }
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
            }
        }
        if (groups->count > 1)
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < 3; j++)
                    total[r][j] = g == 0 ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
    }
    store_tile(rows, groups->count > 1 ? total : acc, bias, out, ldo, n0, n, out_bf16);
}
#endif

/* ---- the widening tiles (every tier; AVX-512 only for bf16 without AVX-512 BF16) ---- */
typedef float wv __attribute__((vector_size(WL * sizeof(float))));
typedef uint32_t wu __attribute__((vector_size(WL * sizeof(uint32_t))));

typedef int32_t wi __attribute__((vector_size(WL * sizeof(int32_t))));
typedef uint16_t wh __attribute__((vector_size(WL * sizeof(uint16_t))));

/* vec.h's bf16 rounding at the tiles' width: the same formula, so the same bits. A WL-lane vector
 * is one register, so its NaN test compiles to one comparison. */
INLINE wi wide_is_nan(wv value) { return value != value; }
DEFINE_BF16_BITS(wide_bf16_bits, wv, wu, wide_is_nan)

/* rows x (vectors * WL) accumulators to out (+ bias), rounded to out's dtype; columns past n are
 * not stored. A vector at a time where all its columns are stored (one element at a time in
 * the last, partial one: 49152 scalar roundings were 7% of a batch-1 lm_head): acc + bias is
 * the same fp32 add either way, and the rounding the same formula. */
INLINE void wide_store(const int rows, const int vectors, wv acc[ROWS][MAX_VECTORS], const void *bias, void *out,
                       int64_t ldo, int64_t col0, int64_t n, int is_bf16, int out_bf16) {
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors && col0 + v * WL < n; v++) {
            const int64_t first = col0 + v * WL;
            if (first + WL <= n) {
                wv value = acc[r][v];
                if (bias != NULL) {
                    wv b;
                    if (is_bf16) {
                        wh half;
                        memcpy(&half, (const uint16_t *)bias + first, sizeof half);
                        const wu wide = __builtin_convertvector(half, wu) << 16;
                        memcpy(&b, &wide, sizeof b);
                    } else {
                        memcpy(&b, (const float *)bias + first, sizeof b);
                    }
                    value += b;
                }
                if (out_bf16) {
                    const wh half = __builtin_convertvector(wide_bf16_bits(value), wh);
                    memcpy((uint16_t *)out + r * ldo + first, &half, sizeof half);
                } else {
                    memcpy((float *)out + r * ldo + first, &value, sizeof value);
                }
                continue;
            }
            for (int c = 0; c < WL && first + c < n; c++) {
                float value = acc[r][v][c];
                const int64_t col = first + c;
                if (bias != NULL)
                    value += is_bf16 ? bf16_to_float(((const uint16_t *)bias)[col]) : ((const float *)bias)[col];
                if (out_bf16)
                    ((uint16_t *)out)[r * ldo + col] = float_to_bf16(value);
                else
                    ((float *)out)[r * ldo + col] = value;
            }
        }
}

/* `rows` rows of x times features [f0, f0 + vectors * WL) of one panel, k by k; bf16 weights are
 * widened in registers: a packed word holds W[j][2i] (low half) and W[j][2i+1] (high half).
 * x is always fp32 here: linear() widens bf16 rows once per call (exactly), not once per panel. */
INLINE void wide_tile(const int rows, const int vectors, const int is_bf16, const void *x, int64_t ldx,
                      const void *panel, int f0, const Warm *warm, int64_t k_len, const Groups *groups,
                      const void *bias, void *out, int64_t ldo, int64_t n0, int64_t n, int out_bf16) {
    wv acc[ROWS][MAX_VECTORS], w[MAX_VECTORS], total[ROWS][MAX_VECTORS];
    const int64_t steps = k_steps(k_len, is_bf16);
    for (int64_t g = 0; g < groups->count; g++) {
        const void *pg = (const char *)panel + g * groups->stride;
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vectors; v++)
                acc[r][v] = (wv){0};
        if (!is_bf16) {
            const float *xs = (const float *)x + g * k_len;
            for (int64_t k = 0; k < k_len; k++) {
                const float *wk = (const float *)pg + k * PANEL + f0;
                warm_step(warm, g * steps + k);
#pragma GCC unroll 12
                for (int v = 0; v < vectors; v++)
                    memcpy(&w[v], wk + v * WL, sizeof w[v]);
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++) {
                    const wv a = SPLAT(xs[r * ldx + k]);
#pragma GCC unroll 12
                    for (int v = 0; v < vectors; v++)
                        acc[r][v] = FMA(a, w[v], acc[r][v]);
                }
            }
        } else {
            const float *xs = (const float *)x + g * k_len;
            const int64_t full = k_len / 2, pairs = (k_len + 1) / 2;
            for (int64_t i = 0; i < pairs; i++) {
                const uint32_t *wi = (const uint32_t *)pg + i * PANEL + f0;
                warm_step(warm, g * steps + i);
                /* k = 2i, then 2i + 1 (past K, the pad's zero weight is skipped): one chain, in order.
                 * Each half is widened straight from memory, so only `vectors` weights are live. */
                const int halves = i < full ? 2 : 1;
#pragma GCC unroll 2
                for (int h = 0; h < halves; h++) {
#pragma GCC unroll 12
                    for (int v = 0; v < vectors; v++) {
                        wu bits;
                        memcpy(&bits, wi + v * WL, sizeof bits);
                        w[v] = (wv)(h == 0 ? bits << 16 : bits & 0xffff0000u);
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < rows; r++) {
                        const wv a = SPLAT(xs[r * ldx + 2 * i + h]);
#pragma GCC unroll 12
                        for (int v = 0; v < vectors; v++)
                            acc[r][v] = FMA(a, w[v], acc[r][v]);
                    }
                }
            }
        }
        if (groups->count > 1)
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < vectors; v++)
                    total[r][v] = g == 0 ? acc[r][v] : total[r][v] + acc[r][v];
    }
    wide_store(rows, vectors, groups->count > 1 ? total : acc, bias, out, ldo, n0 + f0, n, is_bf16, out_bf16);
}

/* A panel's features in slices as wide as the tile, the last ones skipped past n; each slice
 * warms its share of the tile's lines of the next panel. */
INLINE void wide_tiles(const int rows, const int is_bf16, const void *x, int64_t ldx, const void *panel,
                       const Warm *warm, int64_t k_len, const Groups *groups, const void *bias, void *out,
                       int64_t ldo, int64_t n0, int64_t n, int out_bf16) {
    const int width = (rows == 1 ? ONE_VECTORS : ROW_VECTORS) * WL;
    const int64_t slices = ((n - n0 < PANEL ? n - n0 : PANEL) + width - 1) / width;
    const int64_t steps = k_steps(k_len, is_bf16) * groups->count;
    for (int s = 0; s < slices; s++) {
        const Warm part = warm_share(warm->lines, warm->count, s, slices, steps);
        if (rows == 1)
            wide_tile(1, ONE_VECTORS, is_bf16, x, ldx, panel, s * width, &part, k_len, groups, bias, out, ldo, n0,
                      n, out_bf16);
        else
            wide_tile(rows, ROW_VECTORS, is_bf16, x, ldx, panel, s * width, &part, k_len, groups, bias, out, ldo,
                      n0, n, out_bf16);
    }
}

/* One tile: `rows` (1..ROWS) rows of x times one panel. A switch, so that each row count is
 * its own fully unrolled loop with the accumulators in registers. */
static void tile(int rows, const void *x, int64_t ldx, const void *panel, const Warm *warm, int64_t k_len,
                 const Groups *groups, const void *bias, void *out, int64_t ldo, int64_t n0, int64_t n, int is_bf16,
                 int out_bf16) {
#if HAVE_AVX512_BF16
#define TILE_BF16(R) tile_bf16(R, x, ldx, panel, warm, k_len, groups, bias, out, ldo, n0, n, out_bf16)
#else
#define TILE_BF16(R) wide_tiles(R, 1, x, ldx, panel, warm, k_len, groups, bias, out, ldo, n0, n, out_bf16)
#endif
#if HAVE_AVX512_F32
#define TILE_F32(R) tile_f32(R, x, ldx, panel, warm, k_len, groups, bias, out, ldo, n0, n)
#else
#define TILE_F32(R) wide_tiles(R, 0, x, ldx, panel, warm, k_len, groups, bias, out, ldo, n0, n, 0)
#endif
#define TILE_CASE(R)                                                                                          \
    case R:                                                                                                   \
        if (is_bf16)                                                                                          \
            TILE_BF16(R);                                                                                     \
        else                                                                                                  \
            TILE_F32(R);                                                                                      \
        break;
    switch (rows) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
#if ROWS > 4
        TILE_CASE(5)
        TILE_CASE(6)
#endif
#if ROWS > 6
        TILE_CASE(7)
        TILE_CASE(8)
#endif
    }
}

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) W^T + bias[N] (may be NULL), all in one
 * dtype (fp32 or bf16), W packed as above. Threads take whole panels, the same ones for every
 * block of rows, so a panel stays in the L2 of the core that reads it. */
static void linear_rows(const void *x, int64_t ldx, int64_t x_elem, const void *packed, const Groups *groups,
                        const void *bias, void *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int is_bf16,
                        int out_bf16, int num_threads, const NextWeight *next);

static int64_t panel_bytes(int64_t k, int is_bf16) {
    return k_steps(k, is_bf16) * PANEL * 4;
}

/* thread t of `threads` takes panels [first_panel(t), first_panel(t + 1)): the same split in
 * every call, so a caller's next weight is warmed by the thread that will read it */
static int64_t first_panel(int64_t panels, int t, int threads) {
    return panels * t / threads;
}

#if !HAVE_AVX512_BF16
/* rows of bf16 x widened to fp32 (exact) */
static void widen_rows(const uint16_t *x, int64_t ldx, float *wide, int64_t rows, int64_t k) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++)
            wide[r * k + i] = bf16_to_float(x[r * ldx + i]);
}
#endif

void linear(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo, int64_t m,
            int64_t n, int64_t k, int is_bf16, int num_threads) {
    linear_then(x, ldx, packed, bias, out, ldo, m, n, k, is_bf16, num_threads, NULL);
}

void linear_then(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo,
                 int64_t m, int64_t n, int64_t k, int is_bf16, int num_threads, const NextWeight *next) {
    linear_into(x, ldx, packed, bias, out, ldo, m, n, k, is_bf16, is_bf16, num_threads, next);
}

int64_t gemm_packed_bytes(int64_t n, int64_t k, int is_bf16) {
    return (n + PANEL - 1) / PANEL * panel_bytes(k, is_bf16);
}

static void linear_grouped(const void *x, int64_t ldx, const void *packed, const Groups *groups, const void *bias,
                           void *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16,
                           int num_threads, const NextWeight *next);

void linear_into(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo, int64_t m,
                 int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads, const NextWeight *next) {
    const Groups one = {1, 0};
    linear_grouped(x, ldx, packed, &one, bias, out, ldo, m, n, k, is_bf16, out_bf16, num_threads, next);
}

void linear_groups_into(const void *x, int64_t ldx, const void *packed, int64_t groups, void *out, int64_t ldo,
                        int64_t m, int64_t n, int64_t kg, int is_bf16, int out_bf16, int num_threads,
                        const NextWeight *next) {
    const Groups all = {groups, gemm_packed_bytes(n, kg, is_bf16)};
    linear_grouped(x, ldx, packed, &all, NULL, out, ldo, m, n, kg, is_bf16, out_bf16, num_threads, next);
}

/* k: one group's columns (x's row holds groups->count * k) */
static void linear_grouped(const void *x, int64_t ldx, const void *packed, const Groups *groups, const void *bias,
                           void *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16,
                           int num_threads, const NextWeight *next) {
    const int64_t out_elem = out_bf16 ? 2 : 4;
#if !HAVE_AVX512_BF16
    if (is_bf16 && m > 0) { /* the widening tiles take x in fp32: widen it once (exact), WIDE_ROWS rows at a time */
        enum { WIDE_ROWS = 256 };
        const int64_t k1 = k * groups->count > 0 ? k * groups->count : 1;
        float *wide = malloc(sizeof(float) * (size_t)k1 * (size_t)(m < WIDE_ROWS ? m : WIDE_ROWS));
        const int64_t chunk = wide != NULL ? WIDE_ROWS : 1; /* out of memory: a row at a time, on the stack */
        float row[wide != NULL ? 1 : k1];
        float *buffer = wide != NULL ? wide : row;
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t rows = m - m0 < chunk ? m - m0 : chunk;
            widen_rows((const uint16_t *)x + m0 * ldx, ldx, buffer, rows, k1);
            linear_rows(buffer, k1, 4, packed, groups, bias, (char *)out + m0 * ldo * out_elem, ldo, rows, n, k, 1,
                        out_bf16, num_threads, m0 + rows == m ? next : NULL);
        }
        free(wide);
        return;
    }
#endif
    linear_rows(x, ldx, is_bf16 ? 2 : 4, packed, groups, bias, out, ldo, m, n, k, is_bf16, out_bf16, num_threads,
                next);
}

/* linear() on x rows of x_elem bytes (bf16 x arrives widened to fp32 where the tiles want it) */
static void linear_rows(const void *x, int64_t ldx, int64_t x_elem, const void *packed, const Groups *groups,
                        const void *bias, void *out, int64_t ldo, int64_t m, int64_t n, int64_t k, int is_bf16,
                        int out_bf16, int num_threads, const NextWeight *next) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t steps = k_steps(k, is_bf16) * groups->count;
    const int64_t bytes = panel_bytes(k, is_bf16), elem = out_bf16 ? 2 : 4;
    const int tile_rows = is_bf16 && !HAVE_AVX512_BF16 ? BF16_ROWS : ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t p0 = first_panel(panels, thread, threads), p1 = first_panel(panels, thread + 1, threads);
        for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {
            const int64_t m1 = m0 + ROW_BLOCK < m ? m0 + ROW_BLOCK : m;
            const int64_t tiles = (m1 - m0 + tile_rows - 1) / tile_rows;
            /* the rows shared evenly (16 = 6 + 5 + 5, not 6 + 6 + 4: a 4-row tile has too few
             * accumulator chains to cover the FMA latency); a row's chain is the same in any tile */
            const int64_t base = (m1 - m0) / tiles, extra = (m1 - m0) % tiles;
            for (int64_t p = p0; p < p1; p++) {
                const char *panel = (const char *)packed + p * bytes;
                /* what this thread reads next: its next panel; after its last, its first again
                 * (the next block of rows) or its first panel of the caller's next weight */
                const char *ahead = NULL;
                int64_t ahead_bytes = bytes;
                if (m1 - m0 >= WARM_ROWS) {
                    if (p + 1 < p1) {
                        ahead = panel + bytes;
                    } else if (m1 < m) {
                        ahead = (const char *)packed + p0 * bytes;
                    } else if (next != NULL && next->packed != NULL) {
                        const int64_t next_panels = (next->n + PANEL - 1) / PANEL;
                        const int64_t q = first_panel(next_panels, thread, threads);
                        ahead_bytes = panel_bytes(next->k, is_bf16);
                        if (q < first_panel(next_panels, thread + 1, threads))
                            ahead = (const char *)next->packed + q * ahead_bytes;
                    }
                }
                for (int64_t r = m0, t = 0; r < m1; r += base + (t < extra), t++) {
                    const int rows = (int)(base + (t < extra));
                    const Warm warm = warm_share(ahead, ahead_bytes / 64, t, tiles, steps);
                    tile(rows, (const char *)x + r * ldx * x_elem, ldx, panel, &warm, k, groups, bias,
                         (char *)out + r * ldo * elem, ldo, p * PANEL, n, is_bf16, out_bf16);
                }
            }
        }
    }
}
