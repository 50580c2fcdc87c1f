/* Products of 1..16 activation rows with a weight kept as the checkpoint stores it (spec: quant_and_cache.md §1-2,
 * checkpoint.md §4): y[r, o] = sum_k x[r, k] * W[o, k], W decoded on the fly in registers, never materialized.
 *
 *   FP8 E4M3 [N, K] bytes, one UE8M0 scale per 32 x 32 block [ceil(N/32), K/32]
 *   MXFP4    [N, K/2] bytes (element 2j in the low nibble of byte j), one UE8M0 scale per 1 x 32 [N, K/32]
 *   bf16     [N, K]
 *
 * act_qdq (FP8 and FP4): the reference's activation quantize-dequantize (FP8 E4M3 per 32 channels, a UE8M0 scale
 * = pow2ceil(max(amax, 1e-4) * fp32(1/448))) applied to x inside the call, as formats.act_quant_qdq does it.
 *
 * The AVX2 + FMA + F16C paths are compiled for those flags only (target attributes) and chosen at run time by
 * of_cpu_supported(); the caller (kernels/native.py) keeps the PyTorch path where they are absent. Threads split
 * the output rows (OpenMP, the process's runtime: torch's libgomp once torch is loaded).
 *
 * Decoding: each lane of 8 takes its E2M1 nibble by a variable shift of 4 broadcast bytes and looks its magnitude
 * up (VPERMPS) in an 8-entry table already multiplied by the group's scale; bit 3 becomes the sign.
 * An E4M3 byte b, its magnitude bits shifted left by 7, is the fp16 of value(b) / 256, subnormals included; F16C
 * converts it and the 256 is folded into x (exact: a power of two), so extreme block scales stay finite.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 16
#define CHUNK 8 /* activation rows accumulated together: 8 accumulators + 4 weight vectors fit 16 registers */

int of_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static float ue8m0(uint8_t b) { /* 2^(b-127); b = 0 is 2^-127, an fp32 subnormal; 255 is NaN */
    if (b == 255) return NAN;
    uint32_t bits = b ? (uint32_t)b << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float UE8M0[256]; /* byte -> scale, filled when the library loads (read-only afterwards) */

__attribute__((constructor)) static void fill_ue8m0(void) {
    for (int b = 0; b < 256; b++) UE8M0[b] = ue8m0((uint8_t)b);
}

static float pow2_ceil(float t) { /* 2^ceil(log2 t), exact powers of two unchanged (formats.pow2_ceil_scale) */
    uint32_t bits;
    memcpy(&bits, &t, 4);
    uint32_t biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
    if (biased == 0) return ue8m0(0);
    uint32_t out = biased << 23;
    float f;
    memcpy(&f, &out, 4);
    return f;
}

static float e4m3_round(float v) { /* nearest E4M3 value, ties to even, saturating at 448 (formats.e4m3_round) */
    float a = fabsf(v);
    if (a > 448.0f) a = 448.0f;
    int e;
    frexpf(a, &e);
    int binade = e - 1 < -6 ? -6 : e - 1;
    float step = ldexpf(1.0f, binade - 3);
    return copysignf(nearbyintf(a / step) * step, v);
}

/* x [rows, K] -> formats.act_quant_qdq(x) in out (K % 32 == 0). */
static void qdq_activations(const float *x, float *out, int rows, int K) {
    const float inv448 = (float)(1.0 / 448.0);
    for (int r = 0; r < rows; r++) {
        for (int g = 0; g < K; g += 32) {
            const float *src = x + (size_t)r * K + g;
            float *dst = out + (size_t)r * K + g;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(src[i]));
            float s = pow2_ceil(fmaxf(amax, 1e-4f) * inv448);
            for (int i = 0; i < 32; i++) {
                float q = src[i] / s;
                q = q > 448.0f ? 448.0f : (q < -448.0f ? -448.0f : q);
                dst[i] = e4m3_round(q) * s;
            }
        }
    }
}

AVX2 INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Accumulators per activation row: a row's FMAs form a dependency chain (4 cycles each), so few rows get several
 * chains, summed at the end; with 8 rows there are 8 chains already. */
#define ACCS(nr) ((nr) <= 2 ? 4 : ((nr) <= 4 ? 2 : 1))

/* acc[r * A + j] += w[i] * x[r][8 i ..] for the 4 weight vectors of one 32-group. */
AVX2 INLINE void fma_group(const __m256 w[4], const float *x, int ldx, int nr, __m256 *acc) {
    const int A = ACCS(nr);
    for (int r = 0; r < nr; r++) {
        const float *xr = x + (size_t)r * ldx;
        for (int i = 0; i < 4; i++)
            acc[r * A + i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r * A + i % A]);
    }
}

AVX2 INLINE void store_rows(__m256 *acc, int nr, float *y, int ldy) {
    const int A = ACCS(nr);
    for (int r = 0; r < nr; r++) {
        __m256 a = acc[r * A];
        for (int j = 1; j < A; j++) a = _mm256_add_ps(a, acc[r * A + j]);
        y[(size_t)r * ldy] = hsum(a);
    }
}

/* ---- FP4 ---------------------------------------------------------------------------------------------------- */

/* 8 weights from 4 bytes (natural order: byte j's low nibble, then its high nibble): each lane takes its nibble by
 * a variable shift, VPERMPS looks its magnitude up in the group's scaled table (it reads the low 3 bits), and bit 3
 * of the nibble becomes the float's sign. */
AVX2 INLINE __m256 fp4_8(const uint8_t *bytes, __m256 table, __m256i shifts) {
    int32_t word;
    memcpy(&word, bytes, 4);
    __m256i n = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(n, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, n), _mm256_castsi256_ps(sign));
}

/* The 32 weights of one group (16 bytes), each table entry times the group's scale. */
AVX2 INLINE void fp4_group(const uint8_t *bytes, float scale, __m256 w[4]) {
    const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256 table = _mm256_mul_ps(magnitudes, _mm256_set1_ps(scale));
    for (int i = 0; i < 4; i++) w[i] = fp4_8(bytes + 4 * i, table, shifts);
}

/* One output row against nr (<= CHUNK) rows of x. */
AVX2 INLINE void fp4_row(const uint8_t *wrow, const uint8_t *srow, const float *x, int K, int nr, float *y,
                         int ldy) {
    __m256 acc[CHUNK];
    for (int j = 0; j < CHUNK; j++) acc[j] = _mm256_setzero_ps();
    for (int g = 0; g < K / 32; g++) {
        __m256 w[4];
        fp4_group(wrow + 16 * g, UE8M0[srow[g]], w);
        fma_group(w, x + 32 * g, K, nr, acc);
    }
    store_rows(acc, nr, y, ldy);
}

#define DISPATCH_ROWS(call)                                                                                   \
    switch (nr) {                                                                                              \
    case 1: { const int nr = 1; call; } break;                                                                 \
    case 2: { const int nr = 2; call; } break;                                                                 \
    case 3: { const int nr = 3; call; } break;                                                                 \
    case 4: { const int nr = 4; call; } break;                                                                 \
    case 5: { const int nr = 5; call; } break;                                                                 \
    case 6: { const int nr = 6; call; } break;                                                                 \
    case 7: { const int nr = 7; call; } break;                                                                 \
    default: { const int nr = 8; call; } break;                                                                \
    }

AVX2 static void fp4_gemv_avx2(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                               int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < N; o++) {
        const uint8_t *wrow = w + (size_t)o * (K / 2), *srow = scale + (size_t)o * (K / 32);
        for (int r0 = 0; r0 < R; r0 += CHUNK) {
            int nr = R - r0 < CHUNK ? R - r0 : CHUNK;
            DISPATCH_ROWS(fp4_row(wrow, srow, x + (size_t)r0 * K, K, nr, y + (size_t)r0 * N + o, N))
        }
    }
}

/* ---- FP8 ---------------------------------------------------------------------------------------------------- */

/* 16 E4M3 bytes -> 16 floats * scale (value = fp16(magnitude << 7 | sign << 15) * 256). */
AVX2 INLINE void fp8_16(const uint8_t *bytes, __m256 scale256, __m256 *a, __m256 *b) {
    /* sign-extended and shifted by 7, bit 15 is the sign and bits 13..7 the magnitude; bit 14 (the sign again)
     * is cleared */
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)bytes));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBFFF));
    *a = _mm256_mul_ps(scale256, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    *b = _mm256_mul_ps(scale256, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}

AVX2 INLINE void fp8_row(const uint8_t *wrow, const uint8_t *srow, const float *x, int K, int nr, float *y,
                         int ldy) {
    __m256 acc[CHUNK];
    for (int j = 0; j < CHUNK; j++) acc[j] = _mm256_setzero_ps();
    for (int g = 0; g < K / 32; g++) {
        __m256 s = _mm256_set1_ps(UE8M0[srow[g]]), w[4];
        fp8_16(wrow + 32 * g, s, &w[0], &w[1]);
        fp8_16(wrow + 32 * g + 16, s, &w[2], &w[3]);
        fma_group(w, x + 32 * g, K, nr, acc);
    }
    store_rows(acc, nr, y, ldy);
}

AVX2 static void fp8_gemv_avx2(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                               int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < N; o++) {
        const uint8_t *wrow = w + (size_t)o * K, *srow = scale + (size_t)(o / 32) * (K / 32);
        for (int r0 = 0; r0 < R; r0 += CHUNK) {
            int nr = R - r0 < CHUNK ? R - r0 : CHUNK;
            DISPATCH_ROWS(fp8_row(wrow, srow, x + (size_t)r0 * K, K, nr, y + (size_t)r0 * N + o, N))
        }
    }
}

/* ---- bf16 --------------------------------------------------------------------------------------------------- */

AVX2 INLINE __m256 bf16_8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

AVX2 INLINE void bf16_row(const uint16_t *wrow, const float *x, int K, int nr, float *y, int ldy) {
    __m256 acc[CHUNK];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = bf16_8(wrow + k), w1 = bf16_8(wrow + k + 8);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (size_t)r * K + k;
            acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]);
            acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float tail = 0.0f;
        for (int j = k; j < K; j++) {
            uint32_t bits = (uint32_t)wrow[j] << 16;
            float wf;
            memcpy(&wf, &bits, 4);
            tail += wf * x[(size_t)r * K + j];
        }
        y[(size_t)r * ldy] = hsum(acc[r]) + tail;
    }
}

AVX2 static void bf16_gemv_avx2(const float *x, const uint16_t *w, float *y, int R, int N, int K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < N; o++) {
        const uint16_t *wrow = w + (size_t)o * K;
        for (int r0 = 0; r0 < R; r0 += CHUNK) {
            int nr = R - r0 < CHUNK ? R - r0 : CHUNK;
            DISPATCH_ROWS(bf16_row(wrow, x + (size_t)r0 * K, K, nr, y + (size_t)r0 * N + o, N))
        }
    }
}

/* ---- the routed experts of one MoE layer in one call (FP4) ----------------------------------------------------
 * For each (token, expert) pair p, in the order given (pairs of one expert together, experts ascending):
 *   h_p = weight_p * silu(min(x_t W1^T, L)) * clamp(x_t W3^T, -L, L), FP8-QDQ'd per 32 when act_qdq
 *   y[t] += h_p W2^T, summed in pair order (as one call per expert does, model/routed.py `grouped`)
 * x is QDQ'd once per token when act_qdq. Threads split each phase's outputs over all pairs at once: one parallel
 * region per layer, where one call per expert and projection opens eighteen. Each output is the same 1-row dot
 * product fp4_gemv computes. */
AVX2 static void fp4_experts_avx2(const float *x, int K, int I, const uint8_t *const *w1, const uint8_t *const *s1,
                                  const uint8_t *const *w3, const uint8_t *const *s3, const uint8_t *const *w2,
                                  const uint8_t *const *s2, int P, const int64_t *token, const int64_t *expert,
                                  const float *weight, float limit, int act_qdq, float *h, float *out, int threads) {
    const long up_rows = (long)P * I, down_rows = (long)P * K;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long idx = 0; idx < up_rows; idx++) {
            const long p = idx / I, i = idx % I, e = expert[p];
            const float *xr = x + (size_t)token[p] * K;
            float g, u;
            fp4_row(w1[e] + (size_t)i * (K / 2), s1[e] + (size_t)i * (K / 32), xr, K, 1, &g, 1);
            fp4_row(w3[e] + (size_t)i * (K / 2), s3[e] + (size_t)i * (K / 32), xr, K, 1, &u, 1);
            g = g > limit ? limit : g;
            u = u > limit ? limit : (u < -limit ? -limit : u);
            h[idx] = weight[p] * (g / (1.0f + expf(-g)) * u);
        }
#pragma omp single
        if (act_qdq) qdq_activations(h, h, P, I); /* in place: each group's amax is taken before it is written */
#pragma omp for schedule(static)
        for (long idx = 0; idx < down_rows; idx++) {
            const long p = idx / K, k = idx % K, e = expert[p];
            fp4_row(w2[e] + (size_t)k * (I / 2), s2[e] + (size_t)k * (I / 32), h + (size_t)p * I, I, 1, out + idx, 1);
        }
    }
}

/* ---- entry points (0: done; < 0: not served, the caller falls back) ------------------------------------------ */

static float *scratch(size_t n) { return (float *)aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64); }

int of_fp4_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K, int act_qdq,
                int threads) {
    if (!of_cpu_supported() || R < 1 || R > MAX_ROWS || K % 32) return -1;
    float *q = NULL;
    if (act_qdq) {
        if (!(q = scratch((size_t)R * K))) return -2;
        qdq_activations(x, q, R, K);
    }
    fp4_gemv_avx2(act_qdq ? q : x, w, scale, y, R, N, K, threads);
    free(q);
    return 0;
}

int of_fp8_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K, int act_qdq,
                int threads) {
    if (!of_cpu_supported() || R < 1 || R > MAX_ROWS || K % 32) return -1;
    float *xs = scratch((size_t)R * K);
    if (!xs) return -2;
    if (act_qdq)
        qdq_activations(x, xs, R, K);
    else
        memcpy(xs, x, (size_t)R * K * sizeof(float));
    for (size_t i = 0; i < (size_t)R * K; i++) xs[i] *= 256.0f; /* the decoder's value / 256 */
    fp8_gemv_avx2(xs, w, scale, y, R, N, K, threads);
    free(xs);
    return 0;
}

int of_bf16_gemv(const float *x, const uint16_t *w, float *y, int R, int N, int K, int threads) {
    if (!of_cpu_supported() || R < 1 || R > MAX_ROWS) return -1;
    bf16_gemv_avx2(x, w, y, R, N, K, threads);
    return 0;
}

/* y [T, K] (zeroed by the caller) += the routed experts' outputs (fp4_experts_avx2); E pointers per table. */
int of_fp4_experts(const float *x, int T, int K, int I, const uint8_t *const *w1, const uint8_t *const *s1,
                   const uint8_t *const *w3, const uint8_t *const *s3, const uint8_t *const *w2,
                   const uint8_t *const *s2, int P, const int64_t *token, const int64_t *expert, const float *weight,
                   float limit, int act_qdq, float *y, int threads) {
    if (!of_cpu_supported() || T < 1 || P < 1 || K % 32 || I % 32) return -1;
    float *xq = act_qdq ? scratch((size_t)T * K) : NULL, *h = scratch((size_t)P * I), *out = scratch((size_t)P * K);
    if ((act_qdq && !xq) || !h || !out) {
        free(xq), free(h), free(out);
        return -2;
    }
    if (act_qdq) qdq_activations(x, xq, T, K);
    fp4_experts_avx2(act_qdq ? xq : x, K, I, w1, s1, w3, s3, w2, s2, P, token, expert, weight, limit, act_qdq, h, out,
                     threads);
    for (int p = 0; p < P; p++) {
        float *yr = y + (size_t)token[p] * K;
        const float *o = out + (size_t)p * K;
        for (int k = 0; k < K; k++) yr[k] += o[k];
    }
    free(xq), free(h), free(out);
    return 0;
}
