/* quant_dot.c's int8-activation linear layers by AMX int8 tiles (the avx512 tier on a CPU with AMX-INT8:
 * the interleaved groups, m >= amx_min_rows; quant_dot.c calls amx_groups and amx_fold_groups, quant_dot.h
 * has what the two files share). The same integers and the same fold as quant_dot.c's VNNI tiles, so the
 * same bits: per block b, one tile product gives the isum of 16 rows of x by a group's 16 outputs,
 *   C[16 rows x 16 outputs, int32] = A[16 rows x 32 bytes: the rows' q of block b, packed (AmxRows)]
 *                                  . B[8 k-groups x 64 bytes: output c's 4 bytes of k-group g at 4 c]
 * and B is the interleaved layout's block as stored (Q8_0, INT8: read in place), or for Q4 its nibbles
 * unpacked once per group into a thread's buffer (k-groups 0-3 the low nibbles, 4-7 the high: the
 * elements in order). Q8_0, INT8, and Q4_0 as u - 8 (so isum = sum (u - 8) q directly): tdpbssd;
 * Q4_1 (u unsigned): tdpbsud. Row r of C is then output-lanes for row r, as a tile's isum vector,
 * and the fold is the tiles' (scale = dw_b * dx_b rounded once, then fma, Q4_1's fma of mw, sx after).
 * The tile unit runs its loads, products and stores one after the other, and the fold does not
 * overlap them much: blocks are issued two ahead of their fold (four C tiles in flight), which gave
 * a little over issuing each block just before its fold.
 * Rows: the A tiles read a copy of the quantized rows packed per tile of 16 rows (AmxRows; the rows
 * past m zero, their outputs never stored); a last part tile of fewer than amx_min_rows rows takes
 * the VNNI tiles.
 * Runtime: the CPU must report AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 24, 25) and Linux must
 * grant this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once per process; a
 * refusal, e.g. an older kernel, leaves the VNNI tiles); each thread loads its tile configuration
 * in its parallel region and releases the tiles at its end. quant_dot_set_amx(0) (the amx setting) turns
 * the AMX path off: the tests compare both, bit for bit. */
#include <stdint.h>
#include <string.h>

#include "quant_dot.h"

static int amx_off; /* the worker's amx setting given at load, off: the VNNI tiles (every tier has the setter) */

void quant_dot_set_amx(int on) { __atomic_store_n(&amx_off, !on, __ATOMIC_RELAXED); }

#if defined(AMX) /* quant_dot.h: the tier enables AMX-INT8 */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

int amx_permitted(void) { /* once per process: CPUID, then the kernel's permission */
    static int state; /* 0 not asked, 1 yes, -1 no */
    int seen = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (seen != 0)
        return seen > 0;
    unsigned int eax, ebx, ecx, edx;
    int ok = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 24 & 1) && (edx >> 25 & 1);
    if (ok) { /* ARCH_REQ_XCOMP_PERM XFEATURE_XTILEDATA, then ARCH_GET_XCOMP_PERM to confirm */
        unsigned long features = 0;
        ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0 && syscall(SYS_arch_prctl, 0x1022, &features) == 0 &&
             (features >> 18 & 1);
    }
    __atomic_store_n(&state, ok ? 1 : -1, __ATOMIC_RELEASE);
    return ok;
}

int amx_wanted(int fmt, int64_t m) {
    if (m < amx_min_rows(fmt))
        return 0;
    if (__atomic_load_n(&amx_off, __ATOMIC_RELAXED))
        return 0;
    return amx_permitted();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) AmxConfig;

static void amx_configure(void) { /* tmm0, 1: A (16 rows x 32 bytes); tmm2, 3: B (8 x 64); tmm4-7: C (16 x 64) */
    AmxConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = t < 2 ? 32 : 64;
        config.rows[t] = t == 2 || t == 3 ? 8 : 16;
    }
    _tile_loadconfig(&config);
}

/* a group's Q4 values -> per block 512 bytes of B (k-groups 0-3: low nibbles, 4-7: high; Q4_0 as u - 8) */
static void amx_unpack4(int fmt, const uint8_t *group, int64_t blocks, uint8_t *out) {
    const __m512i mask = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(fmt == FMT_Q4_0 ? 8 : 0);
    const int64_t group_bytes = interleaved_block(fmt, group, blocks) - group; /* the next group starts there */
    const int64_t block_span = 16 * block_bytes(fmt); /* a Q4 block of the group's 16 outputs */
    for (int64_t b = 0; b < blocks; b++) {
        /* the group after next's block, into L2 while this group's tiles run: the weights stream from memory
         * once per call, and without it this loop waited on them about as long as the tiles took (batch 16 on the
         * default model, 1 thread: 25% of the step here; L1 prefetches one group ahead filled the line buffers
         * and stalled the loop; L2 two ahead: 471-490 tok/s against 442-445 by the VNNI tiles, 463 with the L1 ones) */
        const uint8_t *block = interleaved_block(fmt, group, b);
        for (int64_t line = 0; line < block_span; line += 64)
            _mm_prefetch((const char *)block + 2 * group_bytes + line, _MM_HINT_T1);
        const uint8_t *values = interleaved_values(fmt, block);
        for (int g = 0; g < 4; g++) {
            const __m512i raw = _mm512_loadu_si512(values + 64 * g);
            const __m512i lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
            _mm512_store_si512(out + b * 512 + 64 * g, _mm512_sub_epi8(lo, eight));
            _mm512_store_si512(out + b * 512 + 64 * (g + 4), _mm512_sub_epi8(hi, eight));
        }
    }
}

/* block b's isum (C, as stored: row r at 16 r) into the 16 rows' chains */
INLINE void amx_fold(int fmt, const uint8_t *block, const int32_t *isum, const float *d, const float *sx,
                     fv acc[AMX_ROWS]) {
    fv dw = splatv(1.0f), mw = splatv(0.0f);
    if (fmt != FMT_INT8)
        dw = scales_at(block);
    if (fmt == FMT_Q4_1)
        mw = scales_at(block + 32);
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        iv sums;
        memcpy(&sums, isum + 16 * r, sizeof sums);
        const fv scale = fmt == FMT_INT8 ? splatv(d[r]) : dw * splatv(d[r]);
        acc[r] = fmav(scale, __builtin_convertvector(sums, fv), acc[r]);
        if (fmt == FMT_Q4_1)
            acc[r] = fmav(mw, splatv(sx[r]), acc[r]);
    }
}

/* The A rows of out[0 .. groups) (m rows by `blocks` each, the rows past m zero): group g's from a[g]
 * (quantize_rows' rows, copied) or, where a is NULL, quantized here from x's columns g kg .. (ldx,
 * is_bf16; kg columns) by the same quantize_block16: the same bytes either way, and no ActQ where the AMX
 * tiles make every output. A worksharing loop: called inside the parallel region of the tiles that read
 * them, so both threads quantize and no region of its own waits on one. Its unit is a block of a tile's
 * 16 rows, which owns its 512 bytes of q and its line of d and of sx (by rows, two threads wrote the same
 * lines of d and sx in turn, and the step ran 13% slower than with quantize_rows on one thread). */
static void amx_rows_fill(AmxRows *out, int64_t groups, int64_t m, int64_t blocks, const ActQ *a, const void *x,
                          int64_t ldx, int64_t kg, int is_bf16) {
    const int64_t cells = (m + AMX_ROWS - 1) / AMX_ROWS * blocks; /* per group */
#pragma omp for schedule(static)
    for (int64_t cell = 0; cell < groups * cells; cell++) {
        const int64_t g = cell / cells, t = cell % cells / blocks, b = cell % blocks;
        const AmxRows *rows = &out[g];
        for (int64_t r = 0; r < AMX_ROWS; r++) {
            const int64_t row = t * AMX_ROWS + r, at = (t * blocks + b) * AMX_ROWS + r;
            if (row >= m) {
                memset(rows->q + at * QBLOCK, 0, QBLOCK);
                rows->d[at] = 0.0f, rows->sx[at] = 0.0f;
            } else if (a != NULL) {
                memcpy(rows->q + at * QBLOCK, a[g].q + (row * blocks + b) * QBLOCK, QBLOCK);
                rows->d[at] = a[g].d[row * blocks + b], rows->sx[at] = a[g].sx[row * blocks + b];
            } else {
                int32_t sum; /* the A rows keep d and sx only */
                quantize_block16(x, row * ldx + g * kg + b * QBLOCK, kg - b * QBLOCK, is_bf16, rows->q + at * QBLOCK,
                                 rows->d + at, &sum, rows->sx + at);
            }
        }
    }
}

/* rows r0 .. r0 + 15 of x (rows of them stored; r0 a multiple of 16) by the interleaved group at `group`
 * (outputs n0 .. n0 + 15); unpacked: the group's B blocks for Q4 (amx_unpack4), else NULL (read in place) */
INLINE void amx_tile(const int fmt, const AmxRows *x, int64_t blocks, int64_t r0, int rows, const uint8_t *group,
                     const uint8_t *unpacked, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16,
                     float *partial) { /* partial: as tile's (row r's 16 lanes at 16 r, fp32), out unused */
    const int64_t tile0 = r0 / AMX_ROWS * blocks;
    const int8_t *q = x->q + tile0 * AMX_ROWS * QBLOCK;
    const float *d = x->d + tile0 * AMX_ROWS, *sx = x->sx + tile0 * AMX_ROWS;
    fv acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++)
        acc[r] = splatv(0.0f);
    int32_t isum[4][AMX_ROWS * 16] __attribute__((aligned(64)));
/* block B: its product into tile TC (A in TA, B in TB); then, later, stored and folded */
#define AMX_ISSUE(B, TA, TB, TC)                                                                            \
    if ((B) < blocks) {                                                                                     \
        _tile_loadd(TA, q + (B) * AMX_ROWS * QBLOCK, QBLOCK);                                                              \
        _tile_loadd(TB, unpacked != NULL ? unpacked + (B) * 512                                             \
                                         : interleaved_values(fmt, interleaved_block(fmt, group, (B))), 64); \
        _tile_zero(TC);                                                                                      \
        if (fmt == FMT_Q4_1)                                                                                 \
            _tile_dpbsud(TC, TA, TB);                                                                        \
        else                                                                                                 \
            _tile_dpbssd(TC, TA, TB);                                                                        \
    }
#define AMX_DRAIN(B, TC)                                                                                     \
    if ((B) >= 0 && (B) < blocks) {                                                                          \
        _tile_stored(TC, isum[(TC) - 4], 64);                                                                \
        amx_fold(fmt, interleaved_block(fmt, group, (B)), isum[(TC) - 4], d + (B) * AMX_ROWS,                \
                 sx + (B) * AMX_ROWS, acc);                                                                   \
    }
    for (int64_t b = 0; b < blocks + 2; b += 4) { /* block b issued two ahead of its fold; folds in block order */
        AMX_ISSUE(b, 0, 2, 4)
        AMX_DRAIN(b - 2, 6)
        AMX_ISSUE(b + 1, 1, 3, 5)
        AMX_DRAIN(b - 1, 7)
        AMX_ISSUE(b + 2, 0, 2, 6)
        AMX_DRAIN(b, 4)
        AMX_ISSUE(b + 3, 1, 3, 7)
        AMX_DRAIN(b + 1, 5)
    }
#undef AMX_ISSUE
#undef AMX_DRAIN
    fv scale = splatv(1.0f), add = splatv(0.0f);
    for (int c = 0; c < 16; c++) {
        if (fmt == FMT_INT8)
            memcpy(&scale[c], group + 4 * c, 4);
        if (bias != NULL)
            add[c] = out_bf16 ? bf16_to_float(((const uint16_t *)bias)[n0 + c]) : ((const float *)bias)[n0 + c];
    }
    for (int r = 0; r < rows; r++) {
        const fv value = fmav(acc[r], scale, add);
        if (partial != NULL) {
            memcpy(partial + 16 * r, &value, sizeof value);
            continue;
        }
        for (int c = 0; c < 16; c++) {
            if (out_bf16)
                ((uint16_t *)out)[(r0 + r) * ldo + n0 + c] = float_to_bf16(value[c]);
            else
                ((float *)out)[(r0 + r) * ldo + n0 + c] = value[c];
        }
    }
}

static void amx_tile_any(int fmt, const AmxRows *x, int64_t blocks, int64_t r0, int rows, const uint8_t *group,
                         const uint8_t *unpacked, const void *bias, void *out, int64_t ldo, int64_t n0, int out_bf16,
                         float *partial) {
#define AMX_TILE(F) amx_tile(F, x, blocks, r0, rows, group, unpacked, bias, out, ldo, n0, out_bf16, partial)
    switch (fmt) {
    case FMT_Q4_0: AMX_TILE(FMT_Q4_0); return;
    case FMT_Q4_1: AMX_TILE(FMT_Q4_1); return;
    case FMT_Q8_0: AMX_TILE(FMT_Q8_0); return;
    default: AMX_TILE(FMT_INT8); return;
    }
#undef AMX_TILE
}

/* Q4: a thread's buffer for a group's unpacked B blocks (its own scratch: one buffer of the calling thread,
 * cut in two, ran the batch-16 step 7% slower), or NULL with *complete cleared (out of memory) */
static uint8_t *amx_unpacked(int q4, size_t bytes, int *complete) {
    uint8_t *unpacked = q4 ? scratch_take(SCRATCH_UNPACKED, bytes) : NULL;
    if (q4 && unpacked == NULL)
        __atomic_store_n(complete, 0, __ATOMIC_RELAXED);
    return unpacked;
}

/* the whole groups of 16 outputs (`groups` of them, interleaved) for all m rows: x's A rows filled first
 * (amx_rows_fill, from `a` or, a NULL, quantized from src), then per group its tiles; the rows past
 * amx_row_count by the VNNI tiles (a then holds them). Returns 0 where a thread had no memory for its
 * unpacked Q4 blocks: the caller's VNNI tiles then make every output. */
int amx_groups(int fmt, const ActQ *a, const void *src, int64_t ldx, int is_bf16, AmxRows *x, int64_t m,
               int64_t blocks, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t groups,
               const void *bias, void *out, int64_t ldo, int out_bf16, int num_threads) {
    int complete = 1;
    const int q4 = fmt == FMT_Q4_0 || fmt == FMT_Q4_1;
    const int64_t amx_rows = amx_row_count(fmt, m); /* the rest: VNNI */
    /* rows per pass over the groups: Q8_0, INT8 one tile (its A stream stays in L1 while the groups' B
     * stream by; all rows at once, prefill's A tiles came from L2 and each load waited: m = 512 ran
     * 1.35x the VNNI tiles' speed, one tile at a time 1.85x); Q4 all the rows, each group unpacked once
     * (one tile at a time, the unpacking repeated per tile: 1.45x at m = 128 against 1.65x) */
    const int64_t panel = q4 ? amx_rows : AMX_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        uint8_t *unpacked = amx_unpacked(q4, (size_t)(blocks * 512), &complete);
        amx_rows_fill(x, 1, m, blocks, a, src, ldx, k, is_bf16); /* its loop's barrier: the rows are filled */
        amx_configure();
        for (int64_t p0 = 0; p0 < amx_rows; p0 += panel) {
            const int64_t p1 = p0 + panel < amx_rows ? p0 + panel : amx_rows;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *group = w + g * 16 * row_bytes;
                if (q4 && unpacked == NULL)
                    continue;
                if (q4)
                    amx_unpack4(fmt, group, blocks, unpacked);
                for (int64_t r = p0; r < p1; r += AMX_ROWS)
                    amx_tile_any(fmt, x, blocks, r, m - r < AMX_ROWS ? (int)(m - r) : AMX_ROWS, group, unpacked,
                                 bias, out, ldo, g * 16, out_bf16, NULL);
            }
        }
        if (amx_rows < m) /* a last part tile of few rows: the VNNI tiles */
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++)
                for (int64_t r = amx_rows; r < m; r += ROWS)
                    tile_any(m - r < ROWS ? (int)(m - r) : ROWS, COLS, fmt, 1, a, r, w + g * 16 * row_bytes, row_bytes,
                             k, bias, out, ldo, g * 16, out_bf16, NULL);
        _tile_release();
        if (q4)
            scratch_give(SCRATCH_UNPACKED);
    }
    return complete;
}

/* quant_linear_int8_groups' AMX part: rows [0, amx_rows) x the whole groups of 16 outputs (`out_groups`);
 * per output group and tile of 16 rows, each K group's partial as the VNNI tiles make it (amx_tile's
 * `partial`: fma(acc, scale, 0) in fp32), added in K-group order into the first, then stored (bf16:
 * rounded once), as the VNNI loop of quant_linear_int8_groups does. x[g], w + g group_bytes: K group g's
 * packed rows and weights. */
int amx_fold_groups(int fmt, AmxRows *x, const ActQ *a, const void *src, int64_t ldx, int is_bf16,
                    int64_t m, int64_t kg, int64_t groups, int64_t blocks, int64_t amx_rows, const uint8_t *w,
                    int64_t row_bytes, int64_t group_bytes, int64_t out_groups, void *out, int64_t ldo,
                    int num_threads) {
    const int q4 = fmt == FMT_Q4_0 || fmt == FMT_Q4_1;
    int complete = 1; /* 0: a thread had no memory for its unpacked blocks; the caller's VNNI tiles then do all */
#pragma omp parallel num_threads(num_threads)
    {
        /* Q4: each K group's B blocks of the output group, unpacked once for all its row tiles */
        uint8_t *unpacked = amx_unpacked(q4, (size_t)(groups * blocks * 512), &complete);
        float total[AMX_ROWS * 16] __attribute__((aligned(64))), part[AMX_ROWS * 16] __attribute__((aligned(64)));
        amx_rows_fill(x, groups, m, blocks, a, src, ldx, kg, is_bf16); /* each K group's A rows, from its first column */
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t j = 0; j < out_groups; j++) {
            if (q4 && unpacked == NULL)
                continue;
            if (q4)
                for (int64_t g = 0; g < groups; g++)
                    amx_unpack4(fmt, w + g * group_bytes + j * 16 * row_bytes, blocks, unpacked + g * blocks * 512);
            for (int64_t r0 = 0; r0 < amx_rows; r0 += AMX_ROWS) {
                const int rows = amx_rows - r0 < AMX_ROWS ? (int)(amx_rows - r0) : AMX_ROWS;
                for (int64_t g = 0; g < groups; g++) {
                    amx_tile_any(fmt, &x[g], blocks, r0, rows, w + g * group_bytes + j * 16 * row_bytes,
                                 q4 ? unpacked + g * blocks * 512 : NULL, NULL, NULL, 0, 0, 0, g == 0 ? total : part);
                    if (g > 0)
                        for (int i = 0; i < rows * 16; i++)
                            total[i] += part[i];
                }
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < 16; c++) {
                        if (is_bf16)
                            ((uint16_t *)out)[(r0 + r) * ldo + j * 16 + c] = float_to_bf16(total[r * 16 + c]);
                        else
                            ((float *)out)[(r0 + r) * ldo + j * 16 + c] = total[r * 16 + c];
                    }
            }
        }
        _tile_release();
        if (q4)
            scratch_give(SCRATCH_UNPACKED);
    }
    return complete;
}
#endif
