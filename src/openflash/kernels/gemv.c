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
 * The entry points below prepare the activations (activations.c) and call one instruction set's products: avx512.c
 * where the caller's `isa` allows it, the CPU has it and the activations are QDQ'd (so exact in bf16), else avx2.c,
 * whose FP4 products of one QDQ'd row run in integers where `isa` has ISA_INTEGER_FP4 (exact per 32-group).
 * The caller (kernels/native.py) keeps the PyTorch path where of_cpu_features() lacks AVX2.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

int of_cpu_features(void) {
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    return avx2 ? ISA_AVX2 | (avx512 ? ISA_AVX512_BF16 : 0) : 0;
}

static int bf16_products(int isa, int act_qdq) {
    return act_qdq && (isa & ISA_AVX512_BF16) && (of_cpu_features() & ISA_AVX512_BF16);
}

/* A product this small (a few microseconds on one core) costs less than waking a second thread: one thread. */
#define SMALL_PRODUCT (1L << 18) /* multiply-adds */
static int threads_for(long multiply_adds, int threads) { return multiply_adds < SMALL_PRODUCT ? 1 : threads; }

static void *scratch(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* ---- the FP4 activation layouts of each instruction set, for the experts' call ---------------------------------- */

typedef struct {
    float (*dot)(const uint8_t *wrow, const uint8_t *srow, const void *x, int K); /* one output of one row */
    void (*prepare)(const float *x, void *out, int rows, int K);                  /* x after any QDQ */
    size_t (*row_bytes)(int K);
} Fp4Path;

static void lane_order(const float *x, void *out, int rows, int K) { fp4_lane_order(x, out, rows, K); }
static size_t lane_order_bytes(int K) { return (size_t)K * sizeof(float); }
static void bf16_pairs(const float *x, void *out, int rows, int K) { fp4_bf16_pairs(x, out, rows, K); }
static size_t bf16_pairs_bytes(int K) { return bf16_pairs_width(K) * sizeof(uint16_t); }

static const Fp4Path AVX2_FP4 = {avx2_fp4_dot, lane_order, lane_order_bytes};
static void int_planes(const float *x, void *out, int rows, int K) { fp4_int_planes(x, out, rows, K); }
static const Fp4Path AVX512_FP4 = {avx512_fp4_dot, bf16_pairs, bf16_pairs_bytes};
static const Fp4Path AVX2_FP4_INT = {avx2_fp4_int_dot, int_planes, int_planes_bytes}; /* QDQ'd activations */

/* ---- the routed experts of one MoE layer in one call (FP4) ----------------------------------------------------
 * For each (token, expert) pair p, in the order given (pairs of one expert together, experts ascending):
 *   h_p = weight_p * silu(min(x_t W1^T, L)) * clamp(x_t W3^T, -L, L), FP8-QDQ'd per 32 when act_qdq
 *   y[t] += h_p W2^T, summed in pair order (as one call per expert does, model/routed.py `grouped`)
 * x arrives prepared (QDQ'd once per token when act_qdq). Threads split each phase's outputs over all pairs at once:
 * one parallel region per layer, where one call per expert and projection opens eighteen. Each output is the same
 * 1-row dot product the gemv computes. */
static void fp4_experts(const Fp4Path *path, const char *x, int K, int I, const uint8_t *const *w1,
                        const uint8_t *const *s1, const uint8_t *const *w3, const uint8_t *const *s3,
                        const uint8_t *const *w2, const uint8_t *const *s2, int P, const int64_t *token,
                        const int64_t *expert, const float *weight, float limit, int act_qdq, float *h, char *hp,
                        float *out, int threads) {
    const long up_rows = (long)P * I, down_rows = (long)P * K;
    const size_t ldx = path->row_bytes(K), ldh = path->row_bytes(I);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long idx = 0; idx < up_rows; idx++) {
            const long p = idx / I, i = idx % I, e = expert[p];
            const char *xr = x + (size_t)token[p] * ldx;
            float g = path->dot(w1[e] + (size_t)i * (K / 2), s1[e] + (size_t)i * (K / 32), xr, K);
            float u = path->dot(w3[e] + (size_t)i * (K / 2), s3[e] + (size_t)i * (K / 32), xr, K);
            g = g > limit ? limit : g;
            u = u > limit ? limit : (u < -limit ? -limit : u);
            h[idx] = weight[p] * (g / (1.0f + expf(-g)) * u);
        }
#pragma omp single
        {
            if (act_qdq) qdq_activations(h, h, P, I);
            path->prepare(h, hp, P, I);
        }
#pragma omp for schedule(static)
        for (long idx = 0; idx < down_rows; idx++) {
            const long p = idx / K, k = idx % K, e = expert[p];
            out[idx] = path->dot(w2[e] + (size_t)k * (I / 2), s2[e] + (size_t)k * (I / 32), hp + (size_t)p * ldh, I);
        }
    }
}

/* ---- entry points (0: done; < 0: not served, the caller falls back) ------------------------------------------ */

int of_fp4_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K, int act_qdq,
                int isa, int threads) {
    if (!(of_cpu_features() & ISA_AVX2) || R < 1 || R > MAX_ROWS || K % 32) return -1;
    /* One row: the integer products, where allowed, even beside AVX-512 BF16 (11-13% faster on released shapes:
     * docs/benchmarks.md, "One-row FP4: integers before BF16"); more rows: BF16 where there is AVX-512 BF16. */
    const int integer = act_qdq && R == 1 && (isa & ISA_INTEGER_FP4), bf16 = !integer && bf16_products(isa, act_qdq);
    const size_t bytes = integer ? (size_t)R * int_planes_bytes(K) : (size_t)R * K * sizeof(float);
    float *q = scratch(bytes);
    uint16_t *xb = bf16 ? scratch((size_t)R * bf16_pairs_bytes(K)) : NULL;
    if (!q || (bf16 && !xb)) {
        free(q), free(xb);
        return -2;
    }
    const int t = threads_for((long)R * N * K, threads);
    if (integer) {
        fp4_int_planes(x, (uint8_t *)q, R, K);
        avx2_fp4_int_gemv((const uint8_t *)q, w, scale, y, N, K, t);
    } else if (bf16) {
        qdq_activations(x, q, R, K);
        fp4_bf16_pairs(q, xb, R, K);
        avx512_fp4_gemv(xb, w, scale, y, R, N, K, t);
    } else {
        if (act_qdq) qdq_activations(x, q, R, K);
        fp4_lane_order(act_qdq ? q : x, q, R, K);
        avx2_fp4_gemv(q, w, scale, y, R, N, K, t);
    }
    free(q), free(xb);
    return 0;
}

int of_fp8_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K, int act_qdq,
                int isa, int threads) {
    if (!(of_cpu_features() & ISA_AVX2) || R < 1 || R > MAX_ROWS || K % 32) return -1;
    const size_t n = (size_t)R * K;
    const int bf16 = bf16_products(isa, act_qdq);
    float *q = scratch(n * sizeof(float));
    uint16_t *xb = bf16 ? scratch(n * sizeof(uint16_t)) : NULL;
    if (!q || (bf16 && !xb)) {
        free(q), free(xb);
        return -2;
    }
    if (act_qdq)
        qdq_activations(x, q, R, K);
    else
        memcpy(q, x, n * sizeof(float));
    if (bf16) {
        to_bf16(q, xb, n);
        avx512_fp8_gemv(xb, w, scale, y, R, N, K, threads_for((long)R * N * K, threads));
    } else {
        for (size_t i = 0; i < n; i++) q[i] *= 256.0f; /* avx2.c's decoder yields value / 256 */
        avx2_fp8_gemv(q, w, scale, y, R, N, K, threads_for((long)R * N * K, threads));
    }
    free(q), free(xb);
    return 0;
}

int of_bf16_gemv(const float *x, const uint16_t *w, float *y, int R, int N, int K, int threads) {
    if (!(of_cpu_features() & ISA_AVX2) || R < 1 || R > MAX_ROWS) return -1;
    avx2_bf16_gemv(x, w, y, R, N, K, threads_for((long)R * N * K, threads));
    return 0;
}

/* y [T, K] (zeroed by the caller) += the routed experts' outputs (fp4_experts); E pointers per table. */
int of_fp4_experts(const float *x, int T, int K, int I, const uint8_t *const *w1, const uint8_t *const *s1,
                   const uint8_t *const *w3, const uint8_t *const *s3, const uint8_t *const *w2,
                   const uint8_t *const *s2, int P, const int64_t *token, const int64_t *expert, const float *weight,
                   float limit, int act_qdq, int isa, float *y, int threads) {
    if (!(of_cpu_features() & ISA_AVX2) || T < 1 || P < 1 || K % 32 || I % 32) return -1;
    const Fp4Path *path = bf16_products(isa, act_qdq)         ? &AVX512_FP4
                          : act_qdq && (isa & ISA_INTEGER_FP4) ? &AVX2_FP4_INT
                                                               : &AVX2_FP4;
    float *q = scratch((size_t)T * K * sizeof(float)), *h = scratch((size_t)P * I * sizeof(float));
    float *out = scratch((size_t)P * K * sizeof(float));
    char *xp = scratch((size_t)T * path->row_bytes(K)), *hp = scratch((size_t)P * path->row_bytes(I));
    if (!q || !h || !out || !xp || !hp) {
        free(q), free(h), free(out), free(xp), free(hp);
        return -2;
    }
    if (act_qdq) qdq_activations(x, q, T, K);
    path->prepare(act_qdq ? q : x, xp, T, K);
    fp4_experts(path, xp, K, I, w1, s1, w3, s3, w2, s2, P, token, expert, weight, limit, act_qdq, h, hp, out,
                threads_for(3L * P * I * K, threads));
    for (int p = 0; p < P; p++) {
        float *yr = y + (size_t)token[p] * K;
        const float *o = out + (size_t)p * K;
        for (int k = 0; k < K; k++) yr[k] += o[k];
    }
    free(q), free(h), free(out), free(xp), free(hp);
    return 0;
}
