/* Linear layers on quantized weights: out = x W^T (+ bias), W kept in its storage format.
 *
 * Formats (each weight row is a run of self-contained blocks, exactly as stored):
 *   Q4_0 (ggml type 2)  blocks of 32: fp16 d, 16 bytes of nibbles      w = (q - 8) d
 *   Q4_1 (ggml type 3)  blocks of 32: fp16 d, fp16 m, 16 bytes          w = q d + m
 *   Q8_0 (ggml type 8)  blocks of 32: fp16 d, 32 int8                   w = q d
 *   Q5_0 (6)            blocks of 32: fp16 d, 4 bytes qh, 16 bytes      w = (q - 16) d, bit 4 of q_i: bit i of qh
 *   Q5_1 (7)            blocks of 32: fp16 d, fp16 m, qh, 16 bytes      w = q d + m
 *   IQ4_NL (20)         blocks of 32: fp16 d, 16 bytes of 4-bit codes   w = d IQ4_VALUES[code]
 *   Q2_K .. Q6_K (10-14), IQ4_XS (23): super-blocks of 256 (kernels/quant.py's dequantizers spell
 *                       out each layout); read as 8 runs of 32 elements, each run's 16-element halves
 *                       with their own scale (and min): w = q (d sc) - dmin m, or q (d sc)
 *   INT8 (our own)      one block per row: fp32 s, K int8               w = q s
 * In a 4-bit block byte j holds element j in its low nibble and element j + 16 in its high one
 * (ggml's layout). GGUF rows are blocks of the file, byte for byte; nothing is dequantized
 * ahead of time. Every weight is the fp32 rounding of its exact value (the products of a
 * scale and a quant are exact in fp32 but the last, and a min is subtracted in the same
 * rounding by an FMA): the bits of kernels/quant.py's and the gguf package's dequantizers.
 *
 * Each block is dequantized into registers (two vectors of 16 lanes: elements 0-15, 16-31)
 * and multiplied into fp32 accumulators. Output element (m, n) is two chains of fused
 * multiply-adds, lane l of `lo` taking the elements 32 b + l and `hi` 32 b + 16 + l, block by
 * block from b = 0, then lo + hi folded by a fixed tree (vec.h's fold), scaled (INT8), biased
 * and rounded once. Which tile, thread or batch computes (m, n) never changes that chain, so
 * a row's bits depend on its own data alone: the same at every batch size, position and
 * thread count, as in gemm.c. Every multiply-add is fused (vec.h's fma: the instruction, or libm's
 * fmaf on a baseline x86-64), so every tier (AVX-512, AVX2 + FMA, generic vectors, aarch64) gives the
 * same bits.
 *
 * bf16 activations are widened to fp32 once per call (exact); results are rounded to bf16
 * (nearest even) at the end.
 */
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

#define BLOCK QBLOCK /* elements per GGUF block */
#define TILE_ROWS 4  /* rows of x per tile */
#define TILE_COLS 4  /* weight rows per tile: 1-2 rows of x take 4 (more chains in flight), 3-4 take 2 */
#define CHUNK 32     /* weight rows a thread keeps hot in L1/L2 while the row tiles pass over them */

typedef uint8_t vb __attribute__((vector_size(16)));
typedef int8_t vsb __attribute__((vector_size(16)));

/* Bytes per weight row of K elements (0: not a format / K not a multiple of the block). */
int64_t quant_row_bytes(int fmt, int64_t k) {
    fmt &= ~(QUANT_ACT_INT8 | QUANT_INTERLEAVED); /* the activations' mode and the rows' order keep the bytes */
    if (fmt == FMT_INT8)
        return 4 + k;
    if (!is_gguf_format(fmt) || k % block_elems(fmt))
        return 0;
    return k / block_elems(fmt) * block_bytes(fmt);
}

/* every lane = value (a broadcast; `(vf){0} + value` would add 0 first) */
INLINE vf splat(float v) { return (vf){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

/* the two halves at p, p + 2 as floats (a Q4_1 block's d and m: one load and one conversion) */
INLINE void two_halves(const uint8_t *p, float *first, float *second) {
#if defined(__F16C__)
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
    *first = _mm_cvtss_f32(both);
    *second = _mm_cvtss_f32(_mm_movehdup_ps(both));
#else
    *first = half_to_float(p);
    *second = half_to_float(p + 2);
#endif
}

/* 16 unsigned bytes / signed bytes as 16 fp32 lanes (exact). */
#if defined(__AVX512F__)
INLINE vf widened(__m512i lanes) { /* 16 int32 lanes as fp32, in vec.h's type */
    const __m512 wide = _mm512_cvtepi32_ps(lanes);
    vf out;
    memcpy(&out, &wide, sizeof out);
    return out;
}
#define BYTES_TO_F32(bytes, extend)                                                                           \
    do {                                                                                                      \
        __m128i raw;                                                                                          \
        memcpy(&raw, &(bytes), 16);                                                                           \
        return widened(extend(raw));                                                                          \
    } while (0)
#define U8_EXTEND _mm512_cvtepu8_epi32
#define S8_EXTEND _mm512_cvtepi8_epi32
#elif defined(__AVX2__)
/* two 8-lane widenings (GCC scalarizes the generic 16-byte -> 16-float conversion here: a byte
 * at a time through the stack, ~30x slower) */
#define BYTES_TO_F32(bytes, extend)                                                                           \
    do {                                                                                                      \
        __m128i raw;                                                                                          \
        memcpy(&raw, &(bytes), 16);                                                                           \
        const __m256 halves[2] = {_mm256_cvtepi32_ps(extend(raw)), _mm256_cvtepi32_ps(extend(_mm_srli_si128(raw, 8)))}; \
        vf out;                                                                                               \
        memcpy(&out, halves, sizeof out);                                                                     \
        return out;                                                                                           \
    } while (0)
#define U8_EXTEND _mm256_cvtepu8_epi32
#define S8_EXTEND _mm256_cvtepi8_epi32
#else
#define BYTES_TO_F32(bytes, extend) return __builtin_convertvector(bytes, vf)
#endif

INLINE vf u8_to_f32(vb bytes) { BYTES_TO_F32(bytes, U8_EXTEND); }

INLINE vf s8_to_f32(vsb bytes) { BYTES_TO_F32(bytes, S8_EXTEND); }

#if defined(__AVX512F__)
/* A 4-bit block's 32 weights: lane l of the table is fma(l, d, offset), the value of nibble l, and
 * vpermps picks each element's lane by its nibble (it reads the low 4 bits of each index), so
 * every weight is the same fused q d + offset as the conversion path computes, with one FMA per
 * block instead of two and no int -> float conversions. */
INLINE void nibbles_lut(const uint8_t *qs, float dh, float offset, vf *lo, vf *hi) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(dh), _mm512_set1_ps(offset));
    __m128i raw;
    memcpy(&raw, qs, 16);
    const __m512i index = _mm512_cvtepu8_epi32(raw); /* byte j: element j in bits 0-3, j + 16 in 4-7 */
    const __m512 low = _mm512_permutexvar_ps(index, table);
    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), table);
    memcpy(lo, &low, 64), memcpy(hi, &high, 64);
}
#endif

/* ---- the formats added with the K-quants: run b of 32 elements of a row -> lo (0-15), hi (16-31) ---- */

/* 16 bytes from p */
INLINE vb load_bytes(const uint8_t *p) {
    vb out;
    memcpy(&out, p, 16);
    return out;
}

/* 16 where bit i of the 16 bits at p (little-endian) is set, else 0, lane i */
INLINE vb bits16(const uint8_t *p) {
    const vb select = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const vb spread = {p[0], p[0], p[0], p[0], p[0], p[0], p[0], p[0], p[1], p[1], p[1], p[1], p[1], p[1], p[1], p[1]};
    return (vb)((spread & select) != 0) & 16;
}

/* IQ4_VALUES[code] for each byte's code (0-15) */
INLINE vsb iq4_lookup(vb codes) {
    vsb table;
    memcpy(&table, IQ4_VALUES, 16);
    return __builtin_shuffle(table, (vsb)codes);
}

/* (v >> shift) & 3 for a run's 2-bit field (shift 0, 2, 4, 6) */
INLINE vb two_bits(vb v, int shift) { return (v >> (uint8_t)shift) & 3; }

/* Q5_0, Q5_1: 32 five-bit q */
INLINE void q5_values(const uint8_t *qh, const uint8_t *qs, vb *lo, vb *hi) {
    const vb bytes = load_bytes(qs);
    *lo = (bytes & 0x0f) | bits16(qh);
    *hi = (bytes >> 4) | bits16(qh + 2);
}

/* Q3_K's scale i (of 16), signed 6 bits: low 4 bits in bytes 0-7, high 2 in bytes 8-11 */
INLINE int q3_scale(const uint8_t *sc, int i) {
    const int low = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

/* Q4_K's and Q5_K's scale and min of run j (ggml's get_scale_min_k4) */
INLINE void k4_scale_min(const uint8_t *sc, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = sc[j] & 63, *min = sc[j + 4] & 63;
    } else {
        *scale = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
        *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* Run b of a row as its 32 integers and their map to the weights: half h (elements 16 h .. 16 h + 15) is
 * q[h] scale[h] + add[h] in one rounding (fused), or, for the formats of signed_run, the signed bytes
 * q[h] scale[h] (one product: a Q8_0 / Q6_K weight is the rounding of q d, never q d + 0). Every format
 * comes through this one decoding; run_to_vf (16-lane vectors) and the AVX2 tile's __m256 quarters apply
 * the map with the same operations lane for lane, so every tier's weights have the same bits. */
typedef struct {
    vb q[2];
    float scale[2], add[2];
} Run;

/* the formats whose run is signed bytes times a scale (INT8: times 1, exact) */
INLINE int signed_run(int fmt) {
    return fmt == FMT_Q8_0 || fmt == FMT_INT8 || fmt == FMT_IQ4_NL || fmt == FMT_IQ4_XS || fmt == FMT_Q3_K ||
           fmt == FMT_Q6_K;
}

INLINE void run_map(Run *o, float scale, float add) { o->scale[0] = o->scale[1] = scale, o->add[0] = o->add[1] = add; }

/* run b of a row (a block of 32; the super-block formats: run b of 32, super-block b / 8) */
INLINE void dequant_run(int fmt, const uint8_t *row, int64_t b, Run *o) {
    const int j = (int)(b & 7), n = j >> 2, r = j & 3; /* a super-block's run, its half of 128, its step */
    const uint8_t *super = row + (b >> 3) * block_bytes(fmt);
    o->add[0] = o->add[1] = 0.0f;
    switch (fmt) {
    case FMT_Q4_0: { /* q d - 8 d = (q - 8) d exactly: both products are exact */
        const uint8_t *blk = block_start(FMT_Q4_0, row, b);
        const float d = half_to_float(blk);
        const vb qs = load_bytes(block_values(FMT_Q4_0, row, b));
        o->q[0] = qs & 0x0f, o->q[1] = qs >> 4;
        run_map(o, d, -8.0f * d);
        return;
    }
    case FMT_Q4_1: {
        const uint8_t *blk = block_start(FMT_Q4_1, row, b);
        float d, m;
        two_halves(blk, &d, &m);
        const vb qs = load_bytes(block_values(FMT_Q4_1, row, b));
        o->q[0] = qs & 0x0f, o->q[1] = qs >> 4;
        run_map(o, d, m);
        return;
    }
    case FMT_Q8_0:
    case FMT_INT8: { /* INT8: 32 elements from byte 4 + 32 b, s applied at the end */
        const uint8_t *values = block_values(fmt, row, b);
        o->q[0] = load_bytes(values), o->q[1] = load_bytes(values + 16);
        run_map(o, fmt == FMT_INT8 ? 1.0f : half_to_float(block_start(FMT_Q8_0, row, b)), 0.0f);
        return;
    }
    case FMT_Q5_0: {
        const uint8_t *blk = row + b * 22;
        const float d = half_to_float(blk);
        q5_values(blk + 2, blk + 6, &o->q[0], &o->q[1]);
        run_map(o, d, -16.0f * d); /* (q - 16) d: both products exact */
        return;
    }
    case FMT_Q5_1: {
        const uint8_t *blk = row + b * 24;
        float d, m;
        two_halves(blk, &d, &m);
        q5_values(blk + 4, blk + 8, &o->q[0], &o->q[1]);
        run_map(o, d, m);
        return;
    }
    case FMT_IQ4_NL: {
        const uint8_t *blk = row + b * 18;
        const vb codes = load_bytes(blk + 2);
        o->q[0] = (vb)iq4_lookup(codes & 0x0f), o->q[1] = (vb)iq4_lookup(codes >> 4);
        run_map(o, half_to_float(blk), 0.0f);
        return;
    }
    case FMT_IQ4_XS: { /* fp16 d, 2 bytes scales_h, 4 bytes scales_l, 128 bytes of codes (16 a run) */
        const uint16_t high = (uint16_t)(super[2] | super[3] << 8);
        const int ls = ((super[4 + j / 2] >> (4 * (j & 1))) & 15) | (((high >> (2 * j)) & 3) << 4);
        const vb codes = load_bytes(super + 8 + 16 * j);
        o->q[0] = (vb)iq4_lookup(codes & 0x0f), o->q[1] = (vb)iq4_lookup(codes >> 4);
        run_map(o, half_to_float(super) * (float)(ls - 32), 0.0f);
        return;
    }
    case FMT_Q2_K: { /* 16 bytes of scale | min << 4, 64 bytes of 2-bit q, fp16 d, fp16 dmin */
        float d, dmin;
        two_halves(super + 80, &d, &dmin);
        const uint8_t s0 = super[8 * n + 2 * r], s1 = super[8 * n + 2 * r + 1];
        const uint8_t *qs = super + 16 + 32 * n;
        o->q[0] = two_bits(load_bytes(qs), 2 * r), o->q[1] = two_bits(load_bytes(qs + 16), 2 * r);
        o->scale[0] = d * (float)(s0 & 15), o->add[0] = -(dmin * (float)(s0 >> 4));
        o->scale[1] = d * (float)(s1 & 15), o->add[1] = -(dmin * (float)(s1 >> 4));
        return;
    }
    case FMT_Q3_K: { /* 32 bytes hmask, 64 bytes of 2-bit q, 12 bytes of scales, fp16 d */
        const float d = half_to_float(super + 108);
        const uint8_t *qs = super + 32 + 32 * n, bit = (uint8_t)(1u << j);
        const vsb low0 = (vsb)two_bits(load_bytes(qs), 2 * r), low1 = (vsb)two_bits(load_bytes(qs + 16), 2 * r);
        const vsb minus0 = (vsb)((load_bytes(super) & bit) == 0) & 4, minus1 = (vsb)((load_bytes(super + 16) & bit) == 0) & 4;
        o->q[0] = (vb)(low0 - minus0), o->q[1] = (vb)(low1 - minus1);
        o->scale[0] = d * (float)q3_scale(super + 96, 8 * n + 2 * r);
        o->scale[1] = d * (float)q3_scale(super + 96, 8 * n + 2 * r + 1);
        return;
    }
    case FMT_Q4_K:
    case FMT_Q5_K: { /* fp16 d, fp16 dmin, 12 bytes of scales and mins, (Q5_K: 32 bytes qh,) 128 bytes of nibbles */
        float d, dmin;
        two_halves(super, &d, &dmin);
        int scale, min;
        k4_scale_min(super + 4, j, &scale, &min);
        const uint8_t *qs = super + (fmt == FMT_Q5_K ? 48 : 16) + 32 * (j / 2);
        vb q0 = load_bytes(qs), q1 = load_bytes(qs + 16);
        q0 = j & 1 ? q0 >> 4 : q0 & 0x0f;
        q1 = j & 1 ? q1 >> 4 : q1 & 0x0f;
        if (fmt == FMT_Q5_K) {
            const uint8_t bit = (uint8_t)(1u << j);
            q0 |= (vb)((load_bytes(super + 16) & bit) != 0) & 16;
            q1 |= (vb)((load_bytes(super + 32) & bit) != 0) & 16;
        }
        o->q[0] = q0, o->q[1] = q1;
        run_map(o, d * (float)scale, -(dmin * (float)min));
        return;
    }
    default: { /* FMT_Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d */
        const float d = half_to_float(super + 208);
        const uint8_t *ql_bytes = super + 64 * n + 32 * (r & 1), *qh_bytes = super + 128 + 32 * n;
        vb q0 = load_bytes(ql_bytes), q1 = load_bytes(ql_bytes + 16);
        q0 = r >= 2 ? q0 >> 4 : q0 & 0x0f;
        q1 = r >= 2 ? q1 >> 4 : q1 & 0x0f;
        q0 |= two_bits(load_bytes(qh_bytes), 2 * r) << 4;
        q1 |= two_bits(load_bytes(qh_bytes + 16), 2 * r) << 4;
        const int8_t *scales = (const int8_t *)(super + 192) + 8 * n + 2 * r;
        o->q[0] = (vb)((vsb)q0 - 32), o->q[1] = (vb)((vsb)q1 - 32);
        o->scale[0] = d * (float)scales[0], o->scale[1] = d * (float)scales[1];
        return;
    }
    }
}

/* a run's two halves as 16-lane vectors */
INLINE void run_to_vf(int fmt, const Run *run, vf *lo, vf *hi) {
    if (signed_run(fmt)) {
        *lo = s8_to_f32((vsb)run->q[0]) * splat(run->scale[0]);
        *hi = s8_to_f32((vsb)run->q[1]) * splat(run->scale[1]);
    } else {
        *lo = fma16(u8_to_f32(run->q[0]), splat(run->scale[0]), splat(run->add[0]));
        *hi = fma16(u8_to_f32(run->q[1]), splat(run->scale[1]), splat(run->add[1]));
    }
}

/* Block b of a row dequantized: lo = elements 0-15, hi = 16-31 (INT8: the raw q, s applied at the end;
 * the super-block formats: run b of 32). */
INLINE void dequant(int fmt, const uint8_t *row, int64_t b, vf *lo, vf *hi) {
#if defined(__AVX512F__)
    if (fmt == FMT_Q4_1) {
        const uint8_t *blk = block_start(FMT_Q4_1, row, b);
        float dh, mh;
        two_halves(blk, &dh, &mh);
        nibbles_lut(block_values(FMT_Q4_1, row, b), dh, mh, lo, hi);
        return;
    }
    if (fmt == FMT_Q4_0) {
        const uint8_t *blk = block_start(FMT_Q4_0, row, b);
        const float dh = half_to_float(blk);
        nibbles_lut(block_values(FMT_Q4_0, row, b), dh, -8.0f * dh, lo, hi);
        return;
    }
#endif
    Run run;
    dequant_run(fmt, row, b, &run);
    run_to_vf(fmt, &run, lo, hi);
}

/* INT8 tail: the last k % 32 elements as a block padded with zeros (x's tail is zero-padded too). */
INLINE void dequant_tail_run(const uint8_t *row, int64_t b, int64_t count, Run *o) {
    int8_t buffer[BLOCK] = {0};
    memcpy(buffer, block_values(FMT_INT8, row, b), (size_t)count);
    o->q[0] = load_bytes((const uint8_t *)buffer), o->q[1] = load_bytes((const uint8_t *)buffer + 16);
    run_map(o, 1.0f, 0.0f);
}

/* AVX2 holds a 16-lane vector as two ymm registers, and GCC keeps arrays of them (the tile's
 * accumulators) on the stack: every FMA went through memory, 8-10 GFLOP/s at any batch. There the
 * tile keeps each accumulator as four __m256 (elements 0-7, 8-15 of `lo`, then of `hi`), the same
 * FMAs lane for lane, folded as one vf at the end: the same bits, 2.4x (batch 1) to 4x (batch 16)
 * faster. The weights too go straight from a run's bytes to four __m256 (dequant_run, then its map):
 * built as 16-lane vectors first, GCC 12 assembled the splats and the conversions lane by lane through
 * the stack (scalar stores, then a vector load: a store-forwarding stall each), and the 4-bit formats
 * ran at 0.36 GB/s of weights on a Zen 3 (Q4_0, Q4_K; 10x slower than now, bench/results/kquant_speed_fp32_avx2.md). */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SPLIT_ACCUMULATORS 1
#else
#define SPLIT_ACCUMULATORS 0
#endif

/* rows (1..TILE_ROWS) of x (fp32, row stride ldx, padded to whole blocks) times cols
 * (1..TILE_COLS) weight rows from w (row stride row_bytes) -> out[r][c] at n0 + c. */
INLINE void tile(const int rows, const int cols, const int fmt, const float *x, int64_t ldx, const uint8_t *w,
                 int64_t row_bytes, int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16) {
#if SPLIT_ACCUMULATORS
    __m256 acc[TILE_ROWS][TILE_COLS][4];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++)
            for (int j = 0; j < 4; j++)
                acc[r][c][j] = _mm256_setzero_ps();
#else
    vf lo[TILE_ROWS][TILE_COLS], hi[TILE_ROWS][TILE_COLS];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++)
            lo[r][c] = hi[r][c] = (vf){0};
#endif
    const int64_t full = k / BLOCK, blocks = (k + BLOCK - 1) / BLOCK;
    /* The next tile's rows are the cols * row_bytes bytes right after these: each block step
     * prefetches its share of them, in address order, so that memory is read as one sequential
     * stream. A tile's rows are short (a few hundred bytes each) and start a new stream every
     * tile, which the hardware prefetcher does not pick up in time: prefetching only the same
     * block of each next row left batch-1 INT8 and Q8_0 at half the DRAM bandwidth (8-12 GB/s
     * against 18-25 GB/s at one thread, Zen 4). */
    const int64_t span = (cols * row_bytes + blocks - 1) / blocks;
    const uint8_t *ahead = w + cols * row_bytes;
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t offset = b * span; offset < (b + 1) * span + 63; offset += 64)
            __builtin_prefetch(ahead + offset, 0, 3);
#if SPLIT_ACCUMULATORS /* each run's map straight into __m256 quarters (elements 8 j .. 8 j + 7), as run_to_vf */
        __m256 wv[TILE_COLS][4];
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            Run run;
            if (fmt != FMT_INT8 || b < full) /* GGUF rows are whole blocks */
                dequant_run(fmt, w + c * row_bytes, b, &run);
            else
                dequant_tail_run(w + c * row_bytes, b, k - b * BLOCK, &run);
            for (int j = 0; j < 4; j++) {
                __m128i bytes;
                memcpy(&bytes, &run.q[j / 2], 16);
                if (j % 2)
                    bytes = _mm_srli_si128(bytes, 8);
                const __m256 q = _mm256_cvtepi32_ps(signed_run(fmt) ? _mm256_cvtepi8_epi32(bytes)
                                                                    : _mm256_cvtepu8_epi32(bytes));
                const __m256 scale = _mm256_set1_ps(run.scale[j / 2]);
                wv[c][j] = signed_run(fmt) ? _mm256_mul_ps(q, scale)
                                           : _mm256_fmadd_ps(q, scale, _mm256_set1_ps(run.add[j / 2]));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++)
                for (int j = 0; j < 4; j++)
                    acc[r][c][j] = _mm256_fmadd_ps(wv[c][j], _mm256_loadu_ps(x + r * ldx + b * BLOCK + 8 * j),
                                                   acc[r][c][j]);
        }
#else
        vf wl[TILE_COLS], wh[TILE_COLS];
#pragma GCC unroll 4
        for (int c = 0; c < cols; c++) {
            if (fmt != FMT_INT8 || b < full) { /* GGUF rows are whole blocks */
                dequant(fmt, w + c * row_bytes, b, &wl[c], &wh[c]);
            } else {
                Run run;
                dequant_tail_run(w + c * row_bytes, b, k - b * BLOCK, &run);
                run_to_vf(fmt, &run, &wl[c], &wh[c]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            vf xl, xh;
            memcpy(&xl, x + r * ldx + b * BLOCK, sizeof xl);
            memcpy(&xh, x + r * ldx + b * BLOCK + 16, sizeof xh);
#pragma GCC unroll 4
            for (int c = 0; c < cols; c++) {
                lo[r][c] = fma16(wl[c], xl, lo[r][c]);
                hi[r][c] = fma16(wh[c], xh, hi[r][c]);
            }
        }
#endif
    }
#pragma GCC unroll 4
    for (int c = 0; c < cols; c++) {
        const int64_t n = n0 + c;
        float scale = 1.0f, add = 0.0f;
        if (fmt == FMT_INT8)
            memcpy(&scale, w + c * row_bytes, 4);
        if (bias != NULL)
            add = out_bf16 ? bf16_to_float(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            /* value * scale + add in one rounding on every path (1 and 0 change nothing): left to the
             * compiler, it would fuse them in some tiles and not in others */
#if SPLIT_ACCUMULATORS
            vf lo, hi;
            memcpy(&lo, &acc[r][c][0], 64), memcpy(&hi, &acc[r][c][2], 64);
            const float value = fma1(fold(lo + hi), scale, add);
#else
            const float value = fma1(fold(lo[r][c] + hi[r][c]), scale, add);
#endif
            if (out_bf16) {
                ((uint16_t *)out)[r * ldo + n] = float_to_bf16(value);
            } else {
                ((float *)out)[r * ldo + n] = value;
            }
        }
    }
}

/* Each (rows, cols, format) its own fully unrolled loop, the accumulators in registers. */
static void tile_any(int rows, int cols, int fmt, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                     int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16) {
#define QT(R, C, F)                                                                                           \
    if (rows == R && cols == C && fmt == F) {                                                                 \
        tile(R, C, F, x, ldx, w, row_bytes, k, bias, out, ldo, n0, out_bf16);                                 \
        return;                                                                                               \
    }
#define QT_FORMATS(R, C) QT(R, C, FMT_Q4_0) QT(R, C, FMT_Q4_1) QT(R, C, FMT_Q8_0) QT(R, C, FMT_INT8)
/* the formats added with the K-quants: the full tiles and one-column tails only (a tail of 2-3 columns is
 * that many one-column tiles: each output's chain is the same whichever tile computes it) */
#define QT_MORE(R, C)                                                                                         \
    QT(R, C, FMT_Q5_0) QT(R, C, FMT_Q5_1) QT(R, C, FMT_IQ4_NL) QT(R, C, FMT_Q2_K) QT(R, C, FMT_Q3_K)           \
    QT(R, C, FMT_Q4_K) QT(R, C, FMT_Q5_K) QT(R, C, FMT_Q6_K) QT(R, C, FMT_IQ4_XS)
    QT_FORMATS(1, 4) QT_FORMATS(2, 4) QT_FORMATS(3, 2) QT_FORMATS(4, 2)
    QT_FORMATS(1, 1) QT_FORMATS(1, 2) QT_FORMATS(1, 3) QT_FORMATS(2, 1) QT_FORMATS(2, 2) QT_FORMATS(2, 3)
    QT_FORMATS(3, 1) QT_FORMATS(4, 1)
    QT_MORE(1, 4) QT_MORE(2, 4) QT_MORE(3, 2) QT_MORE(4, 2) QT_MORE(1, 1) QT_MORE(2, 1) QT_MORE(3, 1) QT_MORE(4, 1)
#undef QT_MORE
#undef QT_FORMATS
#undef QT
    if (cols == 1) /* not a format (quant_row_bytes refused it before) */
        return;
    for (int c = 0; c < cols; c++) /* a K-quant-era format's tail of 2-3 columns */
        tile_any(rows, 1, fmt, x, ldx, w + c * row_bytes, row_bytes, k, bias, out, ldo, n0 + c, out_bf16);
}

/* weight rows per tile for a tile of `rows` rows of x: 16 accumulators either way */
INLINE int tile_cols(int rows) { return rows <= 2 ? 4 : 2; }

/* x [m, k] (fp32 or bf16, row stride ldx) as fp32 rows padded with zeros to whole blocks
 * (the pad multiplies INT8's zero-padded tail; GGUF rows are whole blocks anyway). */
static float *widen(const void *x, int64_t ldx, int64_t m, int64_t k, int is_bf16, int64_t *ld) {
    const int64_t width = (k + BLOCK - 1) / BLOCK * BLOCK;
    float *buffer = aligned_alloc(64, (size_t)((m * width * 4 + 63) / 64 * 64 + 64));
    if (buffer == NULL)
        return NULL;
    for (int64_t r = 0; r < m; r++) {
        float *dst = buffer + r * width;
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)x + r * ldx;
            for (int64_t i = 0; i < k; i++)
                dst[i] = bf16_to_float(src[i]);
        } else {
            memcpy(dst, (const float *)x + r * ldx, (size_t)(k * 4));
        }
        memset(dst + k, 0, (size_t)((width - k) * 4));
    }
    *ld = width;
    return buffer;
}

/* out[m, n] (row stride ldo, x's dtype) = x[m, k] W^T + bias[n] (may be NULL), W in `fmt`
 * (rows of quant_row_bytes(fmt, k) bytes). Threads take contiguous ranges of weight rows.
 * Returns a KERNEL_* status. */
int quant_linear(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                 int64_t m, int64_t n, int64_t k, int is_bf16, int num_threads) {
    return quant_linear_into(x, ldx, w, fmt, bias, out, ldo, m, n, k, is_bf16, is_bf16, num_threads);
}

/* FMT_PARTS: weights of their own formats stacked by rows (a llama.cpp mix's fused q/k/v or gate/up;
 * kernels/quant.py's QuantParts). w starts with a table of int64: the number of parts, then per part its
 * format (as quant_linear takes it: with QUANT_ACT_INT8 and QUANT_INTERLEAVED where its rows are), its
 * rows and the byte offset of its rows from w. Each part's outputs are that part's own call's: the
 * same bits as the part alone. act_int8: QUANT_ACT_INT8 where every part must take int8 activations. */
static int quant_linear_parts(const void *x, int64_t ldx, const void *w, int act_int8, const void *bias, void *out,
                              int64_t ldo, int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16,
                              int num_threads) {
    int64_t count, first = 0;
    memcpy(&count, w, 8);
    if (count < 1 || count > 16)
        return KERNEL_BAD_SHAPE;
    const int64_t elem = out_bf16 ? 2 : 4;
    for (int64_t i = 0; i < count; i++) {
        int64_t entry[3]; /* format, rows, offset */
        memcpy(entry, (const char *)w + 8 + 24 * i, 24);
        const int fmt = (int)entry[0];
        if ((fmt & QUANT_ACT_INT8) != act_int8 || (fmt & ~(QUANT_ACT_INT8 | QUANT_INTERLEAVED)) == FMT_PARTS ||
            first + entry[1] > n)
            return KERNEL_BAD_SHAPE;
        const int status = quant_linear_into(x, ldx, (const char *)w + entry[2], fmt,
                                             bias != NULL ? (const char *)bias + first * elem : NULL,
                                             (char *)out + first * elem, ldo, m, entry[1], k, is_bf16, out_bf16,
                                             num_threads);
        if (status != KERNEL_OK)
            return status;
        first += entry[1];
    }
    return first == n ? KERNEL_OK : KERNEL_BAD_SHAPE;
}

/* quant_linear with out in fp32 (out_bf16 0) or bf16 whatever x's dtype (row_parallel.c's partial
 * sums are fp32); a bias is in out's dtype */
int quant_linear_into(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads) {
    if ((fmt & ~QUANT_ACT_INT8) == FMT_PARTS)
        return quant_linear_parts(x, ldx, w, fmt & QUANT_ACT_INT8, bias, out, ldo, m, n, k, is_bf16, out_bf16,
                                  num_threads);
    if ((fmt & QUANT_ACT_INT8) && !int8_activation_format(fmt & ~(QUANT_ACT_INT8 | QUANT_INTERLEAVED)))
        return KERNEL_BAD_SHAPE;
    if (fmt & QUANT_ACT_INT8)
        return quant_linear_int8(x, ldx, w, fmt & ~QUANT_ACT_INT8, bias, out, ldo, m, n, k, is_bf16, out_bf16,
                                 num_threads);
    if (fmt & QUANT_INTERLEAVED) /* only the int8-activation path reads interleaved rows */
        return KERNEL_BAD_SHAPE;
    const int64_t row_bytes = quant_row_bytes(fmt, k);
    if (row_bytes == 0)
        return KERNEL_BAD_SHAPE;
    if (m == 0 || n == 0)
        return KERNEL_OK;
    int64_t ld = ldx;
    const float *xf = x;
    float *buffer = NULL;
    if (is_bf16 || k % BLOCK) {
        buffer = widen(x, ldx, m, k, is_bf16, &ld);
        if (buffer == NULL)
            return KERNEL_OUT_OF_MEMORY;
        xf = buffer;
    }
    const uint8_t *weights = w;
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t c0 = chunk * CHUNK, c1 = c0 + CHUNK < n ? c0 + CHUNK : n;
        for (int64_t r = 0; r < m; r += TILE_ROWS) {
            const int rows = m - r < TILE_ROWS ? (int)(m - r) : TILE_ROWS, step = tile_cols(rows);
            for (int64_t c = c0; c < c1; c += step) {
                const int cols = c1 - c < step ? (int)(c1 - c) : step;
                tile_any(rows, cols, fmt, xf + r * ld, ld, weights + c * row_bytes, row_bytes, k, bias,
                         (char *)out + r * ldo * (out_bf16 ? 2 : 4), ldo, c, out_bf16);
            }
        }
    }
    free(buffer);
    return KERNEL_OK;
}
