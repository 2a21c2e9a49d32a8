/* The quantized weight formats as both linear-layer paths read them (quant_gemm.c: fp32 activations,
 * quant_dot.c: int8 activations): the format codes, where a block's scale and values are in a row,
 * and the exact half -> float conversion of the scales. quant_gemm.c's header has the layouts.
 *
 * The GGUF codes are ggml's type ids. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL are blocks of 32
 * elements; the K-quants (Q2_K .. Q6_K) and IQ4_XS super-blocks of 256 (QK_K), read by both paths
 * as 8 runs of 32 consecutive elements (block_elems says which; block b of a row below is always a
 * block of the format, of block_elems(fmt) elements). */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q5_0 = 6, FMT_Q5_1 = 7, FMT_Q8_0 = 8,
    FMT_Q2_K = 10, FMT_Q3_K = 11, FMT_Q4_K = 12, FMT_Q5_K = 13, FMT_Q6_K = 14,
    FMT_IQ4_NL = 20, FMT_IQ4_XS = 23, FMT_INT8 = 100,
    FMT_PARTS = 101 /* row-stacked weights of their own formats (quant_gemm.c's quant_linear_into has the table) */
};

#define QBLOCK 32 /* elements per block (INT8: the kernels' blocks; its row has one scale) */
#define QK_K 256  /* elements per super-block of the K-quants and IQ4_XS */

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

/* whether fmt is a super-block format (256 elements a block) */
INLINE int is_super_block(int fmt) {
    return (fmt >= FMT_Q2_K && fmt <= FMT_Q6_K) || fmt == FMT_IQ4_XS;
}

/* elements per block of a GGUF format */
INLINE int64_t block_elems(int fmt) { return is_super_block(fmt) ? QK_K : QBLOCK; }

/* bytes per block of a GGUF format (Q4_0, Q4_1, Q8_0: its fp16 d first; Q4_1's fp16 m after it) */
INLINE int64_t block_bytes(int fmt) {
    switch (fmt) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q5_0: return 22;
    case FMT_Q5_1: return 24;
    case FMT_IQ4_NL: return 18;
    case FMT_Q2_K: return 84;
    case FMT_Q3_K: return 110;
    case FMT_Q4_K: return 144;
    case FMT_Q5_K: return 176;
    case FMT_Q6_K: return 210;
    case FMT_IQ4_XS: return 136;
    default: return 34; /* Q8_0 */
    }
}

/* whether fmt is a GGUF block format the kernels read */
INLINE int is_gguf_format(int fmt) {
    switch (fmt) {
    case FMT_Q4_0: case FMT_Q4_1: case FMT_Q5_0: case FMT_Q5_1: case FMT_Q8_0: case FMT_Q2_K: case FMT_Q3_K:
    case FMT_Q4_K: case FMT_Q5_K: case FMT_Q6_K: case FMT_IQ4_NL: case FMT_IQ4_XS:
        return 1;
    default:
        return 0;
    }
}

/* whether quant_dot.c multiplies fmt with int8 activations */
INLINE int int8_activation_format(int fmt) { return fmt == FMT_INT8 || is_gguf_format(fmt); }

/* IQ4_NL's and IQ4_XS's 16 values, indexed by a 4-bit code (ggml's kvalues_iq4nl) */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* block b of a row: its first byte (the scales; INT8: none) and its values (32 int8, or 16 bytes of
 * nibbles: byte j holds element j low and j + 16 high) */
INLINE const uint8_t *block_start(int fmt, const uint8_t *row, int64_t b) { return row + b * block_bytes(fmt); }

INLINE const uint8_t *block_values(int fmt, const uint8_t *row, int64_t b) {
    if (fmt == FMT_INT8)
        return row + 4 + b * QBLOCK;
    return block_start(fmt, row, b) + (fmt == FMT_Q4_1 ? 4 : 2);
}

/* IEEE half -> float, exactly (normals, subnormals, inf, NaN) on every path */
INLINE float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else { /* subnormal: man * 2^-24, exact in fp32 */
        float value = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &value, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}
