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
 * How the tiers get isum for 8 outputs of one block and row:
 *   avx512 with VNNI   vpdpbusd (u8 x s8, 4 products per int32 lane, exact int32 sums)
 *   avx2 / avx512 without VNNI   vpmaddubsw then vpmaddwd by ones. vpmaddubsw adds two u8 x s8
 *                      products into a saturating int16: here u8 <= 128 (a nibble <= 15, or |w|
 *                      <= 128 for signed weights made unsigned by the sign trick below) and
 *                      |s8| <= 127 (activations are never -128), so |pair| <= 2 * 128 * 127 =
 *                      32512 <= 32767: it never saturates, and the sums are exact.
 *   signed weights (Q8_0, INT8): u8 x s8 as |w| x (q with w's sign) (vpsignb): w q exactly,
 *                      |w| = 128 included (w = -128 as u8 is 128).
 *   aarch64 with dotprod   sdot; without: the generic loop. Eight per-block sums go into one
 *                      vector by a fixed tree of exact integer adds.
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
#include "vec.h"

enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_INT8 = 100 };

#define QBLOCK 32
#define COLS 8      /* outputs per tile: one fp32 lane each */
#define ROWS 4      /* rows of x per tile */
#define OUT_CHUNK 32 /* outputs a thread takes at a time */
#define TINY 7.52316384526264e-37f /* 2^-120 */

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

/* c + a b fused, lane by lane */
INLINE f8 fma8(f8 a, f8 b, f8 c) {
#if defined(__FMA__)
    __m256 va, vb_, vc;
    memcpy(&va, &a, 32), memcpy(&vb_, &b, 32), memcpy(&vc, &c, 32);
    vc = _mm256_fmadd_ps(va, vb_, vc);
    memcpy(&c, &vc, 32);
    return c;
#elif defined(__ARM_NEON) && defined(__aarch64__)
    float32x4_t va[2], vb_[2], vc[2];
    memcpy(va, &a, 32), memcpy(vb_, &b, 32), memcpy(vc, &c, 32);
    vc[0] = vfmaq_f32(vc[0], va[0], vb_[0]);
    vc[1] = vfmaq_f32(vc[1], va[1], vb_[1]);
    memcpy(&c, vc, 32);
    return c;
#else
    for (int i = 0; i < COLS; i++)
        c[i] = fmaf(a[i], b[i], c[i]); /* libm: correctly rounded, as the instruction */
    return c;
#endif
}

INLINE f8 splat8(float v) { return (f8){v, v, v, v, v, v, v, v}; }

INLINE float half_bits_to_float(const uint8_t *p) { /* exact on every path */
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else {
        float value = (float)man * 5.9604644775390625e-8f; /* man 2^-24: exact */
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* ---- activations ----------------------------------------------------------------------- */
typedef struct {
    int8_t *q;    /* [m, blocks * 32] */
    float *d;     /* [m, blocks] */
    float *sx;    /* [m, blocks]: d * sum */
    int32_t *sum; /* [m, blocks] */
    int64_t blocks;
} ActQ;

/* One block of 32 fp32 values (zero-padded) -> q, d, sum, sx: the rule in the header. */
INLINE void quantize_block(const float *v, int8_t *q, float *d, int32_t *sum, float *sx) {
    uint32_t amax_bits = 0;
    for (int i = 0; i < QBLOCK; i++) {
        uint32_t bits;
        memcpy(&bits, &v[i], 4);
        bits &= 0x7fffffffu;
        amax_bits = bits > amax_bits ? bits : amax_bits;
    }
    float amax;
    memcpy(&amax, &amax_bits, 4);
    if (amax_bits >= 0x7f800000u || amax < TINY) {
        memset(q, 0, QBLOCK);
        *d = amax_bits >= 0x7f800000u ? __builtin_nanf("") : 0.0f;
        *sum = 0;
        *sx = 0.0f;
        return;
    }
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
    *d = amax / 127.0f;
    *sum = total;
    *sx = *d * (float)total;
}

static void quantize_rows(const void *x, int64_t ldx, int64_t m, int64_t k, int is_bf16, ActQ *a, int num_threads) {
    const int64_t blocks = a->blocks;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            float v[QBLOCK];
            const int64_t start = b * QBLOCK, count = k - start < QBLOCK ? k - start : QBLOCK;
            for (int64_t i = 0; i < count; i++)
                v[i] = is_bf16 ? bf16_to_float(((const uint16_t *)x)[r * ldx + start + i])
                               : ((const float *)x)[r * ldx + start + i];
            for (int64_t i = count; i < QBLOCK; i++)
                v[i] = 0.0f;
            const int64_t at = r * blocks + b;
            quantize_block(v, a->q + at * QBLOCK, a->d + at, a->sum + at, a->sx + at);
        }
    }
}

/* ---- one block's integer dot products for 8 outputs ----------------------------------- */
/* weight block b of a row: a pointer to its 32 values (int8) or 16 nibble bytes, and its d, m */
INLINE const uint8_t *block_values(int fmt, const uint8_t *row, int64_t b) {
    switch (fmt) {
    case FMT_Q4_0: return row + b * 18 + 2;
    case FMT_Q4_1: return row + b * 20 + 4;
    case FMT_Q8_0: return row + b * 34 + 2;
    }
    return row + 4 + b * QBLOCK;
}

#if defined(__AVX2__)
/* 8 int32 lanes, each the sum of 4 adjacent u8 x s8 products: exact (header) */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* the 8 vectors' lane sums as one vector (exact integer adds, a fixed tree) */
INLINE __m256i reduce8(const __m256i v[COLS]) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* a weight block as 32 unsigned bytes in element order (4-bit: elements 0-15 low nibbles, 16-31 high) */
INLINE __m256i load_weights(int fmt, const uint8_t *p) {
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    }
    return _mm256_loadu_si256((const __m256i *)p);
}
#endif

/* A block b of the 8 weight rows, ready for each row of x: AVX2 keeps them unpacked in registers
 * (|w| and w for the sign trick), the generic path keeps pointers. */
typedef struct {
#if defined(__AVX2__)
    __m256i u[COLS], w[COLS];
#else
    const uint8_t *p[COLS];
#endif
    int64_t count; /* INT8's last block: the values in the row (else 32) */
} Prepared;

INLINE void prepare(int fmt, const uint8_t *const w[COLS], int64_t b, int64_t count, Prepared *out) {
    out->count = count;
    for (int c = 0; c < COLS; c++) {
        const uint8_t *p = block_values(fmt, w[c], b);
#if defined(__AVX2__)
        uint8_t padded[QBLOCK];
        if (count < QBLOCK) { /* INT8's last block: the weights past the row's end read as 0 */
            memset(padded, 0, QBLOCK);
            memcpy(padded, p, (size_t)count);
            p = padded;
        }
        const __m256i wv = load_weights(fmt, p);
        out->w[c] = wv;
        out->u[c] = fmt == FMT_Q8_0 || fmt == FMT_INT8 ? _mm256_abs_epi8(wv) : wv;
#else
        out->p[c] = p;
#endif
    }
}

/* isum[c] for the prepared weight rows against one row's 32 quantized activations (sum xsum) */
INLINE i8v block_isums(int fmt, const Prepared *pw, const int8_t *xq, int32_t xsum) {
    i8v out;
#if defined(__AVX2__)
    const __m256i xs = _mm256_loadu_si256((const __m256i *)xq);
    __m256i parts[COLS];
    for (int c = 0; c < COLS; c++) {
        if (fmt == FMT_Q8_0 || fmt == FMT_INT8)
            parts[c] = dot_u8s8(pw->u[c], _mm256_sign_epi8(xs, pw->w[c]));
        else
            parts[c] = dot_u8s8(pw->u[c], xs);
    }
    const __m256i sums = reduce8(parts);
    memcpy(&out, &sums, 32);
#else
    for (int c = 0; c < COLS; c++) {
        const uint8_t *p = pw->p[c];
        int32_t total = 0;
        if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
#if defined(__ARM_FEATURE_DOTPROD)
            const uint8x16_t raw = vld1q_u8(p), mask = vdupq_n_u8(0x0f);
            const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, mask)), hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
            total = vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(xq)), hi, vld1q_s8(xq + 16)));
#else
            for (int i = 0; i < 16; i++)
                total += (int32_t)(p[i] & 0x0f) * xq[i] + (int32_t)(p[i] >> 4) * xq[i + 16];
#endif
        } else {
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
#endif
    if (fmt == FMT_Q4_0) /* sum (u - 8) q = sum u q - 8 sum q */
        out -= 8 * xsum;
    return out;
}

/* ---- the tile ---------------------------------------------------------------------------- */
/* rows (1..ROWS) of quantized x from row r0, outputs n0 .. n0 + cols (cols 1..8) */
INLINE void tile(int rows, int cols, const int fmt, const ActQ *a, int64_t r0, const uint8_t *w, int64_t row_bytes,
                 int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16) {
    const uint8_t *wr[COLS];
    for (int c = 0; c < COLS; c++) /* a partial tile repeats its first row: computed, never stored */
        wr[c] = w + (c < cols ? c : 0) * row_bytes;
    const int64_t blocks = a->blocks, tail = k % QBLOCK, full = k / QBLOCK;
    f8 acc[ROWS];
    for (int r = 0; r < ROWS; r++)
        acc[r] = splat8(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        f8 dw = splat8(1.0f), mw = splat8(0.0f);
        if (fmt != FMT_INT8) {
            const int64_t size = fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34;
            for (int c = 0; c < COLS; c++) {
                dw[c] = half_bits_to_float(wr[c] + b * size);
                if (fmt == FMT_Q4_1)
                    mw[c] = half_bits_to_float(wr[c] + b * size + 2);
            }
        }
        Prepared pw;
        prepare(fmt, wr, b, fmt == FMT_INT8 && b == full && tail != 0 ? tail : QBLOCK, &pw);
        for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * blocks + b;
            const i8v isum = block_isums(fmt, &pw, a->q + at * QBLOCK, a->sum[at]);
            const f8 sums = __builtin_convertvector(isum, f8);
            const f8 scale = fmt == FMT_INT8 ? splat8(a->d[at]) : dw * splat8(a->d[at]);
            acc[r] = fma8(scale, sums, acc[r]);
            if (fmt == FMT_Q4_1)
                acc[r] = fma8(mw, splat8(a->sx[at]), acc[r]);
        }
    }
    f8 scale = splat8(1.0f), add = splat8(0.0f);
    for (int c = 0; c < cols; c++) {
        if (fmt == FMT_INT8)
            memcpy(&scale[c], wr[c], 4);
        if (bias != NULL)
            add[c] = out_bf16 ? bf16_to_float(((const uint16_t *)bias)[n0 + c]) : ((const float *)bias)[n0 + c];
    }
    for (int r = 0; r < rows; r++) {
        const f8 value = fma8(acc[r], scale, add);
        for (int c = 0; c < cols; c++) {
            if (out_bf16)
                ((uint16_t *)out)[(r0 + r) * ldo + n0 + c] = float_to_bf16(value[c]);
            else
                ((float *)out)[(r0 + r) * ldo + n0 + c] = value[c];
        }
    }
}

/* each format its own copy of the tile, the format a constant in it */
static void tile_any(int rows, int cols, int fmt, const ActQ *a, int64_t r0, const uint8_t *w, int64_t row_bytes,
                     int64_t k, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16) {
    switch (fmt) {
    case FMT_Q4_0: tile(rows, cols, FMT_Q4_0, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16); return;
    case FMT_Q4_1: tile(rows, cols, FMT_Q4_1, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16); return;
    case FMT_Q8_0: tile(rows, cols, FMT_Q8_0, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16); return;
    default: tile(rows, cols, FMT_INT8, a, r0, w, row_bytes, k, bias, out, ldo, n0, out_bf16); return;
    }
}

/* quant_linear_into's int8-activation path (fmt without QUANT_ACT_INT8): the same contract */
int quant_linear_int8(const void *x, int64_t ldx, const void *w, int fmt, const void *bias, void *out, int64_t ldo,
                      int64_t m, int64_t n, int64_t k, int is_bf16, int out_bf16, int num_threads) {
    const int64_t row_bytes = quant_row_bytes(fmt, k);
    if (row_bytes == 0)
        return KERNEL_BAD_SHAPE;
    if (m == 0 || n == 0)
        return KERNEL_OK;
    ActQ a;
    a.blocks = (k + QBLOCK - 1) / QBLOCK;
    a.q = malloc((size_t)(m * a.blocks * QBLOCK));
    a.d = malloc(sizeof(float) * (size_t)(m * a.blocks));
    a.sx = malloc(sizeof(float) * (size_t)(m * a.blocks));
    a.sum = malloc(sizeof(int32_t) * (size_t)(m * a.blocks));
    int status = KERNEL_OK;
    if (a.q == NULL || a.d == NULL || a.sx == NULL || a.sum == NULL) {
        status = KERNEL_OUT_OF_MEMORY;
        goto done;
    }
    quantize_rows(x, ldx, m, k, is_bf16, &a, num_threads);
    const uint8_t *weights = w;
    const int64_t chunks = (n + OUT_CHUNK - 1) / OUT_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t c0 = chunk * OUT_CHUNK, c1 = c0 + OUT_CHUNK < n ? c0 + OUT_CHUNK : n;
        for (int64_t r = 0; r < m; r += ROWS) {
            const int rows = m - r < ROWS ? (int)(m - r) : ROWS;
            for (int64_t c = c0; c < c1; c += COLS) {
                const int cols = c1 - c < COLS ? (int)(c1 - c) : COLS;
                tile_any(rows, cols, fmt, &a, r, weights + c * row_bytes, row_bytes, k, bias, out, ldo, c, out_bf16);
            }
        }
    }
done:
    free(a.q), free(a.d), free(a.sx), free(a.sum);
    return status;
}
