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
 * to each output, the integer sum exact. Against float32 products of the dequantized weight,
 * each input is off by at most dx / 2, so |y - y_ref| <= sum_i |w_i| dx(i) / 2, plus float
 * rounding (tests/test_quant.py holds the kernels to that).
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

static int64_t chunk_bytes(const QWeight *w) {
    return w->bits * QK * QO / 8 + 2 * QO * (w->half_scales ? 2 : 4);
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

/* the block's scale and offset of output o (0..15) */
static void block_scales(const QWeight *w, const uint8_t *chunk, int o, float *d, float *m) {
    const uint8_t *s = chunk + w->bits * QK * QO / 8;
    if (w->half_scales) {
        uint16_t hd, hm;
        memcpy(&hd, s + 2 * o, 2);
        memcpy(&hm, s + 2 * QO + 2 * o, 2);
        *d = half_to_float(hd), *m = half_to_float(hm);
    } else {
        memcpy(d, s + 4 * o, 4);
        memcpy(m, s + 4 * QO + 4 * o, 4);
    }
}

static int code_at(const QWeight *w, const uint8_t *chunk, int o, int i) {
    if (w->bits == 8) return chunk[(i / 4) * 64 + o * 4 + i % 4];
    int j = i / 8, high = (i % 8) / 4;
    uint8_t byte = chunk[j * 64 + o * 4 + i % 4];
    return high ? byte >> 4 : byte & 15;
}

__attribute__((optimize("fp-contract=off"))) void qrows(const QWeight *w, const int64_t *ids, int64_t n, float *out) {
    int64_t nk = w->in / QK, cb = chunk_bytes(w);
    for (int64_t r = 0; r < n; r++) {
        int64_t ob = ids[r] / QO;
        int o = (int)(ids[r] % QO);
        for (int64_t kb = 0; kb < nk; kb++) {
            const uint8_t *chunk = w->packed + (ob * nk + kb) * cb;
            float d, m;
            block_scales(w, chunk, o, &d, &m);
            for (int i = 0; i < QK; i++)
                out[r * w->in + kb * QK + i] = d * (float)code_at(w, chunk, o, i) + m;
        }
    }
}

/* ---- the activations: xq [M, I] int8, and a row's dx and dx * sum(xq) a block [M, I / 32] */

static void quantize_rows(const float *x, int64_t rows, int64_t in, int8_t *xq, float *dx,
                          float *sx) {
    int64_t nk = in / QK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kb = 0; kb < nk; kb++) {
            const float *v = x + r * in + kb * QK;
            int8_t *q = xq + r * in + kb * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                q[i] = (int8_t)lrintf(v[i] * inv);
                sum += q[i];
            }
            dx[r * nk + kb] = d;
            sx[r * nk + kb] = d * (float)sum;
        }
}

typedef struct {
    const QWeight *w;
    const int8_t *xq;
    const float *dx, *sx;
    float *y;
    int64_t rows;
} Job;

static void store_block(const Job *j, int64_t row, int64_t ob, const float *lanes) {
    int64_t o0 = ob * QO, n = j->w->out - o0 < QO ? j->w->out - o0 : QO;
    float *y = j->y + row * j->w->out + o0;
    for (int64_t o = 0; o < n; o++) y[o] = lanes[o] + (j->w->bias ? j->w->bias[o0 + o] : 0.0f);
}

/* ---- AVX-512 VNNI: 16 outputs a vector, tiles of up to 8 rows ---- */

#define VNNI_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define VNNI_TILE 8

VNNI_ATTR static inline void vnni_scales(const QWeight *w, const uint8_t *s, __m512 *d,
                                         __m512 *m) {
    if (w->half_scales) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32)));
    } else {
        *d = _mm512_loadu_ps(s);
        *m = _mm512_loadu_ps(s + 64);
    }
}

#define VNNI_TILE_FN(BITS, ROWS)                                                              \
    VNNI_ATTR static void vnni_##BITS##_##ROWS(const Job *j, int64_t ob, int64_t m0) {        \
        const QWeight *w = j->w;                                                              \
        int64_t nk = w->in / QK, cb = chunk_bytes(w);                                         \
        const uint8_t *p = w->packed + ob * nk * cb;                                          \
        __m512 acc[ROWS];                                                                     \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                          \
        const __m512i low = _mm512_set1_epi8(15);                                             \
        for (int64_t kb = 0; kb < nk; kb++, p += cb) {                                        \
            __m512i q[8];                                                                     \
            if (BITS == 4)                                                                    \
                for (int v = 0; v < 4; v++) {                                                 \
                    __m512i b = _mm512_loadu_si512(p + 64 * v);                               \
                    q[2 * v] = _mm512_and_si512(b, low);                                      \
                    q[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);            \
                }                                                                             \
            else                                                                              \
                for (int v = 0; v < 8; v++) q[v] = _mm512_loadu_si512(p + 64 * v);           \
            __m512 d, m;                                                                      \
            vnni_scales(w, p + BITS * 64, &d, &m);                                            \
            UNROLL for (int r = 0; r < ROWS; r++) {                                           \
                const int8_t *xr = j->xq + (m0 + r) * w->in + kb * QK;                        \
                __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};              \
                UNROLL for (int g = 0; g < 8; g++) { /* two chains: half the latency */       \
                    int32_t four;                                                             \
                    memcpy(&four, xr + 4 * g, 4);                                             \
                    s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], q[g], _mm512_set1_epi32(four));  \
                }                                                                             \
                int64_t at = (m0 + r) * nk + kb;                                              \
                __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(j->dx[at]));                      \
                __m512i sum = _mm512_add_epi32(s[0], s[1]);                                   \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), dd, acc[r]);                \
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(j->sx[at]), acc[r]);               \
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
    VNNI_TILE_FN(BITS, 8)
VNNI_TILES(4)
VNNI_TILES(8)

typedef void (*tile_fn)(const Job *, int64_t, int64_t);
static const tile_fn VNNI4[VNNI_TILE + 1] = {NULL,     vnni_4_1, vnni_4_2, vnni_4_3, vnni_4_4,
                                             vnni_4_5, vnni_4_6, vnni_4_7, vnni_4_8};
static const tile_fn VNNI8[VNNI_TILE + 1] = {NULL,     vnni_8_1, vnni_8_2, vnni_8_3, vnni_8_4,
                                             vnni_8_5, vnni_8_6, vnni_8_7, vnni_8_8};

/* ---- AVX2: 8 outputs a vector (a block's two halves in turn), tiles of up to 4 rows.
 * 4-bit codes: maddubs(code, xq) pairs each under 2 * 15 * 127, eight of them summed in
 * 16 bits, then widened. 8-bit codes go signed (code - 128, whose magnitude maddubs takes
 * unsigned, its sign moved onto xq: each pair under 2 * 128 * 127) and are widened at once;
 * the 128 * sum(xq) left out returns through the offset: m + 128 d. ---- */

#define AVX2_ATTR __attribute__((target("avx2,fma,f16c")))
#define AVX2_TILE 4

AVX2_ATTR static inline void avx2_scales(const QWeight *w, const uint8_t *s, int h, __m256 *d,
                                         __m256 *m) {
    if (w->half_scales) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16 * h)));
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32 + 16 * h)));
    } else {
        *d = _mm256_loadu_ps((const float *)(s + 32 * h));
        *m = _mm256_loadu_ps((const float *)(s + 64 + 32 * h));
    }
}

#define AVX2_TILE_FN(BITS, ROWS)                                                              \
    AVX2_ATTR static void avx2_##BITS##_##ROWS(const Job *j, int64_t ob, int64_t m0) {        \
        const QWeight *w = j->w;                                                              \
        int64_t nk = w->in / QK, cb = chunk_bytes(w);                                         \
        const uint8_t *p = w->packed + ob * nk * cb;                                          \
        __m256 acc[ROWS][2];                                                                  \
        for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();           \
        const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                \
        for (int64_t kb = 0; kb < nk; kb++, p += cb)                                          \
            for (int h = 0; h < 2; h++) {                                                     \
                __m256i q[8];                                                                 \
                if (BITS == 4)                                                                \
                    for (int v = 0; v < 4; v++) {                                             \
                        __m256i b = _mm256_loadu_si256((const __m256i *)(p + 64 * v + 32 * h)); \
                        q[2 * v] = _mm256_and_si256(b, low);                                  \
                        q[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);        \
                    }                                                                         \
                else                                                                          \
                    for (int v = 0; v < 8; v++)                                               \
                        q[v] = _mm256_xor_si256(                                              \
                            _mm256_loadu_si256((const __m256i *)(p + 64 * v + 32 * h)),       \
                            _mm256_set1_epi8((char)0x80));                                    \
                __m256 d, m;                                                                  \
                avx2_scales(w, p + BITS * 64, h, &d, &m);                                     \
                if (BITS == 8) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.0f), m);             \
                UNROLL for (int r = 0; r < ROWS; r++) {                                       \
                    const int8_t *xr = j->xq + (m0 + r) * w->in + kb * QK;                    \
                    __m256i s;                                                                \
                    if (BITS == 4) {                                                          \
                        __m256i t = _mm256_setzero_si256();                                   \
                        for (int g = 0; g < 8; g++) {                                         \
                            int32_t four;                                                     \
                            memcpy(&four, xr + 4 * g, 4);                                     \
                            t = _mm256_add_epi16(                                             \
                                t, _mm256_maddubs_epi16(q[g], _mm256_set1_epi32(four)));      \
                        }                                                                     \
                        s = _mm256_madd_epi16(t, ones);                                       \
                    } else {                                                                  \
                        s = _mm256_setzero_si256();                                           \
                        for (int g = 0; g < 8; g++) {                                         \
                            int32_t four;                                                     \
                            memcpy(&four, xr + 4 * g, 4);                                     \
                            __m256i x4 = _mm256_set1_epi32(four);                             \
                            __m256i t = _mm256_maddubs_epi16(_mm256_abs_epi8(q[g]),           \
                                                             _mm256_sign_epi8(x4, q[g]));     \
                            s = _mm256_add_epi32(s, _mm256_madd_epi16(t, ones));              \
                        }                                                                     \
                    }                                                                         \
                    int64_t at = (m0 + r) * nk + kb;                                          \
                    __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(j->dx[at]));                  \
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[r][h]);        \
                    acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(j->sx[at]), acc[r][h]);     \
                }                                                                             \
            }                                                                                 \
        for (int r = 0; r < ROWS; r++) {                                                      \
            float lanes[QO];                                                                  \
            _mm256_storeu_ps(lanes, acc[r][0]);                                               \
            _mm256_storeu_ps(lanes + 8, acc[r][1]);                                           \
            store_block(j, m0 + r, ob, lanes);                                                \
        }                                                                                     \
    }

AVX2_TILE_FN(4, 1)
AVX2_TILE_FN(4, 2)
AVX2_TILE_FN(4, 3)
AVX2_TILE_FN(4, 4)
AVX2_TILE_FN(8, 1)
AVX2_TILE_FN(8, 2)
AVX2_TILE_FN(8, 3)
AVX2_TILE_FN(8, 4)

static const tile_fn AVX2_4[AVX2_TILE + 1] = {NULL, avx2_4_1, avx2_4_2, avx2_4_3, avx2_4_4};
static const tile_fn AVX2_8[AVX2_TILE + 1] = {NULL, avx2_8_1, avx2_8_2, avx2_8_3, avx2_8_4};

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

int qgemm(const QWeight *w, const float *x, float *y, int64_t rows, int threads) {
    if (path < 0) qpath_select(-1);
    if (path == QPATH_NONE) return -1;
    int64_t nk = w->in / QK, blocks = (w->out + QO - 1) / QO;
    int8_t *xq = malloc(rows * w->in);
    float *dx = malloc(sizeof(float) * rows * nk), *sx = malloc(sizeof(float) * rows * nk);
    if (!xq || !dx || !sx) {
        free(xq), free(dx), free(sx);
        return -1;
    }
    quantize_rows(x, rows, w->in, xq, dx, sx);
    Job j = {w, xq, dx, sx, y, rows};
    int tile = path == QPATH_VNNI512 ? VNNI_TILE : AVX2_TILE;
    const tile_fn *fns = path == QPATH_VNNI512 ? (w->bits == 4 ? VNNI4 : VNNI8)
                                               : (w->bits == 4 ? AVX2_4 : AVX2_8);
    int64_t tiles = (rows + tile - 1) / tile;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t ob = 0; ob < blocks; ob++)
        for (int64_t t = 0, m0 = 0; t < tiles; t++) { /* equal tiles */
            int64_t n = (rows * (t + 1)) / tiles - (rows * t) / tiles;
            fns[n](&j, ob, m0);
            m0 += n;
        }
    free(xq), free(dx), free(sx);
    return 0;
}
