/* Decode attention over the paged KV pool, one query token per row, fused.
 *
 * For each (row, KV head) pair (the work items, split across OpenMP threads): the scores
 * of the head's query group against the row's context, read straight from the pool
 * through the row's block table, a softmax, and the probability-weighted sum of V. No
 * copy of any context is made and no sparse pattern is built: the block table and the
 * context length are all a row needs.
 *
 * Layouts (float32, C-contiguous):
 *   q           [n, hq, d], rows q_stride floats apart (heads and dims contiguous)
 *   out         [n, hq, d]
 *   k_pool      [blocks, bs, hkv, d]  (so slot s of KV head h starts at (s * hkv + h) * d)
 *   v_pool      same as k_pool
 *   tables      [n, table_stride] block ids (int64); only the first ceil(len / bs) are read
 *   lengths     [n] context length of each row (its query sees slots 0 .. len - 1)
 * Query head j reads KV head j / (hq / hkv) (grouped-query attention).
 *
 * Returns 0, or a negative code for arguments it refuses (the caller checks shapes first;
 * this is the last line of defence against reading outside the pool).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64

/* exp(x) for x <= 0 (scores minus their maximum), vectorizable: Cephes' expf (range
 * reduction by ln 2 in two parts, a degree-6 polynomial; within 2 ulp of expf), inlined so
 * that the softmax loop compiles to SIMD instead of one libm call per score. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* below: exp underflows to 0 either way */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t bits;
        float value;
    } two_n = {((int32_t)n + 127) << 23}; /* 2^n, n in [-126, 0] */
    return p * two_n.value;
}

/* One work item: query heads h*g .. h*g+g-1 of row i against KV head h. ``d`` is a
 * compile-time constant in each call the dispatcher below makes (the inner loops then
 * unroll into whole SIMD registers); ``scores`` holds g * len floats. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict qi, const float *restrict k_pool, const float *restrict v_pool,
    const int64_t *restrict table, int64_t len, float *restrict o, float *restrict scores,
    int64_t g, int64_t h, int64_t slot_stride, int64_t bs, float scale, const int64_t d) {
    /* Query head by query head: its query (scores) or its accumulator (output) stays in
     * registers while the head's K or V rows stream past; the group's later heads re-read
     * them from L1 (one row's context of one KV head is len * d floats). */
    for (int64_t j = 0; j < g; ++j) {
        const float *qj = qi + j * d;
        float *row = scores + j * len;
        float high = -INFINITY;
        for (int64_t t0 = 0; t0 < len; t0 += bs) {
            const int64_t stop = len - t0 < bs ? len - t0 : bs;
            const float *kb = k_pool + table[t0 / bs] * bs * slot_stride + h * d;
            for (int64_t t = 0; t < stop; ++t) {
                const float *k = kb + t * slot_stride;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t x = 0; x < d; ++x) s += qj[x] * k[x];
                s *= scale;
                row[t0 + t] = s;
                high = s > high ? s : high;
            }
        }
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
            const float e = exp_nonpositive(row[t] - high);
            row[t] = e;
            total += e;
        }
        float acc[d];
        for (int64_t x = 0; x < d; ++x) acc[x] = 0.0f;
        for (int64_t t0 = 0; t0 < len; t0 += bs) {
            const int64_t stop = len - t0 < bs ? len - t0 : bs;
            const float *vb = v_pool + table[t0 / bs] * bs * slot_stride + h * d;
            for (int64_t t = 0; t < stop; ++t) {
                const float *v = vb + t * slot_stride;
                const float p = row[t0 + t];
#pragma omp simd
                for (int64_t x = 0; x < d; ++x) acc[x] += p * v[x];
            }
        }
        const float inv = 1.0f / total;
        float *oj = o + j * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) oj[x] = acc[x] * inv;
    }
}

int spec_tot_paged_decode(const float *q, int64_t q_stride, const float *k_pool,
                          const float *v_pool, const int64_t *tables, int64_t table_stride,
                          const int64_t *lengths, float *out, int64_t n, int64_t hq,
                          int64_t hkv, int64_t d, int64_t bs, int64_t num_blocks, float scale,
                          int threads) {
    if (n < 0 || hq <= 0 || hkv <= 0 || d <= 0 || bs <= 0 || hq % hkv != 0) return -1;
    if (q_stride < hq * d) return -1;
    const int64_t g = hq / hkv;
    if (g > MAX_GROUP) return -2;
    int64_t longest = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = lengths[i];
        if (len <= 0 || (len + bs - 1) / bs > table_stride) return -3;
        for (int64_t b = 0; b < (len + bs - 1) / bs; ++b) {
            const int64_t block = tables[i * table_stride + b];
            if (block < 0 || block >= num_blocks) return -4;
        }
        longest = len > longest ? len : longest;
    }
    const int64_t items = n * hkv;
    const int64_t slot_stride = hkv * d;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *scores = (float *)malloc((size_t)(g * longest) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            if (scores == NULL) continue;
            const int64_t i = item / hkv, h = item % hkv;
            const float *qi = q + i * q_stride + h * g * d;
            const int64_t *table = tables + i * table_stride;
            float *o = out + (i * hq + h * g) * d;
            const int64_t len = lengths[i];
            switch (d) { /* the head sizes of common models, unrolled; any other: generic */
                case 32:
                    attend(qi, k_pool, v_pool, table, len, o, scores, g, h, slot_stride, bs,
                           scale, 32);
                    break;
                case 64:
                    attend(qi, k_pool, v_pool, table, len, o, scores, g, h, slot_stride, bs,
                           scale, 64);
                    break;
                case 128:
                    attend(qi, k_pool, v_pool, table, len, o, scores, g, h, slot_stride, bs,
                           scale, 128);
                    break;
                default:
                    attend(qi, k_pool, v_pool, table, len, o, scores, g, h, slot_stride, bs,
                           scale, d);
            }
        }
        free(scores);
    }
    return failed ? -5 : 0;
}
