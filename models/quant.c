/* Products over block-quantized weights: the integer codes of a GGUF file, at their width.
 *
 * The weight is packed (models/quant.py: pack) in chunks, one for each block of 16 outputs
 * and 32 inputs: the codes, then the block's 16 scales d and 16 offsets m, so that
 * w[o][i] = d[o] * code[o][i] + m[o]. 4-bit codes fill four 64-byte vectors, vector j holding
 * inputs 8j..8j+3 in its low nibbles and 8j+4..8j+7 in its high ones, output o's four inputs
 * in bytes 4o..4o+3; 8-bit codes fill eight, vector g holding inputs 4g..4g+3. That is the
 * operand layout of a 4-way dot product instruction (vpdpbusd): one vector of codes meets a
 * row's four quantized inputs, broadcast, and leaves 16 outputs' sums.
 *
 * The activations are quantized as llama.cpp's are: a row's 32 inputs of block k to int8,
 * xq = round(x / dx) with dx = max|x| / 127, and s = dx * sum(xq). Then a block adds
 *     d * dx * sum(code * xq) + m * s
 * to each output, the integer sum exact (Q6_K's scale each 16 inputs applied to the sum of
 * its 16). Against float32 products of the dequantized weight, each input is off by at most
 * dx / 2, so |y - y_ref| <= sum_i |w_i| dx(i) / 2, plus float rounding (tests/test_quant.py
 * holds every path to that). A row's quantization depends on that row alone, and its sums run
 * in one order whatever the rows beside it, so its result is the same bits at any row count.
 * A weight whose form asks for two terms (a small model's, models/quant.py: TWO_TERMS) also
 * quantizes each block's residual x - dx xq the same way, as rows of their own, and adds the
 * two rows' results: each input is then off by at most dx' / 2 with dx' = max|x - dx xq| / 127
 * <= dx / 254, for twice the rows' products.
 *
 * Threads share the output blocks; a block's rows go in tiles whose accumulators stay in
 * registers, its codes unpacked once a tile (from the cache after the first). Every output's
 * sum runs over the blocks in order whatever the tiling, so a row's result depends only on
 * that row. The paths are compiled for their instruction sets and chosen at run time from
 * the CPU's features: AVX-512 VNNI, or AVX2 (maddubs, no VNNI needed); models/native.py falls
 * back to torch where neither runs.
 */

#include "quant.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define QK 32 /* inputs a block */
#define UNROLL _Pragma("GCC unroll 16") /* the rows' accumulators stay in registers */
#define QO 16 /* outputs a block */

/* a chunk's codes: 8 bits a code, or 4 in nibbles plus planes of the fifth and sixth bits */
static int64_t code_bytes(int64_t bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }

/* a chunk: its codes, then 16 scales and (unless implied) 16 offsets; 6 bits: the two
 * halves' 16 scales. With supers (the K types), the scales are integers (Q4_K: 16 unsigned
 * scales and 16 minima; Q6_K: the halves' 16 signed scales), multiplied by float16 ones each
 * 256 inputs (Q4_K: d and dmin; Q6_K: d), which follow all the chunks, 8 chunks a set */
static int64_t chunk_bytes(const QWeight *w) {
    if (w->supers) return code_bytes(w->bits) + 2 * QO;
    int64_t vectors = w->bits == 6 || !w->zero ? 2 : 1;
    return code_bytes(w->bits) + vectors * QO * (w->half_scales ? 2 : 4);
}

#define SUPER 8 /* chunks a set of super scales */

/* the float16 scales of output block ob's chunks kb..kb + 7: 16 d, then (Q4_K) 16 dmin */
static const uint16_t *super_scales(const QWeight *w, int64_t ob, int64_t kb) {
    int64_t nk = w->in / QK, blocks = (w->out + QO - 1) / QO, set = (w->bits == 6 ? 1 : 2) * QO;
    const uint16_t *base = (const uint16_t *)(w->packed + blocks * nk * chunk_bytes(w));
    return base + (ob * (nk / SUPER) + kb / SUPER) * set;
}

QWeight qweight(const uint8_t *packed, const float *bias, int64_t out, int64_t in, int64_t form) {
    return (QWeight){packed, bias, out, in, form & 255, (form >> 8) & 1,
                     (form >> 16) & 255, (form >> 9) & 1, 0, (form >> 24) & 1};
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 1023) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* the scale and offset of output o (0..15) at input i (0..31) of a chunk */
static void block_scales(const QWeight *w, const uint8_t *chunk, int64_t ob, int64_t kb, int o,
                         int i, float *d, float *m) {
    const uint8_t *s = chunk + code_bytes(w->bits);
    if (w->supers) {
        const uint16_t *sup = super_scales(w, ob, kb);
        if (w->bits == 6) { /* d sc (code - 32), a signed scale each half */
            *d = half_to_float(sup[o]) * (float)(int8_t)s[(i / 16) * QO + o];
            *m = -(float)w->zero * *d;
        } else { /* d sc code - dmin mn */
            *d = half_to_float(sup[o]) * (float)s[o];
            *m = -(half_to_float(sup[QO + o]) * (float)s[QO + o]);
        }
        return;
    }
    int64_t size = w->half_scales ? 2 : 4, at = w->bits == 6 ? (i / 16) * QO + o : o;
    uint16_t h;
    if (w->half_scales) {
        memcpy(&h, s + size * at, 2), *d = half_to_float(h);
        memcpy(&h, s + size * (QO + o), 2), *m = half_to_float(h);
    } else {
        memcpy(d, s + size * at, 4), memcpy(m, s + size * (QO + o), 4);
    }
    if (w->zero) *m = -(float)w->zero * *d;
}

static int code_at(const QWeight *w, const uint8_t *chunk, int o, int i) {
    int g = i / 4, at = o * 4 + i % 4;
    if (w->bits == 8) return chunk[g * 64 + at];
    uint8_t byte = chunk[(g / 2) * 64 + at];
    int code = g % 2 ? byte >> 4 : byte & 15;
    if (w->bits == 5) code |= ((chunk[256 + at] >> g) & 1) << 4;
    if (w->bits == 6) code |= ((chunk[256 + 64 * (g / 4) + at] >> (2 * (g % 4))) & 3) << 4;
    return code;
}

__attribute__((optimize("fp-contract=off"))) void qrows(const QWeight *w, const int64_t *ids, int64_t n, float *out) {
    int64_t nk = w->in / QK, cb = chunk_bytes(w);
    for (int64_t r = 0; r < n; r++) {
        int64_t ob = ids[r] / QO;
        int o = (int)(ids[r] % QO);
        for (int64_t kb = 0; kb < nk; kb++) {
            const uint8_t *chunk = w->packed + (ob * nk + kb) * cb;
            for (int i = 0; i < QK; i++) {
                float d, m;
                block_scales(w, chunk, ob, kb, o, i, &d, &m);
                out[r * w->in + kb * QK + i] = d * (float)code_at(w, chunk, o, i) + m;
            }
        }
    }
}

/* ---- the activations: xq [M, I] int8, and a row's dx and dx * sum(xq) a block [M, I / 32] */

/* a block's 32 inputs v: q = round(v / dx), dx = max|v| / 127, at `at` of the arrays */
static void quantize_block(const float *v, int8_t *q, int64_t at, float *dx, float *sx,
                           int32_t *halves) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
    float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t half[2] = {0, 0};
    for (int i = 0; i < QK; i++) {
        q[i] = (int8_t)lrintf(v[i] * inv);
        half[i / 16] += q[i];
    }
    dx[at] = d, sx[at] = d * (float)(half[0] + half[1]);
    halves[2 * at] = half[0], halves[2 * at + 1] = half[1];
}

/* rows 0..M-1: x's rows; with two terms, rows M..2M-1 the residuals x - dx q quantized the
 * same way (each input then off by at most max|residual| / 254 <= dx / 508) */
static void quantize_rows(const float *x, int64_t rows, int64_t in, int terms, int8_t *xq,
                          float *dx, float *sx, int32_t *halves) {
    int64_t nk = in / QK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kb = 0; kb < nk; kb++) {
            const float *v = x + r * in + kb * QK;
            int8_t *q = xq + r * in + kb * QK;
            quantize_block(v, q, r * nk + kb, dx, sx, halves);
            if (terms == 1) continue;
            float e[QK], d = dx[r * nk + kb];
            for (int i = 0; i < QK; i++) e[i] = v[i] - d * (float)q[i];
            quantize_block(e, q + rows * in, (rows + r) * nk + kb, dx, sx, halves);
        }
}

typedef struct {
    const QWeight *w;
    const int8_t *xq;
    const float *dx, *sx;
    const int32_t *halves; /* [M, I / 16]: sum(xq) of each 16 inputs */
    float *y;
    int64_t rows;
} Job;

static void store_block(const Job *j, int64_t row, int64_t ob, const float *lanes) {
    int64_t o0 = ob * QO, n = j->w->out - o0 < QO ? j->w->out - o0 : QO;
    float *y = j->y + row * (j->w->ldy ? j->w->ldy : j->w->out) + o0;
    for (int64_t o = 0; o < n; o++) y[o] = lanes[o] + (j->w->bias ? j->w->bias[o0 + o] : 0.0f);
}

/* The chunks a tile will read PREFETCH_AHEAD chunks from now, asked for now: with several
 * rows a chunk's dot products take long enough that the hardware's prefetcher, which follows
 * the loads, no longer keeps the stream ahead of them (a 5-row product of weights streamed
 * from memory ran 1.3-1.8x faster with it, one row as fast; bench/results/NOTES.md). Into
 * the first-level cache: into the second (docs/performance.md, "The K types by rows"), Q6_K's
 * products alone streamed 1.2-1.3x faster, yet Qwen2.5-Coder-1.5B's forwards measured a decode
 * 3% faster and a 5-row verify 3% slower, within the noise. A prefetch past the weight's end
 * is harmless: it never faults. */
#define PREFETCH_AHEAD 8
#define PREFETCH(p, cb)                                                                       \
    for (int64_t line = 0; line < (cb); line += 64)                                           \
    _mm_prefetch((const char *)(p) + PREFETCH_AHEAD * (cb) + line, _MM_HINT_T0)

/* ---- unpacking a chunk's codes: group g (inputs 4g..4g+3, four bytes an output) ----
 * 4, 5 and 6 bits: the low nibbles in four vectors (vector j: group 2j low, 2j + 1 high),
 * then 5 bits: one vector of fifth bits (bit g of byte 4o + t: group g's), 6 bits: two of
 * fifth-and-sixth pairs (vector h, bits 2i, 2i + 1: group 4h + i's). A pair of bytes shifts
 * as one 16-bit lane, and the mask keeps only bits that came from the same byte. 8 bits:
 * eight vectors, group g in vector g. */

#define VNNI_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define VNNI_TILE 8

/* a 16-bit lane shift by s (negative: right) */
#define VNNI_SHIFT(v, s) ((s) >= 0 ? _mm512_slli_epi16(v, (s)) : _mm512_srli_epi16(v, -(s)))

VNNI_ATTR static inline void vnni_unpack(const uint8_t *p, int bits, __m512i q[8]) {
    if (bits == 8) {
        for (int v = 0; v < 8; v++) q[v] = _mm512_loadu_si512(p + 64 * v);
        return;
    }
    const __m512i low = _mm512_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        __m512i b = _mm512_loadu_si512(p + 64 * v);
        q[2 * v] = _mm512_and_si512(b, low);
        q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
    if (bits == 5) {
        __m512i h = _mm512_loadu_si512(p + 256), bit = _mm512_set1_epi8(16);
        for (int g = 0; g < 8; g++)
            q[g] = _mm512_or_si512(q[g], _mm512_and_si512(VNNI_SHIFT(h, 4 - g), bit));
    } else if (bits == 6) {
        __m512i pair = _mm512_set1_epi8(48);
        for (int g = 0; g < 8; g++) {
            __m512i h = _mm512_loadu_si512(p + 256 + 64 * (g / 4));
            q[g] = _mm512_or_si512(q[g], _mm512_and_si512(VNNI_SHIFT(h, 4 - 2 * (g % 4)), pair));
        }
    }
}

/* a K type's chunk scales, its integers times the float16 ones of its 256 inputs: d, and
 * m the offsets (Q4_K: -dmin mn) or (Q6_K) the second half's scales; exact in float32 */
VNNI_ATTR static inline void vnni_supers(const QWeight *w, const uint8_t *sc, int64_t ob,
                                         int64_t kb, __m512 *d, __m512 *m) {
    const uint16_t *sup = super_scales(w, ob, kb);
#define INTS(p, ext) _mm512_cvtepi32_ps(ext(_mm_loadu_si128((const __m128i *)(p))))
    __m512 big = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup));
    if (w->bits == 6) {
        *d = _mm512_mul_ps(big, INTS(sc, _mm512_cvtepi8_epi32));
        *m = _mm512_mul_ps(big, INTS(sc + QO, _mm512_cvtepi8_epi32));
    } else {
        __m512 small = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sup + QO)));
        *d = _mm512_mul_ps(big, INTS(sc, _mm512_cvtepu8_epi32));
        *m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(small, INTS(sc + QO, _mm512_cvtepu8_epi32)));
    }
#undef INTS
}

/* A tile: ROWS rows of one output block. Each row's 32 inputs of a block meet the codes in
 * eight 4-way dot products, two chains (half the latency); 6-bit codes (Q6_K) take a scale
 * each 16 inputs, so their chains are the halves, their offset -32 d applied in integers. */
#define VNNI_TILE_FN(BITS, ROWS)                                                              \
    VNNI_ATTR static void vnni_##BITS##_##ROWS(const Job *j, int64_t ob, int64_t m0) {        \
        const QWeight *w = j->w;                                                              \
        int64_t nk = w->in / QK, cb = chunk_bytes(w);                                         \
        const uint8_t *p = w->packed + ob * nk * cb;                                          \
        __m512 acc[ROWS];                                                                     \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                          \
        for (int64_t kb = 0; kb < nk; kb++, p += cb) {                                        \
            PREFETCH(p, cb);                                                                  \
            __m512i q[8];                                                                     \
            vnni_unpack(p, BITS, q);                                                          \
            const uint8_t *sc = p + code_bytes(BITS);                                         \
            __m512 d, m;                                                                      \
            if (w->supers) {                                                                  \
                vnni_supers(w, sc, ob, kb, &d, &m);                                           \
            } else if (w->half_scales) { /* 6 bits: m holds the second half's scales */       \
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));                 \
                m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));          \
            } else {                                                                          \
                d = _mm512_loadu_ps(sc), m = _mm512_loadu_ps(sc + 64);                        \
            }                                                                                 \
            if (BITS != 6 && w->zero && !w->supers)                                           \
                m = _mm512_mul_ps(d, _mm512_set1_ps(-(float)w->zero));                        \
            UNROLL for (int r = 0; r < ROWS; r++) {                                           \
                const int8_t *xr = j->xq + (m0 + r) * w->in + kb * QK;                        \
                __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};              \
                UNROLL for (int g = 0; g < 8; g++) {                                          \
                    int32_t four;                                                             \
                    memcpy(&four, xr + 4 * g, 4);                                             \
                    int c = BITS == 6 ? g / 4 : g % 2;                                        \
                    s[c] = _mm512_dpbusd_epi32(s[c], q[g], _mm512_set1_epi32(four));          \
                }                                                                             \
                int64_t at = (m0 + r) * nk + kb;                                              \
                __m512 dx = _mm512_set1_ps(j->dx[at]);                                        \
                if (BITS == 6) {                                                              \
                    for (int c = 0; c < 2; c++) {                                             \
                        __m512i off = _mm512_set1_epi32(w->zero * j->halves[2 * at + c]);     \
                        __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(s[c], off));           \
                        acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(c ? m : d, dx), acc[r]);    \
                    }                                                                         \
                } else {                                                                      \
                    __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s[0], s[1]));              \
                    acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, dx), acc[r]);                \
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(j->sx[at]), acc[r]);           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < ROWS; r++) {                                                      \
            float lanes[QO];                                                                  \
            _mm512_storeu_ps(lanes, acc[r]);                                                  \
            store_block(j, m0 + r, ob, lanes);                                                \
        }                                                                                     \
    }

#define VNNI_TILES(BITS)                                                                      \
    VNNI_TILE_FN(BITS, 1)                                                                     \
    VNNI_TILE_FN(BITS, 2)                                                                     \
    VNNI_TILE_FN(BITS, 3)                                                                     \
    VNNI_TILE_FN(BITS, 4)                                                                     \
    VNNI_TILE_FN(BITS, 5)                                                                     \
    VNNI_TILE_FN(BITS, 6)                                                                     \
    VNNI_TILE_FN(BITS, 7)                                                                     \
    VNNI_TILE_FN(BITS, 8)                                                                     \
    static const tile_fn VNNI_##BITS[VNNI_TILE + 1] = {                                       \
        NULL,           vnni_##BITS##_1, vnni_##BITS##_2, vnni_##BITS##_3, vnni_##BITS##_4,   \
        vnni_##BITS##_5, vnni_##BITS##_6, vnni_##BITS##_7, vnni_##BITS##_8};

typedef void (*tile_fn)(const Job *, int64_t, int64_t);
VNNI_TILES(4)
VNNI_TILES(5)
VNNI_TILES(6)
VNNI_TILES(8)

/* ---- AVX2: 8 outputs a vector (a block's two halves in turn), tiles of up to 4 rows.
 * maddubs(code, xq) leaves pairs of products summed in 16 bits: at most 2 * 15 * 127 for
 * 4-bit codes, so eight groups add up in 16 bits before widening; four for 5-bit codes, two
 * for 6-bit. 8-bit codes go signed (code - 128, whose magnitude maddubs takes unsigned, its
 * sign moved onto xq: each pair under 2 * 128 * 127) and are widened at once; the 128 *
 * sum(xq) left out returns through the offset: m + 128 d. ---- */

#define AVX2_ATTR __attribute__((target("avx2,fma,f16c")))
#define AVX2_TILE 4
#define AVX2_SHIFT(v, s) ((s) >= 0 ? _mm256_slli_epi16(v, (s)) : _mm256_srli_epi16(v, -(s)))

/* vnni_supers for outputs 8h..8h+7 */
AVX2_ATTR static inline void avx2_supers(const QWeight *w, const uint8_t *sc, int64_t ob,
                                         int64_t kb, int h, __m256 *d, __m256 *m) {
    const uint16_t *sup = super_scales(w, ob, kb) + 8 * h;
#define INTS(p, ext) _mm256_cvtepi32_ps(ext(_mm_loadl_epi64((const __m128i *)(p))))
    __m256 big = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sup));
    if (w->bits == 6) {
        *d = _mm256_mul_ps(big, INTS(sc + 8 * h, _mm256_cvtepi8_epi32));
        *m = _mm256_mul_ps(big, INTS(sc + QO + 8 * h, _mm256_cvtepi8_epi32));
    } else {
        __m256 small = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + QO)));
        *d = _mm256_mul_ps(big, INTS(sc + 8 * h, _mm256_cvtepu8_epi32));
        *m = _mm256_sub_ps(_mm256_setzero_ps(),
                           _mm256_mul_ps(small, INTS(sc + QO + 8 * h, _mm256_cvtepu8_epi32)));
    }
#undef INTS
}

/* the chunk's codes of outputs 8h..8h+7 */
AVX2_ATTR static inline void avx2_unpack(const uint8_t *p, int bits, int h, __m256i q[8]) {
#define HALF(offset) _mm256_loadu_si256((const __m256i *)(p + (offset) + 32 * h))
    if (bits == 8) {
        for (int v = 0; v < 8; v++) q[v] = _mm256_xor_si256(HALF(64 * v), _mm256_set1_epi8(-128));
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int v = 0; v < 4; v++) {
        __m256i b = HALF(64 * v);
        q[2 * v] = _mm256_and_si256(b, low);
        q[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
    if (bits == 5) {
        __m256i hb = HALF(256), bit = _mm256_set1_epi8(16);
        for (int g = 0; g < 8; g++)
            q[g] = _mm256_or_si256(q[g], _mm256_and_si256(AVX2_SHIFT(hb, 4 - g), bit));
    } else if (bits == 6) {
        __m256i pair = _mm256_set1_epi8(48);
        for (int g = 0; g < 8; g++)
            q[g] = _mm256_or_si256(
                q[g], _mm256_and_si256(AVX2_SHIFT(HALF(256 + 64 * (g / 4)), 4 - 2 * (g % 4)), pair));
    }
#undef HALF
}

/* the dot products of a row's 32 inputs with 8 outputs' codes: s[0] over all 32 (s[1] 0),
 * or for 6-bit codes s[0] over the first 16 and s[1] over the second */
AVX2_ATTR static inline void avx2_dots(const __m256i q[8], const int8_t *xr, int bits,
                                       __m256i s[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    int per = bits == 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 2 : 1; /* groups summed in 16 bits */
    s[0] = s[1] = _mm256_setzero_si256();
    __m256i t = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        int32_t four;
        memcpy(&four, xr + 4 * g, 4);
        __m256i x4 = _mm256_set1_epi32(four);
        __m256i pairs = bits == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(q[g]),
                                                         _mm256_sign_epi8(x4, q[g]))
                                  : _mm256_maddubs_epi16(q[g], x4);
        t = _mm256_add_epi16(t, pairs);
        if ((g + 1) % per == 0) {
            int c = bits == 6 ? g / 4 : 0;
            s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(t, ones));
            t = _mm256_setzero_si256();
        }
    }
}

#define AVX2_TILE_FN(BITS, ROWS)                                                              \
    AVX2_ATTR static void avx2_##BITS##_##ROWS(const Job *j, int64_t ob, int64_t m0) {        \
        const QWeight *w = j->w;                                                              \
        int64_t nk = w->in / QK, cb = chunk_bytes(w);                                         \
        const uint8_t *p = w->packed + ob * nk * cb;                                          \
        __m256 acc[ROWS][2];                                                                  \
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();           \
        for (int64_t kb = 0; kb < nk; kb++, p += cb)                                          \
            for (int h = 0; h < 2; h++) {                                                     \
                if (h == 0) PREFETCH(p, cb);                                                  \
                __m256i q[8];                                                                 \
                avx2_unpack(p, BITS, h, q);                                                   \
                const uint8_t *sc = p + code_bytes(BITS);                                     \
                __m256 d, m;                                                                  \
                if (w->supers) {                                                              \
                    avx2_supers(w, sc, ob, kb, h, &d, &m);                                    \
                } else if (!w->half_scales) { /* 6 bits: m holds the second half's scales */  \
                    d = _mm256_loadu_ps((const float *)(sc + 32 * h));                        \
                    m = _mm256_loadu_ps((const float *)(sc + 64 + 32 * h));                   \
                } else {                                                                      \
                    d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * h)));     \
                    m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 + 16 * h))); \
                }                                                                             \
                if (BITS != 6 && w->zero && !w->supers)                                       \
                    m = _mm256_mul_ps(d, _mm256_set1_ps(-(float)w->zero));                    \
                if (BITS == 8) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.0f), m);             \
                UNROLL for (int r = 0; r < ROWS; r++) {                                       \
                    __m256i s[2];                                                             \
                    avx2_dots(q, j->xq + (m0 + r) * w->in + kb * QK, BITS, s);                \
                    int64_t at = (m0 + r) * nk + kb;                                          \
                    __m256 dx = _mm256_set1_ps(j->dx[at]);                                    \
                    if (BITS == 6) {                                                          \
                        for (int c = 0; c < 2; c++) {                                         \
                            __m256i off = _mm256_set1_epi32(w->zero * j->halves[2 * at + c]); \
                            __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[c], off));       \
                            acc[r][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(c ? m : d, dx),      \
                                                        acc[r][h]);                           \
                        }                                                                     \
                    } else {                                                                  \
                        __m256 f = _mm256_cvtepi32_ps(s[0]);                                  \
                        acc[r][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, dx), acc[r][h]);      \
                        acc[r][h] =                                                           \
                            _mm256_fmadd_ps(m, _mm256_set1_ps(j->sx[at]), acc[r][h]);         \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        for (int r = 0; r < ROWS; r++) {                                                      \
            float lanes[QO];                                                                  \
            _mm256_storeu_ps(lanes, acc[r][0]);                                               \
            _mm256_storeu_ps(lanes + 8, acc[r][1]);                                           \
            store_block(j, m0 + r, ob, lanes);                                                \
        }                                                                                     \
    }

#define AVX2_TILES(BITS)                                                                      \
    AVX2_TILE_FN(BITS, 1)                                                                     \
    AVX2_TILE_FN(BITS, 2)                                                                     \
    AVX2_TILE_FN(BITS, 3)                                                                     \
    AVX2_TILE_FN(BITS, 4)                                                                     \
    static const tile_fn AVX2_##BITS[AVX2_TILE + 1] = {NULL, avx2_##BITS##_1, avx2_##BITS##_2, \
                                                       avx2_##BITS##_3, avx2_##BITS##_4};
AVX2_TILES(4)
AVX2_TILES(5)
AVX2_TILES(6)
AVX2_TILES(8)

/* ---- the path, and the product ---- */

static int path = -1; /* -1: not chosen yet */

static int has(int want) {
    __builtin_cpu_init();
    if (want == QPATH_VNNI512)
        return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    if (want == QPATH_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    return want == QPATH_NONE;
}

int qpath_select(int want) {
    if (want >= 0) return path = has(want) ? want : QPATH_NONE;
    return path = has(QPATH_VNNI512) ? QPATH_VNNI512 : has(QPATH_AVX2) ? QPATH_AVX2 : QPATH_NONE;
}

/* a forward's activations quantized once for every product that reads them */
typedef struct {
    int8_t *xq;
    float *dx, *sx;
    int32_t *halves;
} Activations;

static void release(Activations *a) { free(a->xq), free(a->dx), free(a->sx), free(a->halves); }

/* 0, or -1 when out of memory; `terms` 2: the residuals' rows after x's */
static int quantize(const float *x, int64_t rows, int64_t in, int terms, Activations *a) {
    int64_t nk = in / QK;
    rows *= terms;
    a->xq = malloc(rows * in);
    a->dx = malloc(sizeof(float) * rows * nk), a->sx = malloc(sizeof(float) * rows * nk);
    a->halves = malloc(sizeof(int32_t) * rows * nk * 2);
    if (!a->xq || !a->dx || !a->sx || !a->halves) {
        release(a);
        return -1;
    }
    quantize_rows(x, rows / terms, in, terms, a->xq, a->dx, a->sx, a->halves);
    return 0;
}

/* y [M, ldy] (at its part's outputs) = the two terms' rows of y2 [2M, ldy] summed + bias */
static void add_terms(const float *y2, float *y, int64_t rows, int64_t out, int64_t ldy,
                      const float *bias) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out; o++)
            y[r * ldy + o] = y2[r * ldy + o] + y2[(rows + r) * ldy + o] + (bias ? bias[o] : 0.0f);
}

static void run(const QWeight *w, const Activations *a, float *y, int64_t rows, int threads) {
    Job j = {w, a->xq, a->dx, a->sx, a->halves, y, rows};
    int vnni = path == QPATH_VNNI512, tile = vnni ? VNNI_TILE : AVX2_TILE;
    const tile_fn *by_bits[9] = {[4] = vnni ? VNNI_4 : AVX2_4, [5] = vnni ? VNNI_5 : AVX2_5,
                                 [6] = vnni ? VNNI_6 : AVX2_6, [8] = vnni ? VNNI_8 : AVX2_8};
    const tile_fn *fns = by_bits[w->bits];
    int64_t blocks = (w->out + QO - 1) / QO, tiles = (rows + tile - 1) / tile;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t ob = 0; ob < blocks; ob++)
        for (int64_t t = 0, m0 = 0; t < tiles; t++) { /* equal tiles */
            int64_t n = (rows * (t + 1)) / tiles - (rows * t) / tiles;
            fns[n](&j, ob, m0);
            m0 += n;
        }
}

int qgemm(const QWeight *w, const float *x, float *y, int64_t rows, int threads) {
    if (path < 0) qpath_select(-1);
    Activations a;
    int terms = w->two_terms ? 2 : 1;
    if (path == QPATH_NONE || quantize(x, rows, w->in, terms, &a)) return -1;
    if (terms == 1) {
        run(w, &a, y, rows, threads);
        release(&a);
        return 0;
    }
    QWeight bare = *w;
    bare.bias = NULL;
    int64_t ldy = w->ldy ? w->ldy : w->out;
    float *y2 = malloc(sizeof(float) * 2 * rows * ldy);
    if (y2) {
        run(&bare, &a, y2, 2 * rows, threads);
        add_terms(y2, y, rows, w->out, ldy, w->bias);
    }
    free(y2), release(&a);
    return y2 ? 0 : -1;
}

int qgemm_parts(const int64_t *parts, const float *x, float *y, int64_t rows, int64_t in,
                int threads) {
    if (path < 0) qpath_select(-1);
    Activations a;
    int64_t n = parts[0], out = 0;
    int terms = (parts[4] >> 24) & 1 ? 2 : 1; /* the first part's choice holds for all */
    if (path == QPATH_NONE || quantize(x, rows, in, terms, &a)) return -1;
    for (int64_t i = 0; i < n; i++) out += parts[1 + 4 * i + 2];
    float *y2 = terms == 2 ? malloc(sizeof(float) * 2 * rows * out) : y;
    for (int64_t i = 0, at = 0; y2 && i < n; i++) { /* the activations quantized once for all */
        const int64_t *p = parts + 1 + 4 * i;
        const float *bias = (const float *)(intptr_t)p[1];
        QWeight w = qweight((const uint8_t *)(intptr_t)p[0], terms == 2 ? NULL : bias, p[2], in,
                            p[3]);
        w.ldy = out;
        run(&w, &a, y2 + at, terms * rows, threads);
        if (terms == 2) add_terms(y2 + at, y + at, rows, p[2], out, bias);
        at += p[2];
    }
    int status = y2 ? 0 : -1;
    if (terms == 2) free(y2);
    release(&a);
    return status;
}
