/* Products on stored weights with AVX2 + FMA + F16C, the baseline every x86-64 machine of the last decade has.
 * x is fp32: in lane order for FP4 (activations.c fp4_lane_order), times 256 for FP8 (below). Threads split the
 * output rows (OpenMP). Results equal dequantize-then-fp32-matmul to fp32 summation order.
 *
 * FP4: every E2M1 value is an fp32 whose two low bytes are zero: two VPSHUFB tables decode 32 nibbles into the two
 * high bytes and unpacks with zeros make them floats (fp4_group).
 * FP8: an E4M3 byte b, its magnitude bits shifted left by 7, is the fp16 of value(b) / 256, subnormals included;
 * F16C converts it and the 256 is folded into x (exact: a power of two), so extreme block scales stay finite. */
#include <string.h>

#include "kernels.h"

/* Weight bytes ahead of the decoder a software prefetch asks for (as avx512.c): 1 KiB for FP4, twice that for
 * FP8 and bf16 (the same weights ahead). Every product prefetches: on a 2-core Xeon (a VM) the one-row FP8 product
 * took 1.55 ms without it and 0.73 ms with it, two rows 2.96 and 0.80 (docs/benchmarks.md). */
#define PREFETCH_BYTES 1024
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

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

/* The unscaled dot product of one 32-group's weights with 32 activations: two chains, then their sum. */
AVX2 INLINE __m256 group_dot(const __m256 w[4], const float *x) {
    __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(x)), b = _mm256_mul_ps(w[1], _mm256_loadu_ps(x + 8));
    a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a);
    b = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), b);
    return _mm256_add_ps(a, b);
}

/* Few rows: each group's sum is taken unscaled and multiplied by its scale (one FMA a row); the group index's
 * parity picks the accumulator (a constant once the loop is unrolled by two: registers cannot be indexed). Many rows:
 * the 4 weight vectors are scaled once instead. */
#define SCALED_PRODUCT(decode, nr, x, K, acc, g, scale, parity)                                                 \
    do {                                                                                                       \
        __m256 w_[4], s_ = _mm256_set1_ps(scale);                                                              \
        decode;                                                                                                \
        if (nr <= 2) {                                                                                         \
            for (int r = 0; r < nr; r++)                                                                       \
                acc[r * 4 + parity] = _mm256_fmadd_ps(group_dot(w_, x + (size_t)r * K + 32 * (g)), s_,         \
                                                      acc[r * 4 + parity]);                                    \
        } else {                                                                                               \
            for (int i = 0; i < 4; i++) w_[i] = _mm256_mul_ps(w_[i], s_);                                      \
            fma_group(w_, x + 32 * (g), K, nr, acc);                                                           \
        }                                                                                                      \
    } while (0)

AVX2 INLINE void store_rows(__m256 *acc, int nr, float *y, int ldy) {
    const int A = ACCS(nr);
    for (int r = 0; r < nr; r++) {
        __m256 a = acc[r * A];
        for (int j = 1; j < A; j++) a = _mm256_add_ps(a, acc[r * A + j]);
        y[(size_t)r * ldy] = hsum(a);
    }
}

/* ---- FP4 ---------------------------------------------------------------------------------------------------- */

/* The 32 weights of a group in lane order: the 16 even elements (low nibbles) and the 16 odd ones (high nibbles)
 * side by side, vector i lanes 0-3 holding even elements 4i .. 4i + 3 (elements 8i, 8i + 2, ..) and lanes 4-7 the
 * odd ones (8i + 1, 8i + 3, ..); x is laid out to match once per call, so no weight is shuffled across lanes. An
 * E2M1 value's fp32 has its bits in the top two bytes only: two VPSHUFB tables give them, and two rounds of
 * unpacking with zeros put them in place (shuffles, leaving the FMA ports to the products). */
AVX2 INLINE void fp4_group(const uint8_t *bytes, __m256 w[4]) {
    const __m256i top = _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF,
                                         (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0,
                                         0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF,
                                         (char)0xBF, (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0);
    const __m256i next = _mm256_setr_epi8(0x00, 0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0, 0x00,
                                          0x00, (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0, 0x00, 0x00,
                                          (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0, 0x00, 0x00,
                                          (char)0x80, (char)0xC0, 0x00, 0x40, (char)0x80, (char)0xC0);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                           _mm256_set1_epi8(0x0F)); /* lane 0: even elements, lane 1: odd ones */
    const __m256i hi = _mm256_shuffle_epi8(top, codes), lo = _mm256_shuffle_epi8(next, codes);
    const __m256i first = _mm256_unpacklo_epi8(lo, hi), second = _mm256_unpackhi_epi8(lo, hi); /* 16-bit halves */
    w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, first));
    w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, first));
    w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, second));
    w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, second));
}

/* One output row against nr (<= CHUNK) rows of x in lane order. */
AVX2 INLINE void fp4_row(const uint8_t *wrow, const uint8_t *srow, const float *x, int K, int nr, float *y,
                         int ldy) {
    __m256 acc[CHUNK];
    for (int j = 0; j < CHUNK; j++) acc[j] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 2 <= K / 32; g += 2) {
        PREFETCH(wrow + 16 * g + PREFETCH_BYTES);
        SCALED_PRODUCT(fp4_group(wrow + 16 * g, w_), nr, x, K, acc, g, UE8M0[srow[g]], 0);
        SCALED_PRODUCT(fp4_group(wrow + 16 * (g + 1), w_), nr, x, K, acc, g + 1, UE8M0[srow[g + 1]], 1);
    }
    if (g < K / 32) SCALED_PRODUCT(fp4_group(wrow + 16 * g, w_), nr, x, K, acc, g, UE8M0[srow[g]], 0);
    store_rows(acc, nr, y, ldy);
}

AVX2 void avx2_fp4_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                          int threads) {
    EACH_OUTPUT_ROW(N, R, fp4_row(w + (size_t)o * (K / 2), scale + (size_t)o * (K / 32), x + (size_t)r0 * K, K, nr,
                                  y + (size_t)r0 * N + o, N))
}

/* ---- FP4 with QDQ'd activations, in integers ------------------------------------------------------------------
 * Twice an E2M1 value is an integer (0, +-1, .., +-12) and a QDQ'd activation times 512 over its group's scale one
 * below 2^18 in magnitude (activations.c fp4_int_planes: three signed 6-bit planes). Two groups at a time, as 32
 * weight bytes split into even and odd elements: VPMADDUBSW multiplies 32 weights (offset by 12 to be unsigned) by
 * 32 of a plane and adds pairs (below 2^12), the even and odd halves add up in 16 bits (below 2^13: no
 * saturation), VPMADDWD weighs the planes by 1, 64 and 4096 and adds pairs again, and the offset's share (computed
 * with the planes) is taken off. Each lane then holds the exact sum of 8 products of one group; below 2^24 (always
 * but where most of the 8 are near the largest of both formats, one sign) fp32 holds it exactly, above it the
 * conversion rounds once, as an fp32 addition would. A group's value is that times the activation's scale (exact)
 * and then the weight's (the one rounding the float products make too); the lanes add up in fp32. One activation
 * row only: with fewer shuffles than the float decoder it is faster there, but it multiplies each row three times
 * where the floats do once (docs/benchmarks.md). */

/* The integer products go through a group faster than the float ones: they ask further ahead (2 KiB: on a 2-core
 * Xeon the streamed one-row w1/w3 product took 0.35-0.37 ms with it, 0.44-0.45 with 1 KiB, 0.36 with 4 KiB;
 * benchmarks/native_stream.c, docs/benchmarks.md). */
#ifndef INT_PREFETCH_BYTES /* benchmarks/native_stream.c builds other distances */
#define INT_PREFETCH_BYTES 2048
#endif

/* Two groups' weights as VPMADDUBSW's unsigned operand, from their 32 bytes (`odd`: the high nibbles): twice the
 * E2M1 value plus 12 (0 .. 24), so that the signed activations need no sign instructions; the 12 times the
 * activations' sum that this adds is taken off each lane (fp4_int_planes computes it once per call). */
AVX2 INLINE __m256i fp4_int_weights(__m256i bytes, int odd) {
    const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15,
                                           16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i codes = _mm256_and_si256(odd ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(table, codes);
}

/* The 16-bit sums of one plane's products (each below 2^12 in magnitude): even elements and odd ones. */
AVX2 INLINE __m256i fp4_int_plane(__m256i even, __m256i odd, const uint8_t *plane) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_loadu_si256((const __m256i *)plane)),
                            _mm256_maddubs_epi16(odd, _mm256_loadu_si256((const __m256i *)(plane + 32))));
}

/* acc + one pair of groups (32 weight bytes, 224 plane bytes, the pair's 8 activation scales) times the weights'
 * scales `ws` (the first group's in lanes 0-3, the second's in 4-7). */
AVX2 INLINE __m256 fp4_int_pair(__m256i bytes, const uint8_t *pair, const float *xs, __m256 ws, __m256 acc) {
    const __m256i even = fp4_int_weights(bytes, 0), odd = fp4_int_weights(bytes, 1);
    __m256i t = _mm256_sub_epi32(_mm256_madd_epi16(fp4_int_plane(even, odd, pair), _mm256_set1_epi16(1)),
                                 _mm256_loadu_si256((const __m256i *)(pair + 192)));
    t = _mm256_add_epi32(t, _mm256_madd_epi16(fp4_int_plane(even, odd, pair + 64), _mm256_set1_epi16(64)));
    t = _mm256_add_epi32(t, _mm256_madd_epi16(fp4_int_plane(even, odd, pair + 128), _mm256_set1_epi16(4096)));
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_loadu_ps(xs)), ws, acc);
}

AVX2 INLINE __m256 pair_scales(float first, float second) {
    return _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(first));
}

/* One output row against one row of planes: two chains of pairs; an odd last group pairs with zero weights. */
AVX2 INLINE float fp4_int_row(const uint8_t *wrow, const uint8_t *srow, const uint8_t *planes, int K) {
    const int G = K / 32, P = (G + 1) / 2;
    const float *xs = (const float *)(planes + (size_t)P * 224);
    __m256 chain[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int p = 0;
    for (; 2 * p + 2 <= G; p++) {
        if (p % 2 == 0) PREFETCH(wrow + 32 * p + INT_PREFETCH_BYTES);
        chain[p % 2] = fp4_int_pair(_mm256_loadu_si256((const __m256i *)(wrow + 32 * p)), planes + (size_t)p * 224,
                                    xs + 8 * p, pair_scales(UE8M0[srow[2 * p]], UE8M0[srow[2 * p + 1]]),
                                    chain[p % 2]);
    }
    if (p < P) /* G odd */
        chain[0] = fp4_int_pair(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(wrow + 32 * p))),
                                planes + (size_t)p * 224, xs + 8 * p, pair_scales(UE8M0[srow[2 * p]], 0.0f),
                                chain[0]);
    return hsum(_mm256_add_ps(chain[0], chain[1]));
}

AVX2 void avx2_fp4_int_gemv(const uint8_t *x, const uint8_t *w, const uint8_t *scale, float *y, int N, int K,
                            int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < N; o++) y[o] = fp4_int_row(w + (size_t)o * (K / 2), scale + (size_t)o * (K / 32), x, K);
}

AVX2 float avx2_fp4_int_dot(const uint8_t *wrow, const uint8_t *srow, const void *x, int K) {
    return fp4_int_row(wrow, srow, (const uint8_t *)x, K);
}

/* ---- FP8 ---------------------------------------------------------------------------------------------------- */

/* 16 E4M3 bytes -> 16 floats (value = fp16(magnitude << 7 | sign << 15) * 256). */
AVX2 INLINE void fp8_16(const uint8_t *bytes, __m256 *a, __m256 *b) {
    /* sign-extended and shifted by 7, bit 15 is the sign and bits 13..7 the magnitude; bit 14 (the sign again)
     * is cleared */
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)bytes));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBFFF));
    *a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

AVX2 INLINE void fp8_row(const uint8_t *wrow, const uint8_t *srow, const float *x, int K, int nr, float *y,
                         int ldy) {
    __m256 acc[CHUNK];
    for (int j = 0; j < CHUNK; j++) acc[j] = _mm256_setzero_ps();
#define FP8_GROUP(g) fp8_16(wrow + 32 * (g), &w_[0], &w_[1]), fp8_16(wrow + 32 * (g) + 16, &w_[2], &w_[3])
    int g = 0;
    for (; g + 2 <= K / 32; g += 2) {
        PREFETCH(wrow + 32 * g + 2 * PREFETCH_BYTES);
        SCALED_PRODUCT(FP8_GROUP(g), nr, x, K, acc, g, UE8M0[srow[g]], 0);
        SCALED_PRODUCT(FP8_GROUP(g + 1), nr, x, K, acc, g + 1, UE8M0[srow[g + 1]], 1);
    }
    if (g < K / 32) SCALED_PRODUCT(FP8_GROUP(g), nr, x, K, acc, g, UE8M0[srow[g]], 0);
#undef FP8_GROUP
    store_rows(acc, nr, y, ldy);
}

AVX2 void avx2_fp8_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                          int threads) {
    EACH_OUTPUT_ROW(N, R, fp8_row(w + (size_t)o * K, scale + (size_t)(o / 32) * (K / 32), x + (size_t)r0 * K, K, nr,
                                  y + (size_t)r0 * N + o, N))
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
        PREFETCH(wrow + k + PREFETCH_BYTES);  /* 2 KiB ahead: bf16 elements are 2 bytes */
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

AVX2 void avx2_bf16_gemv(const float *x, const uint16_t *w, float *y, int R, int N, int K, int threads) {
    EACH_OUTPUT_ROW(N, R, bf16_row(w + (size_t)o * K, x + (size_t)r0 * K, K, nr, y + (size_t)r0 * N + o, N))
}

AVX2 float avx2_fp4_dot(const uint8_t *wrow, const uint8_t *srow, const void *x, int K) {
    float y;
    fp4_row(wrow, srow, (const float *)x, K, 1, &y, 1);
    return y;
}
