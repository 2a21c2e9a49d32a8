/* What quant_dot.c (the int8-activation linear layers, their VNNI / vpmaddubsw / generic tiles) and quant_amx.c
 * (their AMX tiles) share: the tile's width, the fp32 vectors, the quantized activations and their rounding
 * (quant_dot.c's header has the rule and the interleaved layout), the AMX path's rows and each file's functions
 * the other calls. */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "quant_blocks.h"
#include "vec.h"

/* a function one of the two files defines and the other calls: not exported from the library */
#define SHARED __attribute__((visibility("hidden")))

/* outputs per tile, one fp32 lane each: a 512-bit register of int32 sums on AVX-512, 256-bit below */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define COLS 16
#else
#define COLS 8
#endif
#ifndef ROWS
#if COLS == 16
#define ROWS 8      /* rows of x per tile: each block's unpacked weights serve them all */
#else
#define ROWS 4
#endif
#endif
#define TINY 7.52316384526264e-37f /* 2^-120 */

typedef float fv __attribute__((vector_size(4 * COLS)));
typedef int32_t iv __attribute__((vector_size(4 * COLS)));

/* c + a b fused, lane by lane: vec.h's fma of the tile's width */
#if COLS == 16
#define fmav fma16
#else
#define fmav fma8
#endif

INLINE fv splatv(float v) { /* a broadcast (adding v to a zero vector would turn -0 into +0) */
    fv out;
#if COLS == 16
    const __m512 wide = _mm512_set1_ps(v);
    memcpy(&out, &wide, 64);
#elif defined(__AVX__)
    const __m256 wide = _mm256_set1_ps(v);
    memcpy(&out, &wide, 32);
#else
    for (int i = 0; i < COLS; i++)
        out[i] = v;
#endif
    return out;
}

/* ---- activations (quant_dot.c's quantize_rows; quant_amx.c's A rows) ------------------ */
typedef struct {
    int8_t *q;    /* [m, blocks * span] */
    float *d;     /* [m, blocks] */
    float *sx;    /* [m, blocks]: d * sum (of the whole block) */
    int32_t *sum; /* [m, blocks] (span 256: [m, blocks, 16], the sums of each 16) */
    int64_t blocks;
    int span;     /* elements per block: 32, or 256 (a super-block: the K-quants, IQ4_XS) */
} ActQ;

/* a block's amax (its bit pattern, the largest |x_i|) as a float, or 0 after writing the block of a zero, tiny or
 * non-finite amax (q = 0, d = 0 or NaN); the rule is quant_dot.c's header's, shared by every quantize_block */
INLINE float block_amax(uint32_t amax_bits, int8_t *q, float *d, int32_t *sum, float *sx) {
    float amax;
    memcpy(&amax, &amax_bits, 4);
    if (amax_bits >= 0x7f800000u || amax < TINY) {
        memset(q, 0, QBLOCK);
        *d = amax_bits >= 0x7f800000u ? __builtin_nanf("") : 0.0f;
        *sum = 0;
        *sx = 0.0f;
        return 0.0f;
    }
    return amax;
}

/* a quantized block's d, integer sum and sx = d (float)sum */
INLINE void block_sums(float amax, int32_t total, float *d, int32_t *sum, float *sx) {
    *d = amax / 127.0f;
    *sum = total;
    *sx = *d * (float)total;
}

#if COLS == 16
/* quantize_block on AVX-512, reading the row in place (its dtype's values widened exactly, the lanes past k
 * zero): the same operations lane by lane (bit-pattern max, one product, cvtps2dq's round half to even),
 * the integer sum in any order; the scalar element loops made quantize_rows a third of a 16-row
 * 576 x 576 layer's time */
INLINE __m512 act_load16(const void *x, int64_t at, int64_t count, int is_bf16) { /* count: 0..16 lanes */
    const __mmask16 lanes = count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (count > 0 ? count : 0)) - 1);
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, (const uint16_t *)x + at)), 16));
    return _mm512_maskz_loadu_ps(lanes, (const float *)x + at);
}

INLINE void quantize_block16(const void *x, int64_t at, int64_t count, int is_bf16, int8_t *q, float *d, int32_t *sum,
                             float *sx) {
    const __m512 lo = act_load16(x, at, count, is_bf16), hi = act_load16(x, at + 16, count - 16, is_bf16);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const uint32_t amax_bits = (uint32_t)_mm512_reduce_max_epu32(
        _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(lo), magnitude),
                         _mm512_and_si512(_mm512_castps_si512(hi), magnitude)));
    const float amax = block_amax(amax_bits, q, d, sum, sx);
    if (amax == 0.0f)
        return;
    const float inv = 127.0f / amax;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo)); /* |q| <= 127: the truncation is the value */
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    block_sums(amax, total, d, sum, sx);
}

/* quant_dot.c's quantize_super on AVX-512, reading the row in place: the super-block's 256 values (lanes past k
 * zero) in 16 registers, then quantize_block16's operations lane by lane (bit-pattern max, one product,
 * cvtps2dq's round half to even), each 16's integer sum in any order. The scalar loop (lrintf a call per
 * element) took 16% of a 1B model's pp512 */
INLINE void quantize_super16(const void *x, int64_t at, int64_t count, int is_bf16, int8_t *q, float *d, int32_t *sum16,
                             float *sx) {
    __m512 v[16];
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i top = _mm512_setzero_si512();
    for (int h = 0; h < 16; h++) {
        v[h] = act_load16(x, at + 16 * h, count - 16 * h, is_bf16);
        top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(v[h]), magnitude));
    }
    int32_t total;
    const float amax = block_amax((uint32_t)_mm512_reduce_max_epu32(top), q, d, &total, sx);
    if (amax == 0.0f) {
        memset(q, 0, 256);
        memset(sum16, 0, 16 * sizeof(int32_t));
        return;
    }
    const __m512 vinv = _mm512_set1_ps(127.0f / amax);
    total = 0;
    for (int h = 0; h < 16; h++) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], vinv));
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtepi32_epi8(qi)); /* |q| <= 127 */
        sum16[h] = _mm512_reduce_add_epi32(qi);
        total += sum16[h];
    }
    block_sums(amax, total, d, &total, sx);
}
#endif

INLINE size_t align64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* interleaved rows (quant_dot.c's header has the layout): block b of a group of 16 outputs (its scales first), and
 * where its k-groups start */
INLINE const uint8_t *interleaved_block(int fmt, const uint8_t *group, int64_t b) {
    return fmt == FMT_INT8 ? group + 64 + b * 16 * QBLOCK : group + b * 16 * block_bytes(fmt);
}

INLINE const uint8_t *interleaved_values(int fmt, const uint8_t *block) {
    return fmt == FMT_INT8 ? block : block + (fmt == FMT_Q4_1 || fmt == FMT_Q5_1 ? 64 : 32);
}

#if defined(__AVX2__)
/* COLS outputs' fp16 scales, consecutive at p (interleaved rows) -> floats, exactly */
INLINE fv scales_at(const uint8_t *p) {
    fv out;
#if COLS == 16
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#else
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#endif
    memcpy(&out, &v, sizeof out);
    return out;
}
#endif

/* quant_dot.c: rows (1..ROWS) of a from row r0 by outputs n0 .. n0 + cols (1..COLS) of w (interleaved: in a
 * group of 16); partial (not NULL): the fp32 values to partial[r * COLS + c], not to out. The AMX path's
 * last part tile of rows goes through it. */
SHARED void tile_any(int rows, int cols, int fmt, int interleaved, const ActQ *a, int64_t r0, const uint8_t *w,
                     int64_t row_bytes, int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16,
                     float *partial);

/* ---- quant_amx.c's AMX tiles: compiled where the tier enables AMX-INT8 (the avx512 tier on such a CPU) */
#if COLS == 16 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__x86_64__) && defined(__linux__)
#define AMX 1
/* rows of x from which a 16-row AMX tile beats the VNNI tiles (measured at 1 thread, n x k = 576 x 576
 * and 1536 x 576: at 8 rows AMX took 0.9-1.05x the VNNI time, at 10 rows 0.8-0.9x, Q4_1 0.97-1.1x; Q4_1
 * folds one more fma per block, which the AMX path does not speed up) */
INLINE int amx_min_rows(int fmt) { return fmt == FMT_Q4_1 ? 13 : 10; }
#define AMX_ROWS 16

/* rows [0, this) of m take the AMX tiles: the whole tiles of 16, and a last part tile of amx_min_rows or more */
INLINE int64_t amx_row_count(int fmt, int64_t m) {
    const int64_t whole = m / AMX_ROWS * AMX_ROWS;
    return m - whole >= amx_min_rows(fmt) ? m : whole;
}

/* x's rows as the A tiles read them: per tile of 16 rows (the rows past m zero) and block, the 16 rows'
 * q (512 bytes, one contiguous stream per tile: with the rows in place, 16 lines apart, prefill's
 * tile loads waited on L2 one after the other), then their d and sx (16 floats each) */
typedef struct {
    int8_t *q;
    float *d, *sx;
} AmxRows;

/* the bytes of one AmxRows of m rows by `blocks` (amx_rows_carve's share of a buffer) */
INLINE size_t amx_rows_bytes(int64_t m, int64_t blocks) {
    const size_t cells = (size_t)((m + AMX_ROWS - 1) / AMX_ROWS * blocks * AMX_ROWS);
    return align64(cells * QBLOCK) + 2 * align64(sizeof(float) * cells);
}

/* out's arrays for m rows by `blocks` from *cursor, which moves past them */
INLINE void amx_rows_carve(AmxRows *out, int64_t m, int64_t blocks, char **cursor) {
    const size_t cells = (size_t)((m + AMX_ROWS - 1) / AMX_ROWS * blocks * AMX_ROWS);
    out->q = (int8_t *)*cursor, *cursor += align64(cells * QBLOCK);
    out->d = (float *)*cursor, *cursor += align64(sizeof(float) * cells);
    out->sx = (float *)*cursor, *cursor += align64(sizeof(float) * cells);
}

/* whether the CPU has AMX-INT8 and Linux granted this process the tile data (asked once per process) */
SHARED int amx_permitted(void);
/* whether m rows of fmt take the AMX tiles: enough rows, the amx setting on, amx_permitted */
SHARED int amx_wanted(int fmt, int64_t m);
/* quant_linear_int8's whole groups of 16 outputs for all m rows (the rows past amx_row_count by the VNNI tiles,
 * from a); 0 where a thread had no memory for its unpacked Q4 blocks: the caller's VNNI tiles then do all */
SHARED int amx_groups(int fmt, const ActQ *a, const void *src, int64_t ldx, int is_bf16, AmxRows *x, int64_t m,
                      int64_t blocks, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t groups,
                      const void *bias, void *out, int64_t ldo, int out_bf16, int num_threads);
/* quant_linear_int8_groups' rows [0, amx_rows) x whole groups of 16 outputs, the K groups folded in order;
 * 0 as amx_groups */
SHARED int amx_fold_groups(int fmt, AmxRows *x, const ActQ *a, const void *src, int64_t ldx, int is_bf16,
                           int64_t m, int64_t kg, int64_t groups, int64_t blocks, int64_t amx_rows, const uint8_t *w,
                           int64_t row_bytes, int64_t group_bytes, int64_t out_groups, void *out, int64_t ldo,
                           int num_threads);
#endif
