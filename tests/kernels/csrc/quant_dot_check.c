/* tests/kernels/test_quant_dot_aarch64.py's and test_quant_types.py's harness: quant_linear on cases read
 * from a file (the format code as the kernels take it: with QUANT_ACT_INT8 for int8 activations), outputs
 * written to another (the kernels built for aarch64, run under qemu).
 * Input: cases of int64 m, n, k, fmt, is_bf16, has_bias, weight_bytes, then x [m, k], the weight
 * rows, the bias [n] (x's dtype); output: each case's out [m, n] in x's dtype. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels.h"

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (in == NULL || out == NULL)
        return 2;
    int64_t header[7];
    while (fread(header, sizeof header, 1, in) == 1) {
        const int64_t m = header[0], n = header[1], k = header[2], fmt = header[3], is_bf16 = header[4];
        const int64_t has_bias = header[5], weight_bytes = header[6], elem = is_bf16 ? 2 : 4;
        void *x = malloc((size_t)(m * k * elem)), *w = malloc((size_t)weight_bytes), *bias = malloc((size_t)(n * elem));
        void *result = malloc((size_t)(m * n * elem));
        if (fread(x, (size_t)(m * k * elem), 1, in) != 1 || fread(w, (size_t)weight_bytes, 1, in) != 1 ||
            (has_bias && fread(bias, (size_t)(n * elem), 1, in) != 1))
            return 3;
        const int status = quant_linear(x, k, w, (int)fmt, has_bias ? bias : NULL, result, n, m, n, k,
                                        (int)is_bf16, 1);
        if (status != KERNEL_OK)
            return 4;
        fwrite(result, (size_t)(m * n * elem), 1, out);
        free(x), free(w), free(bias), free(result);
    }
    fclose(out);
    return 0;
}
