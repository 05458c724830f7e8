/* Paged decode attention for the CPU: each sequence's query rows attend to its keys and values where they
 * lie in the KV pool (no gather), one (sequence, KV head) at a time, in parallel over them with OpenMP.
 *
 * Built and loaded by paged_decode.py (plain C, no torch headers: one compiler call of about a second);
 * the CPU attention backend calls it for its decode groups (cpu_backend.py). Layouts, all row-major:
 *
 *   q, out     [seqs, width, kv_heads * group, head_dim] float32: query head kv * group + g shares KV head kv
 *   k, v       [slots, kv_heads, head_dim], float32 or bfloat16 (`kv_bf16`): one layer's KV pool;
 *              token position l of a sequence lies in slot pages[l / page_size] * page_size + l % page_size
 *   pages      [seqs, max_pages] int64: each sequence's KV pages
 *   sees       [seqs, width] int64: query position j of a sequence attends to its keys [0, sees[j])
 *              (1 <= sees[j] <= max_pages * page_size)
 *
 * Per query row: scores = scale * q . k over the keys it sees, softmax (max subtracted), out = the
 * scores' weighted sum of the values: what torch's SDPA computes with the keys past `sees` masked out,
 * in float32 (its sums in another order: equal to rounding).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The KV row of `slot` for KV head `h`: k or v + (slot * kv_heads + h) * head_dim elements. */
static inline float dot(const float *q, const void *kv, int kv_bf16, int64_t at, int64_t head_dim) {
    float s = 0.f;
    if (kv_bf16) {
        const uint16_t *row = (const uint16_t *)kv + at;
        for (int64_t d = 0; d < head_dim; d++) s += q[d] * bf16_to_float(row[d]);
    } else {
        const float *row = (const float *)kv + at;
        for (int64_t d = 0; d < head_dim; d++) s += q[d] * row[d];
    }
    return s;
}

static inline void add_scaled(float *acc, float p, const void *kv, int kv_bf16, int64_t at, int64_t head_dim) {
    if (kv_bf16) {
        const uint16_t *row = (const uint16_t *)kv + at;
        for (int64_t d = 0; d < head_dim; d++) acc[d] += p * bf16_to_float(row[d]);
    } else {
        const float *row = (const float *)kv + at;
        for (int64_t d = 0; d < head_dim; d++) acc[d] += p * row[d];
    }
}

/* e^x for x <= 0 (a score minus its row's maximum), in a form the compiler vectorizes (no call): x = n ln2 + r,
 * |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (under 1 ulp of e^x), times 2^n built in the exponent bits. Below
 * -87 (where e^x is under float's smallest normal) it gives e^-87, which no sum of a row with e^0 in it
 * notices; NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    /* ln2 in two parts (Cody-Waite), each step a fused multiply-add: the reassociation this file is built with
     * (-fassociative-math, for the vectorized sums) would otherwise fold the parts back into one */
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x));
#else
    /* (no FMA instruction: fmaf would be a library call per score, so ln2 in one part; its rounding error grows
     * with n, on weights of at most 2^-n of the row's largest) */
    const float r = x - n * 0.69314718055994531f;
#endif
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef struct {
    const void *k, *v;
    int kv_bf16;
    int64_t width, kv_heads, group, head_dim, page_size;
    float scale;
} Shape;

/* One sequence (its pages, its `sees`, its query rows q and out) and one KV head `h`; `n` = max(sees).
 * scores [width * group, n] and acc [width * group, head_dim]: this thread's scratch. */
static void attend_one_head(const Shape *s, const float *q, float *out, const int64_t *pages, const int64_t *sees,
                            int64_t n, int64_t h, float *scores, float *acc) {
    const int64_t rows = s->width * s->group, dim = s->head_dim, row_stride = s->kv_heads * s->group * dim;
    /* scores: every query row against every key up to n (a row's own limit is applied by the softmax) */
    for (int64_t first = 0, page = 0; first < n; first += s->page_size, page++) {
        const int64_t slot0 = pages[page] * s->page_size, count = n - first < s->page_size ? n - first : s->page_size;
        for (int64_t o = 0; o < count; o++) {
            const int64_t at = ((slot0 + o) * s->kv_heads + h) * dim;
            for (int64_t j = 0; j < s->width; j++)
                for (int64_t g = 0; g < s->group; g++)
                    scores[(j * s->group + g) * n + first + o] =
                        s->scale * dot(q + j * row_stride + (h * s->group + g) * dim, s->k, s->kv_bf16, at, dim);
        }
    }
    /* softmax over each row's visible keys: probabilities (unnormalized) in place, their sums kept */
    float *sums = acc + rows * dim;
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * n, top = -INFINITY, sum = 0.f;
        const int64_t seen = sees[r / s->group];
        for (int64_t l = 0; l < seen; l++) top = row[l] > top ? row[l] : top;
        for (int64_t l = 0; l < seen; l++) {
            row[l] = exp_nonpositive(row[l] - top);
            sum += row[l];
        }
        sums[r] = sum;
    }
    /* the values, weighted */
    memset(acc, 0, sizeof(float) * rows * dim);
    for (int64_t first = 0, page = 0; first < n; first += s->page_size, page++) {
        const int64_t slot0 = pages[page] * s->page_size, count = n - first < s->page_size ? n - first : s->page_size;
        for (int64_t o = 0; o < count; o++) {
            const int64_t at = ((slot0 + o) * s->kv_heads + h) * dim, l = first + o;
            for (int64_t r = 0; r < rows; r++)
                if (l < sees[r / s->group]) add_scaled(acc + r * dim, scores[r * n + l], s->v, s->kv_bf16, at, dim);
        }
    }
    for (int64_t j = 0; j < s->width; j++)
        for (int64_t g = 0; g < s->group; g++) {
            const int64_t r = j * s->group + g;
            const float inv = 1.f / sums[r];
            float *dst = out + j * row_stride + (h * s->group + g) * dim;
            for (int64_t d = 0; d < dim; d++) dst[d] = acc[r * dim + d] * inv;
        }
}

/* The entry point (module comment for the layouts). Returns 0, or 1 when scratch memory ran out. */
int vlmrun_paged_decode(const float *q, const void *k, const void *v, int kv_bf16, const int64_t *pages,
                        int64_t max_pages, const int64_t *sees, int64_t seqs, int64_t width, int64_t kv_heads,
                        int64_t group, int64_t head_dim, int64_t page_size, float scale, float *out, int num_threads) {
    const Shape shape = {k, v, kv_bf16, width, kv_heads, group, head_dim, page_size, scale};
    const int64_t rows = width * group, seq_stride = width * kv_heads * group * head_dim;
    const int64_t max_keys = max_pages * page_size;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * rows * max_keys);
        float *acc = malloc(sizeof(float) * rows * (head_dim + 1));  /* + 1: the softmax sums */
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < seqs * kv_heads; i++) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t b = i / kv_heads;
            int64_t n = 0;
            for (int64_t j = 0; j < width; j++) n = sees[b * width + j] > n ? sees[b * width + j] : n;
            attend_one_head(&shape, q + b * seq_stride, out + b * seq_stride, pages + b * max_pages,
                            sees + b * width, n, i % kv_heads, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
