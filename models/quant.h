/* Products over block-quantized weights (models/quant.c), for models/kernels.c. */

#ifndef TANDEM_QUANT_H
#define TANDEM_QUANT_H

#include <stdint.h>

/* the kernel paths, chosen at run time from the CPU's features (or forced) */
enum { QPATH_NONE = 0, QPATH_AVX2 = 1, QPATH_VNNI512 = 2 };

/* A packed weight [O, I] (models/quant.py: pack): for each block of 16 outputs and each 32
 * inputs, a chunk of the codes (4, 5, 6 or 8 bits), then 16 scales d and, unless the offset
 * is implied (m = -zero d), 16 offsets m (float16 or float32): w = d * code + m. 6-bit codes
 * have a scale each 16 inputs (two vectors of them) and zero 32. */
typedef struct {
    const uint8_t *packed;
    const float *bias; /* [O] or NULL */
    int64_t out, in, bits, half_scales, zero;
    int64_t supers; /* K types: integer scales a chunk, float16 ones each 256 inputs */
    int64_t ldy;    /* floats between y's rows (0: out) */
    int64_t two_terms; /* the activations as two int8 terms (models/quant.c: quantize_rows) */
} QWeight;

/* a weight's form as one int, as models/quant.py writes it: bits + 256 half + 512 supers +
 * 65536 zero + 2**24 two terms */
QWeight qweight(const uint8_t *packed, const float *bias, int64_t out, int64_t in, int64_t form);

/* y [M, O] = x [M, I] W^T (+ bias); the activations are quantized to int8 a row and 32
 * inputs at a time. 0, or -1 when out of memory (called without the GIL). */
int qgemm(const QWeight *w, const float *x, float *y, int64_t rows, int threads);

/* y [M, sum of the parts' outputs] from products side by side, each its own weight:
 * parts = {n, then per part: packed, bias (or 0), its outputs, its form} */
int qgemm_parts(const int64_t *parts, const float *x, float *y, int64_t rows, int64_t in,
                int threads);

/* the path qgemm takes: `want` QPATH_* forced (if the CPU has it), or -1 for the best; the
 * path chosen is returned */
int qpath_select(int want);

/* rows `ids` of W dequantized: out [n, I] (a tied embedding's lookup) */
void qrows(const QWeight *w, const int64_t *ids, int64_t n, float *out);

#endif
