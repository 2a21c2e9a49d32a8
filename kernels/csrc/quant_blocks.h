/* The quantized weight formats as both linear-layer paths read them (quant_gemm.c: fp32 activations,
 * quant_dot.c: int8 activations): the format codes, where a block's scale and values are in a row,
 * and the exact half -> float conversion of the scales. quant_gemm.c's header has the layouts. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q8_0 = 8, FMT_INT8 = 100 };

#define QBLOCK 32 /* elements per block (INT8: the kernels' blocks; its row has one scale) */

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

/* bytes per block of a GGUF format (its fp16 d first; Q4_1's fp16 m after it) */
INLINE int64_t block_bytes(int fmt) { return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34; }

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
