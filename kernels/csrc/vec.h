/* 16-lane fp32 vectors (GCC vector extensions: AVX-512, AVX2 or SSE, whatever -march gives)
 * and the few operations the CPU kernels share. Every operation works lane by lane with the
 * same instructions, so a value's result never depends on its lane or its neighbours. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#define LANES 16

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));

#define INLINE static inline __attribute__((always_inline))

INLINE vf bits_to_float(vu bits) {
    vf value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The comparisons, lane by lane. On AVX-512 a 16-lane comparison is one instruction; with
 * narrower registers GCC 12 turns it into 16 scalar ones (vcomiss, seta, insert: exp16 ran 8x
 * slower on AVX2 for them), so there it compares NATIVE_LANES at a time. */
#if defined(__AVX512F__)
#define NATIVE_LANES 16
#elif defined(__AVX__)
#define NATIVE_LANES 8
#else
#define NATIVE_LANES 4 /* SSE, NEON */
#endif

/* NAME(a, b) = a OP b lane by lane, all ones where true, else 0: one instruction on AVX-512,
 * NATIVE_LANES lanes at a time below */
#if NATIVE_LANES == 16
#define DEFINE_COMPARE16(NAME, OP) \
    INLINE vi NAME(vf a, vf b) { return a OP b; }
#else
#define DEFINE_COMPARE16(NAME, OP)                                                          \
    INLINE vi NAME(vf a, vf b) {                                                            \
        typedef float vf_native __attribute__((vector_size(NATIVE_LANES * sizeof(float))));  \
        typedef int32_t vi_native __attribute__((vector_size(NATIVE_LANES * sizeof(int32_t)))); \
        vi mask;                                                                            \
        for (int i = 0; i < LANES; i += NATIVE_LANES) {                                     \
            vf_native x, y;                                                                 \
            memcpy(&x, (const float *)&a + i, sizeof x);                                    \
            memcpy(&y, (const float *)&b + i, sizeof y);                                    \
            const vi_native piece = x OP y;                                                 \
            memcpy((int32_t *)&mask + i, &piece, sizeof piece);                             \
        }                                                                                   \
        return mask;                                                                        \
    }
#endif
DEFINE_COMPARE16(greater16, >)
DEFINE_COMPARE16(not_equal16, !=) /* true where either is NaN */

/* the NaN lanes */
INLINE vi is_nan16(vf a) { return not_equal16(a, a); }

/* mask ? a : b for vectors of any width (F the float vector, U the uint32 vector as wide) */
#define LANE_SELECT(F, U, mask, a, b) ((F)(((U)(a) & (U)(mask)) | ((U)(b) & ~(U)(mask))))

/* mask ? a : b, lane by lane (C has no vector ?:) */
INLINE vf select16(vi mask, vf a, vf b) { return LANE_SELECT(vf, vu, mask, a, b); }

/* 16 elements from fp32 or bf16 memory as fp32: a bf16 value is the top half of its fp32 value */
INLINE vf load16(const void *base, int is_bf16, int64_t index) {
#ifdef __AVX512F__
    if (is_bf16) { /* one widening load and a shift (GCC 12 splits the generic conversion into ymm pieces) */
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)((const uint16_t *)base + index)));
        vf value;
        const __m512i bits = _mm512_slli_epi32(wide, 16);
        memcpy(&value, &bits, sizeof value);
        return value;
    }
#endif
    if (is_bf16) {
        vh half;
        memcpy(&half, (const uint16_t *)base + index, sizeof half);
        return bits_to_float(__builtin_convertvector(half, vu) << 16);
    }
    vf value;
    memcpy(&value, (const float *)base + index, sizeof value);
    return value;
}

/* bf16 bits of each lane, rounded to nearest even as torch rounds; NaN stays NaN. One body for
 * each width: F, U the float and uint32 vectors, IS_NAN(F) its NaN lanes (register-wide: see the
 * comparisons above); bf16_bits16 here, gemm.c's tiles at theirs. */
#define DEFINE_BF16_BITS(NAME, F, U, IS_NAN)                               \
    INLINE U NAME(F value) {                                               \
        const U bits = (U)value;                                           \
        const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;    \
        const U nan = (U)IS_NAN(value);                                    \
        return (rounded & ~nan) | (((bits >> 16) | 0x40u) & nan);          \
    }
DEFINE_BF16_BITS(bf16_bits16, vf, vu, is_nan16)

/* one bf16 value as fp32 (exact: a bf16 value is the top half of its fp32 value) */
INLINE float bf16_to_float(uint16_t half) {
    const uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* bf16_bits16 for one value: round to nearest even, NaN stays NaN */
INLINE uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* each lane as the value a tensor of the given dtype would hold */
INLINE vf round16(vf value, int is_bf16) { return is_bf16 ? bits_to_float(bf16_bits16(value) << 16) : value; }

INLINE void store16(void *base, int is_bf16, int64_t index, vf value) {
#ifdef __AVX512F__
    if (is_bf16) { /* one narrowing store, as load16 */
        const vu bits = bf16_bits16(value);
        __m512i wide;
        memcpy(&wide, &bits, sizeof wide);
        _mm256_storeu_si256((void *)((uint16_t *)base + index), _mm512_cvtepi32_epi16(wide));
        return;
    }
#endif
    if (is_bf16) {
        const vh half = __builtin_convertvector(bf16_bits16(value), vh);
        memcpy((uint16_t *)base + index, &half, sizeof half);
    } else {
        memcpy((float *)base + index, &value, sizeof value);
    }
}

/* the first `count` (< 16) elements, the other lanes 0: tails go through the same code as full chunks */
INLINE vf load16_partial(const void *base, int is_bf16, int64_t index, int count) {
    uint32_t buffer[LANES] = {0};
    memcpy(buffer, (const char *)base + index * (is_bf16 ? 2 : 4), (size_t)count * (is_bf16 ? 2 : 4));
    return load16(buffer, is_bf16, 0);
}

INLINE void store16_partial(void *base, int is_bf16, int64_t index, int count, vf value) {
    uint32_t buffer[LANES];
    store16(buffer, is_bf16, 0, value);
    memcpy((char *)base + index * (is_bf16 ? 2 : 4), buffer, (size_t)count * (is_bf16 ? 2 : 4));
}

/* 16 elements at index of a row, `left` of them from index on (fewer at the row's end, the other lanes 0) */
INLINE vf row_load(const void *base, int is_bf16, int64_t index, int64_t left) {
    return left >= LANES ? load16(base, is_bf16, index) : load16_partial(base, is_bf16, index, (int)left);
}

INLINE void row_store(void *base, int is_bf16, int64_t index, int64_t left, vf value) {
    if (left >= LANES)
        store16(base, is_bf16, index, value);
    else
        store16_partial(base, is_bf16, index, (int)left, value);
}

/* the sum of the 16 lanes by a fixed tree: lane l + lane l+8, then +4, +2, +1 */
INLINE float fold(vf v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* The vectors of one AVX2 register (two SSE or NEON ones): exp8 and the attention's 8-lane path */
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef uint32_t vu8 __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef int32_t vi8 __attribute__((vector_size(8 * sizeof(int32_t))));

/* ---- the fused multiply-add: c + a b rounded once, lane by lane ----
 * Every fused multiply-add in the kernels is one of these, written out where the code wants it: the
 * library is compiled with -ffp-contract=off (kernels/cpu_kernels.py COMMON_FLAGS), so the compiler
 * fuses nothing on its own and `a * b + c` rounds twice on every tier. Where the target has an FMA
 * instruction (AVX2, AVX-512, aarch64, any target GCC says has a fast fmaf) it is that instruction; on
 * a baseline x86-64 (SSE2, the generic tier) it is libm's fmaf, correctly rounded as the instruction
 * is, a call per lane: slower, the same bits. This is what makes the tiers agree (docs/ARCHITECTURE.md,
 * "Kernels"): the same operations on the same values, whatever the vector width. */
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

INLINE float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

INLINE vf4 fma4(vf4 a, vf4 b, vf4 c) {
#if defined(__FMA__)
    return (vf4)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#elif defined(__ARM_NEON) && defined(__aarch64__)
    return (vf4)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
#endif
}

INLINE vf8 fma8(vf8 a, vf8 b, vf8 c) {
#if defined(__AVX__) && defined(__FMA__)
    return (vf8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    const vf4 low = fma4(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(b, b, 0, 1, 2, 3),
                         __builtin_shufflevector(c, c, 0, 1, 2, 3));
    const vf4 high = fma4(__builtin_shufflevector(a, a, 4, 5, 6, 7), __builtin_shufflevector(b, b, 4, 5, 6, 7),
                          __builtin_shufflevector(c, c, 4, 5, 6, 7));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
}

INLINE vf fma16(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    const vf8 low = fma8(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                         __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                         __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
    const vf8 high = fma8(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                          __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                          __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* a * b + c in two roundings, for DEFINE_EXP's unfused form */
#define MUL_ADD(a, b, c) ((a) * (b) + (c))

/* exp of each lane by one polynomial (Cephes' expf, within 2 ulp): below -87.3, 0; above 88.37,
 * inf. One body for each width: F, I, U the float, int32 and uint32 vectors; MADD(a, b, c) its
 * multiply-add: fused (the fma of that width: attention's exp, whose multiply-adds GCC fused by
 * contraction on AVX2 and AVX-512 before contraction was turned off, so the same bits as then) or
 * MUL_ADD (silu's, never fused). */
#define DEFINE_EXP(NAME, F, I, U, MADD)                                                                      \
    INLINE F NAME(F x) {                                                                                     \
        const I underflow = x < -87.33654f, overflow = x > 88.3762626647949f;                                \
        x = LANE_SELECT(F, U, underflow, (F){0} - 87.33654f, LANE_SELECT(F, U, overflow, (F){0}, x));         \
        const F t = MADD(x, (F){0} + 1.44269504f, (F){0} + 0.5f);                                            \
        F n = __builtin_convertvector(__builtin_convertvector(t, I), F); /* toward 0 */                      \
        n += __builtin_convertvector(n > t, F);                          /* floor */                         \
        const F r = MADD(n, (F){0} + 2.12194440e-4f, MADD(-n, (F){0} + 0.693359375f, x));                     \
        F p = (F){0} + 1.9875691500e-4f;                                                                     \
        p = MADD(p, r, (F){0} + 1.3981999507e-3f);                                                           \
        p = MADD(p, r, (F){0} + 8.3334519073e-3f);                                                           \
        p = MADD(p, r, (F){0} + 4.1665795894e-2f);                                                           \
        p = MADD(p, r, (F){0} + 1.6666665459e-1f);                                                           \
        p = MADD(p, r, (F){0} + 5.0000001201e-1f);                                                           \
        p = MADD(p, r * r, r) + 1.0f;                                                                        \
        const F two_n = (F)(U)((__builtin_convertvector(n, I) + 127) << 23);                                 \
        return LANE_SELECT(F, U, underflow, (F){0}, LANE_SELECT(F, U, overflow, (F){0} + __builtin_inff(), p * two_n)); \
    }

DEFINE_EXP(exp8, vf8, vi8, vu8, MUL_ADD)
DEFINE_EXP(exp8_fused, vf8, vi8, vu8, fma8)
#if NATIVE_LANES == 16
DEFINE_EXP(exp16, vf, vi, vu, MUL_ADD)
DEFINE_EXP(exp16_fused, vf, vi, vu, fma16)
#else
/* two exp8, so that the comparisons are register-wide (see DEFINE_COMPARE16): the same operations lane by lane */
#define DEFINE_EXP16_HALVES(NAME, EXP8)                                                                          \
    INLINE vf NAME(vf x) {                                                                                       \
        const vf8 low = EXP8(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));                             \
        const vf8 high = EXP8(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));                      \
        return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);         \
    }
DEFINE_EXP16_HALVES(exp16, exp8)
DEFINE_EXP16_HALVES(exp16_fused, exp8_fused)
#endif
