/* y = x @ W.T for W in GGUF's Q4_1 or Q8_0 blocks, read as shipped (4 or 8 bits a weight;
 * Q4_0 arrives as Q4_1 with m = -8 d, gguf_weights.py).
 *
 * A Q4_1 block holds 32 consecutive weights of one output row: a scale d, a minimum m
 * and 16 bytes of 4-bit codes q (byte j: code of weight j in its low nibble, of weight
 * j + 16 in its high one); weight = d * q + m. So a row's dot product with x is
 *
 *     sum over blocks b of  d_b * sum_j q_j x_j  +  m_b * sum_j x_j
 *
 * and the block sums of x are taken once per input row, not once per output row. As in
 * llama.cpp (``ggml_vec_dot_q4_1_q8_1``), each block of 32 inputs is quantized to int8
 * with a scale (max |x| / 127), so a weight costs one byte product: the inner sums are
 * exact integers, the inputs carry about 2 significant digits (the sums of x stay float).
 *
 * Layouts (C-contiguous): x [rows, k] float32, rows x_stride floats apart; qs [n, k/32, 16]
 * uint8; d, m [n, k/32] float32; out [rows, n] float32, rows out_stride floats apart.
 * Output rows are split across OpenMP threads; each thread walks its weights once and
 * applies every input row to a block while it is in registers (rows in tiles of four).
 *
 * Returns 0, or a negative code for arguments it refuses.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define TILE 4

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 codes of one block as 32 bytes in weight order (low nibbles: weights 0-15, high
 * nibbles: 16-31). */
static inline __m256i codes(const uint8_t *restrict q) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

/* Output column o for input rows r0 .. r0 + t - 1 (t <= TILE), against the rows as int8
 * blocks (xq, scale xd) as llama.cpp does: one byte product per weight. */
static inline void column(const int8_t *restrict xq, const float *restrict xd,
                          const float *restrict sx, int64_t nb, const uint8_t *restrict qs,
                          const float *restrict d, const float *restrict m, int64_t r0,
                          int64_t t, float *restrict y) {
    __m256 acc[TILE];
    float macc[TILE];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < t; ++r) {
        acc[r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i c = codes(qs + b * 16);
        for (int64_t r = 0; r < t; ++r) {
            const int64_t at = (r0 + r) * nb + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + at * 32));
            const __m256i pairs = _mm256_maddubs_epi16(c, x); /* |sum| <= 2 * 15 * 127 */
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * xd[at]), dot, acc[r]);
            macc[r] += m[b] * sx[at];
        }
    }
    for (int64_t r = 0; r < t; ++r) y[r] = hsum(acc[r]) + macc[r];
}
#else
static inline void column(const int8_t *restrict xq, const float *restrict xd,
                          const float *restrict sx, int64_t nb, const uint8_t *restrict qs,
                          const float *restrict d, const float *restrict m, int64_t r0,
                          int64_t t, float *restrict y) {
    for (int64_t r = 0; r < t; ++r) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t at = (r0 + r) * nb + b;
            const int8_t *x = xq + at * 32;
            const uint8_t *q = qs + b * 16;
            int32_t dot = 0;
            for (int j = 0; j < 16; ++j) dot += (q[j] & 0x0F) * x[j] + (q[j] >> 4) * x[j + 16];
            acc += d[b] * xd[at] * (float)dot + m[b] * sx[at];
        }
        y[r] = acc;
    }
}
#endif

/* Q8_0: blocks of 32 int8 weights with a scale d (weight = d * q), against the same int8
 * input blocks: the byte products as llama.cpp forms them (|w| unsigned, x given w's sign). */
static void q8_column(const int8_t *restrict xq, const float *restrict xd, int64_t nb,
                      const int8_t *restrict qs, const float *restrict d, int64_t r0, int64_t t,
                      float *restrict y) {
#ifdef __AVX2__
    __m256 acc[TILE];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < t; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + b * 32));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int64_t r = 0; r < t; ++r) {
            const int64_t at = (r0 + r) * nb + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + at * 32));
            const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * xd[at]), dot, acc[r]);
        }
    }
    for (int64_t r = 0; r < t; ++r) y[r] = hsum(acc[r]);
#else
    for (int64_t r = 0; r < t; ++r) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t at = (r0 + r) * nb + b;
            int32_t dot = 0;
            for (int j = 0; j < 32; ++j) dot += (int32_t)qs[b * 32 + j] * xq[at * 32 + j];
            acc += d[b] * xd[at] * (float)dot;
        }
        y[r] = acc;
    }
#endif
}

/* Each input block of 32 as int8 codes with a scale (max |x| / 127), and its exact sum. */
static void quantize_rows(const float *x, int64_t x_stride, int64_t rows, int64_t nb,
                          int8_t *xq, float *xd, float *sx) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * x_stride + b * 32;
            float s = 0.0f, amax = 0.0f;
            for (int j = 0; j < 32; ++j) {
                s += xb[j];
                amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            }
            const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            for (int j = 0; j < 32; ++j) xq[(r * nb + b) * 32 + j] = (int8_t)lrintf(xb[j] * inv);
            sx[r * nb + b] = s;
            xd[r * nb + b] = scale;
        }
}

/* kind 0: Q4_1 (qs [n, k/32, 16] uint8, d and m [n, k/32]); kind 1: Q8_0 (qs [n, k/32, 32]
 * int8, d [n, k/32], m unused). */
int spec_tot_quant_linear(const float *x, int64_t x_stride, int64_t rows, int64_t k, int kind,
                          const void *qs, const float *d, const float *m, int64_t n,
                          float *out, int64_t out_stride, int threads) {
    if (rows < 1 || k < 32 || k % 32 || n < 1 || x_stride < k || out_stride < n) return -1;
    if (kind != 0 && kind != 1) return -1;
    const int64_t nb = k / 32;
    float *sx = malloc(sizeof(float) * (size_t)(2 * rows * nb));
    int8_t *xq = malloc((size_t)(rows * k));
    if (!sx || !xq) {
        free(sx);
        free(xq);
        return -5;
    }
    float *xd = sx + rows * nb;
    quantize_rows(x, x_stride, rows, nb, xq, xd, sx);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t o = 0; o < n; ++o) {
        float y[TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int64_t t = rows - r0 < TILE ? rows - r0 : TILE;
            if (kind == 0)
                column(xq, xd, sx, nb, (const uint8_t *)qs + o * nb * 16, d + o * nb,
                       m + o * nb, r0, t, y);
            else
                q8_column(xq, xd, nb, (const int8_t *)qs + o * nb * 32, d + o * nb, r0, t, y);
            for (int64_t r = 0; r < t; ++r) out[(r0 + r) * out_stride + o] = y[r];
        }
    }
    free(sx);
    free(xq);
    return 0;
}
