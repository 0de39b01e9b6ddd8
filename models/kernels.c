/* Native CPU kernels for a forward of a few tokens (float32, int8 weights).
 *
 * A decode forward of a small model issues about a thousand small torch operations, each of
 * which costs microseconds of dispatch for a few hundred floats of work. Here are: an RMSNorm,
 * the rotary embedding of q and k, silu(gate) * up, a paged attention of a few queries a
 * sequence that reads keys and values where the cache keeps them, products over blocked
 * float32 or int8 weights, and decode_layers, which runs all of a forward's layers in one call.
 *
 * The caller (models/native.py) passes tensors as data pointers and guarantees their shapes,
 * dtypes and contiguity; nothing here allocates Python objects or touches torch. Loops are
 * written on the machine's own vectors over 16-float blocks (or as `omp simd` loops without
 * reductions); every reduction runs in a fixed order, the same on every vector width, so a
 * row's result depends only on that row. The threads of the attention and the products are
 * an OpenMP team: the process's libgomp is torch's (the same soname, loaded first), so they
 * are the threads torch's own operations use.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include "quant.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- argument parsing: every argument is an int (a pointer or a size) or a float ---- */

static int ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int64_t *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (PyFloat_Check(args[i])) {
            double d = PyFloat_AsDouble(args[i]);
            memcpy(&out[i], &d, sizeof d); /* a float travels bit for bit */
        } else {
            out[i] = PyLong_AsLongLong(args[i]);
            if (out[i] == -1 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

static double as_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

#define PTR(type, v) ((type *)(intptr_t)(v))

/* ---- 16-lane vectors (GCC's vector extensions), the native vectors of AVX-512, where the
 * attention's scores and hsum_block use them; every horizontal sum is hsum16's tree ---- */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float *x) {
    v16 v;
    memcpy(&v, x, sizeof v);
    return v;
}

static inline void store16(float *x, v16 v) { memcpy(x, &v, sizeof v); }

/* the 16 lanes of x summed: halves, then quarters, ... */
static inline float hsum16(v16 x) {
    x += __builtin_shuffle(x, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (i16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (i16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (i16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

/* lane j of the result: the sum of acc[j]'s lanes, all 16 at once (a transposing tree: each
 * level adds two vectors' halves, quarters, ...; the lanes come out in bit-reversed order) */
static inline v16 sum16x16(const v16 acc[16]) {
    const i16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16 hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i16 lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i16 hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i16 lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i16 hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const i16 bit_reversed = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    v16 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = __builtin_shuffle(acc[2 * i], acc[2 * i + 1], lo1) +
               __builtin_shuffle(acc[2 * i], acc[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo2) +
               __builtin_shuffle(x[2 * i], x[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], lo3) +
               __builtin_shuffle(y[2 * i], y[2 * i + 1], hi3);
    v16 f = __builtin_shuffle(z[0], z[1], lo4) + __builtin_shuffle(z[0], z[1], hi4);
    return __builtin_shuffle(f, bit_reversed);
}

/* ---- the machine's own vectors: 16 floats with AVX-512, 8 with AVX2. GCC keeps a 16-float
 * vector on the stack where registers hold 8 (5 times slower products, 2 times slower
 * attention, measured), so the kernels loop over a 16-float block's HALVES native vectors,
 * and every horizontal sum still runs hsum16's tree, whatever the width ---- */

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#define HALVES (16 / LANES) /* native vectors a 16-float block */

typedef float vn __attribute__((vector_size(LANES * 4)));
typedef int32_t ivn __attribute__((vector_size(LANES * 4)));
typedef int8_t i8n __attribute__((vector_size(LANES)));

static inline vn loadn(const float *x) {
    vn v;
    memcpy(&v, x, sizeof v);
    return v;
}

static inline void storen(float *x, vn v) { memcpy(x, &v, sizeof v); }

static inline vn splatn(float x) { return (vn){0} + x; }

static inline vn selectn(ivn take_a, vn a, vn b) { /* take_a lanes are all ones or zero */
    return (vn)(((ivn)a & take_a) | ((ivn)b & ~take_a));
}

/* the 16 floats of a block's halves summed by hsum16's tree: lane l + lane l + 8, then the
 * same folds by 4, 2 and 1 */
static inline float hsum_block(const vn *a) {
#if LANES == 16
    return hsum16(a[0]);
#else
    vn x = a[0] + a[1];
    x += __builtin_shuffle(x, (ivn){4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (ivn){2, 3, 0, 1, 6, 7, 4, 5});
    x += __builtin_shuffle(x, (ivn){1, 0, 3, 2, 5, 4, 7, 6});
    return x[0];
#endif
}

#if LANES == 8
/* lane j of the result: x[j]'s lanes summed by hsum_block's folds by 4, 2 and 1, all 8 at
 * once (a transposing tree; the lanes come out as 0 2 1 3 4 6 5 7, put back in order) */
static inline vn sum8x8(const vn x[8]) {
    const ivn lo1 = {0, 1, 2, 3, 8, 9, 10, 11}, hi1 = {4, 5, 6, 7, 12, 13, 14, 15};
    const ivn lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const ivn lo3 = {0, 2, 4, 6, 8, 10, 12, 14}, hi3 = {1, 3, 5, 7, 9, 11, 13, 15};
    vn y[4], z[2];
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo1) +
               __builtin_shuffle(x[2 * i], x[2 * i + 1], hi1);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shuffle(y[2 * i], y[2 * i + 1], lo2) +
               __builtin_shuffle(y[2 * i], y[2 * i + 1], hi2);
    vn f = __builtin_shuffle(z[0], z[1], lo3) + __builtin_shuffle(z[0], z[1], hi3);
    return __builtin_shuffle(f, (ivn){0, 2, 1, 3, 4, 6, 5, 7});
}
#endif

/* exp(x) lane by lane: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial
 * (relative error below 2e-7), 2^n put into the exponent bits; 0 at and below -87 (-inf
 * included), x capped at 88 (exp(88) = 1.7e38, float32's largest power of e) */
static inline vn expn(vn x) {
    ivn tiny = x <= splatn(-87.0f);
    x = selectn(tiny, splatn(-87.0f), x);
    x = selectn(x > splatn(88.0f), splatn(88.0f), x);
    vn n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    vn r = x - n * 0.693145752f - n * 1.42860677e-6f;
    vn poly = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f +
              r * (8.33333333e-3f + r * 1.38888889e-3f)))));
    ivn bits = (__builtin_convertvector(n, ivn) + 127) << 23;
    return selectn(tiny, splatn(0.0f), poly * (vn)bits);
}

static inline float exp1(float x) { return expn(splatn(x))[0]; }

/* ---- products with blocked weights: y [M, O] = x [M, I] W^T (+ bias) ----
 *
 * W is stored in blocks of 16 outputs: block b holds, for each input i, outputs 16b..16b+15
 * next to each other ([O / 16, I, 16], O padded to a multiple of 16 with zero rows), so a
 * block is one contiguous stream and a row of x meets each weight in one fused multiply-add
 * into a 16-lane accumulator: no horizontal sums, and up to 16 rows share each weight read
 * from the registers, up to GEMM_CHUNK from the cache (a verify of k + 1 rows, or a tree's,
 * costs little more than one row while the weights stream from memory). Float32 weights, or int8 with a scale per output (applied once at the end).
 * Output blocks are shared by the threads. A row's result depends only on that row. */

/* A pass covers PASS_BLOCKS output blocks; the threads share the passes. Within a pass, rows
 * go in tiles of up to TILE_ROWS, whose accumulators (rows x blocks x halves native vectors)
 * stay in registers: AVX-512 has 32, for 8 rows x 2 blocks; AVX2 has 16, for 6 rows x 1
 * block x 2 halves, a pass then being one block. With several tiles only the first reads
 * the pass's weights from memory, the others from the cache, and the hardware's prefetcher
 * stops with the first: so each tile fetches its share of the next pass's weights ahead,
 * spread over its steps, and the memory keeps streaming while the later tiles compute
 * (docs/performance.md "Forwards by rows" has the figures, and the tilings tried that were no
 * faster). Each output's sum runs over the inputs in order whatever the tiling,
 * so the results do not depend on it. */
#ifdef __AVX512F__
#define TILE_ROWS 8
#define PASS_BLOCKS 2
#else
#define TILE_ROWS 6
#define PASS_BLOCKS 1
#endif
#define PASS_VECS (PASS_BLOCKS * HALVES) /* native vectors a row's pass accumulates */

/* LANES int8 weights as floats: one sign extension and one conversion */
static inline vn int8_weights(const int8_t *q) {
#ifdef __AVX512F__
    __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q));
    vn w;
    __m512 f = _mm512_cvtepi32_ps(wide);
    memcpy(&w, &f, sizeof w);
    return w;
#elif defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
    vn w;
    memcpy(&w, &f, sizeof w);
    return w;
#else
    i8n b;
    memcpy(&b, q, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, ivn), vn);
#endif
}

/* one input's weights for the pass's blocks, times each row's input, into the accumulators */
#define GEMM_STEP(ROWS, LOAD)                                                                 \
    {                                                                                         \
        vn w[PASS_VECS];                                                                      \
        for (int v = 0; v < PASS_VECS; v++)                                                   \
            w[v] = LOAD((v / HALVES) * next + i * 16 + (v % HALVES) * LANES);                 \
        for (int m = 0; m < ROWS; m++) {                                                      \
            float xm = xr[m * in + i];                                                        \
            for (int v = 0; v < PASS_VECS; v++) acc[v][m] += xm * w[v];                       \
        }                                                                                     \
    }
#define INT8_AT(offset) int8_weights(wq + base + (offset))
#define FLOAT_AT(offset) loadn(wf + base + (offset))

/* rows m0..m0+ROWS of the product for output blocks ob..ob+nb-1 (nb <= PASS_BLOCKS); ROWS a
 * constant, so that the accumulators stay in registers */
#define GEMM_TILE(ROWS)                                                                       \
    static void gemm_tile_##ROWS(const float *x, const float *wf, const int8_t *wq,          \
                                 const float *scales, const float *bias, float *y,            \
                                 int64_t m0, int64_t in, int64_t out, int64_t ob,             \
                                 int64_t nb, int64_t t, int64_t tiles) {                      \
        vn acc[PASS_VECS][ROWS];                                                              \
        for (int v = 0; v < PASS_VECS; v++)                                                   \
            for (int m = 0; m < ROWS; m++) acc[v][m] = (vn){0};                               \
        int64_t base = ob * in * 16, next = nb > 1 ? in * 16 : 0;                             \
        const float *xr = x + m0 * in;                                                        \
        /* tile t of several fetches its share of the next pass's weights, a little a step */ \
        int64_t bytes = (wq ? 1 : 4) * PASS_BLOCKS * in * 16;                                 \
        const char *ahead = (wq ? (const char *)(wq + base) : (const char *)(wf + base)) +    \
                            bytes + t * bytes / tiles;                                        \
        uint64_t at = 0, stride = ((uint64_t)(bytes / tiles) << 16) / (uint64_t)in;          \
        if (tiles == 1 && wq)                                                                 \
            for (int64_t i = 0; i < in; i++) GEMM_STEP(ROWS, INT8_AT)                         \
        else if (tiles == 1)                                                                  \
            for (int64_t i = 0; i < in; i++) GEMM_STEP(ROWS, FLOAT_AT)                        \
        else if (wq)                                                                          \
            for (int64_t i = 0; i < in; i++, at += stride) {                                  \
                __builtin_prefetch(ahead + (at >> 16), 0, 2);                                 \
                GEMM_STEP(ROWS, INT8_AT)                                                      \
            }                                                                                 \
        else                                                                                  \
            for (int64_t i = 0; i < in; i++, at += stride) {                                  \
                __builtin_prefetch(ahead + (at >> 16), 0, 2);                                 \
                GEMM_STEP(ROWS, FLOAT_AT)                                                     \
            }                                                                                 \
        for (int64_t b = 0; b < nb; b++)                                                      \
            for (int m = 0; m < ROWS; m++) {                                                  \
                float lanes[16];                                                              \
                for (int h = 0; h < HALVES; h++)                                              \
                    memcpy(lanes + h * LANES, &acc[b * HALVES + h][m], sizeof(vn));           \
                store_row(lanes, scales, bias, y + (m0 + m) * out, out, ob + b);              \
            }                                                                                 \
    }

/* a row's 16 sums of block ob into y (scaled for int8 weights, then the bias added) */
static inline void store_row(const float *lanes, const float *scales, const float *bias,
                             float *y, int64_t out, int64_t ob) {
    int64_t o0 = ob * 16, n = out - o0 < 16 ? out - o0 : 16;
    for (int64_t j = 0; j < n; j++) {
        float r = scales ? lanes[j] * scales[o0 + j] : lanes[j];
        y[o0 + j] = r + (bias ? bias[o0 + j] : 0.0f);
    }
}

GEMM_TILE(1)
GEMM_TILE(2)
GEMM_TILE(3)
GEMM_TILE(4)
GEMM_TILE(5)
GEMM_TILE(6)
#if TILE_ROWS == 8
GEMM_TILE(7)
GEMM_TILE(8)
#endif

typedef void (*gemm_tile_fn)(const float *, const float *, const int8_t *, const float *,
                             const float *, float *, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t);
static const gemm_tile_fn GEMM_TILES[TILE_ROWS + 1] = {
    NULL,        gemm_tile_1, gemm_tile_2, gemm_tile_3, gemm_tile_4, gemm_tile_5,
    gemm_tile_6,
#if TILE_ROWS == 8
    gemm_tile_7, gemm_tile_8,
#endif
};

/* Rows go GEMM_CHUNK at a time, their inputs held in the cache; for each chunk the threads
 * share the passes, and a pass's weights (in x 32 floats) are read from memory once for all
 * of the chunk's tiles: a verify of up to GEMM_CHUNK rows streams the weights once, a
 * prefill's rows re-read them once a chunk. A chunk's rows are split into equal tiles. */
#define GEMM_CHUNK 64

static void gemm(const float *x, const float *wf, const int8_t *wq, const float *scales,
                 const float *bias, float *y, int64_t m_rows, int64_t in, int64_t out,
                 int threads) {
    int64_t blocks = (out + 15) / 16, passes = (blocks + PASS_BLOCKS - 1) / PASS_BLOCKS;
    /* one team for all chunks, which need not wait for each other: a team's start and end
     * are what cost most when the threads share their cores with another process */
#pragma omp parallel num_threads(threads)
    for (int64_t c0 = 0; c0 < m_rows; c0 += GEMM_CHUNK) {
        int64_t rows = m_rows - c0 < GEMM_CHUNK ? m_rows - c0 : GEMM_CHUNK;
        int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp for schedule(static) nowait
        for (int64_t pass = 0; pass < passes; pass++) {
            int64_t ob = PASS_BLOCKS * pass;
            int64_t nb = blocks - ob < PASS_BLOCKS ? blocks - ob : PASS_BLOCKS;
            for (int64_t t = 0, m0 = c0; t < tiles; t++) {
                int64_t n = (rows * (t + 1)) / tiles - (rows * t) / tiles;
                GEMM_TILES[n](x, wf, wq, scales, bias, y, m0, in, out, ob, nb, t, tiles);
                m0 += n;
            }
        }
    }
}

/* linear(y, x, weight, int8 weight, scales, bias, rows, in, out, threads): one of the two
 * weight pointers is 0 */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[10];
    if (ints(args, nargs, 10, a)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    gemm(PTR(const float, a[1]), PTR(const float, a[2]), PTR(const int8_t, a[3]),
         PTR(const float, a[4]), PTR(const float, a[5]), PTR(float, a[0]), a[6], a[7], a[8],
         (int)a[9]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w ---- */

static void rms_norm_rows(float *out, const float *x, const float *w, int64_t rows, int64_t dim,
                          float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        vn squares[HALVES] = {0};
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16)
            for (int h = 0; h < HALVES; h++) {
                vn v = loadn(xr + i + h * LANES);
                squares[h] += v * v;
            }
        float ss = hsum_block(squares);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * scale * w[i];
    }
}

/* rms_norm(out, x, weight, rows, dim, eps) */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[6];
    if (ints(args, nargs, 6, a)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows(PTR(float, a[0]), PTR(const float, a[1]), PTR(const float, a[2]), a[3], a[4],
                  (float)as_double(a[5]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- rotary embedding, in place: x = x * cos + rotate_half(x) * sin ----
 * x [rows, heads, dim] with row stride `stride` floats; cos, sin [rows, dim] with sin's first
 * half negated (models/llama.py: `rotate`), so rotate_half is a roll by dim / 2. */

static void rope_rows(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads,
                      int64_t dim, int64_t stride) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * dim;
            float lo[512];
            memcpy(lo, v, half * sizeof(float));
#pragma omp simd
            for (int64_t i = 0; i < half; i++) v[i] = v[i] * c[i] + v[i + half] * s[i];
#pragma omp simd
            for (int64_t i = 0; i < half; i++)
                v[i + half] = v[i + half] * c[i + half] + lo[i] * s[i + half];
        }
    }
}

/* rope(x, cos, sin, rows, heads, dim, row_stride) */
static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    if (ints(args, nargs, 7, a)) return NULL;
    if (a[5] > 1024 || a[5] % 2) {
        PyErr_SetString(PyExc_ValueError, "rope: head_dim must be even and at most 1024");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_rows(PTR(float, a[0]), PTR(const float, a[1]), PTR(const float, a[2]), a[3], a[4], a[5],
              a[6]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- silu(gate) * up: gate_up [rows, 2 * inter] (gate then up), out [rows, inter] ---- */

static void silu_mul_rows(float *out, const float *gu, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) {
            vn x = loadn(g + i);
            storen(o + i, x / (1.0f + expn(-x)) * loadn(u + i));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* silu_mul(out, gate_up, rows, inter) */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[4];
    if (ints(args, nargs, 4, a)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    silu_mul_rows(PTR(float, a[0]), PTR(const float, a[1]), a[2], a[3]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- paged attention over a few queries a sequence ----
 *
 * The store is one layer's rows [pages * 2 * page_size, kv_heads, dim]: a key row r, its value
 * row r + page_size. The T new tokens' k and v are written first (rows `write_rows`), then
 * each query attends to the keys its sequence has: key j (row `read_rows[b * lmax + j]`) is
 * seen when j < kv_lens[b] and j <= the query's position, or, with a tree mask [B, qmax, lmax]
 * of bytes, where the mask says so. Tokens come sequence by sequence; token t is padded query
 * q_index[t] = b * qmax + i.
 *
 * The work splits into items of (sequence, kv head, CHUNK keys), shared by the threads: an
 * item reads its keys and values once for every query of its sequence and every q head of
 * its group, and leaves each row's running max, sum of exponentials and weighted values; the
 * chunks of a row then merge in key order. A row's result depends only on its query and its
 * keys, not on the thread count or on the other rows. */

#define CHUNK 128 /* keys an item: small enough that a 512-token decode keeps 2 threads busy */
#define VALUE_FLOATS 64 /* a row's weighted values: accumulators a pass over the keys */

typedef struct {
    float *out;             /* [T, hq, dim] */
    const float *q;         /* [T, hq, dim], rows `q_stride` floats apart */
    const float *k, *v;     /* [T, hkv, dim], rows `k_stride` and `v_stride` floats apart */
    void *store;            /* one layer's rows, float32 or (half) float16 */
    const int64_t *write_rows, *read_rows, *kv_lens, *q_index, *q_positions;
    const uint8_t *mask;    /* NULL: causal by position */
    int64_t tokens, seqs, qmax, lmax, hq, hkv, dim, page_size, q_stride, k_stride, v_stride;
    float scale;
    int half;
} Paged;

/* ---- a float16 store: rows converted as they are written, and as an item reads them (into
 * its scratch, where the float32 loops below read them); F16C's conversions round to nearest */

static void to_half(uint16_t *out, const float *x, int64_t n) {
#ifdef __F16C__
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#else
    for (int64_t i = 0; i < n; i++) out[i] = _cvtss_sh(x[i], 0);
#endif
}

static void from_half(float *out, const uint16_t *x, int64_t n) {
#ifdef __F16C__
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
#else
    for (int64_t i = 0; i < n; i++) out[i] = _cvtsh_ss(x[i]);
#endif
}

/* row r of the store's element type, `offset` elements in */
static void *store_at(const Paged *p, int64_t r, int64_t offset) {
    int64_t at = r * p->hkv * p->dim + offset;
    return p->half ? (void *)((uint16_t *)p->store + at) : (void *)((float *)p->store + at);
}

static void write_kv(const Paged *p) {
    int64_t row = p->hkv * p->dim;
    for (int64_t t = 0; t < p->tokens; t++) {
        int64_t r = p->write_rows[t];
        const float *k = p->k + t * p->k_stride, *v = p->v + t * p->v_stride;
        if (p->half) {
            to_half(store_at(p, r, 0), k, row);
            to_half(store_at(p, r + p->page_size, 0), v, row);
        } else {
            memcpy(store_at(p, r, 0), k, row * sizeof(float));
            memcpy(store_at(p, r + p->page_size, 0), v, row * sizeof(float));
        }
    }
}

/* the chunk's key (or value) rows of kv head h as float32 pointers: into the store, or (a
 * float16 store) into `scratch` [n, dim], converted */
static void chunk_rows(const Paged *p, const int64_t *rows, int64_t n, int64_t shift, int64_t h,
                       float *scratch, const float **out) {
    for (int64_t j = 0; j < n; j++) {
        void *at = store_at(p, rows[j] + shift, h * p->dim);
        if (p->half) {
            from_half(scratch + j * p->dim, at, p->dim);
            out[j] = scratch + j * p->dim;
        } else {
            out[j] = at;
        }
    }
}

typedef struct {
    int64_t b, t0, t1, h, j0, j1; /* sequence, its tokens, kv head, keys */
    float *part;                  /* per row: max, sum, dim weighted values */
} Item;

#define QUERY_VECS 8 /* a query's 16-float vectors held in registers: head_dim up to 128 */

/* s[j] = scale * (query . keys[j]) for j < n16 (a multiple of 16). The query stays in
 * registers (its first QUERY_VECS vectors; `vecs` a constant where this is inlined) while the
 * keys stream past; each key's sum runs over its vectors in order, then by hsum16's tree. */
static inline __attribute__((always_inline)) void score_keys(const float *qv,
                                                             const float *const *keys,
                                                             int64_t n16, int64_t vecs,
                                                             float scale, float *s) {
#if LANES == 16 /* the 16 keys' sums at once, by a transposing tree */
    v16 q[QUERY_VECS];
    for (int64_t c = 0; c < vecs && c < QUERY_VECS; c++) q[c] = load16(qv + 16 * c);
#define QUERY16(c) ((c) < QUERY_VECS ? q[c] : load16(qv + 16 * (c)))
    for (int64_t k0 = 0; k0 < n16; k0 += 16) {
        v16 acc[16];
        for (int j = 0; j < 16; j++) {
            v16 a = q[0] * load16(keys[k0 + j]);
            for (int64_t c = 1; c < vecs; c++) a += QUERY16(c) * load16(keys[k0 + j] + 16 * c);
            acc[j] = a;
        }
        store16(s + k0, sum16x16(acc) * scale);
    }
#undef QUERY16
#else /* 8 keys at a time: each key's two halves added, then the same tree (sum8x8) */
    vn q[2 * QUERY_VECS];
    for (int64_t c = 0; c < vecs && c < QUERY_VECS; c++)
        q[2 * c] = loadn(qv + 16 * c), q[2 * c + 1] = loadn(qv + 16 * c + 8);
#define QUERY8(c, half) ((c) < QUERY_VECS ? q[2 * (c) + (half)] : loadn(qv + 16 * (c) + 8 * (half)))
    for (int64_t k0 = 0; k0 < n16; k0 += 8) {
        vn halves[8];
        for (int j = 0; j < 8; j++) {
            const float *kv = keys[k0 + j];
            vn lo = q[0] * loadn(kv), hi = q[1] * loadn(kv + 8);
            for (int64_t c = 1; c < vecs; c++) {
                lo += QUERY8(c, 0) * loadn(kv + 16 * c);
                hi += QUERY8(c, 1) * loadn(kv + 16 * c + 8);
            }
            halves[j] = lo + hi;
        }
        storen(s + k0, sum8x8(halves) * scale);
    }
#undef QUERY8
#endif
}

/* out[d] = sum over the n keys of w[j] values[j][d], VALUE_FLOATS of the row at a time, a key
 * at a time: independent accumulators, each summing over the keys in order (a chain of one
 * accumulator is latency-bound) */
static void weigh(const float *const *values, int64_t n, int64_t dim, const float *w,
                  float *out) {
    for (int64_t d0 = 0; d0 < dim; d0 += VALUE_FLOATS) {
        int64_t nv = (dim - d0 < VALUE_FLOATS ? dim - d0 : VALUE_FLOATS) / LANES;
        vn o[VALUE_FLOATS / LANES] = {0};
        for (int64_t j = 0; j < n; j++) {
            const float *v = values[j] + d0;
            if (nv == VALUE_FLOATS / LANES)
                for (int c = 0; c < VALUE_FLOATS / LANES; c++) o[c] += w[j] * loadn(v + LANES * c);
            else
                for (int c = 0; c < nv; c++) o[c] += w[j] * loadn(v + LANES * c);
        }
        for (int c = 0; c < nv; c++) storen(out + d0 + LANES * c, o[c]);
    }
}

#define PAIR_FLOATS 32 /* weigh_pair's floats of two rows a pass */

/* weigh for two rows of weights (wa, wb) over the same values, PAIR_FLOATS at a time: each
 * value vector loaded once for both; each output the same sum, in the same order, as weigh's */
static void weigh_pair(const float *const *values, int64_t n, int64_t dim, const float *wa,
                       const float *wb, float *outa, float *outb) {
    for (int64_t d0 = 0; d0 < dim; d0 += PAIR_FLOATS) {
        vn oa[PAIR_FLOATS / LANES] = {0}, ob[PAIR_FLOATS / LANES] = {0};
        for (int64_t j = 0; j < n; j++) {
            vn v[PAIR_FLOATS / LANES];
            for (int c = 0; c < PAIR_FLOATS / LANES; c++) v[c] = loadn(values[j] + d0 + LANES * c);
            for (int c = 0; c < PAIR_FLOATS / LANES; c++) oa[c] += wa[j] * v[c];
            for (int c = 0; c < PAIR_FLOATS / LANES; c++) ob[c] += wb[j] * v[c];
        }
        for (int c = 0; c < PAIR_FLOATS / LANES; c++) {
            storen(outa + d0 + LANES * c, oa[c]);
            storen(outb + d0 + LANES * c, ob[c]);
        }
    }
}

/* one item: rows (t, g) for t in t0..t1, g in the group; scores: [rows, CHUNK] scratch;
 * rows_scratch: [CHUNK, dim] for a float16 store's rows */
static void attend_chunk(const Paged *p, const Item *it, float *scores, float *rows_scratch) {
    int64_t group = p->hq / p->hkv, dim = p->dim, vecs = dim / 16;
    int64_t b = it->b, h = it->h, j0 = it->j0, n = it->j1 - it->j0;
    const int64_t *rows = p->read_rows + b * p->lmax + j0;
    int64_t nrows = (it->t1 - it->t0) * group, n16 = (n + 15) / 16 * 16;
    /* the chunk's keys (past its end: its last key again, then unseen) */
    const float *keys[CHUNK];
    chunk_rows(p, rows, n, 0, h, rows_scratch, keys);
    for (int64_t j = n; j < n16; j++) keys[j] = keys[n - 1];
    /* each row's scores */
    for (int64_t t = it->t0; t < it->t1; t++) {
        int64_t i = p->q_index[t] - b * p->qmax, pos = p->q_positions[b * p->qmax + i];
        const uint8_t *seen = p->mask ? p->mask + (b * p->qmax + i) * p->lmax + j0 : NULL;
        for (int64_t g = 0; g < group; g++) {
            const float *qv = p->q + t * p->q_stride + (h * group + g) * dim;
            float *s = scores + ((t - it->t0) * group + g) * CHUNK;
            if (vecs == 4) /* head_dim 64 and 128 unrolled */
                score_keys(qv, keys, n16, 4, p->scale, s);
            else if (vecs == 8)
                score_keys(qv, keys, n16, 8, p->scale, s);
            else
                score_keys(qv, keys, n16, vecs, p->scale, s);
            /* unseen: past the chunk, then by the tree mask, or past the query's position */
            int64_t end = seen || pos - j0 + 1 > n ? n : pos - j0 + 1 < 0 ? 0 : pos - j0 + 1;
            for (int64_t key = end; key < n16; key++) s[key] = -INFINITY;
            if (seen)
                for (int64_t key = 0; key < n; key++) s[key] = seen[key] ? s[key] : -INFINITY;
        }
    }
    /* each row's max and exponentials */
    for (int64_t r = 0; r < nrows; r++) {
        float *s = scores + r * CHUNK, *part = it->part + r * (dim + 2);
        float top = -INFINITY;
        for (int64_t j = 0; j < n16; j++) top = s[j] > top ? s[j] : top;
        part[0] = top;
        memset(part + 1, 0, (dim + 1) * sizeof(float));
        if (top == -INFINITY) continue; /* nothing seen in this chunk */
        vn sum[HALVES] = {0};
        for (int64_t k0 = 0; k0 < n16; k0 += 16)
            for (int hv = 0; hv < HALVES; hv++) {
                vn e = expn(loadn(s + k0 + hv * LANES) - top);
                storen(s + k0 + hv * LANES, e);
                sum[hv] += e;
            }
        part[1] = hsum_block(sum);
    }
    /* each row's exponential-weighted values, in key order; two rows at once where both saw
     * some key and the head splits into PAIR_FLOATS (each value read once for both) */
    const float **values = keys; /* the keys' pointers (and their scratch) are done with */
    chunk_rows(p, rows, n, p->page_size, h, rows_scratch, values);
    for (int64_t r = 0; r < nrows;) {
        float *part = it->part + r * (dim + 2), *next = part + dim + 2;
        const float *w = scores + r * CHUNK;
        if (part[0] == -INFINITY) {
            r++;
        } else if (r + 1 < nrows && next[0] != -INFINITY && dim % PAIR_FLOATS == 0) {
            weigh_pair(values, n, dim, w, w + CHUNK, part + 2, next + 2);
            r += 2;
        } else {
            weigh(values, n, dim, w, part + 2);
            r++;
        }
    }
}

/* write the tokens' k and v, then attend; 0, or -1 when out of memory (called without the
 * GIL) */
static int paged_attend(const Paged *pp, int threads) {
    const Paged p = *pp;
    int64_t group = p.hq / p.hkv, dim = p.dim, chunks_max = (p.lmax + CHUNK - 1) / CHUNK;
    /* items: each sequence's tokens (a run of equal q_index / qmax) x kv heads x key chunks */
    int64_t n_items = 0, part_floats = 0;
    Item *items = malloc(sizeof(Item) * p.tokens * p.hkv * (chunks_max ? chunks_max : 1));
    int64_t *row_part = malloc(sizeof(int64_t) * p.tokens * p.hkv); /* first chunk's part */
    int64_t *row_chunks = malloc(sizeof(int64_t) * p.tokens * p.hkv);
    if (!items || !row_part || !row_chunks) {
        free(items), free(row_part), free(row_chunks);
        return -1;
    }
    for (int64_t t0 = 0, t1; t0 < p.tokens; t0 = t1) {
        int64_t b = p.q_index[t0] / p.qmax, len = p.kv_lens[b];
        for (t1 = t0 + 1; t1 < p.tokens && p.q_index[t1] / p.qmax == b; t1++) {
        }
        int64_t chunks = (len + CHUNK - 1) / CHUNK, rows = (t1 - t0) * group;
        for (int64_t h = 0; h < p.hkv; h++) {
            row_part[t0 * p.hkv + h] = part_floats;
            row_chunks[t0 * p.hkv + h] = chunks;
            for (int64_t c = 0; c < chunks; c++) {
                int64_t j1 = (c + 1) * CHUNK < len ? (c + 1) * CHUNK : len;
                items[n_items++] = (Item){b, t0, t1, h, c * CHUNK, j1, (float *)(intptr_t)part_floats};
                part_floats += rows * (dim + 2);
            }
        }
    }
    float *parts = malloc(sizeof(float) * (part_floats ? part_floats : 1));
    if (!parts) {
        free(items), free(row_part), free(row_chunks);
        return -1;
    }
    for (int64_t i = 0; i < n_items; i++) items[i].part = parts + (intptr_t)items[i].part;
    int failed = 0;
    write_kv(&p);
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * p.qmax * group * CHUNK);
        float *rows_scratch = p.half ? malloc(sizeof(float) * CHUNK * dim) : NULL;
        if (!scores || (p.half && !rows_scratch)) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n_items; i++)
                attend_chunk(&p, &items[i], scores, rows_scratch);
        }
        free(scores), free(rows_scratch);
    }
    /* merge each row's chunks in key order */
    for (int64_t t0 = 0, t1; !failed && t0 < p.tokens; t0 = t1) {
        int64_t b = p.q_index[t0] / p.qmax;
        for (t1 = t0 + 1; t1 < p.tokens && p.q_index[t1] / p.qmax == b; t1++) {
        }
        int64_t rows = (t1 - t0) * group;
        for (int64_t h = 0; h < p.hkv; h++) {
            const float *first = parts + row_part[t0 * p.hkv + h];
            int64_t chunks = row_chunks[t0 * p.hkv + h], stride = rows * (dim + 2);
            for (int64_t r = 0; r < rows; r++) {
                int64_t t = t0 + r / group, g = r % group;
                float *o = p.out + t * p.hq * dim + (h * group + g) * dim;
                float top = -INFINITY, sum = 0.0f;
                for (int64_t c = 0; c < chunks; c++) {
                    float m = first[c * stride + r * (dim + 2)];
                    top = m > top ? m : top;
                }
                memset(o, 0, dim * sizeof(float));
                for (int64_t c = 0; c < chunks; c++) {
                    const float *part = first + c * stride + r * (dim + 2);
                    if (part[0] == -INFINITY) continue;
                    float w = exp1(part[0] - top);
                    sum += w * part[1];
                    for (int64_t d = 0; d < dim; d += LANES)
                        storen(o + d, loadn(o + d) + w * loadn(part + 2 + d));
                }
                float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                for (int64_t d = 0; d < dim; d += LANES) storen(o + d, loadn(o + d) * inv);
            }
        }
    }
    free(parts), free(items), free(row_part), free(row_chunks);
    return failed ? -1 : 0;
}

static int paged_check(const Paged *p) {
    if (p->hkv <= 0 || p->hq % p->hkv || p->tokens <= 0 || p->dim % 16) {
        PyErr_SetString(PyExc_ValueError, "paged attention: q heads must be a multiple of kv "
                                          "heads, tokens > 0 and head_dim a multiple of 16");
        return -1;
    }
    return 0;
}

/* paged_attention(out, q, k, v, store, write_rows, read_rows, kv_lens, q_index, q_positions,
 *                 mask, tokens, seqs, qmax, lmax, hq, hkv, dim, page_size, q_stride,
 *                 k_stride, v_stride, scale, threads, half): the store float32, or
 * float16 where `half` */
static PyObject *py_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[25];
    if (ints(args, nargs, 25, a)) return NULL;
    Paged p = {
        PTR(float, a[0]), PTR(const float, a[1]), PTR(const float, a[2]), PTR(const float, a[3]),
        PTR(void, a[4]), PTR(const int64_t, a[5]), PTR(const int64_t, a[6]),
        PTR(const int64_t, a[7]), PTR(const int64_t, a[8]), PTR(const int64_t, a[9]),
        PTR(const uint8_t, a[10]), a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18],
        a[19], a[20], a[21], (float)as_double(a[22]), (int)a[24],
    };
    if (paged_check(&p)) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = paged_attend(&p, (int)a[23]);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- a forward of a few tokens through decoder layers ----
 *
 * A decode (or a verify of a few rows) is, per layer, four products and a dozen small steps;
 * done here in one call, the small steps cost nanoseconds instead of a dispatched torch
 * operation each, and the products are the blocked ones above or the quantized ones of
 * quant.c. Each layer's entry of the table holds, as int64: its input norm's weight (0: none),
 * the post-attention norm's, the layer's index in the KV cache, then for each of q|k|v, o,
 * gate|up and down: the weight (blocked float32 or int8, or packed codes), its int8 scales
 * (0: none), its bias (0: none) and its codes' form (0: not packed codes; else qweight's; -1:
 * products side by side, the weight a qgemm_parts table). */

enum { W_IN_NORM, W_POST_NORM, CACHE_LAYER, LINEARS };
enum { QKV, O, GATE_UP, DOWN };
#define LINEAR_FIELDS 4
#define LAYER_FIELDS (LINEARS + LINEAR_FIELDS * 4)

typedef struct {
    const float *wf, *scales, *bias;
    const int8_t *wq;
    const uint8_t *packed;
    int64_t codes;
} Linear;

static Linear linear_of(const int64_t *w, int which) {
    const int64_t *f = w + LINEARS + LINEAR_FIELDS * which;
    Linear l = {PTR(const float, f[0]), PTR(const float, f[1]), PTR(const float, f[2]), NULL,
                NULL, f[3]};
    if (l.codes) l.packed = PTR(const uint8_t, f[0]), l.wf = NULL;
    else if (l.scales) l.wq = PTR(const int8_t, f[0]), l.wf = NULL;
    return l;
}

/* 0, or -1 when a quantized product could not run */
static int apply(Linear l, const float *x, float *y, int64_t rows, int64_t in, int64_t out,
                 int threads) {
    if (l.codes < 0) return qgemm_parts(PTR(const int64_t, l.packed), x, y, rows, in, threads);
    if (l.packed) {
        QWeight q = qweight(l.packed, l.bias, out, in, l.codes);
        return qgemm(&q, x, y, rows, threads);
    }
    gemm(x, l.wf, l.wq, l.scales, l.bias, y, rows, in, out, threads);
    return 0;
}

/* decode_layers(x, table, layers, tokens, hidden, hq, hkv, dim, inter, eps, cos, sin,
 *               store_base, layer_elements, write_rows, read_rows, kv_lens, q_index,
 *               q_positions, mask, seqs, qmax, lmax, page_size, aux_out, aux_every, threads,
 *               half):
 * x [tokens, hidden] is the residual stream, updated in place; after layer l with
 * aux_every[l] != 0, x is copied to the next [tokens, hidden] of aux_out. The cache is
 * float32, or float16 where `half`. */
static PyObject *py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[28];
    if (ints(args, nargs, 28, a)) return NULL;
    float *x = PTR(float, a[0]);
    const int64_t *table = PTR(const int64_t, a[1]);
    int64_t layers = a[2], tokens = a[3], hidden = a[4], hq = a[5], hkv = a[6], dim = a[7];
    int64_t inter = a[8];
    float eps = (float)as_double(a[9]);
    const float *cos = PTR(const float, a[10]), *sin = PTR(const float, a[11]);
    char *store_base = PTR(char, a[12]);
    int64_t layer_bytes = a[13] * (a[27] ? 2 : 4);
    float *aux_out = PTR(float, a[24]);
    const uint8_t *aux_every = PTR(const uint8_t, a[25]);
    int threads = (int)a[26];
    int64_t qkv_size = (hq + 2 * hkv) * dim, n = tokens;
    Paged p = {NULL, NULL, NULL, NULL, NULL, PTR(const int64_t, a[14]), PTR(const int64_t, a[15]),
               PTR(const int64_t, a[16]), PTR(const int64_t, a[17]), PTR(const int64_t, a[18]),
               PTR(const uint8_t, a[19]), tokens, a[20], a[21], a[22], hq, hkv, dim, a[23],
               qkv_size, qkv_size, qkv_size, 1.0f / sqrtf((float)dim), (int)a[27]};
    if (paged_check(&p)) return NULL;
    if (dim > 1024) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: head_dim must be at most 1024");
        return NULL;
    }
    float *scratch = malloc(sizeof(float) * n * (2 * hidden + qkv_size + hq * dim + 3 * inter));
    if (!scratch) return PyErr_NoMemory();
    float *h = scratch, *y = h + n * hidden, *qkv = y + n * hidden, *att = qkv + n * qkv_size;
    float *gu = att + n * hq * dim, *act = gu + n * 2 * inter;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t l = 0; l < layers && !status; l++) {
        const int64_t *w = table + l * LAYER_FIELDS;
        if (w[W_IN_NORM])
            rms_norm_rows(h, x, PTR(const float, w[W_IN_NORM]), n, hidden, eps);
        else
            memcpy(h, x, n * hidden * sizeof(float));
        status |= apply(linear_of(w, QKV), h, qkv, n, hidden, qkv_size, threads);
        rope_rows(qkv, cos, sin, n, hq + hkv, dim, qkv_size);
        p.out = att, p.q = qkv, p.k = qkv + hq * dim, p.v = qkv + (hq + hkv) * dim;
        p.store = store_base + w[CACHE_LAYER] * layer_bytes;
        status |= paged_attend(&p, threads);
        status |= apply(linear_of(w, O), att, y, n, hq * dim, hidden, threads);
        for (int64_t i = 0; i < n * hidden; i++) x[i] += y[i];
        rms_norm_rows(h, x, PTR(const float, w[W_POST_NORM]), n, hidden, eps);
        status |= apply(linear_of(w, GATE_UP), h, gu, n, hidden, 2 * inter, threads);
        silu_mul_rows(act, gu, n, inter);
        status |= apply(linear_of(w, DOWN), act, y, n, inter, hidden, threads);
        for (int64_t i = 0; i < n * hidden; i++) x[i] += y[i];
        if (aux_every[l]) {
            memcpy(aux_out, x, n * hidden * sizeof(float));
            aux_out += n * hidden;
        }
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* qlinear(y, x, packed, bias, rows, in, out, form, threads) (quant.c) */
static PyObject *py_qlinear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[9];
    if (ints(args, nargs, 9, a)) return NULL;
    QWeight w = qweight(PTR(const uint8_t, a[2]), PTR(const float, a[3]), a[6], a[5], a[7]);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qgemm(&w, PTR(const float, a[1]), PTR(float, a[0]), a[4], (int)a[8]);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* qlinear_parts(y, x, parts, rows, in, threads) (quant.c) */
static PyObject *py_qlinear_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[6];
    if (ints(args, nargs, 6, a)) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qgemm_parts(PTR(const int64_t, a[2]), PTR(const float, a[1]), PTR(float, a[0]), a[3],
                         a[4], (int)a[5]);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* qrows(out, packed, ids, n, out_features, in, form) (quant.c) */
static PyObject *py_qrows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    if (ints(args, nargs, 7, a)) return NULL;
    QWeight w = qweight(PTR(const uint8_t, a[1]), NULL, a[4], a[5], a[6]);
    Py_BEGIN_ALLOW_THREADS
    qrows(&w, PTR(const int64_t, a[2]), a[3], PTR(float, a[0]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* qpath(want): the quantized products' path, forced (want >= 0) or the best (-1) */
static PyObject *py_qpath(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[1];
    if (ints(args, nargs, 1, a)) return NULL;
    return PyLong_FromLong(qpath_select((int)a[0]));
}

/* ---- argmax of rows: each row's first index of its largest value, a NaN counting as the
 * largest (torch.argmax's rule): greedy sampling over a vocabulary. One pass of vectors keeps
 * each lane's largest value and the span where it first saw it (a lane's indices rise, and
 * only a strictly larger value replaces its best); the first index of the row's largest value
 * is then the least among the lanes that hold it. ARGMAX_SPAN floats a step, in independent
 * vectors, so that no step waits for the one before. ---- */

#define ARGMAX_SPAN 64
#define ARGMAX_VECS (ARGMAX_SPAN / LANES)

static int64_t argmax_row(const float *x, int64_t n) {
    vn top[ARGMAX_VECS];
    ivn at[ARGMAX_VECS], nan[ARGMAX_VECS];
    for (int h = 0; h < ARGMAX_VECS; h++) {
        top[h] = (vn){0} - INFINITY;
        at[h] = nan[h] = (ivn){0};
    }
    int64_t i = 0;
    for (; i + ARGMAX_SPAN <= n; i += ARGMAX_SPAN) {
        ivn span = (ivn){0} + (int32_t)(i / ARGMAX_SPAN);
        for (int h = 0; h < ARGMAX_VECS; h++) {
            vn v = loadn(x + i + h * LANES);
            ivn above = v > top[h]; /* lanes of -1 where v is larger */
            top[h] = (vn)((above & (ivn)v) | (~above & (ivn)top[h]));
            at[h] = (above & span) | (~above & at[h]);
            nan[h] |= v != v;
        }
    }
    float m = -INFINITY;
    int64_t first = 0;
    int seen_nan = 0;
    for (int h = 0; h < ARGMAX_VECS; h++)
        for (int l = 0; l < LANES; l++) {
            int64_t j = (int64_t)at[h][l] * ARGMAX_SPAN + h * LANES + l;
            if (top[h][l] > m || (top[h][l] == m && j < first)) first = j;
            m = top[h][l] > m ? top[h][l] : m;
            seen_nan |= nan[h][l] != 0;
        }
    for (; i < n; i++) { /* the tail's indices come after every lane's */
        if (x[i] > m) m = x[i], first = i;
        seen_nan |= x[i] != x[i];
    }
    if (seen_nan)
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    return first;
}

/* argmax(out int64, x, rows, n) */
static PyObject *py_argmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[4];
    if (ints(args, nargs, 4, a)) return NULL;
    int64_t *out = PTR(int64_t, a[0]);
    const float *x = PTR(const float, a[1]);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < a[2]; r++) out[r] = argmax_row(x + r * a[3], a[3]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- the seeded coupling (stages/rng.py): token v's uniform at a row's (seed, position) is
 * r = (h >> 8) 2^-24 for h the murmur3 hash (x86, 32-bit) of the five words salt-keyed seed,
 * position and v, `key` the hash state after the first four (the device path's very bits).
 * A coupled row emits argmax_v p_v / E_v with E_v = -log(r_v + 2^-25), an exponential: the
 * Gumbel-max token of p under G = -log E (argmax log p + G), found without a logarithm for
 * most tokens: E >= 1 - u, so p / (1 - u) bounds p / E from above, strictly (relatively by
 * more than 2^-26, where u is closest to 1), and only the tokens whose bound reaches the best
 * score found need their E, in double precision. ---- */

static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

static inline uint32_t coupling_bits(uint32_t key, uint32_t token) {
    uint32_t k = rotl32(token * 0xCC9E2D51u, 15) * 0x1B873593u;
    uint32_t h = rotl32(key ^ k, 13) * 5 + 0xE6546B64u;
    h ^= 4 * 5;
    h = (h ^ (h >> 16)) * 0x85EBCA6Bu;
    h = (h ^ (h >> 13)) * 0xC2B2AE35u;
    return (h ^ (h >> 16)) >> 8;
}

static inline float coupling_uniform(uint32_t key, uint32_t token) {
    return (float)coupling_bits(key, token) * 0x1p-24f;
}

static double coupled_score(const float *p, uint32_t key, int64_t v) {
    double u = (double)coupling_uniform(key, (uint32_t)v) + 0x1p-25; /* exact in double */
    return (double)p[v] / -log(u);
}

/* the bound's slack: 1 - u and the quotient each rounded in float (2^-24 of the value each),
 * the best score too (2^-24), well under the slack */
#define BOUND_SLACK (1.0f + 0x1p-20f)

static int64_t coupled_row(const float *p, uint32_t key, int64_t n, float *bound) {
    for (int64_t v = 0; v < n; v++) /* vectorised: no logarithm */
        bound[v] = p[v] / ((1.0f - coupling_uniform(key, (uint32_t)v)) - 0x1p-25f);
    int64_t best = argmax_row(bound, n);
    double top = coupled_score(p, key, best);
    for (int64_t v = 0; v < n; v++) {
        if (bound[v] * BOUND_SLACK < (float)top || v == best) continue;
        double s = coupled_score(p, key, v);
        if (s > top || (s == top && v < best)) top = s, best = v;
    }
    return best;
}

/* coupled_tokens(out int64 [R], p float32 [R, V], keys uint32 [R], R, V) */
static PyObject *py_coupled_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[5];
    if (ints(args, nargs, 5, a)) return NULL;
    float *bound = malloc(sizeof(float) * (a[4] > 0 ? a[4] : 1));
    if (!bound) return PyErr_NoMemory();
    int64_t *out = PTR(int64_t, a[0]);
    const float *p = PTR(const float, a[1]);
    const uint32_t *keys = PTR(const uint32_t, a[2]);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < a[3]; r++) out[r] = coupled_row(p + r * a[4], keys[r], a[4], bound);
    Py_END_ALLOW_THREADS
    free(bound);
    Py_RETURN_NONE;
}

/* coupling_uniforms(out float32 [R, V], keys uint32 [R], R, V): each token's r */
static PyObject *py_coupling_uniforms(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[4];
    if (ints(args, nargs, 4, a)) return NULL;
    float *out = PTR(float, a[0]);
    const uint32_t *keys = PTR(const uint32_t, a[1]);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < a[2]; r++)
        for (int64_t v = 0; v < a[3]; v++) out[r * a[3] + v] = coupling_uniform(keys[r], (uint32_t)v);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, "x W^T, W blocked"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "RMSNorm of rows"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, "rotary embedding in place"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, "silu(gate) * up"},
    {"paged_attention", (PyCFunction)(void (*)(void))py_paged_attention, METH_FASTCALL,
     "write k, v into the paged store and attend"},
    {"decode_layers", (PyCFunction)(void (*)(void))py_decode_layers, METH_FASTCALL,
     "a forward of a few tokens through decoder layers"},
    {"qlinear", (PyCFunction)(void (*)(void))py_qlinear, METH_FASTCALL, "x W^T, W packed codes"},
    {"qlinear_parts", (PyCFunction)(void (*)(void))py_qlinear_parts, METH_FASTCALL,
     "products side by side"},
    {"qrows", (PyCFunction)(void (*)(void))py_qrows, METH_FASTCALL, "rows of W, dequantized"},
    {"argmax", (PyCFunction)(void (*)(void))py_argmax, METH_FASTCALL, "argmax of rows"},
    {"coupled_tokens", (PyCFunction)(void (*)(void))py_coupled_tokens, METH_FASTCALL,
     "the seeded coupling's token of rows"},
    {"coupling_uniforms", (PyCFunction)(void (*)(void))py_coupling_uniforms, METH_FASTCALL,
     "the seeded coupling's uniforms of rows"},
    {"qpath", (PyCFunction)(void (*)(void))py_qpath, METH_FASTCALL, "the quantized path"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
