/* Products on stored weights with AVX-512 (F, BW, VL) and its bf16 dot product VDPBF16PS, where the CPU has them
 * (Zen 4 and later, Cooper Lake, Sapphire Rapids and later) and the activations went through the FP8 QDQ. A QDQ'd
 * activation is an E4M3 value times a power of two, exact in bf16, as every E2M1 and E4M3 weight value is; VDPBF16PS
 * multiplies pairs exactly and sums in fp32, so results equal dequantize-then-fp32-matmul to fp32 summation order.
 * It reads bf16 subnormals as zero: activations below 2^-126 in magnitude, never a weight (each group's block scale
 * is applied in fp32 to the group's sum). Threads split the output rows (OpenMP).
 *
 * FP4: two 32-groups (32 bytes) become 32 words, byte i in word i; VPERMW looks the low nibbles up in a 16-entry bf16
 * table (the sign included), then the high ones: even elements, odd elements (x in activations.c fp4_bf16_pairs).
 * FP8: an E4M3 magnitude m (exponent e >= 1) shifted left by 4, plus 120 << 7, is the bf16 of its value; the eight
 * codes with e = 0 (zero and the subnormals) come from a table, the sign bit is moved to bit 15. x in natural order.
 */
#include "kernels.h"

/* Indexed by 5 bits (VPERMW's), so a byte's low nibble needs no mask: entries 16..31 repeat 0..15. */
static const uint16_t FP4_BF16[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,  /* +0..6 */
                                      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,  /* -0..-6 */
                                      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
/* Weight bytes ahead of the decoder a software prefetch asks for: the hardware's stream prefetcher alone left the
 * long rows (K = 5120, 8192) slower (docs/benchmarks.md). */
#define PREFETCH_BYTES 1024

static const uint16_t E4M3_SUBNORMAL_BF16[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

AVX512 INLINE __m512 dot_pairs(__m512 acc, __m512i w, const uint16_t *x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

/* ---- FP4 ---------------------------------------------------------------------------------------------------- */

/* Groups g and g + 1 (only g where g + 1 == G): even and odd elements' bf16, and the scales of lanes 0..7 and
 * 8..15 (0 past the end, so that a missing group adds nothing). */
AVX512 INLINE void fp4_pair(const uint8_t *wrow, const uint8_t *srow, int g, int G, __m512i table, __m512i *even,
                            __m512i *odd, __m512 *scale) {
    const int both = g + 1 < G;
    __m512i words = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(both ? 0xFFFFFFFFu : 0xFFFFu, wrow + 16 * g));
    *even = _mm512_permutexvar_epi16(words, table);                         /* reads the low 5 bits */
    *odd = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);    /* a byte's high nibble */
    *scale = _mm512_mask_broadcastss_ps(_mm512_set1_ps(UE8M0[srow[g]]), 0xFF00,
                                        _mm_set_ss(both ? UE8M0[srow[g + 1]] : 0.0f));
}

AVX512 INLINE void fp4_row(const uint8_t *wrow, const uint8_t *srow, const uint16_t *x, size_t ldx, int K, int nr,
                           float *y, int ldy) {
    const __m512i table = _mm512_loadu_si512(FP4_BF16);
    const int G = K / 32;
    __m512 acc[CHUNK];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g += 2) {
        __m512i even, odd;
        __m512 s;
        _mm_prefetch((const char *)(wrow + 16 * g + PREFETCH_BYTES), _MM_HINT_T0);
        fp4_pair(wrow, srow, g, G, table, &even, &odd, &s);
        for (int r = 0; r < nr; r++) {
            const uint16_t *xr = x + r * ldx + 32 * g;
            acc[r] = _mm512_fmadd_ps(dot_pairs(dot_pairs(_mm512_setzero_ps(), even, xr), odd, xr + 32), s, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) y[(size_t)r * ldy] = _mm512_reduce_add_ps(acc[r]);
}

AVX512 void avx512_fp4_gemv(const uint16_t *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                            int threads) {
    const size_t ldx = bf16_pairs_width(K);
    EACH_OUTPUT_ROW(N, R, fp4_row(w + (size_t)o * (K / 2), scale + (size_t)o * (K / 32), x + r0 * ldx, ldx, K, nr,
                                  y + (size_t)r0 * N + o, N))
}

AVX512 float avx512_fp4_dot(const uint8_t *wrow, const uint8_t *srow, const void *x, int K) {
    float y;
    fp4_row(wrow, srow, (const uint16_t *)x, 0, K, 1, &y, 1);
    return y;
}

/* ---- FP8 ---------------------------------------------------------------------------------------------------- */

AVX512 INLINE __m512i fp8_group(const uint8_t *bytes, __m512i subnormals) {
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)bytes));
    __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
    v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)), magnitude,
                                      subnormals);
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8), _mm512_set1_epi16((short)0x8000), 0xF8); /* a|b&c */
}

AVX512 INLINE void fp8_row(const uint8_t *wrow, const uint8_t *srow, const uint16_t *x, int K, int nr, float *y,
                           int ldy) {
    const __m512i subnormals = _mm512_loadu_si512(E4M3_SUBNORMAL_BF16);
    __m512 acc[CHUNK];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < K / 32; g++) {
        _mm_prefetch((const char *)(wrow + 32 * g + 2 * PREFETCH_BYTES), _MM_HINT_T0);
        __m512i w = fp8_group(wrow + 32 * g, subnormals);
        __m512 s = _mm512_set1_ps(UE8M0[srow[g]]);
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_fmadd_ps(dot_pairs(_mm512_setzero_ps(), w, x + (size_t)r * K + 32 * g), s, acc[r]);
    }
    for (int r = 0; r < nr; r++) y[(size_t)r * ldy] = _mm512_reduce_add_ps(acc[r]);
}

AVX512 void avx512_fp8_gemv(const uint16_t *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                            int threads) {
    EACH_OUTPUT_ROW(N, R, fp8_row(w + (size_t)o * K, scale + (size_t)(o / 32) * (K / 32), x + (size_t)r0 * K, K, nr,
                                  y + (size_t)r0 * N + o, N))
}
