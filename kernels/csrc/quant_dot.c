/* Linear layers on quantized weights with 8-bit activations: integer dot products per block of 32,
 * the same bits on every tier (AVX-512 VNNI, AVX2, generic vectors, aarch64 with or without sdot).
 *
 * Activations (quantize_rows; kernels/quant.py's quantize_activations_reference is its mirror,
 * the rounding rule is defined here and there only):
 *   each row is cut into blocks of 32 from its first element (a last partial block is padded
 *   with zeros); per block, amax = max |x_i| (compared as bit patterns, so NaN ranks above inf
 *   and every tier picks the same), then
 *     amax < 2^-120 (zero, tiny):  d = 0, q_i = 0
 *     amax not finite:             d = NaN, q_i = 0 (the outputs that read the block are NaN)
 *     otherwise:                   d = amax / 127, inv = 127 / amax (two fp32 divisions),
 *                                  q_i = round-half-even(x_i * inv) (one fp32 product, rounded once)
 *   |x_i * inv| <= amax * RN(127 / amax) <= 127 (1 + 2^-24)^2 < 127.5, so q_i is in [-127, 127]
 *   without a clamp; 127 / amax cannot overflow above 2^-120. Per block the integer sum of the
 *   q_i (s = sum) and sx = d * (float)s are kept (Q4_1's minimum term).
 *
 * Weights as quant_gemm.c stores them. Per output n, row r and block b the integer dot product
 *   Q8_0, INT8:  isum = sum w_i q_i                    (w_i the stored int8)
 *   Q4_0:        isum = sum (u_i - 8) q_i = sum u_i q_i - 8 s   (u_i the nibble, 0..15)
 *   Q4_1:        isum = sum u_i q_i
 * is exact in int32 (|isum| <= 32 * 128 * 127 < 2^24, so (float)isum is exact too), however a
 * tier computes it. Then one fp32 chain per output, block by block from b = 0:
 *   acc = 0
 *   Q4_0, Q8_0:  acc = fma(dw_b * dx_b, isum, acc)
 *   Q4_1:        acc = fma(dw_b * dx_b, isum, acc); acc = fma(mw_b, sx_b, acc)
 *   INT8:        acc = fma(dx_b, isum, acc)
 *   out = fma(acc, scale, bias)          (scale: INT8's row scale, else 1; bias: 0 without one)
 * then rounded to bf16 (nearest even) for bf16 outputs. Every product is IEEE fp32 (dw_b * dx_b
 * rounded once), every fma fused (the FMA instruction on AVX2/AVX-512/aarch64, libm's correctly
 * rounded fmaf on a baseline x86-64): the same operations on the same values in every tier, so
 * every tier gives the same bits. No expression here multiplies and adds in one statement, so
 * -ffp-contract has nothing to fuse. Each (row, output) is computed on its own data only, so
 * the bits do not depend on the batch, the tile, the thread count or the row's position.
 *
 * The other GGUF formats (the section "K-quants" below; kernels/kquant_int8.py is their reference):
 *   Q5_0, Q5_1, IQ4_NL: blocks of 32, activations as above; w_i the block's signed integer (Q5_0 u - 16,
 *     Q5_1 u, IQ4_NL the table value), isum = sum w_i q_i (|isum| <= 32 * 127 * 127 < 2^24), and
 *       Q5_0, IQ4_NL:  acc = fma(dw_b * dx_b, isum, acc);   Q5_1: then acc = fma(mw_b, sx_b, acc)
 *   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: super-blocks of 256, and the activations are rounded per
 *     super-block of 256 by the rule above over its 256 elements (one d, q_i in [-127, 127]; a last
 *     partial super-block padded with zeros), keeping the integer sum s_h of each 16 (h = 0..15).
 *     w_i the element's signed integer (Q4_K, Q5_K, Q2_K: u; Q6_K: u - 32; Q3_K: u - 4 where its high
 *     bit is clear; IQ4_XS: the table value), sc_h, mn_h the integer scale and min of sub-block h of 16
 *     (Q4_K, Q5_K, IQ4_XS: the scale (IQ4_XS: ls - 32) of its sub-block of 32, on both halves; Q3_K
 *     scale - 32; Q6_K its int8 scale; Q2_K the nibbles; mins: Q2_K, Q4_K, Q5_K only). Per super-block b
 *       S = sum_h sc_h sum_{i in h} w_i q_i,   M = sum_h mn_h s_h   (int32, exact: |S| < 2^28, |M| < 2^22)
 *       acc = fma(d_b * dx_b, (float)S, acc);   mins: acc = fma(-(dmin_b * dx_b), (float)M, acc)
 *     (float)S rounds to nearest even where |S| > 2^24: the same conversion of the same integer on
 *     every tier. One fp32 step per super-block, not per sub-block: the sub-blocks add in integers.
 *   then out = fma(acc, 1, bias) and bf16 as above. Q2_K .. Q6_K and IQ4_XS rows are interleaved (below); on
 *   x86 their whole groups take the tile of the Q4_0 path, one int32 lane per output (kqi_tile), the rows
 *   past them (Q4_K, Q6_K) vectors per output (kq_chains_x86); the rows past the groups, and every
 *   super-block type on the generic and aarch64 tiers, integer loops per output (kq_chains; interleaved
 *   blocks gathered back to row order). IQ4_NL, Q5_0 and Q5_1 (interleaved as Q4_0, below) take Q4_0's tiles
 *   on every tier, interleaved or not (tile): IQ4_NL its nibbles through the table, then as Q8_0's 8-bit
 *   values; Q5_0, Q5_1 their nibbles with the fifth bit from qh, u = 0..31, then as Q4_0 / Q4_1 (Q5_0:
 *   isum = sum u q - 16 s, as Q4_0's - 8 s; Q5_1: sum u q, then Q4_1's m step).
 *
 * How the tiers get isum, for a tile of 16 outputs (AVX-512) or 8 (below) at a time:
 *   x86 (AVX-512, AVX2)  the block's weights are transposed in registers so that one int32 lane per
 *                      output holds 4 of its bytes, and a u8 x s8 dot product against the row's 4
 *                      activations broadcast adds them in that lane (the comment at transpose_load):
 *                      avx512 with VNNI vpdpbusd; avx2 / avx512 without VNNI vpmaddubsw then vpmaddwd
 *                      by ones. vpmaddubsw adds two u8 x s8 products into a saturating int16: the u8
 *                      side is a nibble (<= 15) or |w| <= 128 (the sign trick: |w| x (q with w's sign),
 *                      w q exactly, w = -128 included), and |q| <= 127 (activations are never -128), so
 *                      a pair is at most 32512 <= 32767: it never saturates, and the sums are exact
 *                      (Q5_0 / Q5_1's u <= 31: a pair <= 7874, so 4 k-groups' pairs add in int16).
 *                      avx512 with VNNI, 4+ rows by two whole interleaved groups (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
 *                      Q6_K): the wide tiles (tile_wide, kqi_wide), 4 rows by 32 outputs, each row's broadcast serving
 *                      both groups' vpdpbusd; the same integers and fold, only the tile differs.
 *   aarch64 with dotprod   sdot; without it, and the generic tier: integer loops per output.
 *   AMX (the avx512 tier where the CPU has AMX-INT8 and Linux grants the tile data; interleaved groups,
 *   10+ rows, Q4_1 13+): one tile product per block gives 16 rows x 16 outputs (quant_amx.c, its own
 *   file; quant_dot.h has what the two share); quant_linear_int8_groups (o_proj, down_proj) too, each K
 *   group's partial folded in order. The worker's amx setting (quant_dot_set_amx, at load) turns it off.
 * The tile, the lanes and the instructions differ; the integers and the fold on them do not.
 *
 * Interleaved rows (QUANT_INTERLEAVED; kernels/quant.py `interleave` makes them at load, and reads
 * them back for the embedding lookup): the bytes of each group of 16 outputs (rows 16 t .. 16 t + 15,
 * 16 row_bytes bytes, where the group's rows were) in the order the x86 tile loads them, so a tile
 * reads one stream of whole vectors (no transposes, no scattered scale loads). Per block b, in
 * block order:
 *   Q4_0, Q4_1, Q8_0:  the 16 outputs' fp16 d (32 bytes), Q4_1 then their 16 m (32 bytes), then the
 *                      values as k-groups: 64 bytes per group g, output c's 4 bytes of group g at
 *                      4 c (4-bit: the 16 nibble bytes of a block are groups 0-3; 8-bit: 32 bytes,
 *                      groups 0-7)
 *   INT8 (K a multiple of 32):  the 16 row scales (fp32, 64 bytes) once, before block 0; then per
 *                      block the 8 k-groups as above
 *   Q4_K, Q5_K (per super-block):  the 16 d (32 bytes), the 16 dmin (32 bytes), then the block's bytes
 *                      from byte 4 (scales; Q5_K qh; qs) as k-groups of 64 bytes, output c's 4 at 4 c
 *   Q6_K (per super-block):  the 16 d, the 16 scales as 4 k-groups, then per 128 elements n and
 *                      l = 0, 4, .. 28 the k-groups of ql[64 n + l], ql[64 n + 32 + l] and qh[32 n + l]:
 *                      4 vectors of unpacked values, each one run of 4 elements of a sub-block of 16
 *   Q2_K:              the 16 d, the 16 dmin, then scales[16] and qs[64] as k-groups
 *   Q3_K:              the 16 d, scales[12] as 3 k-groups, then hmask[32] and qs[64] as k-groups
 *   IQ4_XS:            as Q4_K (its scales_h where Q4_K's dmin is); IQ4_NL: as Q4_0
 *   Q5_0, Q5_1:        as Q4_0, Q4_1 (the 16 d, Q5_1 then the 16 m), then qh as one k-group (output c's
 *                      4 qh bytes at 4 c), then the 4 k-groups of nibbles
 * The same bytes, moved: every tier reads them (the generic and aarch64 tiers put a block's bytes
 * back in row order), and the integers and the fold are those of the row layout. Rows past the
 * last whole group of 16 stay in row order.
 */
#include <math.h>
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
#include "quant_blocks.h"
#include "vec.h"
#include "quant_dot.h" /* what quant_amx.c shares: COLS, ROWS, the vectors, ActQ */

/* out[at] = value, rounded to out's dtype (bf16 or fp32): every tile's store */
INLINE void store_out(void *out, int64_t at, float value, int out_bf16) {
    if (out_bf16)
        ((uint16_t *)out)[at] = float_to_bf16(value);
    else
        ((float *)out)[at] = value;
}

#define OUT_CHUNK 32 /* outputs a thread takes at a time */
#define MAX_FOLD_GROUPS 64 /* quant_linear_int8_groups' most K groups */
#define SCALE_BLOCKS 64 /* blocks whose d, m a tile copies out at a time */

/* ---- activations ----------------------------------------------------------------------- */
/* One block of 32 fp32 values (zero-padded) -> q, d, sum, sx: the rule in the header. */
INLINE void quantize_block(const float *v, int8_t *q, float *d, int32_t *sum, float *sx) {
    uint32_t amax_bits = 0;
    for (int i = 0; i < QBLOCK; i++) {
        uint32_t bits;
        memcpy(&bits, &v[i], 4);
        bits &= 0x7fffffffu;
        amax_bits = bits > amax_bits ? bits : amax_bits;
    }
    const float amax = block_amax(amax_bits, q, d, sum, sx);
    if (amax == 0.0f)
        return;
    const float inv = 127.0f / amax;
    int32_t total = 0;
#if defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv);
    int32_t lanes[QBLOCK];
    for (int i = 0; i < QBLOCK; i += 8) /* cvtps2dq rounds half to even (the default MXCSR) */
        _mm256_storeu_si256((__m256i *)(lanes + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), vinv)));
    for (int i = 0; i < QBLOCK; i++) {
        q[i] = (int8_t)lanes[i];
        total += lanes[i];
    }
#else
    for (int i = 0; i < QBLOCK; i++) {
        const float scaled = v[i] * inv;
        const int32_t value = (int32_t)lrintf(scaled); /* half to even in the default rounding mode */
        q[i] = (int8_t)value;
        total += value;
    }
#endif
    block_sums(amax, total, d, sum, sx);
}

#if COLS != 16
/* One super-block of 256 fp32 values (zero-padded) -> q, d, the 16 sums of each 16, sx: the rule in the
 * header over 256 elements (one product and one rounding per element, as above; AVX-512: quant_dot.h's
 * quantize_super16) */
static void quantize_super(const float *v, int8_t *q, float *d, int32_t *sum16, float *sx) {
    uint32_t amax_bits = 0;
    for (int i = 0; i < QK_K; i++) {
        uint32_t bits;
        memcpy(&bits, &v[i], 4);
        bits &= 0x7fffffffu;
        amax_bits = bits > amax_bits ? bits : amax_bits;
    }
    int32_t total;
    const float amax = block_amax(amax_bits, q, d, &total, sx);
    if (amax == 0.0f) {
        memset(q, 0, QK_K);
        memset(sum16, 0, 16 * sizeof(int32_t));
        return;
    }
    const float inv = 127.0f / amax;
    total = 0;
    for (int h = 0; h < 16; h++) {
        int32_t part = 0;
#if defined(__AVX2__) /* cvtps2dq rounds half to even (the default MXCSR), as lrintf: 8 lanes at a time */
        const __m256 vinv = _mm256_set1_ps(inv);
        int32_t lanes[16];
        for (int i = 0; i < 16; i += 8)
            _mm256_storeu_si256((__m256i *)(lanes + i),
                                _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * h + i), vinv)));
        for (int i = 0; i < 16; i++) {
            q[16 * h + i] = (int8_t)lanes[i];
            part += lanes[i];
        }
#else
        for (int i = 16 * h; i < 16 * h + 16; i++) {
            const float scaled = v[i] * inv;
            const int32_t value = (int32_t)lrintf(scaled); /* half to even in the default rounding mode */
            q[i] = (int8_t)value;
            part += value;
        }
#endif
        sum16[h] = part;
        total += part;
    }
    block_sums(amax, total, d, &total, sx);
}
#endif

/* elements [start, start + span) of x's row r widened to fp32 (exactly) into v, zeros past column k: what
 * quantize_block and quantize_super round */
INLINE void widen_run(const void *x, int64_t ldx, int64_t r, int64_t start, int64_t k, int span, int is_bf16,
                      float *v) {
    const int64_t count = k - start < span ? k - start : span;
    for (int64_t i = 0; i < count; i++)
        v[i] = is_bf16 ? bf16_to_float(((const uint16_t *)x)[r * ldx + start + i]) : ((const float *)x)[r * ldx + start + i];
    for (int64_t i = count; i < span; i++)
        v[i] = 0.0f;
}

/* x's rows as super-blocks of 256 (a's span 256) */
static void quantize_rows_super(const void *x, int64_t ldx, int64_t m, int64_t k, int is_bf16, ActQ *a,
                                int num_threads) {
    const int64_t blocks = a->blocks;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = r * blocks + b;
#if COLS == 16
            quantize_super16(x, r * ldx + b * QK_K, k - b * QK_K, is_bf16, a->q + at * QK_K, a->d + at, a->sum + at * 16,
                             a->sx + at);
#else
            float v[QK_K];
            widen_run(x, ldx, r, b * QK_K, k, QK_K, is_bf16, v);
            quantize_super(v, a->q + at * QK_K, a->d + at, a->sum + at * 16, a->sx + at);
#endif
        }
}

static void quantize_rows(const void *x, int64_t ldx, int64_t m, int64_t k, int is_bf16, ActQ *a, int num_threads) {
    const int64_t blocks = a->blocks;
    if (a->span == QK_K) {
        quantize_rows_super(x, ldx, m, k, is_bf16, a, num_threads);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++) {
#if COLS == 16
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = r * blocks + b;
            quantize_block16(x, r * ldx + b * QBLOCK, k - b * QBLOCK, is_bf16, a->q + at * QBLOCK, a->d + at,
                             a->sum + at, a->sx + at);
        }
#else
        for (int64_t b = 0; b < blocks; b++) {
            float v[QBLOCK];
            widen_run(x, ldx, r, b * QBLOCK, k, QBLOCK, is_bf16, v);
            const int64_t at = r * blocks + b;
            quantize_block(v, a->q + at * QBLOCK, a->d + at, a->sum + at, a->sx + at);
        }
#endif
    }
}

/* the bytes of `count` ActQ of m rows by k in blocks of `span`, carved from one buffer (act_carve) */
static size_t act_bytes(int64_t count, int64_t m, int64_t k, int span) {
    const size_t blocks = (size_t)((k + span - 1) / span), cells = (size_t)m * blocks;
    const size_t sums = span == QK_K ? 16 : 1;
    return (size_t)count * (align64(cells * (size_t)span) + 2 * align64(sizeof(float) * cells) +
                            align64(sizeof(int32_t) * cells * sums));
}

/* a's arrays from *cursor (one ActQ's act_bytes), which moves past them */
static void act_carve(ActQ *a, char **cursor, int64_t m, int64_t k, int span) {
    a->span = span;
    a->blocks = (k + span - 1) / span;
    const size_t cells = (size_t)(m * a->blocks);
    a->q = (int8_t *)*cursor, *cursor += align64(cells * (size_t)span);
    a->d = (float *)*cursor, *cursor += align64(sizeof(float) * cells);
    a->sx = (float *)*cursor, *cursor += align64(sizeof(float) * cells);
    a->sum = (int32_t *)*cursor, *cursor += align64(sizeof(int32_t) * cells * (span == QK_K ? 16 : 1));
}

/* a[0 .. groups): the rows of x's K groups of kg columns (group g from column g kg), quantized in blocks
 * of `span` into the calling thread's SCRATCH_ACT (the caller gives it back); KERNEL_OUT_OF_MEMORY
 * without it */
static int act_quantize(ActQ *a, int64_t groups, const void *x, int64_t ldx, int64_t m, int64_t kg, int is_bf16,
                        int num_threads, int span) {
    char *cursor = scratch_take(SCRATCH_ACT, act_bytes(groups, m, kg, span));
    if (cursor == NULL)
        return KERNEL_OUT_OF_MEMORY;
    for (int64_t g = 0; g < groups; g++) {
        act_carve(&a[g], &cursor, m, kg, span);
        quantize_rows((const char *)x + g * kg * (is_bf16 ? 2 : 4), ldx, m, kg, is_bf16, &a[g], num_threads);
    }
    return KERNEL_OK;
}

/* ---- one block's integer dot products for COLS outputs ------------------------------------ */
/* the formats of 16 bytes of nibbles per block of 32 (byte j: element j low, j + 16 high) */
INLINE int nibble_format(int fmt) { return fmt == FMT_Q4_0 || fmt == FMT_Q4_1 || fmt == FMT_IQ4_NL; }
/* Q5_0, Q5_1: those nibbles and 4 bytes of fifth bits (qh: bit e for element e) */
INLINE int five_bit_format(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q5_1; }
/* the formats with an fp16 m after d (acc = fma(m, sx, acc) after each block's isum step) */
INLINE int min_format(int fmt) { return fmt == FMT_Q4_1 || fmt == FMT_Q5_1; }
/* a Q5_0 / Q5_1 block's qh in row order (its nibbles the 16 bytes after it) */
INLINE const uint8_t *five_bit_qh(int fmt, const uint8_t *row, int64_t b) {
    return block_start(fmt, row, b) + (fmt == FMT_Q5_1 ? 4 : 2);
}

#if defined(__AVX2__)
/* x86: the weights of COLS outputs are transposed in registers, block by block, into k-groups:
 * vector g holds in its int32 lane c the 4 bytes of output c that multiply elements 4g .. 4g + 3
 * of the block. One u8 x s8 dot-product instruction against the row's 4 activations of group g
 * broadcast to every lane then adds each output's 4 products into its own lane, so after the
 * block's 8 groups lane c holds output c's isum: no horizontal reduction at all, and a block's
 * unpacked weights serve every row of the tile.
 *   4-bit: the 16 bytes of a block transposed (a 4 x 4 transpose of int32 per 128-bit lane) give
 *          groups 0-3 in the low nibbles and groups 4-7 in the high ones.
 *   8-bit: the two 16-byte halves transposed give groups 0-3 and 4-7.
 * Per tier the u8 x s8 products:
 *   VNNI (AVX-512): vpdpbusd. Signed weights are made unsigned as w + 128 (w xor 0x80), and
 *          128 sum q (the activation block's integer sum) is taken off again: exact.
 *   vpmaddubsw (AVX2, AVX-512 without VNNI): nibbles (<= 15) times |q| <= 127: a pair is at most
 *          3810, so the 8 groups' pairs add in int16 without overflow (<= 30480) before one
 *          vpmaddwd by ones. Signed weights: |w| times q with w's sign (the sign trick), each
 *          group widened by vpmaddwd at once (a pair can reach 32512). */
#if COLS == 16
typedef __m512i wv;
#define WV_ZERO _mm512_setzero_si512()
#define WV_AND(a, b) _mm512_and_si512(a, b)
#define WV_SRL16(a, n) _mm512_srli_epi16(a, n)
#define WV_SET8(v) _mm512_set1_epi8(v)
#define WV_SET16(v) _mm512_set1_epi16(v)
#define WV_SET32(v) _mm512_set1_epi32(v)
#define WV_XOR(a, b) _mm512_xor_si512(a, b)
#define WV_ABS8(a) _mm512_abs_epi8(a)
#define WV_ADD16(a, b) _mm512_add_epi16(a, b)
#define WV_ADD32(a, b) _mm512_add_epi32(a, b)
#define WV_MADDUBS(u, s) _mm512_maddubs_epi16(u, s)
#define WV_MADD(a, b) _mm512_madd_epi16(a, b)
/* s with the sign of w per byte (w = 0: any, |w| is 0); s is never -128 */
#define WV_SIGN8(s, w) _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s)
#define WV_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define WV_SHUF8(table, idx) _mm512_shuffle_epi8(table, idx)
#define WV_TABLE16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(p)))
/* the 4 bytes at p in every 32-bit lane: a broadcast from memory (the load port), where the same
 * values brought through a general register went through a register-to-vector move each */
#define WV_BCAST4(p) _mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss((const float *)(const void *)(p))))
#if defined(__AVX512VNNI__)
#define VNNI 1
#endif

/* 16 bytes at each of the 16 pointers -> out[g], lane c = bytes 4g .. 4g + 3 at p[c] */
INLINE void transpose_load(const uint8_t *const p[COLS], wv out[4]) {
    wv z[4];
    for (int t = 0; t < 4; t++) { /* 128-bit lane l of z[t]: the bytes at p[4 l + t] */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p[t]));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p[4 + t]), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p[8 + t]), 2);
        z[t] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)p[12 + t]), 3);
    }
    const wv a = _mm512_unpacklo_epi32(z[0], z[1]), b = _mm512_unpackhi_epi32(z[0], z[1]);
    const wv c = _mm512_unpacklo_epi32(z[2], z[3]), d = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(a, c), out[1] = _mm512_unpackhi_epi64(a, c);
    out[2] = _mm512_unpacklo_epi64(b, d), out[3] = _mm512_unpackhi_epi64(b, d);
}

/* block b's d (and m) of the 16 rows as floats (vcvtph2ps: exact, as the scalar conversion), from
 * their first 4 bytes per row: `raw`, copied out by scalar loads for the whole tile ahead of the
 * blocks (a vpgatherdd per block, or the 16 copies just before the vector load, ran 2-8x slower) */
INLINE void block_scales(int fmt, const int32_t raw_bits[COLS], fv *dw, fv *mw) {
    const __m512i raw = _mm512_loadu_si512(raw_bits);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
    memcpy(dw, &d, 64);
    if (min_format(fmt)) {
        const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(raw, 16)));
        memcpy(mw, &m, 64);
    }
}
#else /* AVX2: 8 outputs */
typedef __m256i wv;
#define WV_ZERO _mm256_setzero_si256()
#define WV_AND(a, b) _mm256_and_si256(a, b)
#define WV_SRL16(a, n) _mm256_srli_epi16(a, n)
#define WV_SET8(v) _mm256_set1_epi8(v)
#define WV_SET16(v) _mm256_set1_epi16(v)
#define WV_SET32(v) _mm256_set1_epi32(v)
#define WV_XOR(a, b) _mm256_xor_si256(a, b)
#define WV_ABS8(a) _mm256_abs_epi8(a)
#define WV_ADD16(a, b) _mm256_add_epi16(a, b)
#define WV_ADD32(a, b) _mm256_add_epi32(a, b)
#define WV_MADDUBS(u, s) _mm256_maddubs_epi16(u, s)
#define WV_MADD(a, b) _mm256_madd_epi16(a, b)
#define WV_SIGN8(s, w) _mm256_sign_epi8(s, w)
#define WV_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define WV_SHUF8(table, idx) _mm256_shuffle_epi8(table, idx)
#define WV_TABLE16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define WV_BCAST4(p) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(p)))

INLINE void transpose_load(const uint8_t *const p[COLS], wv out[4]) {
    wv z[4];
    for (int t = 0; t < 4; t++) /* 128-bit lane l of z[t]: the bytes at p[4 l + t] */
        z[t] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p[t])),
                                       _mm_loadu_si128((const __m128i *)p[4 + t]), 1);
    const wv a = _mm256_unpacklo_epi32(z[0], z[1]), b = _mm256_unpackhi_epi32(z[0], z[1]);
    const wv c = _mm256_unpacklo_epi32(z[2], z[3]), d = _mm256_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm256_unpacklo_epi64(a, c), out[1] = _mm256_unpackhi_epi64(a, c);
    out[2] = _mm256_unpacklo_epi64(b, d), out[3] = _mm256_unpackhi_epi64(b, d);
}

INLINE void block_scales(int fmt, const int32_t raw_bits[COLS], fv *dw, fv *mw) {
    for (int c = 0; c < COLS; c++) {
        uint8_t bytes[4];
        memcpy(bytes, &raw_bits[c], 4);
        (*dw)[c] = half_to_float(bytes);
        if (min_format(fmt))
            (*mw)[c] = half_to_float(bytes + 2);
    }
}
#endif

/* block b of the COLS weight rows, unpacked once for every row of the tile */
typedef struct {
    wv w[8];  /* k-group g: 4-bit: nibbles; 8-bit: w + 128 (VNNI) or |w| */
#if !defined(VNNI)
    wv s[8];  /* 8-bit without VNNI: the signed weights, for the sign trick */
#endif
    fv dw, mw;
} Prepared;

#if COLS == 16 /* u, with 0x10 added in the bytes where sel & bits has a bit set (AVX-512BW: a mask) */
#define WV_FIFTH(u, sel, bits) _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(sel, bits), u, _mm512_set1_epi8(0x10))
#else
#define WV_FIFTH(u, sel, bits)                                                                                    \
    _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(sel, bits), bits), _mm256_set1_epi8(0x10)))
#endif
/* Q5_0 / Q5_1's fifth bits: byte 4 j + i of a 128-bit lane (output j's byte i) picks byte FIVE_PICK[h][4 j + i] of
 * it from the qh k-group: h = 0, 1 output j's qh byte h (elements 0-15), h = 2, 3 its byte h (elements 16-31) */
static const uint8_t FIVE_PICK[4][16] = {{0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12},
                                         {1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9, 13, 13, 13, 13},
                                         {2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 14, 14, 14, 14},
                                         {3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15, 15}};

/* a block's k-groups as loaded (4-bit: raw[0..3], Q5_0 / Q5_1 then their qh k-group raw[4], 8-bit: raw[0..7])
 * -> what block_isums multiplies */
INLINE void unpack_groups(int fmt, const wv raw[8], Prepared *out) {
    if (five_bit_format(fmt)) { /* u = nibble | fifth bit << 4: k-group g byte i is element 4 g + i (low nibble,
                                 * qh bit 4 g + i) and 4 g + 16 + i (high, qh bit 4 g + 16 + i) */
        const wv mask = WV_SET8(0x0f);
        for (int g = 0; g < 4; g++) {
            /* bit 4 (g % 2) + i of the picked qh byte, byte i of each lane */
            const wv bits = WV_SET32(g % 2 ? (int)0x80402010u : 0x08040201);
            const wv low = WV_SHUF8(raw[4], WV_TABLE16(FIVE_PICK[g / 2])), high = WV_SHUF8(raw[4], WV_TABLE16(FIVE_PICK[2 + g / 2]));
            out->w[g] = WV_FIFTH(WV_AND(raw[g], mask), low, bits);
            out->w[g + 4] = WV_FIFTH(WV_AND(WV_SRL16(raw[g], 4), mask), high, bits);
        }
        return;
    }
    if (fmt == FMT_IQ4_NL) { /* the nibbles through the table (vpshufb): w, as Q8_0's 8-bit values below */
#if defined(VNNI) /* the table of w + 128 */
        const wv mask = WV_SET8(0x0f), table = WV_XOR(WV_TABLE16(IQ4_VALUES), WV_SET8((char)0x80));
#else
        const wv mask = WV_SET8(0x0f), table = WV_TABLE16(IQ4_VALUES);
#endif
        for (int g = 0; g < 4; g++) {
            const wv lo = WV_SHUF8(table, WV_AND(raw[g], mask)), hi = WV_SHUF8(table, WV_AND(WV_SRL16(raw[g], 4), mask));
#if defined(VNNI)
            out->w[g] = lo, out->w[g + 4] = hi;
#else
            out->s[g] = lo, out->w[g] = WV_ABS8(lo), out->s[g + 4] = hi, out->w[g + 4] = WV_ABS8(hi);
#endif
        }
        return;
    }
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        const wv mask = WV_SET8(0x0f);
        for (int g = 0; g < 4; g++) {
            out->w[g] = WV_AND(raw[g], mask);
            out->w[g + 4] = WV_AND(WV_SRL16(raw[g], 4), mask);
        }
        return;
    }
    for (int g = 0; g < 8; g++) {
#if defined(VNNI)
        out->w[g] = WV_XOR(raw[g], WV_SET8((char)0x80));
#else
        out->s[g] = raw[g];
        out->w[g] = WV_ABS8(raw[g]);
#endif
    }
}

INLINE void prepare(int fmt, const uint8_t *const w[COLS], int64_t b, int64_t count, const int32_t *raw_scales,
                    Prepared *out) {
    const uint8_t *p[COLS];
    uint8_t padded[COLS][QBLOCK];
    for (int c = 0; c < COLS; c++) {
        p[c] = block_values(fmt, w[c], b);
        if (count < QBLOCK) { /* INT8's last block: the weights past the row's end read as 0 */
            memset(padded[c], 0, QBLOCK);
            memcpy(padded[c], p[c], (size_t)count);
            p[c] = padded[c];
        }
    }
    wv raw[8];
    if (five_bit_format(fmt)) { /* the nibbles after qh; qh as a k-group (output c's 4 bytes in lane c) */
        int32_t qh[COLS];
        for (int c = 0; c < COLS; c++) {
            memcpy(&qh[c], five_bit_qh(fmt, w[c], b), 4);
            p[c] = five_bit_qh(fmt, w[c], b) + 4;
        }
        raw[4] = WV_LOAD(qh);
    }
    transpose_load(p, raw);
    if (!nibble_format(fmt) && !five_bit_format(fmt)) {
        const uint8_t *second[COLS];
        for (int c = 0; c < COLS; c++)
            second[c] = p[c] + 16;
        transpose_load(second, raw + 4);
    }
    unpack_groups(fmt, raw, out);
    out->dw = splatv(1.0f), out->mw = splatv(0.0f); /* what the format has not (fmt is a constant here) */
    if (fmt != FMT_INT8)
        block_scales(fmt, raw_scales, &out->dw, &out->mw);
}

/* block b of COLS outputs of interleaved rows: `group` the first byte of their group of 16, `lane0`
 * the tile's first output in it (0; 8 for a second half of 8 outputs) */
INLINE void prepare_interleaved(int fmt, const uint8_t *group, int64_t b, int lane0, Prepared *out) {
    const uint8_t *block = interleaved_block(fmt, group, b), *values = interleaved_values(fmt, block);
    wv raw[8];
    if (five_bit_format(fmt)) { /* the qh k-group, then the 4 of nibbles */
        raw[4] = WV_LOAD(values + lane0 * 4);
        values += 64;
    }
    for (int g = 0; g < (nibble_format(fmt) || five_bit_format(fmt) ? 4 : 8); g++)
        raw[g] = WV_LOAD(values + g * 64 + lane0 * 4);
    unpack_groups(fmt, raw, out);
    out->dw = splatv(1.0f), out->mw = splatv(0.0f);
    if (fmt != FMT_INT8)
        out->dw = scales_at(block + 2 * lane0);
    if (min_format(fmt))
        out->mw = scales_at(block + 32 + 2 * lane0);
}

/* lane c: output c's isum against one row's 32 quantized activations (integer sum xsum) */
INLINE iv block_isums(int fmt, const Prepared *pw, const int8_t *xq, int32_t xsum, int rows) {
    wv total = WV_ZERO;
    int32_t group[8];
    memcpy(group, xq, 32);
#if defined(VNNI)
    /* integer sums: any order gives the same total. One row: four chains of two, not one of
     * eight (a vpdpbusd waits for the one before it in its chain). Several rows (rows is a
     * constant in each tile): their chains run side by side anyway, so two chains of four, and
     * one add instead of three */
    const int chains = rows == 1 ? 4 : 2;
    wv part[4] = {WV_ZERO, WV_ZERO, WV_ZERO, WV_ZERO};
    for (int g = 0; g < 8; g++)
        part[g % chains] = _mm512_dpbusd_epi32(part[g % chains], pw->w[g], WV_BCAST4(xq + 4 * g));
    total = WV_ADD32(part[0], part[1]);
    if (chains == 4)
        total = WV_ADD32(total, WV_ADD32(part[2], part[3]));
#else
    (void)rows;
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        wv pairs = WV_ZERO;
        for (int g = 0; g < 8; g++)
            pairs = WV_ADD16(pairs, WV_MADDUBS(pw->w[g], WV_SET32(group[g])));
        total = WV_MADD(pairs, WV_SET16(1));
    } else if (five_bit_format(fmt)) { /* u <= 31: a pair <= 7874, so 4 groups' pairs (<= 31496) add in int16 */
        wv low = WV_ZERO, high = WV_ZERO;
        for (int g = 0; g < 4; g++) {
            low = WV_ADD16(low, WV_MADDUBS(pw->w[g], WV_SET32(group[g])));
            high = WV_ADD16(high, WV_MADDUBS(pw->w[g + 4], WV_SET32(group[g + 4])));
        }
        total = WV_ADD32(WV_MADD(low, WV_SET16(1)), WV_MADD(high, WV_SET16(1)));
    } else {
        for (int g = 0; g < 8; g++) {
            const wv x = WV_SET32(group[g]);
            total = WV_ADD32(total, WV_MADD(WV_MADDUBS(pw->w[g], WV_SIGN8(x, pw->s[g])), WV_SET16(1)));
        }
    }
#endif
    iv out;
    memcpy(&out, &total, sizeof out);
    if (fmt == FMT_Q4_0) /* sum (u - 8) q = sum u q - 8 sum q */
        out -= 8 * xsum;
    else if (fmt == FMT_Q5_0) /* sum (u - 16) q = sum u q - 16 sum q */
        out -= 16 * xsum;
#if defined(VNNI)
    else if (fmt == FMT_Q8_0 || fmt == FMT_INT8 || fmt == FMT_IQ4_NL) /* sum (w + 128) q - 128 sum q */
        out -= 128 * xsum;
#endif
    return out;
}
#else /* generic vectors, aarch64 */
/* A block b of the 8 weight rows: pointers to their values */
typedef struct {
    const uint8_t *p[COLS];
    int64_t count; /* INT8's last block: the values in the row (else 32) */
    fv dw, mw;
    uint8_t rows[COLS][QBLOCK]; /* interleaved rows: the block's values back in row order */
} Prepared;

/* Q5_0 / Q5_1: a block's qh (4 bytes) and nibbles (16) -> its 32 u (0..31), as 8-bit values in row order */
INLINE void five_bit_values(const uint8_t *qh_at, const uint8_t *qs, uint8_t *u) {
    uint32_t qh;
    memcpy(&qh, qh_at, 4);
    for (int j = 0; j < 16; j++) {
        u[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j & 1) << 4));
        u[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16) & 1) << 4));
    }
}

/* interleaved rows (the header's layout): block b of outputs lane0 .. lane0 + COLS of a group of 16 */
INLINE void prepare_interleaved(int fmt, const uint8_t *group, int64_t b, int lane0, Prepared *out) {
    const uint8_t *block = interleaved_block(fmt, group, b), *values = interleaved_values(fmt, block);
    const int groups = nibble_format(fmt) || five_bit_format(fmt) ? 4 : 8;
    out->count = QBLOCK;
    out->dw = splatv(1.0f), out->mw = splatv(0.0f);
    for (int c = 0; c < COLS; c++) {
        if (five_bit_format(fmt)) { /* the qh k-group, then the nibbles' -> u */
            uint8_t qs[16];
            for (int g = 0; g < groups; g++)
                memcpy(qs + 4 * g, values + (g + 1) * 64 + 4 * (lane0 + c), 4);
            five_bit_values(values + 4 * (lane0 + c), qs, out->rows[c]);
        } else {
            for (int g = 0; g < groups; g++)
                memcpy(out->rows[c] + 4 * g, values + g * 64 + 4 * (lane0 + c), 4);
        }
        out->p[c] = out->rows[c];
        if (fmt != FMT_INT8)
            out->dw[c] = half_to_float(block + 2 * (lane0 + c));
        if (min_format(fmt))
            out->mw[c] = half_to_float(block + 32 + 2 * (lane0 + c));
    }
}

INLINE void prepare(int fmt, const uint8_t *const w[COLS], int64_t b, int64_t count, const int32_t *raw_scales,
                    Prepared *out) {
    (void)raw_scales;
    out->count = count;
    out->dw = splatv(1.0f), out->mw = splatv(0.0f);
    for (int c = 0; c < COLS; c++) {
        out->p[c] = block_values(fmt, w[c], b);
        if (five_bit_format(fmt)) { /* u, as 8-bit values */
            five_bit_values(five_bit_qh(fmt, w[c], b), five_bit_qh(fmt, w[c], b) + 4, out->rows[c]);
            out->p[c] = out->rows[c];
        }
        if (fmt != FMT_INT8) {
            out->dw[c] = half_to_float(block_start(fmt, w[c], b));
            if (min_format(fmt))
                out->mw[c] = half_to_float(block_start(fmt, w[c], b) + 2);
        }
    }
}

/* isum[c] for the prepared weight rows against one row's 32 quantized activations (sum xsum) */
INLINE iv block_isums(int fmt, const Prepared *pw, const int8_t *xq, int32_t xsum, int rows) {
    (void)rows;
    iv out;
    for (int c = 0; c < COLS; c++) {
        const uint8_t *p = pw->p[c];
        int32_t total = 0;
        if (fmt == FMT_IQ4_NL) {
            for (int i = 0; i < 16; i++)
                total += (int32_t)IQ4_VALUES[p[i] & 0x0f] * xq[i] + (int32_t)IQ4_VALUES[p[i] >> 4] * xq[i + 16];
        } else if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
#if defined(__ARM_FEATURE_DOTPROD)
            const uint8x16_t raw = vld1q_u8(p), mask = vdupq_n_u8(0x0f);
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, mask)), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
            total = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(xq)), hi, vld1q_s8(xq + 16)));
#else
            for (int i = 0; i < 16; i++)
                total += (int32_t)(p[i] & 0x0f) * xq[i] + (int32_t)(p[i] >> 4) * xq[i + 16];
#endif
        } else { /* Q8_0, INT8; Q5_0, Q5_1: their u (0..31) */
            const int8_t *s = (const int8_t *)p;
#if defined(__ARM_FEATURE_DOTPROD)
            if (pw->count == QBLOCK)
                total = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), vld1q_s8(s), vld1q_s8(xq)), vld1q_s8(s + 16),
                                             vld1q_s8(xq + 16)));
            else
#endif
                for (int64_t i = 0; i < pw->count; i++)
                    total += (int32_t)s[i] * xq[i];
        }
        out[c] = total;
    }
    if (fmt == FMT_Q4_0) /* sum (u - 8) q = sum u q - 8 sum q */
        out -= 8 * xsum;
    else if (fmt == FMT_Q5_0) /* sum (u - 16) q = sum u q - 16 sum q */
        out -= 16 * xsum;
    return out;
}
#endif

/* ---- the tile ---------------------------------------------------------------------------- */
/* rows (1..ROWS) of quantized x from row r0, outputs n0 .. n0 + cols (cols 1..COLS) */
/* partial (not NULL): the fp32 values go to partial[r * COLS + c] (a K group's, for the fold), not to out */
INLINE void tile(const int rows, const int cols, const int fmt, const int interleaved, const ActQ *a, int64_t r0,
                 const uint8_t *w, int64_t row_bytes, int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0,
                 int out_bf16, float *partial) {
    /* interleaved: the tile's group of 16 outputs and its first output in it */
    const int lane0 = interleaved ? (int)(n0 % 16) : 0;
    const uint8_t *group = w - lane0 * row_bytes;
    const uint8_t *wr[COLS];
    for (int c = 0; c < COLS; c++) /* a partial tile repeats its first row: computed, never stored */
        wr[c] = w + (c < cols ? c : 0) * row_bytes;
    const int64_t blocks = a->blocks, tail = k % QBLOCK, full = k / QBLOCK;
    fv acc[ROWS];
    for (int r = 0; r < ROWS; r++)
        acc[r] = splatv(0.0f);
    int32_t raw_scales[SCALE_BLOCKS][COLS]; /* each block's first 4 bytes per row (d, m), lanes by output */
    /* the next tile's rows (the cols * row_bytes bytes after these), a share per block in address
     * order, as quant_gemm.c's tile does: without it batch-1 Q8_0 (the default model's lm_head) read
     * memory at 2/3 of the fp32-activation kernel's rate and was slower than it */
    const int64_t span = (cols * row_bytes + blocks - 1) / blocks;
    const uint8_t *ahead = w + cols * row_bytes; /* interleaved rows: one stream, the hardware prefetcher's */
    const int fetch = r0 == 0 && !interleaved;
    for (int64_t b = 0; b < blocks; b++) {
        if (fetch)
            for (int64_t offset = b * span; offset < (b + 1) * span + 63; offset += 64)
                __builtin_prefetch(ahead + offset, 0, 3);
        Prepared pw;
        if (interleaved) {
            prepare_interleaved(fmt, group, b, lane0, &pw);
        } else {
            if (b % SCALE_BLOCKS == 0 && fmt != FMT_INT8)
                for (int c = 0; c < COLS; c++)
                    for (int64_t i = b; i < blocks && i < b + SCALE_BLOCKS; i++)
                        memcpy(&raw_scales[i - b][c], block_start(fmt, wr[c], i), 4);
            prepare(fmt, wr, b, fmt == FMT_INT8 && b == full && tail != 0 ? tail : QBLOCK,
                    raw_scales[b % SCALE_BLOCKS], &pw);
        }
#pragma GCC unroll 8 /* every row's accumulator its own register (a loop kept them in memory) */
        for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * blocks + b;
            const iv isum = block_isums(fmt, &pw, a->q + at * QBLOCK, a->sum[at], rows);
            const fv sums = __builtin_convertvector(isum, fv);
            const fv scale = fmt == FMT_INT8 ? splatv(a->d[at]) : pw.dw * splatv(a->d[at]);
            acc[r] = fmav(scale, sums, acc[r]);
            if (min_format(fmt))
                acc[r] = fmav(pw.mw, splatv(a->sx[at]), acc[r]);
        }
    }
    fv scale = splatv(1.0f), add = splatv(0.0f);
    for (int c = 0; c < cols; c++) {
        if (fmt == FMT_INT8)
            memcpy(&scale[c], interleaved ? group + 4 * (lane0 + c) : wr[c], 4);
        if (bias != NULL)
            add[c] = out_bf16 ? bf16_to_float(((const uint16_t *)bias)[n0 + c]) : ((const float *)bias)[n0 + c];
    }
    for (int r = 0; r < rows; r++) {
        const fv value = fmav(acc[r], scale, add);
        if (partial != NULL) { /* every lane (past cols: a repeated row's, never stored) */
            memcpy(partial + r * COLS, &value, sizeof value);
            continue;
        }
        for (int c = 0; c < cols; c++)
            store_out(out, (r0 + r) * ldo + n0 + c, value[c], out_bf16);
    }
}
/* each format and row count its own copy of the tile, both constants in it (the accumulators
 * stay in registers: with a variable row count they went through memory, a store and a load on
 * every block's chain) */
#define TILE_CASE(R, FMT, IL)                                                                               \
    case R: tile(R, cols, FMT, IL, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial); return;
#if ROWS == 8
#define TILE_ROWS(FMT, IL)                                                                                   \
    switch (rows) {                                                                                          \
    TILE_CASE(1, FMT, IL) TILE_CASE(2, FMT, IL) TILE_CASE(3, FMT, IL) TILE_CASE(4, FMT, IL)                  \
    TILE_CASE(5, FMT, IL) TILE_CASE(6, FMT, IL) TILE_CASE(7, FMT, IL)                                         \
    default: tile(ROWS, cols, FMT, IL, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial); return;         \
    }
#else
#define TILE_ROWS(FMT, IL)                                                                                   \
    switch (rows) {                                                                                          \
    TILE_CASE(1, FMT, IL) TILE_CASE(2, FMT, IL) TILE_CASE(3, FMT, IL)                                         \
    default: tile(ROWS, cols, FMT, IL, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial); return;         \
    }
#endif
/* IQ4_NL: one row (decode), ROWS rows (a whole tile) as constants, else the count a variable (fewer copies) */
#define TILE_FEW_ROWS(FMT, IL)                                                                               \
    if (rows == 1)                                                                                           \
        tile(1, cols, FMT, IL, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial);               \
    else if (rows == ROWS)                                                                                   \
        tile(ROWS, cols, FMT, IL, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial);            \
    else                                                                                                     \
        tile(rows, cols, FMT, IL, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial);            \
    return;
void tile_any(int rows, int cols, int fmt, int interleaved, const ActQ *a, int64_t r0, const uint8_t *w,
              int64_t row_bytes, int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16,
              float *partial) {
    if (fmt == FMT_IQ4_NL) {
        if (interleaved) {
            TILE_FEW_ROWS(FMT_IQ4_NL, 1)
        }
        TILE_FEW_ROWS(FMT_IQ4_NL, 0)
    }
    /* Q5_0, Q5_1: rows in order only past the last whole group of 16 (and in layers under 16 outputs): one copy */
    if (fmt == FMT_Q5_0) {
        if (interleaved) {
            TILE_FEW_ROWS(FMT_Q5_0, 1)
        }
        tile(rows, cols, FMT_Q5_0, 0, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial);
        return;
    }
    if (fmt == FMT_Q5_1) {
        if (interleaved) {
            TILE_FEW_ROWS(FMT_Q5_1, 1)
        }
        tile(rows, cols, FMT_Q5_1, 0, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16, partial);
        return;
    }
    if (interleaved) {
        switch (fmt) {
        case FMT_Q4_0: TILE_ROWS(FMT_Q4_0, 1)
        case FMT_Q4_1: TILE_ROWS(FMT_Q4_1, 1)
        case FMT_Q8_0: TILE_ROWS(FMT_Q8_0, 1)
        default: TILE_ROWS(FMT_INT8, 1)
        }
    }
    switch (fmt) {
    case FMT_Q4_0: TILE_ROWS(FMT_Q4_0, 0)
    case FMT_Q4_1: TILE_ROWS(FMT_Q4_1, 0)
    case FMT_Q8_0: TILE_ROWS(FMT_Q8_0, 0)
    default: TILE_ROWS(FMT_INT8, 0)
    }
}

#if defined(VNNI)
/* The wide tile (avx512 with VNNI; interleaved Q4_0, Q4_1, Q8_0): TILE_WIDE_ROWS rows by the 32 outputs of two
 * interleaved groups of 16, each row's broadcast of 4 activations serving both groups' vpdpbusd (a broadcast from
 * memory costs about what a vpdpbusd does: kqi_wide's comment). Per block and row, each group's isum starts from the
 * block's correction (-8 s for Q4_0, -128 s for Q8_0's w + 128) and takes the 8 k-groups' vpdpbusd: the integers
 * of block_isums; then the fold of tile, the same operations in the same order per (row, output). */
#define TILE_WIDE_ROWS 4
/* acc[v][r]: the chains of rows r0 .. r0 + TILE_WIDE_ROWS - 1 by the 16 outputs of group v (0, 1) from `group` */
INLINE void tile_wide_acc(const int fmt, const ActQ *a, int64_t r0, const uint8_t *group, int64_t row_bytes,
                          fv acc[2][TILE_WIDE_ROWS]) {
    const int64_t blocks = a->blocks;
    const wv low4 = WV_SET8(0x0f), flip = WV_SET8((char)0x80);
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < TILE_WIDE_ROWS; r++)
            acc[v][r] = splatv(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk[2], *values[2];
        for (int v = 0; v < 2; v++) {
            blk[v] = interleaved_block(fmt, group + v * 16 * row_bytes, b);
            values[v] = interleaved_values(fmt, blk[v]);
        }
        wv t[2][TILE_WIDE_ROWS];
        for (int r = 0; r < TILE_WIDE_ROWS; r++) {
            const int32_t xsum = a->sum[(r0 + r) * blocks + b];
            t[0][r] = t[1][r] = WV_SET32(fmt == FMT_Q4_0 ? -8 * xsum : fmt == FMT_Q8_0 ? -128 * xsum : 0);
        }
        for (int g = 0; g < 8; g++) {
            wv w[2];
            for (int v = 0; v < 2; v++) {
                if (fmt == FMT_Q8_0) {
                    w[v] = WV_XOR(WV_LOAD(values[v] + 64 * g), flip);
                } else {
                    const wv raw = WV_LOAD(values[v] + 64 * (g % 4));
                    w[v] = WV_AND(g < 4 ? raw : WV_SRL16(raw, 4), low4);
                }
            }
            for (int r = 0; r < TILE_WIDE_ROWS; r++) {
                const wv x = WV_BCAST4(a->q + ((r0 + r) * blocks + b) * QBLOCK + 4 * g);
                t[0][r] = _mm512_dpbusd_epi32(t[0][r], w[0], x);
                t[1][r] = _mm512_dpbusd_epi32(t[1][r], w[1], x);
            }
        }
        for (int v = 0; v < 2; v++) {
            const fv dw = scales_at(blk[v]);
            for (int r = 0; r < TILE_WIDE_ROWS; r++) {
                const int64_t at = (r0 + r) * blocks + b;
                iv isum;
                memcpy(&isum, &t[v][r], sizeof isum);
                const fv scale = dw * splatv(a->d[at]);
                acc[v][r] = fmav(scale, __builtin_convertvector(isum, fv), acc[v][r]);
                if (fmt == FMT_Q4_1)
                    acc[v][r] = fmav(scales_at(blk[v] + 32), splatv(a->sx[at]), acc[v][r]);
            }
        }
    }
}

/* tile_wide_acc's chains stored: out = fma(acc, 1, bias), rounded to out's dtype */
INLINE void tile_wide(const int fmt, const ActQ *a, int64_t r0, const uint8_t *group, int64_t row_bytes,
                      const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16) {
    fv acc[2][TILE_WIDE_ROWS];
    tile_wide_acc(fmt, a, r0, group, row_bytes, acc);
    for (int v = 0; v < 2; v++) {
        fv add = splatv(0.0f);
        if (bias != NULL)
            for (int c = 0; c < 16; c++) {
                const int64_t n = n0 + 16 * v + c;
                add[c] = out_bf16 ? bf16_to_float(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
            }
        for (int r = 0; r < TILE_WIDE_ROWS; r++) {
            const fv value = fmav(acc[v][r], splatv(1.0f), add);
            for (int c = 0; c < 16; c++)
                store_out(out, (r0 + r) * ldo + n0 + 16 * v + c, value[c], out_bf16);
        }
    }
}

/* rows r0 .. r0 + rows - 1 (a multiple of TILE_WIDE_ROWS) by outputs n0 .. n0 + 31 (two whole interleaved groups
 * from w) in wide tiles: 1, or 0 where fmt has none */
static __attribute__((noinline)) int tile_wide_any(int fmt, int rows, const ActQ *a, int64_t r0, const uint8_t *w, int64_t row_bytes,
                         const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16) {
    for (int r = 0; r < rows; r += TILE_WIDE_ROWS)
        switch (fmt) {
        case FMT_Q4_0: tile_wide(FMT_Q4_0, a, r0 + r, w, row_bytes, bias, out, ldo, n0, out_bf16); break;
        case FMT_Q4_1: tile_wide(FMT_Q4_1, a, r0 + r, w, row_bytes, bias, out, ldo, n0, out_bf16); break;
        case FMT_Q8_0: tile_wide(FMT_Q8_0, a, r0 + r, w, row_bytes, bias, out, ldo, n0, out_bf16); break;
        default: return 0;
        }
    return 1;
}
#endif

/* ---- the K-quants, read as integers -----------------------------------------------------------
 * Q2_K .. Q6_K, IQ4_XS (super-blocks of 256, activations per super-block; Q5_0, Q5_1 and IQ4_NL take the
 * tile above): each block of an output row is decoded once per tile of KQ_ROWS rows of x into its integers
 * (the header's w, sc, mn) and its fp16 d, dmin, then each row's integer sums and its fold, in the header's
 * order: integer loops the compiler vectorizes, fmaf (the FMA instruction or libm's correctly rounded one).
 * Q4_K and Q6_K on x86 (avx512, avx2) take kq_chains_x86 instead: the same integers by vpmaddubsw and
 * vpdpwssd / vpmaddwd, the same fold. */
#define KQ_ROWS 8 /* rows of x per decoded block */

typedef struct {
    int8_t w[QK_K];       /* the signed integer of each element */
    int16_t ws[QK_K];     /* super-blocks: w sc_h, exact in int16 (|w sc| <= 127 * 32, 32 * 128, 63 * 31) */
    int32_t sc[16], mn[16]; /* super-blocks: each sub-block of 16's scale and min (of 32: both halves) */
    float d, dmin;          /* dmin: the mins' scale */
} Decoded;

INLINE int kq_format(int fmt) {
    return fmt == FMT_Q5_0 || fmt == FMT_Q5_1 || fmt == FMT_IQ4_NL || fmt == FMT_Q2_K || fmt == FMT_Q3_K ||
           fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K || fmt == FMT_IQ4_XS;
}

/* the formats of kq_format that take the tile of the Q4_0 path instead (every tier, interleaved or not) */
INLINE int block32_tile_format(int fmt) { return fmt == FMT_IQ4_NL || fmt == FMT_Q5_0 || fmt == FMT_Q5_1; }

INLINE int kq_has_mins(int fmt) { return fmt == FMT_Q2_K || fmt == FMT_Q4_K || fmt == FMT_Q5_K; }

/* Q4_K / Q5_K's 12 bytes of six-bit scales and mins (8 sub-blocks of 32) -> per sub-block of 16 */
INLINE void k4_scales(const uint8_t *s, int32_t sc[16], int32_t mn[16]) {
    for (int j = 0; j < 8; j++) {
        const int scale = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        const int min = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        sc[2 * j] = sc[2 * j + 1] = scale;
        mn[2 * j] = mn[2 * j + 1] = min;
    }
}

/* one block at p -> its integers (ggml-common.h's layouts) */
INLINE void kq_decode_values(int fmt, const uint8_t *p, Decoded *o) {
    switch (fmt) {
    case FMT_Q4_K: /* d, dmin, scales[12], qs[128]: per 64 elements, 32 bytes' low nibbles then high */
    case FMT_Q5_K: { /* d, dmin, scales[12], qh[32] (element 32 j + t: bit j of byte t), qs[128] */
        const uint8_t *qs = p + (fmt == FMT_Q4_K ? 16 : 48), *qh = p + 16;
        o->d = half_to_float(p), o->dmin = half_to_float(p + 2);
        k4_scales(p + 4, o->sc, o->mn);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 0xF, hi = qs[32 * c + l] >> 4;
                if (fmt == FMT_Q5_K)
                    lo |= (qh[l] >> (2 * c) & 1) << 4, hi |= (qh[l] >> (2 * c + 1) & 1) << 4;
                o->w[64 * c + l] = (int8_t)lo, o->w[64 * c + 32 + l] = (int8_t)hi;
            }
        return;
    }
    case FMT_Q6_K: { /* ql[128], qh[64], scales[16] (int8), d: per 128 elements, q - 32 */
        const uint8_t *ql = p, *qh = p + 128;
        o->d = half_to_float(p + 208), o->dmin = 0.0f;
        for (int h = 0; h < 16; h++)
            o->sc[h] = (int8_t)p[192 + h], o->mn[h] = 0;
        for (int n = 0; n < 2; n++)
            for (int l = 0; l < 32; l++) {
                const uint8_t a = ql[64 * n + l], b = ql[64 * n + 32 + l], h = qh[32 * n + l];
                int8_t *w = o->w + 128 * n + l;
                w[0] = (int8_t)(((a & 0xF) | ((h & 3) << 4)) - 32);
                w[32] = (int8_t)(((b & 0xF) | ((h >> 2 & 3) << 4)) - 32);
                w[64] = (int8_t)(((a >> 4) | ((h >> 4 & 3) << 4)) - 32);
                w[96] = (int8_t)(((b >> 4) | ((h >> 6 & 3) << 4)) - 32);
            }
        return;
    }
    case FMT_Q3_K:   /* hmask[32], qs[64], scales[12] (six-bit, - 32), d: q - 4 where the high bit is clear */
    case FMT_Q2_K: { /* scales[16] (scale, min: four bits each), qs[64], d, dmin */
        const int q3 = fmt == FMT_Q3_K;
        const uint8_t *hm = p, *qs = p + (q3 ? 32 : 16), *s = p + (q3 ? 96 : 0);
        o->d = half_to_float(p + (q3 ? 108 : 80)), o->dmin = q3 ? 0.0f : half_to_float(p + 82);
        for (int i = 0; i < 16; i++) {
            if (q3) {
                const int low = i < 8 ? s[i] & 0xF : s[i - 8] >> 4, high = s[8 + i % 4] >> (2 * (i / 4)) & 3;
                o->sc[i] = (low | high << 4) - 32, o->mn[i] = 0;
            } else {
                o->sc[i] = s[i] & 0xF, o->mn[i] = s[i] >> 4;
            }
        }
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int t = 0; t < 32; t++) {
                    int v = qs[32 * n + t] >> (2 * j) & 3;
                    if (q3 && !(hm[t] >> (4 * n + j) & 1))
                        v -= 4;
                    o->w[128 * n + 32 * j + t] = (int8_t)v;
                }
        return;
    }
    case FMT_IQ4_XS: { /* d, scales_h (uint16), scales_l[4], qs[128]: per 32, the table's values */
        const int high = p[2] | p[3] << 8;
        o->d = half_to_float(p), o->dmin = 0.0f;
        for (int ib = 0; ib < 8; ib++) {
            const int ls = (p[4 + ib / 2] >> (4 * (ib % 2)) & 0xF) | ((high >> (2 * ib) & 3) << 4);
            o->sc[2 * ib] = o->sc[2 * ib + 1] = ls - 32;
            o->mn[2 * ib] = o->mn[2 * ib + 1] = 0;
            for (int j = 0; j < 16; j++) {
                const uint8_t byte = p[8 + 16 * ib + j];
                o->w[32 * ib + j] = IQ4_VALUES[byte & 0xF], o->w[32 * ib + 16 + j] = IQ4_VALUES[byte >> 4];
            }
        }
        return;
    }
    }
}

/* one block at p -> its integers, and each element's w sc: S = sum_i (w_i sc_h(i)) q_i is the header's
 * sum_h sc_h sum_{i in h} w_i q_i, the same integer, as one plain loop the compiler vectorizes */
INLINE void kq_decode(int fmt, const uint8_t *p, Decoded *o) {
    kq_decode_values(fmt, p, o);
    for (int i = 0; i < QK_K; i++)
        o->ws[i] = (int16_t)(o->w[i] * o->sc[i / 16]);
}

/* one decoded block against one row's activations (its cell `at` of a): the header's step of the chain */
INLINE float kq_step(int fmt, const Decoded *dw, const ActQ *a, int64_t at, float acc) {
    const float dx = a->d[at];
    const float scale = dw->d * dx; /* rounded once, then the fma */
    const int8_t *q = a->q + at * QK_K;
    const int32_t *sums = a->sum + at * 16;
    int32_t total = 0, mins = 0; /* integers: any order of the adds gives them */
    for (int i = 0; i < QK_K; i++)
        total += (int32_t)dw->ws[i] * q[i];
    if (kq_has_mins(fmt))
        for (int h = 0; h < 16; h++)
            mins += dw->mn[h] * sums[h];
    acc = fmaf(scale, (float)total, acc);
    if (kq_has_mins(fmt)) {
        const float min_scale = dw->dmin * dx;
        acc = fmaf(-min_scale, (float)mins, acc);
    }
    return acc;
}

/* interleaved K-quant rows (Q2_K .. Q6_K, IQ4_XS; the header's layout, kernels/quant.py's interleave_order): where
 * byte j of output c's block lies in its group's block of 16 outputs (16 block_bytes bytes) */
INLINE int64_t kqi_position(int fmt, int c, int j) {
    if (fmt == FMT_Q2_K) /* the 16 d, the 16 dmin, then scales[16] and qs[64] as k-groups */
        return j >= 80 ? 32 * ((j - 80) / 2) + 2 * c + j % 2 : 64 + 64 * (j / 4) + 4 * c + j % 4;
    if (fmt == FMT_Q3_K) /* the 16 d, scales[12] as 3 k-groups, then hmask[32] and qs[64] as k-groups */
        return j >= 108 ? 2 * c + j - 108 : j >= 96 ? 32 + 64 * ((j - 96) / 4) + 4 * c + j % 4 : 224 + 64 * (j / 4) + 4 * c + j % 4;
    if (fmt != FMT_Q6_K) /* Q4_K, Q5_K: the 16 d, the 16 dmin, then the block's bytes 4 .. as k-groups */
        return j < 4 ? 32 * (j / 2) + 2 * c + j % 2 : 64 + 64 * ((j - 4) / 4) + 4 * c + j % 4;
    if (j >= 208) /* Q6_K: the 16 d, the 16 scales as 4 k-groups, then per 128 elements n and l = 0, 4, .. 28 the */
        return 2 * c + j - 208; /* k-groups of ql[64 n + l], ql[64 n + 32 + l] and qh[32 n + l] */
    if (j >= 192)
        return 32 + 64 * ((j - 192) / 4) + 4 * c + j % 4;
    const int n = j < 128 ? j / 64 : (j - 128) / 32, slot = j < 128 ? j % 64 / 32 : 2, l = j < 128 ? j % 32 : (j - 128) % 32;
    return 288 + 192 * (8 * n + l / 4) + 64 * slot + 4 * c + l % 4;
}

/* output c's block back in row order from its group's interleaved block */
INLINE void kqi_gather(int fmt, const uint8_t *block16, int c, uint8_t *out) {
    for (int j = 0; j < (int)block_bytes(fmt); j++)
        out[j] = block16[kqi_position(fmt, c, j)];
}

/* acc[0 .. rows): the chains of rows r0 .. of a by one output's row of blocks (group not NULL: output `lane` of
 * the interleaved group there, row unused) */
INLINE void kq_chains(const int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *row, const uint8_t *group,
                      int lane, float *acc) {
    for (int r = 0; r < rows; r++)
        acc[r] = 0.0f;
    const int64_t bytes = block_bytes(fmt);
    for (int64_t b = 0; b < a->blocks; b++) {
        Decoded dw;
        uint8_t gathered[256];
        if (group != NULL)
            kqi_gather(fmt, group + b * 16 * bytes, lane, gathered);
        kq_decode(fmt, group != NULL ? gathered : row + b * bytes, &dw);
        for (int r = 0; r < rows; r++)
            acc[r] = kq_step(fmt, &dw, a, (r0 + r) * a->blocks + b, acc[r]);
    }
}

#if defined(__AVX2__)
/* Q4_K and Q6_K on x86 (the avx2 and avx512 tiers): the same integers S, M and the same fold as kq_step, with
 * the sums in vectors, a row of blocks at a time (no decode into Decoded). Per run of 32 elements, u the
 * element's unsigned integer (Q4_K: the nibble; Q6_K: the six bits, w = u - 32) and q the activations:
 * vpmaddubsw gives pairs u q + u' q' (<= 2 * 63 * 127 = 16002: never saturates), then vpmaddwd by the run's
 * sub-block scales (vpdpwssd where VNNI is) adds sc_h (u q + u' q') into int32 lanes. Q6_K's - 32 comes off
 * as 32 sum_h sc_h s_h (the activations' sums of each 16); Q4_K's M = sum_h mn_h s_h the same way. The lanes
 * are added in any order (integers), then the header's two fmas per super-block. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KQ_DOT16(acc, pairs, scales) _mm256_dpwssd_epi32(acc, pairs, scales)
#else
#define KQ_DOT16(acc, pairs, scales) _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales))
#endif

/* Q4_K / Q5_K's 12 bytes -> the 8 six-bit scales (bytes 0-7 of *scales) and mins (of *mins): k4_scales' rule
 * on 4 sub-blocks at a time (bytes j of each word: sub-blocks j and j + 4) */
INLINE void k4_scales_packed(const uint8_t *s, uint8_t scales[8], uint8_t mins[8]) {
    uint32_t w[3], out[4];
    memcpy(w, s, 12);
    out[0] = w[0] & 0x3f3f3f3fu;                                            /* scales 0-3 */
    out[1] = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 6 & 0x03030303u) << 4);       /* scales 4-7 */
    out[2] = w[1] & 0x3f3f3f3fu;                                            /* mins 0-3 */
    out[3] = (w[2] >> 4 & 0x0f0f0f0fu) | ((w[1] >> 6 & 0x03030303u) << 4);  /* mins 4-7 */
    memcpy(scales, out, 8);
    memcpy(mins, out + 2, 8);
}

/* the 8 int32 lanes of v added (integers: any order) */
INLINE int32_t kq_hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

#if COLS == 16
/* AVX-512 (BW): the same integers 64 elements to a vector (Q4_K: one chunk of 32 bytes, its low nibbles
 * then its high ones, = elements 64 c .. 64 c + 63 in order; Q6_K: runs 2i, 2i + 1), vpermw placing each
 * sub-block's scale on its lanes */
#if defined(__AVX512VNNI__)
#define KQ_DOT32(acc, pairs, scales) _mm512_dpwssd_epi32(acc, pairs, scales)
#else
#define KQ_DOT32(acc, pairs, scales) _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, scales))
#endif

INLINE void kq_chains_x86(const int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *row, float *acc) {
    static const int16_t by_eight[32] __attribute__((aligned(64))) = {
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    for (int r = 0; r < rows; r++)
        acc[r] = 0.0f;
    const int64_t bytes = block_bytes(fmt);
    const __m512i low4 = _mm512_set1_epi8(0x0f), low2 = _mm512_set1_epi8(0x03);
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1); /* lane / 16 */
    const __m512i quarters = _mm512_load_si512(by_eight);                                         /* lane / 8 */
    for (int64_t b = 0; b < a->blocks; b++) {
        const uint8_t *p = row + b * bytes;
        __m512i u[4], sc[4], mn; /* vector i: elements 64 i .. 64 i + 63, their scales as int16 lanes */
        float d, dmin = 0.0f;
        if (fmt == FMT_Q4_K) {
            uint8_t scales[8], mins[8];
            k4_scales_packed(p + 4, scales, mins);
            d = half_to_float(p), dmin = half_to_float(p + 2);
            const __m512i sw = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)scales)));
            for (int c = 0; c < 4; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
                u[c] = _mm512_and_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low4);
                sc[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(halves, _mm512_set1_epi16((short)(2 * c))), sw);
            }
            const __m128i m8 = _mm_loadl_epi64((const __m128i *)mins);
            mn = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(m8, m8)); /* h = 0 .. 15: each min twice */
        } else { /* Q6_K: ql[64 n .. 64 n + 63] is runs 4n, 4n + 1's low bits (low nibbles), 4n + 2, 4n + 3's (high) */
            d = half_to_float(p + 208);
            for (int n = 0; n < 2; n++) {
                const __m512i ql = _mm512_loadu_si512((const void *)(p + 64 * n));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
                const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
                u[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(hh, low2), 4));
                u[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), low2), 4));
            }
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(p + 192));
            const __m512i sw = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s8));
            for (int i = 0; i < 4; i++) /* sub-blocks 4i .. 4i + 3, one per 128-bit lane */
                sc[i] = _mm512_permutexvar_epi16(_mm512_add_epi16(quarters, _mm512_set1_epi16((short)(4 * i))), sw);
            mn = _mm512_slli_epi32(_mm512_cvtepi8_epi32(s8), 5); /* 32 sc_h, taken off as 32 sum sc_h s_h */
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * a->blocks + b;
            const int8_t *q = a->q + at * QK_K;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512(); /* two chains */
            for (int i = 0; i < 4; i += 2) {
                s0 = KQ_DOT32(s0, _mm512_maddubs_epi16(u[i], _mm512_loadu_si512((const void *)(q + 64 * i))), sc[i]);
                s1 = KQ_DOT32(s1, _mm512_maddubs_epi16(u[i + 1], _mm512_loadu_si512((const void *)(q + 64 * i + 64))),
                              sc[i + 1]);
            }
            const __m512i m = _mm512_mullo_epi32(mn, _mm512_loadu_si512((const void *)(a->sum + at * 16)));
            const float dx = a->d[at];
            const float scale = d * dx; /* rounded once, then the fma, as kq_step */
            if (fmt == FMT_Q4_K) {
                const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
                const int32_t mins = _mm512_reduce_add_epi32(m);
                acc[r] = fmaf(scale, (float)total, acc[r]);
                const float min_scale = dmin * dx;
                acc[r] = fmaf(-min_scale, (float)mins, acc[r]);
            } else {
                const int32_t total = _mm512_reduce_add_epi32(_mm512_sub_epi32(_mm512_add_epi32(s0, s1), m));
                acc[r] = fmaf(scale, (float)total, acc[r]);
            }
        }
    }
}
#else
/* kq_chains for Q4_K / Q6_K (fmt a constant): acc[0 .. rows) */
INLINE void kq_chains_x86(const int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *row, float *acc) {
    for (int r = 0; r < rows; r++)
        acc[r] = 0.0f;
    const int64_t bytes = block_bytes(fmt);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < a->blocks; b++) {
        const uint8_t *p = row + b * bytes;
        __m256i u[8], sc[8], mn[2]; /* run j's u and its scales as int16 (per 128-bit lane: a sub-block of 16) */
        float d, dmin = 0.0f;
        if (fmt == FMT_Q4_K) {
            uint8_t scales[8], mins[8];
            k4_scales_packed(p + 4, scales, mins);
            d = half_to_float(p), dmin = half_to_float(p + 2);
            for (int c = 0; c < 4; c++) { /* 32 bytes: run 2c's nibbles low, run 2c + 1's high */
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * c));
                u[2 * c] = _mm256_and_si256(raw, low4);
                u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                sc[2 * c] = _mm256_set1_epi16(scales[2 * c]);
                sc[2 * c + 1] = _mm256_set1_epi16(scales[2 * c + 1]);
            }
            /* per sub-block of 16 (both halves of a 32 the same), as int32 lanes: h = 0-7, 8-15 */
            const __m128i m8 = _mm_loadl_epi64((const __m128i *)mins);
            const __m128i m16 = _mm_unpacklo_epi8(m8, m8); /* each min twice */
            mn[0] = _mm256_cvtepu8_epi32(m16);
            mn[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(m16, 8));
        } else { /* Q6_K: ql[128], qh[64], scales[16], d; run 4n + g: elements 128 n + 32 g .. */
            d = half_to_float(p + 208);
            const __m256i low2 = _mm256_set1_epi8(0x03);
            for (int n = 0; n < 2; n++) {
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(p + 64 * n));
                const __m256i a1 = _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
                u[4 * n] = _mm256_or_si256(_mm256_and_si256(a0, low4), _mm256_slli_epi16(_mm256_and_si256(h, low2), 4));
                u[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(a1, low4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), low2), 4));
                u[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a0, 4), low4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), low2), 4));
                u[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a1, 4), low4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), low2), 4));
            }
            const int8_t *s = (const int8_t *)(p + 192);
            for (int j = 0; j < 8; j++) /* run j: sub-blocks 2j (low lane), 2j + 1 (high lane) */
                sc[j] = _mm256_setr_m128i(_mm_set1_epi16(s[2 * j]), _mm_set1_epi16(s[2 * j + 1]));
            const __m128i s16 = _mm_loadu_si128((const __m128i *)s); /* 32 sc_h, taken off as 32 sum sc_h s_h */
            mn[0] = _mm256_slli_epi32(_mm256_cvtepi8_epi32(s16), 5);
            mn[1] = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8)), 5);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * a->blocks + b;
            const int8_t *q = a->q + at * QK_K;
            const int32_t *sums = a->sum + at * 16;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256(); /* two chains */
            for (int j = 0; j < 8; j += 2) {
                const __m256i p0 = _mm256_maddubs_epi16(u[j], _mm256_loadu_si256((const __m256i *)(q + 32 * j)));
                const __m256i p1 = _mm256_maddubs_epi16(u[j + 1], _mm256_loadu_si256((const __m256i *)(q + 32 * j + 32)));
                s0 = KQ_DOT16(s0, p0, sc[j]);
                s1 = KQ_DOT16(s1, p1, sc[j + 1]);
            }
            const __m256i m = _mm256_add_epi32(_mm256_mullo_epi32(mn[0], _mm256_loadu_si256((const __m256i *)sums)),
                                               _mm256_mullo_epi32(mn[1], _mm256_loadu_si256((const __m256i *)(sums + 8))));
            const float dx = a->d[at];
            const float scale = d * dx; /* rounded once, then the fma, as kq_step */
            if (fmt == FMT_Q4_K) {
                const int32_t total = kq_hsum(_mm256_add_epi32(s0, s1)), mins = kq_hsum(m);
                acc[r] = fmaf(scale, (float)total, acc[r]);
                const float min_scale = dmin * dx;
                acc[r] = fmaf(-min_scale, (float)mins, acc[r]);
            } else {
                const int32_t total = kq_hsum(_mm256_sub_epi32(_mm256_add_epi32(s0, s1), m));
                acc[r] = fmaf(scale, (float)total, acc[r]);
            }
        }
    }
}
#endif /* COLS == 16 */
#endif

/* out = fma(acc, 1, bias) for rows r0 .. r0 + rows - 1 and output c (acc[r * stride]) */
INLINE void kq_store(const float *acc, int stride, int64_t r0, int rows, int64_t c, const void *bias, void *out,
                     int64_t ldo, int out_bf16) {
    const float add = bias == NULL ? 0.0f : out_bf16 ? bf16_to_float(((const uint16_t *)bias)[c]) : ((const float *)bias)[c];
    for (int r = 0; r < rows; r++) {
        const float value = fmaf(acc[r * stride], 1.0f, add);
        store_out(out, (r0 + r) * ldo + c, value, out_bf16);
    }
}

#if defined(__AVX2__)
/* Q2_K .. Q6_K and IQ4_XS's interleaved groups on x86 (avx512 with or without VNNI, avx2): the tile of the Q4_0 path,
 * one int32 lane per output. A k-group vector holds per lane 4 unsigned values u of its output (Q4_K the nibble,
 * Q5_K the nibble and its 5th bit, Q6_K the six bits: w = u - 32; Q2_K the two bits; Q3_K the two bits and 4 times
 * the hmask bit: w = u - 4) for 4 consecutive elements of one sub-block; vpdpbusd against the row's 4 activations
 * broadcast adds the 4 products u q in the lane, so a sub-block's integer
 * sum lands in its output's lane with no per-block decode and no horizontal add, and a block's values are unpacked
 * once for every row of the tile. Then (VNNI) vpmulld by the sub-block's scale, or (without VNNI) vpmaddubsw pairs
 * added in int16 (never past 32767: Q4_K 8 k-groups of pairs <= 2 15 127, Q5_K 4 of 2 31 127, Q6_K 2 of 2 63 127,
 * Q3_K 4 of 2 7 127, Q2_K 4 of 2 3 127) and vpmaddwd by the scale in both halves of the lane:
 * S = sum_h sc_h sum_{i in h} u_i q_i. The mins M = sum_j mn_j (s_2j + s_2j+1) (Q4_K, Q5_K; Q2_K per 16), and Q6_K's
 * 32 sum_h sc_h s_h (Q3_K's 4 sum_h sc_h s_h; S - that is the header's S of w = u - 32, u - 4), take
 * vpmaddwd of the scales' or mins' int16 pairs by the activations' sums of each 16 (or 32) broadcast. IQ4_XS: the
 * nibbles through the table (vpshufb); VNNI: u = w + 128 and each sub-block's 128 (s_2j + s_2j+1) off before its
 * scale; without: |w| by q with w's sign (a pair <= 2 127 127), each k-group by vpmaddwd at once. The same
 * integers as kq_step, exact in int32 (any order), then the same two fmas per super-block in every lane. */
#if COLS == 16
#define WV_MULLO32(a, b) _mm512_mullo_epi32(a, b)
#define WV_SLLI32(a, n) _mm512_slli_epi32(a, n)
#define WV_SRLI32(a, n) _mm512_srli_epi32(a, n)
#define WV_SRAI32(a, n) _mm512_srai_epi32(a, n)
#define WV_SLLI16(a, n) _mm512_slli_epi16(a, n)
#define WV_SRAI16(a, n) _mm512_srai_epi16(a, n)
#define WV_OR(a, b) _mm512_or_si512(a, b)
#define WV_SUB32(a, b) _mm512_sub_epi32(a, b)
#else
#define WV_MULLO32(a, b) _mm256_mullo_epi32(a, b)
#define WV_SLLI32(a, n) _mm256_slli_epi32(a, n)
#define WV_SRLI32(a, n) _mm256_srli_epi32(a, n)
#define WV_SRAI32(a, n) _mm256_srai_epi32(a, n)
#define WV_SLLI16(a, n) _mm256_slli_epi16(a, n)
#define WV_SRAI16(a, n) _mm256_srai_epi16(a, n)
#define WV_OR(a, b) _mm256_or_si256(a, b)
#define WV_SUB32(a, b) _mm256_sub_epi32(a, b)
#endif

/* lane c: sc_c sum_{g < count} u_g . q[4 g .. 4 g + 3] (sc32: the scale per lane; sc16: in both int16 halves) */
INLINE wv kqi_scaled(const wv *u, const int8_t *q, const int count, const int pairs, wv sc32, wv sc16) {
#if defined(VNNI)
    (void)pairs, (void)sc16;
    wv t0 = WV_ZERO, t1 = WV_ZERO; /* two chains */
    for (int g = 0; g < count; g += 2) {
        t0 = _mm512_dpbusd_epi32(t0, u[g], WV_BCAST4(q + 4 * g));
        t1 = _mm512_dpbusd_epi32(t1, u[g + 1], WV_BCAST4(q + 4 * g + 4));
    }
    return WV_MULLO32(WV_ADD32(t0, t1), sc32);
#else
    (void)sc32;
    wv total = WV_ZERO;
    for (int g0 = 0; g0 < count; g0 += pairs) {
        wv p = WV_ZERO;
        for (int g = g0; g < g0 + pairs; g++)
            p = WV_ADD16(p, WV_MADDUBS(u[g], WV_BCAST4(q + 4 * g)));
        total = WV_ADD32(total, WV_MADD(p, sc16));
    }
    return total;
#endif
}

/* two int16 in one int32 (a vpmaddwd operand) */
INLINE int32_t kqi_pack(int32_t lo, int32_t hi) { return (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)hi << 16); }

/* Q3_K's scale of sub-block h per lane, from the 12 bytes' k-groups at sv (s2: the third, the high bits): the low 4
 * bits are byte h % 8's low (h < 8) or high nibble, the high 2 bits byte 8 + h % 4's bits 2 (h / 4), minus 32 */
INLINE wv kqi_q3_scale(const uint8_t *sv, wv s2, int h) {
    const wv low = WV_AND(WV_SRLI32(WV_LOAD(sv + 64 * (h % 8 / 4)), 8 * (h % 4) + 4 * (h / 8)), WV_SET32(0x0f));
    const wv high = WV_AND(WV_SRLI32(s2, 8 * (h % 4) + 2 * (h / 4)), WV_SET32(0x03));
    return WV_SUB32(WV_OR(low, WV_SLLI32(high, 4)), WV_SET32(32));
}

/* COLS outputs' 16-bit integers, consecutive at p (interleaved rows), each in its int32 lane */
INLINE wv kqi_u16_at(const uint8_t *p) {
#if COLS == 16
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)p));
#else
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
#endif
}

/* the two fmas of a super-block with mins (Q2_K, Q4_K, Q5_K) in every lane: S and M by d dx and dmin dx */
INLINE void kqi_fold(wv S, wv M, fv d, fv dmin, float dx, fv *acc) {
    iv si, mi;
    memcpy(&si, &S, sizeof si);
    memcpy(&mi, &M, sizeof mi);
    const fv scale = d * splatv(dx), min_scale = dmin * splatv(dx); /* each rounded once, then the fmas */
    *acc = fmav(scale, __builtin_convertvector(si, fv), *acc);
    *acc = fmav(-min_scale, __builtin_convertvector(mi, fv), *acc);
}

/* super-block b of rows r0 .. r0 + rows - 1 (rows <= ROWS) of a by outputs lane0 .. lane0 + COLS - 1 of the
 * interleaved group at `group`, folded into acc[0 .. rows) (fmt a constant) */
INLINE void kqi_block(const int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *group, int lane0, int64_t b,
                      fv *acc) {
    const int64_t bytes = block_bytes(fmt);
    const wv low4 = WV_SET8(0x0f), bytes16 = WV_SET32(0x00ff00ff), low16 = WV_SET32(0xffff);
    const uint8_t *blk = group + b * 16 * bytes;
    wv S[ROWS], M[ROWS];
    for (int r = 0; r < rows; r++)
        S[r] = WV_ZERO, M[r] = WV_ZERO;
    const fv d = scales_at(blk + 2 * lane0);
    if (fmt == FMT_Q6_K || fmt == FMT_Q3_K || fmt == FMT_Q2_K) { /* sub-blocks of 16 */
        /* the scales' k-groups (Q6_K 4: int8; Q3_K 3: the 12 bytes; Q2_K 4: scale | min << 4), the values' */
        const uint8_t *sv = blk + (fmt == FMT_Q2_K ? 64 : 32) + 4 * lane0;
        const uint8_t *vals = blk + (fmt == FMT_Q6_K ? 288 : fmt == FMT_Q3_K ? 736 : 320) + 4 * lane0;
        const uint8_t *hmask = blk + 224 + 4 * lane0; /* Q3_K: hmask[t] bit 4 n + j is element 128 n + 32 j + t's */
        wv sc3[16]; /* Q3_K: each sub-block's scale, unpacked once (for M and for S) */
        if (fmt == FMT_Q3_K) {
            const wv s2 = WV_LOAD(sv + 128); /* the high bits */
            for (int h = 0; h < 16; h++)
                sc3[h] = kqi_q3_scale(sv, s2, h);
        }
        for (int g = 0; g < 4; g++) { /* M: scales (Q2_K mins) 4g, 4g + 2 and 4g + 1, 4g + 3 as int16 pairs */
            wv even, odd;
            if (fmt == FMT_Q6_K) {
                const wv s = WV_LOAD(sv + 64 * g);
                even = WV_SRAI16(WV_SLLI16(s, 8), 8), odd = WV_SRAI16(s, 8);
            } else if (fmt == FMT_Q2_K) {
                const wv s = WV_LOAD(sv + 64 * g), mins = WV_SET32(0x000f000f);
                even = WV_AND(WV_SRL16(s, 4), mins), odd = WV_AND(WV_SRL16(s, 12), mins);
            } else {
                even = WV_OR(WV_AND(sc3[4 * g], low16), WV_SLLI32(sc3[4 * g + 2], 16));
                odd = WV_OR(WV_AND(sc3[4 * g + 1], low16), WV_SLLI32(sc3[4 * g + 3], 16));
            }
            for (int r = 0; r < rows; r++) {
                const int32_t *sums = a->sum + ((r0 + r) * a->blocks + b) * 16 + 4 * g;
                M[r] = WV_ADD32(M[r], WV_ADD32(WV_MADD(even, WV_SET32(kqi_pack(sums[0], sums[2]))),
                                               WV_MADD(odd, WV_SET32(kqi_pack(sums[1], sums[3])))));
            }
        }
        const wv high = WV_SET8(0x30), low2 = WV_SET8(0x03), third = WV_SET8(0x04);
        for (int n = 0; n < 2; n++)
            for (int half = 0; half < 2; half++) { /* l = 16 half .. 16 half + 15 of each run of 32 */
                wv u[4][4]; /* [run of 32 within the 128][k-group]: sub-block 8 n + 2 run + half */
                for (int t = 0; t < 4; t++) {
                    if (fmt == FMT_Q6_K) {
                        const uint8_t *tp = vals + 192 * (8 * n + 4 * half + t);
                        const wv lo = WV_LOAD(tp), hi = WV_LOAD(tp + 64), h = WV_LOAD(tp + 128);
                        u[0][t] = WV_OR(WV_AND(lo, low4), WV_AND(WV_SLLI16(h, 4), high));
                        u[1][t] = WV_OR(WV_AND(hi, low4), WV_AND(WV_SLLI16(h, 2), high));
                        u[2][t] = WV_OR(WV_AND(WV_SRL16(lo, 4), low4), WV_AND(h, high));
                        u[3][t] = WV_OR(WV_AND(WV_SRL16(hi, 4), low4), WV_AND(WV_SRL16(h, 2), high));
                        continue;
                    } /* Q2_K, Q3_K: qs[32 n + l] bits 2 j are element 128 n + 32 j + l's */
                    const wv raw = WV_LOAD(vals + 64 * (8 * n + 4 * half + t));
                    u[0][t] = WV_AND(raw, low2), u[1][t] = WV_AND(WV_SRL16(raw, 2), low2);
                    u[2][t] = WV_AND(WV_SRL16(raw, 4), low2), u[3][t] = WV_AND(WV_SRL16(raw, 6), low2);
                    if (fmt == FMT_Q3_K) { /* u = the two bits + 4 hbit (w = u - 4): bit 4 n + j to bit 2 */
                        const wv hm = WV_LOAD(hmask + 64 * (4 * half + t));
                        for (int j = 0; j < 4; j++) {
                            const int bit = 4 * n + j;
                            u[j][t] = WV_OR(u[j][t], WV_AND(bit >= 2 ? WV_SRL16(hm, bit - 2) : WV_SLLI16(hm, 2 - bit), third));
                        }
                    }
                }
                for (int run = 0; run < 4; run++) {
                    const int h = 8 * n + 2 * run + half;
                    wv sc32;
                    if (fmt == FMT_Q6_K)
                        sc32 = WV_SRAI32(WV_SLLI32(WV_LOAD(sv + 64 * (h / 4)), 24 - 8 * (h % 4)), 24);
                    else if (fmt == FMT_Q2_K)
                        sc32 = WV_AND(WV_SRLI32(WV_LOAD(sv + 64 * (h / 4)), 8 * (h % 4)), WV_SET32(0x0f));
                    else
                        sc32 = sc3[h];
                    const wv sc16 = WV_OR(WV_AND(sc32, low16), WV_SLLI32(sc32, 16));
                    for (int r = 0; r < rows; r++) {
                        const int8_t *q = a->q + ((r0 + r) * a->blocks + b) * QK_K + 128 * n + 32 * run + 16 * half;
                        S[r] = WV_ADD32(S[r], kqi_scaled(u[run], q, 4, fmt == FMT_Q6_K ? 2 : 4, sc32, sc16));
                    }
                }
            }
        if (fmt == FMT_Q2_K) { /* the mins' fold, as Q4_K's below */
            const fv dmin = scales_at(blk + 32 + 2 * lane0);
            for (int r = 0; r < rows; r++)
                kqi_fold(S[r], M[r], d, dmin, a->d[(r0 + r) * a->blocks + b], &acc[r]);
            return;
        }
        for (int r = 0; r < rows; r++) { /* S - 32 M (Q6_K), S - 4 M (Q3_K): the header's S of w = u - 32, u - 4 */
            const wv total = WV_SUB32(S[r], WV_SLLI32(M[r], fmt == FMT_Q6_K ? 5 : 2));
            iv t;
            memcpy(&t, &total, sizeof t);
            const fv scale = d * splatv(a->d[(r0 + r) * a->blocks + b]); /* rounded once, then the fma */
            acc[r] = fmav(scale, __builtin_convertvector(t, fv), acc[r]);
        }
        return;
    }
    if (fmt == FMT_IQ4_XS) { /* sub-blocks of 32, scale ls - 32 (ls: scales_l's nibble ib, scales_h's bits 2 ib) */
#if defined(VNNI) /* the table of w + 128 */
        const wv table = WV_XOR(WV_TABLE16(IQ4_VALUES), WV_SET8((char)0x80)), sl = WV_LOAD(blk + 64 + 4 * lane0);
#else
        const wv table = WV_TABLE16(IQ4_VALUES), sl = WV_LOAD(blk + 64 + 4 * lane0);
#endif
        const wv sh = kqi_u16_at(blk + 32 + 2 * lane0);
        const uint8_t *qs = blk + 128 + 4 * lane0; /* sub-block ib: k-groups 4 ib .. 4 ib + 3, low nibbles then high */
        for (int ib = 0; ib < 8; ib++) {
            const wv ls = WV_OR(WV_AND(WV_SRLI32(sl, 4 * ib), WV_SET32(0x0f)),
                                WV_SLLI32(WV_AND(WV_SRLI32(sh, 2 * ib), WV_SET32(0x03)), 4));
            const wv sc32 = WV_SUB32(ls, WV_SET32(32));
            wv v[8]; /* k-group g: elements 32 ib + 4 g .. 4 g + 3, their table values (VNNI: + 128) */
            for (int t = 0; t < 4; t++) {
                const wv raw = WV_LOAD(qs + 64 * (4 * ib + t));
                v[t] = WV_SHUF8(table, WV_AND(raw, low4)), v[t + 4] = WV_SHUF8(table, WV_AND(WV_SRL16(raw, 4), low4));
            }
#if defined(VNNI) /* vpdpbusd of w + 128, then the sub-block's 128 (s_2ib + s_2ib+1) off before its scale */
            for (int r = 0; r < rows; r++) {
                const int64_t at = (r0 + r) * a->blocks + b;
                const int8_t *q = a->q + at * QK_K + 32 * ib;
                const int32_t *sums = a->sum + at * 16 + 2 * ib;
                wv t = WV_ZERO;
                for (int g = 0; g < 8; g++)
                    t = _mm512_dpbusd_epi32(t, v[g], WV_BCAST4(q + 4 * g));
                t = WV_SUB32(t, WV_SET32(128 * (sums[0] + sums[1])));
                S[r] = WV_ADD32(S[r], WV_MULLO32(t, sc32));
            }
#else /* vpmaddubsw of |w| by q with w's sign (a pair <= 2 127 127), each k-group's pairs by the scale at once */
            const wv sc16 = WV_OR(WV_AND(sc32, low16), WV_SLLI32(sc32, 16));
            wv mag[8];
            for (int g = 0; g < 8; g++)
                mag[g] = WV_ABS8(v[g]);
            for (int r = 0; r < rows; r++) {
                const int8_t *q = a->q + ((r0 + r) * a->blocks + b) * QK_K + 32 * ib;
                for (int g = 0; g < 8; g++)
                    S[r] = WV_ADD32(S[r], WV_MADD(WV_MADDUBS(mag[g], WV_SIGN8(WV_BCAST4(q + 4 * g), v[g])), sc16));
            }
#endif
        }
        for (int r = 0; r < rows; r++) {
            iv t;
            memcpy(&t, &S[r], sizeof t);
            const fv scale = d * splatv(a->d[(r0 + r) * a->blocks + b]); /* rounded once, then the fma */
            acc[r] = fmav(scale, __builtin_convertvector(t, fv), acc[r]);
        }
        return;
    }
    /* Q4_K, Q5_K: k-group i at kg + 64 i: 0-2 the scales' 12 bytes; Q5_K 3-10 qh; then qs */
    const fv dmin = scales_at(blk + 32 + 2 * lane0);
    const uint8_t *kg = blk + 64 + 4 * lane0;
    const wv s0 = WV_LOAD(kg), s1 = WV_LOAD(kg + 64), s2 = WV_LOAD(kg + 128);
    const wv six = WV_SET8(0x3f), two = WV_SET8(0x03);
    const wv sa = WV_AND(s0, six), sb = WV_OR(WV_AND(s2, low4), WV_SLLI16(WV_AND(WV_SRL16(s0, 6), two), 4));
    const wv ma = WV_AND(s1, six), mb = WV_OR(WV_AND(WV_SRL16(s2, 4), low4), WV_SLLI16(WV_AND(WV_SRL16(s1, 6), two), 4));
    /* mins 0, 2 | 1, 3 | 4, 6 | 5, 7 as int16 pairs, against the sums of each 32 */
    const wv mins[4] = {WV_AND(ma, bytes16), WV_SRL16(ma, 8), WV_AND(mb, bytes16), WV_SRL16(mb, 8)};
    for (int r = 0; r < rows; r++) {
        const int32_t *s = a->sum + ((r0 + r) * a->blocks + b) * 16;
        int32_t s32[8];
        for (int j = 0; j < 8; j++)
            s32[j] = s[2 * j] + s[2 * j + 1];
        for (int i = 0; i < 4; i++) {
            const int j = 4 * (i / 2) + i % 2;
            M[r] = WV_ADD32(M[r], WV_MADD(mins[i], WV_SET32(kqi_pack(s32[j], s32[j + 2]))));
        }
    }
    const uint8_t *qs = kg + 64 * (fmt == FMT_Q4_K ? 3 : 11);
    for (int c = 0; c < 4; c++) { /* 64 elements: sub-blocks 2c (the low nibbles), 2c + 1 (the high ones) */
        wv lo[8], hi[8];
        for (int g = 0; g < 8; g++) {
            const wv raw = WV_LOAD(qs + 64 * (8 * c + g));
            lo[g] = WV_AND(raw, low4), hi[g] = WV_AND(WV_SRL16(raw, 4), low4);
            if (fmt == FMT_Q5_K) { /* qh byte l: bit 2c is element 64 c + l's 5th, bit 2c + 1 element 64 c + 32 + l's */
                const wv qh = WV_LOAD(kg + 64 * (3 + g)), fifth = WV_SET8(0x10);
                lo[g] = WV_OR(lo[g], WV_AND(c <= 2 ? WV_SLLI16(qh, 4 - 2 * c) : WV_SRL16(qh, 2 * c - 4), fifth));
                hi[g] = WV_OR(hi[g], WV_AND(c <= 1 ? WV_SLLI16(qh, 3 - 2 * c) : WV_SRL16(qh, 2 * c - 3), fifth));
            }
        }
        const wv sc_lo = WV_AND(WV_SRLI32(c < 2 ? sa : sb, 16 * (c % 2)), WV_SET32(0xff));
        const wv sc_hi = WV_AND(WV_SRLI32(c < 2 ? sa : sb, 16 * (c % 2) + 8), WV_SET32(0xff));
        const wv sc16_lo = WV_OR(sc_lo, WV_SLLI32(sc_lo, 16)), sc16_hi = WV_OR(sc_hi, WV_SLLI32(sc_hi, 16));
        const int pairs = fmt == FMT_Q4_K ? 8 : 4;
        for (int r = 0; r < rows; r++) {
            const int8_t *q = a->q + ((r0 + r) * a->blocks + b) * QK_K + 64 * c;
            S[r] = WV_ADD32(S[r], WV_ADD32(kqi_scaled(lo, q, 8, pairs, sc_lo, sc16_lo),
                                           kqi_scaled(hi, q + 32, 8, pairs, sc_hi, sc16_hi)));
        }
    }
    for (int r = 0; r < rows; r++)
        kqi_fold(S[r], M[r], d, dmin, a->d[(r0 + r) * a->blocks + b], &acc[r]);
}

/* acc[0 .. rows) (rows <= ROWS): rows r0 .. of a by outputs lane0 .. lane0 + COLS - 1 of the interleaved group at
 * `group` (fmt a constant) */
INLINE void kqi_tile(const int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *group, int lane0, fv *acc) {
    for (int r = 0; r < rows; r++)
        acc[r] = splatv(0.0f);
    for (int64_t b = 0; b < a->blocks; b++)
        kqi_block(fmt, a, r0, rows, group, lane0, b, acc);
}

#if COLS == 8
/* AVX2 (8 outputs a vector): one row by the whole group of 16, both halves of each super-block in turn (acc[0]:
 * outputs 0-7, acc[1]: 8-15). The two tiles of 8 one after the other read the group's bytes twice, the second time
 * from cache, and the first pass, half of each cache line used, waited on memory with half the work to hide it
 * behind; each output's chain is the same fmas in the same order, so the same bits. */
#define KQ_AHEAD 4 /* super-blocks of the group kqi_pair fetches ahead (the next group's, past its last) */
INLINE void kqi_pair(const int fmt, const ActQ *a, int64_t r0, const uint8_t *group, fv acc[2]) {
    acc[0] = acc[1] = splatv(0.0f);
    const int64_t bytes = 16 * block_bytes(fmt); /* one super-block of the group's 16 outputs */
    for (int64_t b = 0; b < a->blocks; b++) {
        /* one row is too little work to hide memory behind: the hardware prefetcher, which stops at each 4 KiB
         * page, left the decode of a step's experts (each a few pages of a new stretch) at ~60% of the rate of
         * the same call on cached weights; fetching KQ_AHEAD super-blocks ahead into L2 gained ~7% a decode step */
        for (int64_t line = 0; line < bytes; line += 64)
            __builtin_prefetch(group + (b + KQ_AHEAD) * bytes + line, 0, 2);
        kqi_block(fmt, a, r0, 1, group, 0, b, &acc[0]);
        kqi_block(fmt, a, r0, 1, group, 8, b, &acc[1]);
    }
}

static void kqi_pair_any(int fmt, const ActQ *a, int64_t r0, const uint8_t *group, fv acc[2]) {
    switch (fmt) {
    case FMT_Q4_K: kqi_pair(FMT_Q4_K, a, r0, group, acc); return;
    case FMT_Q5_K: kqi_pair(FMT_Q5_K, a, r0, group, acc); return;
    case FMT_Q2_K: kqi_pair(FMT_Q2_K, a, r0, group, acc); return;
    case FMT_Q3_K: kqi_pair(FMT_Q3_K, a, r0, group, acc); return;
    case FMT_IQ4_XS: kqi_pair(FMT_IQ4_XS, a, r0, group, acc); return;
    default: kqi_pair(FMT_Q6_K, a, r0, group, acc); return;
    }
}
#endif

/* each format its own copy, and in it one row (decode) and ROWS rows (a whole tile) with the count a constant: the
 * rows' S, M and acc then stay in registers (a variable count kept them in memory, a load and a store on every
 * sub-block's add, and Q6_K's unpacked values were spilled: batch-1 Q6_K read its bytes at 0.77x Q4_0's rate) */
#define KQI_ROWS(FMT)                                                                                               \
    if (rows == 1)                                                                                                  \
        kqi_tile(FMT, a, r0, 1, group, lane0, acc);                                                                 \
    else if (rows == ROWS)                                                                                          \
        kqi_tile(FMT, a, r0, ROWS, group, lane0, acc);                                                              \
    else                                                                                                            \
        kqi_tile(FMT, a, r0, rows, group, lane0, acc);                                                              \
    return;
static void kqi_tile_any(int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *group, int lane0, fv *acc) {
    switch (fmt) {
    case FMT_Q4_K: KQI_ROWS(FMT_Q4_K)
    case FMT_Q5_K: KQI_ROWS(FMT_Q5_K)
    case FMT_Q2_K: KQI_ROWS(FMT_Q2_K)
    case FMT_Q3_K: KQI_ROWS(FMT_Q3_K)
    case FMT_IQ4_XS: KQI_ROWS(FMT_IQ4_XS)
    default: KQI_ROWS(FMT_Q6_K)
    }
}

/* 2 and 3 rows (a mixture of experts' step: most experts get one to three of its tokens) with the count a constant,
 * as KQI_ROWS's 1 and ROWS: with it a variable, kqi_tile kept the rows' sums in memory (batch 2, gate/up 8192x2048,
 * one thread: Q4_K 400 -> 366 us, Q6_K 690 -> 550 us). Their own function: the same copies added to kqi_tile_any
 * made its one-row Q6_K copy 14-30% slower (batch-1 decode of every Q4_K_M file). */
static __attribute__((noinline)) void kqi_tile_few_any(int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *group,
                                                       int lane0, fv *acc) {
#define KQI_FEW(FMT)                                                                                                \
    if (rows == 2)                                                                                                  \
        kqi_tile(FMT, a, r0, 2, group, lane0, acc);                                                                 \
    else                                                                                                            \
        kqi_tile(FMT, a, r0, 3, group, lane0, acc);                                                                 \
    return;
    switch (fmt) {
    case FMT_Q4_K: KQI_FEW(FMT_Q4_K)
    case FMT_Q5_K: KQI_FEW(FMT_Q5_K)
    case FMT_Q2_K: KQI_FEW(FMT_Q2_K)
    case FMT_Q3_K: KQI_FEW(FMT_Q3_K)
    case FMT_IQ4_XS: KQI_FEW(FMT_IQ4_XS)
    default: KQI_FEW(FMT_Q6_K)
    }
#undef KQI_FEW
}

/* kqi_tile of any format and row count */
INLINE void kqi_tile_rows(int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *group, int lane0, fv *acc) {
    if (rows == 2 || rows == 3)
        kqi_tile_few_any(fmt, a, r0, rows, group, lane0, acc);
    else
        kqi_tile_any(fmt, a, r0, rows, group, lane0, acc);
}

#if defined(VNNI)
/* The wide tiles (avx512 with VNNI; Q4_K, Q5_K, Q6_K): WIDE_ROWS rows by the 32 outputs of two interleaved groups
 * of 16. A vpdpbusd of 16 outputs needs its row's 4 activations broadcast, and a broadcast from memory costs about
 * what the vpdpbusd does (measured on Zen 4: 8 rows x 16 outputs, one broadcast per vpdpbusd, ran at ~0.55 of the
 * rate of the same vpdpbusd on registers; one broadcast per two vpdpbusd ran at the full rate), so here each
 * broadcast serves both groups. Each k-group's values are unpacked once per 4 rows (not 8), which the halved
 * broadcasts more than pay for. The same integers S, M (any order) and the same fold per super-block as kqi_tile. */
#define WIDE_ROWS 4
/* k-group g of w[0], w[1] (the two groups) against each row's broadcast */
#define KQ4_WIDE_DOT(g)                                                                                             \
    for (int r = 0; r < WIDE_ROWS; r++) {                                                                           \
        const wv x = WV_BCAST4(q[r] + 64 * c + 32 * half + 4 * (g));                                                \
        t[0][r] = _mm512_dpbusd_epi32(t[0][r], w[0], x);                                                            \
        t[1][r] = _mm512_dpbusd_epi32(t[1][r], w[1], x);                                                            \
    }
/* Q4_K, Q5_K (kqi_tile's Q4_K branch): per sub-block of 32, its 8 k-groups' vpdpbusd on u (Q5_K: the nibble, plus
 * 16 where its 5th bit in qh is set), then vpmulld by the sub-block's scale; M by vpmaddwd, as kqi_tile */
INLINE void kq4_wide(const int fmt, const ActQ *a, int64_t r0, const uint8_t *group, int64_t row_bytes,
                     fv acc[2][WIDE_ROWS]) {
    const int64_t bytes = block_bytes(fmt), blocks = a->blocks;
    const wv low4 = WV_SET8(0x0f), bytes16 = WV_SET32(0x00ff00ff), six = WV_SET8(0x3f), two = WV_SET8(0x03);
    const int64_t qs = 64 + 64 * (fmt == FMT_Q4_K ? 3 : 11); /* the k-groups of qs (Q5_K: qh's 8 before them) */
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < WIDE_ROWS; r++)
            acc[v][r] = splatv(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk[2] = {group + b * 16 * bytes, group + 16 * row_bytes + b * 16 * bytes};
        const int8_t *q[WIDE_ROWS];
        for (int r = 0; r < WIDE_ROWS; r++)
            q[r] = a->q + ((r0 + r) * blocks + b) * QK_K;
        wv sa[2], sb[2], S[2][WIDE_ROWS];
        for (int v = 0; v < 2; v++) { /* the scales as kqi_tile's Q4_K */
            const wv s0 = WV_LOAD(blk[v] + 64), s2 = WV_LOAD(blk[v] + 192);
            sa[v] = WV_AND(s0, six), sb[v] = WV_OR(WV_AND(s2, low4), WV_SLLI16(WV_AND(WV_SRL16(s0, 6), two), 4));
            for (int r = 0; r < WIDE_ROWS; r++)
                S[v][r] = WV_ZERO;
        }
        for (int c = 0; c < 4; c++) /* 64 elements: sub-blocks 2c (the low nibbles), 2c + 1 (the high ones) */
            for (int half = 0; half < 2; half++) {
                wv t[2][WIDE_ROWS];
                for (int v = 0; v < 2; v++)
                    for (int r = 0; r < WIDE_ROWS; r++)
                        t[v][r] = WV_ZERO;
                if (fmt == FMT_Q5_K) { /* qh byte l's bit 2 c + half is element 64 c + 32 half + l's 5th */
                    const wv sel = WV_SET8((char)(1 << (2 * c + half)));
#pragma GCC unroll 8 /* else not unrolled: the accumulators then took two register copies per vpdpbusd */
                    for (int g = 0; g < 8; g++) {
                        wv w[2];
                        for (int v = 0; v < 2; v++) {
                            const wv raw = WV_LOAD(blk[v] + qs + 64 * (8 * c + g));
                            const wv qh = WV_LOAD(blk[v] + 64 * (4 + g));
                            w[v] = WV_FIFTH(WV_AND(half ? WV_SRL16(raw, 4) : raw, low4), sel, qh);
                        }
                        KQ4_WIDE_DOT(g)
                    }
                } else
                    for (int g = 0; g < 8; g++) {
                        wv w[2];
                        for (int v = 0; v < 2; v++) {
                            const wv raw = WV_LOAD(blk[v] + qs + 64 * (8 * c + g));
                            w[v] = WV_AND(half ? WV_SRL16(raw, 4) : raw, low4);
                        }
                        KQ4_WIDE_DOT(g)
                    }
                for (int v = 0; v < 2; v++) {
                    const wv sc = WV_AND(WV_SRLI32(c < 2 ? sa[v] : sb[v], 16 * (c % 2) + 8 * half), WV_SET32(0xff));
                    for (int r = 0; r < WIDE_ROWS; r++)
                        S[v][r] = WV_ADD32(S[v][r], WV_MULLO32(t[v][r], sc));
                }
            }
        int32_t s32[WIDE_ROWS][8]; /* each row's sums of each 32 */
        for (int r = 0; r < WIDE_ROWS; r++) {
            const int32_t *sums = a->sum + ((r0 + r) * blocks + b) * 16;
            for (int j = 0; j < 8; j++)
                s32[r][j] = sums[2 * j] + sums[2 * j + 1];
        }
        for (int v = 0; v < 2; v++) { /* M and the fold, as kqi_tile's Q4_K */
            const wv s0 = WV_LOAD(blk[v] + 64), s1 = WV_LOAD(blk[v] + 128), s2 = WV_LOAD(blk[v] + 192);
            const wv ma = WV_AND(s1, six), mb = WV_OR(WV_AND(WV_SRL16(s2, 4), low4), WV_SLLI16(WV_AND(WV_SRL16(s1, 6), two), 4));
            const wv mins[4] = {WV_AND(ma, bytes16), WV_SRL16(ma, 8), WV_AND(mb, bytes16), WV_SRL16(mb, 8)};
            (void)s0;
            const fv d = scales_at(blk[v]), dmin = scales_at(blk[v] + 32);
            for (int r = 0; r < WIDE_ROWS; r++) {
                wv M = WV_ZERO;
                for (int i = 0; i < 4; i++) {
                    const int j = 4 * (i / 2) + i % 2;
                    M = WV_ADD32(M, WV_MADD(mins[i], WV_SET32(kqi_pack(s32[r][j], s32[r][j + 2]))));
                }
                kqi_fold(S[v][r], M, d, dmin, a->d[(r0 + r) * blocks + b], &acc[v][r]);
            }
        }
    }
}

/* Q6_K (kqi_tile's Q6_K branch): per sub-block of 16 (h = 8 n + 2 run + half), its 4 k-groups' vpdpbusd on the
 * six-bit u (w = u - 32; each k-group's u unpacked from its ql, qh vectors as kqi_tile does) from -32 s_h (the row's
 * sum of the 16 activations), then vpmulld by the int8 scale: S = sum_h sc_h (sum u q - 32 s_h), the header's S of
 * w = u - 32 (kqi_tile adds the same integers in another order: S - 32 M). Each broadcast serves both groups. */
INLINE void kq6_wide(const ActQ *a, int64_t r0, const uint8_t *group, int64_t row_bytes, fv acc[2][WIDE_ROWS]) {
    const int64_t bytes = block_bytes(FMT_Q6_K), blocks = a->blocks;
    const wv low4 = WV_SET8(0x0f), high = WV_SET8(0x30);
    for (int v = 0; v < 2; v++)
        for (int r = 0; r < WIDE_ROWS; r++)
            acc[v][r] = splatv(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk[2] = {group + b * 16 * bytes, group + 16 * row_bytes + b * 16 * bytes};
        const int8_t *q[WIDE_ROWS];
        int32_t offset[WIDE_ROWS][16] __attribute__((aligned(64))); /* -32 s_h */
        for (int r = 0; r < WIDE_ROWS; r++) {
            const int64_t at = (r0 + r) * blocks + b;
            q[r] = a->q + at * QK_K;
            _mm512_store_si512((void *)offset[r], WV_SUB32(WV_ZERO, WV_SLLI32(WV_LOAD(a->sum + at * 16), 5)));
        }
        wv S[2][WIDE_ROWS];
        for (int v = 0; v < 2; v++)
            for (int r = 0; r < WIDE_ROWS; r++)
                S[v][r] = WV_ZERO;
        for (int n = 0; n < 2; n++)
            for (int half = 0; half < 2; half++)
                for (int run = 0; run < 4; run++) {
                    const int h = 8 * n + 2 * run + half;
                    wv t[2][WIDE_ROWS];
                    for (int r = 0; r < WIDE_ROWS; r++)
                        t[0][r] = t[1][r] = WV_SET32(offset[r][h]);
                    for (int k = 0; k < 4; k++) { /* elements 128 n + 32 run + 16 half + 4 k .. + 3 */
                        wv w[2];
                        for (int v = 0; v < 2; v++) {
                            const uint8_t *tp = blk[v] + 288 + 192 * (8 * n + 4 * half + k);
                            const wv bits = WV_LOAD(tp + 64 * (run % 2)), hb = WV_LOAD(tp + 128);
                            const wv lo = WV_AND(run < 2 ? bits : WV_SRL16(bits, 4), low4);
                            const wv hi = WV_AND(run == 0 ? WV_SLLI16(hb, 4) : run == 1 ? WV_SLLI16(hb, 2)
                                                 : run == 2 ? hb : WV_SRL16(hb, 2), high);
                            w[v] = WV_OR(lo, hi);
                        }
                        for (int r = 0; r < WIDE_ROWS; r++) {
                            const wv x = WV_BCAST4(q[r] + 128 * n + 32 * run + 16 * half + 4 * k);
                            t[0][r] = _mm512_dpbusd_epi32(t[0][r], w[0], x);
                            t[1][r] = _mm512_dpbusd_epi32(t[1][r], w[1], x);
                        }
                    }
                    for (int v = 0; v < 2; v++) {
                        const wv sc = WV_SRAI32(WV_SLLI32(WV_LOAD(blk[v] + 32 + 64 * (h / 4)), 24 - 8 * (h % 4)), 24);
                        for (int r = 0; r < WIDE_ROWS; r++)
                            S[v][r] = WV_ADD32(S[v][r], WV_MULLO32(t[v][r], sc));
                    }
                }
        for (int v = 0; v < 2; v++) { /* the fold, as kqi_tile's Q6_K */
            const fv d = scales_at(blk[v]);
            for (int r = 0; r < WIDE_ROWS; r++) {
                iv total;
                memcpy(&total, &S[v][r], sizeof total);
                const fv scale = d * splatv(a->d[(r0 + r) * blocks + b]); /* rounded once, then the fma */
                acc[v][r] = fmav(scale, __builtin_convertvector(total, fv), acc[v][r]);
            }
        }
    }
}

/* the wide tile of fmt (Q4_K, Q5_K, Q6_K; the caller checked it has one) */
INLINE void kqi_wide(const int fmt, const ActQ *a, int64_t r0, const uint8_t *group, int64_t row_bytes,
                     fv acc[2][WIDE_ROWS]) {
    if (fmt == FMT_Q6_K)
        kq6_wide(a, r0, group, row_bytes, acc);
    else if (fmt == FMT_Q5_K)
        kq4_wide(FMT_Q5_K, a, r0, group, row_bytes, acc);
    else
        kq4_wide(FMT_Q4_K, a, r0, group, row_bytes, acc);
}

/* rows r0 .. r0 + rows - 1 by the 32 outputs of the two interleaved groups at `group` (outputs c0 ..): the wide
 * tiles, then the rows past their multiple of WIDE_ROWS by kqi_tile; 0 where fmt has no wide tile (and nothing was
 * done). Its own function, not inlined, so that kq_linear's loop (and its batch-1 path) compiles as without it. */
static __attribute__((noinline)) int kqi_wide_rows(int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *group,
                                                   int64_t row_bytes, int64_t c0, const void *bias, void *out,
                                                   int64_t ldo, int out_bf16) {
    if (fmt != FMT_Q4_K && fmt != FMT_Q5_K && fmt != FMT_Q6_K)
        return 0;
    int r = 0;
    for (; r + WIDE_ROWS <= rows; r += WIDE_ROWS) {
        fv acc[2][WIDE_ROWS];
        kqi_wide(fmt, a, r0 + r, group, row_bytes, acc);
        for (int v = 0; v < 2; v++)
            for (int j = 0; j < 16; j++)
                kq_store((const float *)acc[v] + j, 16, r0 + r, WIDE_ROWS, c0 + 16 * v + j, bias, out, ldo, out_bf16);
    }
    for (; r < rows; r += ROWS) /* the rows left: the tiles of 16 outputs */
        for (int v = 0; v < 2; v++) {
            fv left[ROWS];
            const int part = rows - r < ROWS ? rows - r : ROWS;
            kqi_tile_rows(fmt, a, r0 + r, part, group + 16 * v * row_bytes, 0, left);
            for (int j = 0; j < COLS; j++)
                kq_store((const float *)left + j, COLS, r0 + r, part, c0 + 16 * v + j, bias, out, ldo, out_bf16);
        }
    return 1;
}
#endif
#endif

/* each format its own copy (fmt a constant in the decode and the step); group: as kq_chains */
static void kq_chains_any(int fmt, const ActQ *a, int64_t r0, int rows, const uint8_t *row, const uint8_t *group,
                          int lane, float *acc) {
    switch (fmt) {
    case FMT_Q2_K: kq_chains(FMT_Q2_K, a, r0, rows, row, group, lane, acc); return; /* group: generic, aarch64 */
    case FMT_Q3_K: kq_chains(FMT_Q3_K, a, r0, rows, row, group, lane, acc); return;
#if defined(__AVX2__)
    case FMT_Q4_K: kq_chains_x86(FMT_Q4_K, a, r0, rows, row, acc); return;
    case FMT_Q6_K: kq_chains_x86(FMT_Q6_K, a, r0, rows, row, acc); return;
    case FMT_Q5_K: kq_chains(FMT_Q5_K, a, r0, rows, row, NULL, 0, acc); return;
#else
    case FMT_Q4_K: kq_chains(FMT_Q4_K, a, r0, rows, row, group, lane, acc); return;
    case FMT_Q6_K: kq_chains(FMT_Q6_K, a, r0, rows, row, group, lane, acc); return;
    case FMT_Q5_K: kq_chains(FMT_Q5_K, a, r0, rows, row, group, lane, acc); return;
#endif
    default: kq_chains(FMT_IQ4_XS, a, r0, rows, row, group, lane, acc); return;
    }
    (void)group, (void)lane;
}

/* quant_linear_int8 for these formats: out = fma(acc, 1, bias) per (row, output); `grouped` outputs in
 * interleaved groups of 16 (Q4_K, Q5_K, Q6_K), the rest in row order */
static int kq_linear(const void *x, int64_t ldx, const uint8_t *w, int fmt, int64_t grouped, const void *bias, void *out,
                     int64_t ldo, int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads) {
    const int64_t row_bytes = quant_row_bytes(fmt, k);
    ActQ a;
    const int status = act_quantize(&a, 1, x, ldx, m, k, is_bf16, num_threads, (int)block_elems(fmt));
    if (status != KERNEL_OK)
        goto done;
    const int64_t chunks = (n + OUT_CHUNK - 1) / OUT_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t c0 = chunk * OUT_CHUNK, c1 = c0 + OUT_CHUNK < n ? c0 + OUT_CHUNK : n;
        for (int64_t r0 = 0; r0 < m; r0 += KQ_ROWS) {
            const int rows = m - r0 < KQ_ROWS ? (int)(m - r0) : KQ_ROWS;
            int64_t c = c0;
#if defined(VNNI)
            if (c1 - c0 == 32 && c1 <= grouped && rows >= WIDE_ROWS &&
                kqi_wide_rows(fmt, &a, r0, rows, w + c0 * row_bytes, row_bytes, c0, bias, out, ldo, out_bf16))
                c = c1;
#endif
#if defined(__AVX2__) && COLS == 8
            if (rows == 1) /* one row (decode): a group of 16 a call, both halves of each super-block in turn */
                for (; c % 16 == 0 && c + 16 <= c1 && c + 16 <= grouped; c += 16) {
                    fv acc[2];
                    kqi_pair_any(fmt, &a, r0, w + c * row_bytes, acc);
                    for (int j = 0; j < 16; j++)
                        kq_store((const float *)acc + j, 8, r0, 1, c + j, bias, out, ldo, out_bf16);
                }
#endif
#if defined(__AVX2__)
            for (; c < c1 && c < grouped; c += COLS) { /* whole groups: COLS outputs a tile, ROWS rows at a time */
                for (int r = 0; r < rows; r += ROWS) {
                    fv acc[ROWS];
                    const int part = rows - r < ROWS ? rows - r : ROWS;
                    kqi_tile_rows(fmt, &a, r0 + r, part, w + (c - c % 16) * row_bytes, (int)(c % 16), acc);
                    for (int j = 0; j < COLS; j++)
                        kq_store((const float *)acc + j, COLS, r0 + r, part, c + j, bias, out, ldo, out_bf16);
                }
            }
#endif
            for (; c < c1; c++) {
                float acc[KQ_ROWS];
                const int in_group = c < grouped;
                kq_chains_any(fmt, &a, r0, rows, w + c * row_bytes, in_group ? w + (c - c % 16) * row_bytes : NULL,
                              (int)(c % 16), acc);
                kq_store(acc, 1, r0, rows, c, bias, out, ldo, out_bf16);
            }
        }
    }
done:
    scratch_give(SCRATCH_ACT);
    return status;
}

/* whether this build takes the AMX path where it applies: compiled with AMX-INT8, the CPU has it and Linux
 * granted the tile data (asks for it once); the amx setting is not read here (the tests check this
 * first, so that their AMX-against-VNNI comparisons are not two runs of the VNNI tiles) */
int quant_dot_amx(void) {
#if defined(AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

/* quant_linear_into's int8-activation path (fmt without QUANT_ACT_INT8, with QUANT_INTERLEAVED where
 * the rows are): the same contract */
int quant_linear_int8(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads) {
    const int interleaved = (fmt & QUANT_INTERLEAVED) != 0;
    fmt &= ~QUANT_INTERLEAVED;
    const int64_t row_bytes = quant_row_bytes(fmt, k);
    if (row_bytes == 0 || (interleaved && fmt == FMT_INT8 && k % QBLOCK != 0))
        return KERNEL_BAD_SHAPE;
    /* IQ4_NL, Q5_0, Q5_1: Q4_0's tiles below (IQ4_NL's values through the table, Q5's nibbles with their qh bits) */
    if (kq_format(fmt) && !block32_tile_format(fmt))
        return m == 0 || n == 0 ? KERNEL_OK : kq_linear(x, ldx, w, fmt, interleaved ? n / 16 * 16 : 0, bias, out, ldo, m,
                                                        n, k, is_bf16, out_bf16, num_threads);
    const int64_t grouped = interleaved ? n / 16 * 16 : 0; /* outputs in whole interleaved groups */
    if (m == 0 || n == 0)
        return KERNEL_OK;
    ActQ a; /* x's quantized rows for the VNNI tiles (quantize_rows), where they make any output */
    const uint8_t *weights = w;
    int64_t first = 0; /* outputs from here: the VNNI tiles (the AMX path: those past the whole groups) */
    int have_rows = 0, status = KERNEL_OK;
#if defined(AMX)
    if (grouped > 0 && !block32_tile_format(fmt) && amx_wanted(fmt, m)) {
        /* the AMX tiles quantize x straight into their A rows, unless the VNNI tiles also make some outputs (a
         * last part tile of rows, the outputs past the whole groups): then both read quantize_rows' rows */
        const int vnni_too = amx_row_count(fmt, m) < m || grouped < n;
        const int64_t blocks = (k + QBLOCK - 1) / QBLOCK;
        have_rows = vnni_too && act_quantize(&a, 1, x, ldx, m, k, is_bf16, num_threads, QBLOCK) == KERNEL_OK;
        char *packed = scratch_take(SCRATCH_AMX_ROWS, amx_rows_bytes(m, blocks));
        if (have_rows == vnni_too && packed != NULL) { /* the VNNI tiles' rows quantized, where they need any */
            AmxRows rows;
            amx_rows_carve(&rows, m, blocks, &packed);
            if (amx_groups(fmt, vnni_too ? &a : NULL, x, ldx, is_bf16, &rows, m, blocks, weights, row_bytes, k,
                           grouped / 16, bias, out, ldo, out_bf16, num_threads))
                first = grouped;
        } /* else (or a thread's unpacked blocks) out of memory for the AMX path: the VNNI tiles do it all */
        scratch_give(SCRATCH_AMX_ROWS);
    }
#endif
    if (first < n && !have_rows)
        status = act_quantize(&a, 1, x, ldx, m, k, is_bf16, num_threads, QBLOCK);
    if (status != KERNEL_OK)
        goto done;
    const int64_t chunks = (n - first + OUT_CHUNK - 1) / OUT_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (first == 0)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t c0 = first + chunk * OUT_CHUNK, c1 = c0 + OUT_CHUNK < n ? c0 + OUT_CHUNK : n;
        for (int64_t r = 0; r < m; r += ROWS) {
            const int rows = m - r < ROWS ? (int)(m - r) : ROWS;
            int done = 0; /* rows of this tile of rows the wide tiles made */
#if defined(VNNI)
            if (c1 - c0 == 32 && c1 <= grouped && rows >= TILE_WIDE_ROWS &&
                tile_wide_any(fmt, rows / TILE_WIDE_ROWS * TILE_WIDE_ROWS, &a, r, weights + c0 * row_bytes, row_bytes,
                              bias, out, ldo, c0, out_bf16))
                done = rows / TILE_WIDE_ROWS * TILE_WIDE_ROWS;
#endif
            if (done == rows)
                continue;
            for (int64_t c = c0; c < c1; c += COLS) {
                const int cols = c1 - c < COLS ? (int)(c1 - c) : COLS;
                tile_any(rows - done, cols, fmt, c < grouped, &a, r + done, weights + c * row_bytes, row_bytes, k, bias,
                         out, ldo, c, out_bf16, NULL);
            }
        }
    }
done:
    scratch_give(SCRATCH_ACT);
    return status;
}

/* ---- K groups folded in registers ------------------------------------------------------------
 * A whole interleaved tile (COLS outputs from n0, rows 1..ROWS from r0) of `groups` K groups, group g's rows
 * group_bytes after group g - 1's and its activations a[g]: per group the chain of tile() on the group
 * (acc from 0, block by block, then fma(acc, scale, 0): the value tile_any writes to its partial), and the
 * groups' values added 0..G-1 into `sum` [rows, COLS] as quant_linear_int8_groups adds the partials: the same
 * operations on the same values, with the running sums in registers instead of a tile_any call per group
 * (down_proj's groups are 3 blocks of 32 wide at hidden 2048 / 8 groups: the calls' set-up and the
 * partials' stores made it read its bytes at ~0.55x gate_up's rate). */
INLINE void fold_tile(const int rows, const int fmt, const ActQ *a, int64_t groups, int64_t r0, const uint8_t *w,
                      int64_t row_bytes, int64_t group_bytes, int64_t n0, float *sum) {
    const int lane0 = (int)(n0 % 16);
    fv total[ROWS];
    for (int r = 0; r < ROWS; r++) /* never read before group 0 sets it (groups >= 1); aarch64's gcc cannot tell */
        total[r] = splatv(0.0f);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes + (n0 - lane0) * row_bytes;
        const int64_t blocks = a[g].blocks, share = (16 * row_bytes + blocks - 1) / blocks;
        const uint8_t *ahead = group + 16 * row_bytes; /* the next group of 16 outputs: each of several K groups its own
                                                        * short stream, which the hardware prefetcher left cold */
        fv acc[ROWS];
        for (int r = 0; r < ROWS; r++)
            acc[r] = splatv(0.0f);
        for (int64_t b = 0; b < blocks; b++) {
            if (groups > 1 && lane0 == 0)
                for (int64_t offset = b * share; offset < (b + 1) * share; offset += 64)
                    __builtin_prefetch(ahead + offset, 0, 3);
            Prepared pw;
            prepare_interleaved(fmt, group, b, lane0, &pw);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const int64_t at = (r0 + r) * blocks + b;
                const iv isum = block_isums(fmt, &pw, a[g].q + at * QBLOCK, a[g].sum[at], rows);
                const fv sums = __builtin_convertvector(isum, fv);
                const fv scale = fmt == FMT_INT8 ? splatv(a[g].d[at]) : pw.dw * splatv(a[g].d[at]);
                acc[r] = fmav(scale, sums, acc[r]);
                if (fmt == FMT_Q4_1)
                    acc[r] = fmav(pw.mw, splatv(a[g].sx[at]), acc[r]);
            }
        }
        fv scale = splatv(1.0f);
        if (fmt == FMT_INT8)
            for (int c = 0; c < COLS; c++)
                memcpy(&scale[c], group + 4 * (lane0 + c), 4);
        for (int r = 0; r < rows; r++) {
            const fv value = fmav(acc[r], scale, splatv(0.0f));
            total[r] = g == 0 ? value : total[r] + value;
        }
    }
    for (int r = 0; r < rows; r++)
        memcpy(sum + r * COLS, &total[r], sizeof total[r]);
}
#define FOLD_CASE(R, FMT) case R: fold_tile(R, FMT, a, groups, r0, w, row_bytes, group_bytes, n0, sum); return 1;
#if ROWS == 8
#define FOLD_ROWS(FMT)                                                                                              \
    switch (rows) {                                                                                                 \
    FOLD_CASE(1, FMT) FOLD_CASE(2, FMT) FOLD_CASE(3, FMT) FOLD_CASE(4, FMT) FOLD_CASE(5, FMT) FOLD_CASE(6, FMT)     \
    FOLD_CASE(7, FMT) default: fold_tile(ROWS, FMT, a, groups, r0, w, row_bytes, group_bytes, n0, sum); return 1;   \
    }
#else
#define FOLD_ROWS(FMT)                                                                                              \
    switch (rows) {                                                                                                 \
    FOLD_CASE(1, FMT) FOLD_CASE(2, FMT) FOLD_CASE(3, FMT)                                                           \
    default: fold_tile(ROWS, FMT, a, groups, r0, w, row_bytes, group_bytes, n0, sum); return 1;                     \
    }
#endif
/* fold_tile with the format and the row count constants (1), or 0 for a format it leaves to tile_any */
static int fold_tile_any(int rows, int fmt, const ActQ *a, int64_t groups, int64_t r0, const uint8_t *w,
                         int64_t row_bytes, int64_t group_bytes, int64_t n0, float *sum) {
    switch (fmt) {
    case FMT_Q8_0: FOLD_ROWS(FMT_Q8_0)
    case FMT_Q4_0: FOLD_ROWS(FMT_Q4_0)
    case FMT_Q4_1: FOLD_ROWS(FMT_Q4_1)
    case FMT_INT8: FOLD_ROWS(FMT_INT8)
    default: return 0;
    }
}

/* ---- a tile of G K groups, folded in registers, then stored --------------------------------------
 * What quant_linear_int8_groups and quant_experts_int8 make per tile: rows r .. r + rows - 1 of the groups'
 * activations a[g] (1..ROWS rows) by outputs c .. c + cols - 1 (1..COLS; `il`: a whole tile of an interleaved group
 * of 16), each K group's value as quant_linear_int8 gives it on the group alone (bias none, fp32 out: tile's
 * fma(acc, scale, 0), kq_store's fma(acc, 1, 0)), the groups' values added in the order 0..G-1 in fp32 and
 * rounded once to out's dtype, into out's rows out_r .. (the contract of row_parallel.c's fold_partials). */

/* one K group's values for the tile into part [rows, COLS] (lanes past cols unset): quant_linear_int8's on the group,
 * bias none, fp32 out. The super-block K-quants (kq_linear's formats): the accumulators of kq_linear's own tiles
 * (kqi_tile on x86's interleaved groups, kq_chains for the rest) as kq_store rounds them; the rest: tile_any's partial.
 * wg: the group's rows */
static void group_tile(int rows, int cols, int fmt, int il, const ActQ *a, int64_t r, const uint8_t *wg,
                       int64_t row_bytes, int64_t kg, int64_t c, float *part) {
    if (!kq_format(fmt) || block32_tile_format(fmt)) {
        tile_any(rows, cols, fmt, il, a, r, wg + c * row_bytes, row_bytes, kg, NULL, NULL, 0, c, 0, part);
        return;
    }
#if defined(__AVX2__)
    if (il) {
        fv acc[ROWS];
        kqi_tile_rows(fmt, a, r, rows, wg + (c - c % 16) * row_bytes, (int)(c % 16), acc);
        for (int i = 0; i < rows; i++) {
            const fv value = fmav(acc[i], splatv(1.0f), splatv(0.0f)); /* kq_store's, bias none */
            memcpy(part + i * COLS, &value, sizeof value);
        }
        return;
    }
#endif
    for (int j = 0; j < cols; j++) {
        float acc[KQ_ROWS];
        const int64_t o = c + j;
        kq_chains_any(fmt, a, r, rows, wg + o * row_bytes, il ? wg + (o - o % 16) * row_bytes : NULL, (int)(o % 16),
                      acc);
        for (int i = 0; i < rows; i++)
            part[i * COLS + j] = fmaf(acc[i], 1.0f, 0.0f); /* kq_store's, bias none */
    }
}

/* the tile: fold_tile for whole interleaved tiles of Q4_0, Q4_1, Q8_0, INT8, else group_tile's values per group added
 * in order; then the store */
static void fold_store(int rows, int cols, int fmt, int il, const ActQ *a, int64_t groups, int64_t r, const uint8_t *w,
                       int64_t row_bytes, int64_t group_bytes, int64_t kg, int64_t c, void *out, int64_t ldo,
                       int64_t out_r, int out_bf16) {
    float sum[ROWS * COLS], part[ROWS * COLS];
    if (!(cols == COLS && il && fold_tile_any(rows, fmt, a, groups, r, w, row_bytes, group_bytes, c, sum)))
        for (int64_t g = 0; g < groups; g++) {
            group_tile(rows, cols, fmt, il, &a[g], r, w + g * group_bytes, row_bytes, kg, c, g == 0 ? sum : part);
            if (g > 0)
                for (int i = 0; i < rows; i++)
                    for (int j = 0; j < cols; j++)
                        sum[i * COLS + j] += part[i * COLS + j];
        }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            const int64_t at = (out_r + i) * ldo + c + j;
            store_out(out, at, sum[i * COLS + j], out_bf16);
        }
}

#if defined(VNNI)
/* the wide tiles (avx512 VNNI, 4 rows by the 32 outputs of two interleaved groups of 16 from c; w: K group 0's rows)
 * folded: each K group's tile_wide or kqi_wide accumulators, as their store makes them (fma(acc, 1, 0)), added in
 * the order 0..G-1 (a 4 x 32 running sum, in registers or L1), rounded once to out's dtype */
INLINE void wide_fold(const int fmt, const ActQ *a, int64_t groups, int64_t r, const uint8_t *w, int64_t row_bytes,
                      int64_t group_bytes, int64_t c, void *out, int64_t ldo, int64_t out_r, int out_bf16) {
    fv total[2][TILE_WIDE_ROWS];
    for (int64_t g = 0; g < groups; g++) {
        fv acc[2][TILE_WIDE_ROWS];
        const uint8_t *group = w + g * group_bytes + c * row_bytes;
        if (kq_format(fmt)) /* fmt a constant: the K-quants kqi_wide takes (wide_fold_any's cases) */
            kqi_wide(fmt, &a[g], r, group, row_bytes, acc);
        else
            tile_wide_acc(fmt, &a[g], r, group, row_bytes, acc);
        for (int v = 0; v < 2; v++)
            for (int i = 0; i < TILE_WIDE_ROWS; i++) {
                const fv value = fmav(acc[v][i], splatv(1.0f), splatv(0.0f));
                total[v][i] = g == 0 ? value : total[v][i] + value;
            }
    }
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < TILE_WIDE_ROWS; i++)
            for (int j = 0; j < 16; j++) {
                const int64_t at = (out_r + i) * ldo + c + 16 * v + j;
                store_out(out, at, total[v][i][j], out_bf16);
            }
}

/* rows r .. r + rows - 1 (a multiple of TILE_WIDE_ROWS) in wide_fold's tiles: 1, or 0 where fmt has none (nothing
 * done). Not inlined, so that the callers' batch-1 loops compile as without it. A K-quant kqi_wide takes: its case
 * here (as kqi_wide_rows'). */
static __attribute__((noinline)) int wide_fold_any(int fmt, int rows, const ActQ *a, int64_t groups, int64_t r,
                                                   const uint8_t *w, int64_t row_bytes, int64_t group_bytes, int64_t c,
                                                   void *out, int64_t ldo, int64_t out_r, int out_bf16) {
    for (int i = 0; i < rows; i += TILE_WIDE_ROWS)
        switch (fmt) {
        case FMT_Q4_0: wide_fold(FMT_Q4_0, a, groups, r + i, w, row_bytes, group_bytes, c, out, ldo, out_r + i, out_bf16); break;
        case FMT_Q4_1: wide_fold(FMT_Q4_1, a, groups, r + i, w, row_bytes, group_bytes, c, out, ldo, out_r + i, out_bf16); break;
        case FMT_Q8_0: wide_fold(FMT_Q8_0, a, groups, r + i, w, row_bytes, group_bytes, c, out, ldo, out_r + i, out_bf16); break;
        case FMT_Q4_K: wide_fold(FMT_Q4_K, a, groups, r + i, w, row_bytes, group_bytes, c, out, ldo, out_r + i, out_bf16); break;
        case FMT_Q5_K: wide_fold(FMT_Q5_K, a, groups, r + i, w, row_bytes, group_bytes, c, out, ldo, out_r + i, out_bf16); break;
        case FMT_Q6_K: wide_fold(FMT_Q6_K, a, groups, r + i, w, row_bytes, group_bytes, c, out, ldo, out_r + i, out_bf16); break;
        default: return 0;
        }
    return 1;
}
#endif

/* rows r .. r + rows - 1 (rows <= ROWS) by outputs c0 .. c1 - 1 (one chunk of OUT_CHUNK) of G folded K groups: the
 * wide tiles where they apply (4+ rows, two whole interleaved groups), fold_store for the rest */
static void fold_chunk(int rows, int fmt, const ActQ *a, int64_t groups, int64_t r, const uint8_t *w, int64_t row_bytes,
                       int64_t group_bytes, int64_t kg, int64_t grouped, int64_t c0, int64_t c1, void *out, int64_t ldo,
                       int64_t out_r, int out_bf16) {
    int done = 0; /* rows the wide tiles made */
#if defined(VNNI)
    if (c1 - c0 == 32 && c1 <= grouped && rows >= TILE_WIDE_ROWS &&
        wide_fold_any(fmt, rows / TILE_WIDE_ROWS * TILE_WIDE_ROWS, a, groups, r, w, row_bytes, group_bytes, c0, out,
                      ldo, out_r, out_bf16))
        done = rows / TILE_WIDE_ROWS * TILE_WIDE_ROWS;
#endif
    if (done == rows)
        return;
#if defined(__AVX2__) && COLS == 8
    if (rows == 1 && kq_format(fmt) && !block32_tile_format(fmt)) /* one row: whole groups of 16 by kqi_pair */
        for (; c0 % 16 == 0 && c0 + 16 <= c1 && c0 + 16 <= grouped; c0 += 16) {
            float sum[16];
            for (int64_t g = 0; g < groups; g++) {
                fv acc[2];
                kqi_pair_any(fmt, &a[g], r, w + g * group_bytes + c0 * row_bytes, acc);
                for (int j = 0; j < 16; j++) { /* group_tile's value (kq_store's, bias none), added as fold_store's */
                    const float value = fmaf(((const float *)acc)[j], 1.0f, 0.0f);
                    sum[j] = g == 0 ? value : sum[j] + value;
                }
            }
            for (int j = 0; j < 16; j++)
                store_out(out, out_r * ldo + c0 + j, sum[j], out_bf16);
        }
#endif
    for (int64_t c = c0; c < c1; c += COLS)
        fold_store(rows - done, c1 - c < COLS ? (int)(c1 - c) : COLS, fmt, c < grouped, a, groups, r + done, w,
                   row_bytes, group_bytes, kg, c, out, ldo, out_r + done, out_bf16);
}

/* Below FEW_ROWS rows (decode) a thread takes a run of up to RUN_OUTPUTS outputs and streams each K group's rows of
 * them in turn, the run's values summed in order in L1 (sum[rows, run]): per group one long read, as the group's own
 * call makes it. Per tile (fold_store's order) a thread read G short runs of 16 rows, one per group, which the
 * hardware prefetcher left cold (down_proj at 1B, Q4_K, batch 1: ~0.85x the partials' speed in CPU time); from
 * FEW_ROWS rows the tiles' work hides it, and the wide tiles need 4 rows. */
#define FEW_ROWS 4
#define RUN_OUTPUTS 512
static void fold_runs(int fmt, int interleaved, const ActQ *a, int64_t groups, int64_t m, int64_t n, int64_t kg,
                      const uint8_t *w, int64_t row_bytes, void *out, int64_t ldo, int is_bf16, int num_threads) {
    const int64_t grouped = interleaved ? n / 16 * 16 : 0, group_bytes = n * row_bytes;
    const int64_t threads = num_threads > 1 ? num_threads : 1;
    int64_t run = ((n + threads - 1) / threads + OUT_CHUNK - 1) / OUT_CHUNK * OUT_CHUNK; /* every thread a run */
    run = run > RUN_OUTPUTS ? RUN_OUTPUTS : run;
    const int64_t runs = (n + run - 1) / run;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < runs; i++) {
        const int64_t c0 = i * run, c1 = c0 + run < n ? c0 + run : n;
        float sum[FEW_ROWS * RUN_OUTPUTS], part[ROWS * COLS];
        for (int64_t g = 0; g < groups; g++)
            for (int64_t c = c0; c < c1; c += COLS) {
                const int cols = c1 - c < COLS ? (int)(c1 - c) : COLS;
                group_tile((int)m, cols, fmt, c < grouped, &a[g], 0, w + g * group_bytes, row_bytes, kg, c, part);
                for (int r = 0; r < m; r++)
                    for (int j = 0; j < cols; j++) {
                        float *at = &sum[r * RUN_OUTPUTS + c - c0 + j];
                        *at = g == 0 ? part[r * COLS + j] : *at + part[r * COLS + j];
                    }
            }
        for (int r = 0; r < m; r++)
            for (int64_t c = c0; c < c1; c++)
                store_out(out, r * ldo + c, sum[r * RUN_OUTPUTS + c - c0], is_bf16);
    }
}

/* row_parallel_linear's int8-activation path in one process: the G groups' weights [n, kg] one after
 * the other (each interleaved or not, as fmt says), out [m, n] (x's dtype) = their partials folded in
 * the order 0..G-1, as fold_partials folds them: each tile's G partials are the tile's values of
 * quant_linear_int8 on the group (bias none, out fp32), added in order in registers and rounded once,
 * so the bits are those of the partials and the fold, without their memory, G + 1 parallel regions
 * and G quantization calls. Each group's columns of x are quantized from the group's first column,
 * as the group's own call does (in super-blocks of 256 for the K-quants, as kq_linear does). Every
 * format quant_linear_int8 takes. */
int quant_linear_int8_groups(const void *x, int64_t ldx, const void *w, int fmt, int64_t groups, int64_t m, int64_t n,
                             int64_t kg, int is_bf16, void *out, int64_t ldo, int num_threads) {
    const int interleaved = (fmt & QUANT_INTERLEAVED) != 0;
    fmt &= ~QUANT_INTERLEAVED;
    const int64_t row_bytes = quant_row_bytes(fmt, kg);
    if (row_bytes == 0 || groups < 1 || groups > MAX_FOLD_GROUPS || (interleaved && fmt == FMT_INT8 && kg % QBLOCK))
        return KERNEL_BAD_SHAPE;
    if (m == 0 || n == 0)
        return KERNEL_OK;
    ActQ a[MAX_FOLD_GROUPS]; /* each K group's quantized rows for the VNNI tiles, where they make any output */
    const uint8_t *weights = w;
    const int64_t group_bytes = n * row_bytes, grouped = interleaved ? n / 16 * 16 : 0;
    int64_t amx_rows = 0, amx_cols = 0; /* the tiles the AMX path made: rows [0, amx_rows) x outputs [0, amx_cols) */
    int have_rows = 0, status = KERNEL_OK;
#if defined(AMX)
    if (grouped > 0 && !kq_format(fmt) && amx_wanted(fmt, m)) { /* as quant_linear_int8's AMX path, per K group */
        const int64_t rows = amx_row_count(fmt, m), blocks = (kg + QBLOCK - 1) / QBLOCK; /* the rest: VNNI */
        const int vnni_too = rows < m || grouped < n;
        have_rows = vnni_too && act_quantize(a, groups, x, ldx, m, kg, is_bf16, num_threads, QBLOCK) == KERNEL_OK;
        char *rows_at = scratch_take(SCRATCH_AMX_ROWS, (size_t)groups * amx_rows_bytes(m, blocks));
        if (have_rows == vnni_too && rows_at != NULL) { /* the VNNI tiles' rows quantized, where they need any */
            AmxRows packed[MAX_FOLD_GROUPS];
            for (int64_t g = 0; g < groups; g++)
                amx_rows_carve(&packed[g], m, blocks, &rows_at);
            if (amx_fold_groups(fmt, packed, vnni_too ? a : NULL, x, ldx, is_bf16, m, kg, groups, blocks, rows,
                                weights, row_bytes, group_bytes, grouped / 16, out, ldo, num_threads))
                amx_rows = rows, amx_cols = grouped;
        } /* else (or a thread's unpacked blocks) out of memory for the AMX path: the VNNI tiles do it all */
        scratch_give(SCRATCH_AMX_ROWS);
    }
#endif
    const int vnni_left = amx_rows < m || amx_cols < n; /* none at the AMX tiles' usual 16+ rows */
    if (vnni_left && !have_rows)
        status = act_quantize(a, groups, x, ldx, m, kg, is_bf16, num_threads, (int)block_elems(fmt));
    if (status == KERNEL_OK && m < FEW_ROWS) { /* decode: each group's run of outputs in turn (no AMX at these rows) */
        fold_runs(fmt, interleaved, a, groups, m, n, kg, weights, row_bytes, out, ldo, is_bf16, num_threads);
        scratch_give(SCRATCH_ACT);
        return status;
    }
    /* what the AMX tiles left (nothing at all at their usual 16+ rows: no parallel region then) */
    const int64_t chunks = status == KERNEL_OK && vnni_left ? (n + OUT_CHUNK - 1) / OUT_CHUNK : 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (chunks > 0)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t c0 = chunk * OUT_CHUNK, c1 = c0 + OUT_CHUNK < n ? c0 + OUT_CHUNK : n;
        for (int64_t r = 0; r < m; r += ROWS) {
            const int rows = m - r < ROWS ? (int)(m - r) : ROWS;
            /* rows the AMX tiles made: only the outputs past theirs (none where they made the whole chunk) */
            const int64_t from = r + rows <= amx_rows && amx_cols > c0 ? amx_cols : c0;
            if (from < c1)
                fold_chunk(rows, fmt, a, groups, r, weights, row_bytes, group_bytes, kg, grouped, from, c1, out, ldo, r,
                           is_bf16);
        }
    }
    scratch_give(SCRATCH_ACT);
    return status;
}

/* ---- a mixture-of-experts layer's experts in one parallel region (services/worker/models/moe.py) ----------------
 * x [m, k]: a step's rows grouped by expert, expert i's rows spans[2 i] .. spans[2 i + 1] - 1, its weight at
 * weights[i]: `groups` K groups of kg = k / groups columns one after the other, each [n, kg] (n quant_row_bytes
 * rows; interleaved as fmt says). out [m, n] (x's dtype) row r = x's row r times its expert's weight, each K
 * group's tile partials added in the order 0..G-1 in registers and rounded once: groups 1 gives
 * quant_linear_int8's bits (no bias), groups G those of quant_linear_int8_groups (row_parallel_linear), for
 * each row whatever rows and experts share the call. Per step one quantization of x (every expert's rows are
 * rows of it, each group's columns quantized from the group's first column as the group's own call does) and
 * one parallel region, where the experts' own calls took 2 regions each (decode at 8 experts: 16, whose
 * fork, join and uneven shares were a third of the layer's time). Each thread takes one contiguous run of
 * the (expert, chunk of OUT_CHUNK outputs) items, the runs cut at equal estimated cost (a chunk's weight
 * bytes, and its rows' tiles), so every thread streams its own stretch of weights; each tile through
 * fold_chunk (quant_linear_int8_groups' tiles: the wide tiles, fold_tile, group_tile's values per group).
 * The VNNI / vpmaddubsw / generic tiles only (no AMX: its tiles give the same bits, so a caller with
 * many rows per expert can take the experts' own calls instead); every format quant_linear_int8 takes, the
 * super-block K-quants' rows quantized per super-block of 256 as kq_linear does; else KERNEL_BAD_SHAPE. */
int quant_experts_int8(const void *x, int64_t ldx, const int64_t *spans, const int64_t *weights, int64_t count,
                       int fmt, int64_t groups, int64_t m, int64_t n, int64_t k, int is_bf16, void *out, int64_t ldo,
                       int num_threads) {
    const int interleaved = (fmt & QUANT_INTERLEAVED) != 0;
    fmt &= ~QUANT_INTERLEAVED;
    if (groups < 1 || groups > MAX_FOLD_GROUPS || k % groups != 0 || count < 0)
        return KERNEL_BAD_SHAPE;
    const int64_t kg = k / groups, row_bytes = quant_row_bytes(fmt, kg);
    if (row_bytes == 0 || (interleaved && fmt == FMT_INT8 && kg % QBLOCK))
        return KERNEL_BAD_SHAPE;
    for (int64_t i = 0; i < count; i++)
        if (spans[2 * i] < 0 || spans[2 * i] > spans[2 * i + 1] || spans[2 * i + 1] > m)
            return KERNEL_BAD_SHAPE;
    if (m == 0 || n == 0 || count == 0)
        return KERNEL_OK;
    ActQ a[MAX_FOLD_GROUPS];
    const int span = (int)block_elems(fmt), sums = span == QK_K ? 16 : 1; /* each cell's q bytes, its integer sums */
    int status = act_quantize(a, groups, x, ldx, m, kg, is_bf16, num_threads, span);
    int64_t *cost = malloc(sizeof(int64_t) * (size_t)(count + 1)); /* cost[i]: the items' cost before expert i */
    if (cost == NULL)
        status = KERNEL_OUT_OF_MEMORY;
    if (status != KERNEL_OK)
        goto done;
    const int64_t chunks = (n + OUT_CHUNK - 1) / OUT_CHUNK, group_bytes = n * row_bytes;
    const int64_t grouped = interleaved ? n / 16 * 16 : 0;
    cost[0] = 0; /* a chunk: reading its weights, about a whole tile of rows' work, then its rows' tiles */
    for (int64_t i = 0; i < count; i++)
        cost[i + 1] = cost[i] + chunks * (ROWS + spans[2 * i + 1] - spans[2 * i]);
    const int64_t total = cost[count];
    if (num_threads < 1)
        num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < num_threads; t++) {
        /* the items whose cost starts in [total t / T, total (t + 1) / T): each item in exactly one run */
        const int64_t from = total * t / num_threads, to = total * (t + 1) / num_threads;
        for (int64_t i = 0; i < count; i++) {
            const int64_t start = spans[2 * i], stop = spans[2 * i + 1], each = ROWS + stop - start;
            if (stop == start || cost[i + 1] <= from || cost[i] >= to)
                continue;
            const int64_t first = cost[i] >= from ? 0 : (from - cost[i] + each - 1) / each;
            const int64_t last = cost[i + 1] <= to ? chunks : (to - cost[i] + each - 1) / each;
            const uint8_t *w = (const uint8_t *)(intptr_t)weights[i];
            ActQ mine[MAX_FOLD_GROUPS]; /* the expert's rows as a call of its own sees them (its row 0 first) */
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = start * a[g].blocks;
                mine[g] = a[g];
                mine[g].q += at * span, mine[g].d += at, mine[g].sx += at, mine[g].sum += at * sums;
            }
            for (int64_t chunk = first; chunk < last; chunk++) {
                const int64_t c0 = chunk * OUT_CHUNK, c1 = c0 + OUT_CHUNK < n ? c0 + OUT_CHUNK : n;
                for (int64_t r = 0; r < stop - start; r += ROWS) /* the expert's rows, ROWS at a time */
                    fold_chunk(stop - start - r < ROWS ? (int)(stop - start - r) : ROWS, fmt, mine, groups, r, w,
                               row_bytes, group_bytes, kg, grouped, c0, c1, out, ldo, start + r, is_bf16);
            }
        }
    }
done:
    free(cost);
    scratch_give(SCRATCH_ACT);
    return status;
}
