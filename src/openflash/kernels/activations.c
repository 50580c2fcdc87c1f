/* Activations before a product: the reference's FP8 QDQ (formats.act_quant_qdq), and the layouts the products
 * read them in (one pass per call, over K values a row, where the products read N * K weights). */
#include <math.h>
#include <string.h>

#include "kernels.h"

float UE8M0[256];

__attribute__((constructor)) static void fill_ue8m0(void) {
    for (int b = 0; b < 256; b++) {
        uint32_t bits = b ? (uint32_t)b << 23 : 0x00400000u; /* b = 0: 2^-127, an fp32 subnormal */
        memcpy(&UE8M0[b], &bits, 4);
        if (b == 255) UE8M0[b] = NAN;
    }
}

static float pow2_ceil(float t) { /* 2^ceil(log2 t), exact powers of two unchanged (formats.pow2_ceil_scale) */
    uint32_t bits;
    memcpy(&bits, &t, 4);
    uint32_t biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
    if (biased == 0) return UE8M0[0];
    uint32_t out = biased << 23;
    float f;
    memcpy(&f, &out, 4);
    return f;
}

AVX2 INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* The nearest E4M3 value of q (|q| <= 448 already, ties to even; formats.e4m3_round): 3 mantissa bits kept by
 * integer rounding at bit 20 for normals, steps of 2^-9 below 2^-6 (the subnormals). NaN stays NaN. */
AVX2 INLINE __m256 e4m3_round8(__m256 q) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 a = _mm256_and_ps(q, magnitude), sign = _mm256_andnot_ps(magnitude, q);
    __m256i bits = _mm256_castps_si256(a);
    __m256i even = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), even));
    __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xFFF00000u)));
    __m256 sub = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                               _mm256_set1_ps(1.0f / 512.0f));
    __m256 r = _mm256_blendv_ps(normal, sub, _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ));
    return _mm256_or_ps(r, sign);
}

/* Per 32 channels: s = pow2ceil(max(amax, 1e-4) * fp32(1/448)), x -> e4m3(clamp(x / s, +-448)) * s. x / s is
 * x * (1 / s), both exact scalings by a power of two. min/max take q second so that NaN passes through. Returns s
 * and the E4M3 values (before the times s) in q. */
AVX2 INLINE float qdq_group(const float *x, __m256 q[4]) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(m, _mm256_and_ps(q[i], magnitude));
    }
    float s = pow2_ceil(fmaxf(hmax(m), 1e-4f) * (float)(1.0 / 448.0));
    __m256 inv = _mm256_set1_ps(1.0f / s);
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_min_ps(_mm256_set1_ps(448.0f), _mm256_max_ps(_mm256_set1_ps(-448.0f),
                                                                        _mm256_mul_ps(q[i], inv)));
        q[i] = e4m3_round8(v);
    }
    return s;
}

AVX2 void qdq_activations(const float *x, float *out, int rows, int K) {
    for (long g = 0; g < (long)rows * K; g += 32) {
        __m256 q[4];
        const __m256 scale = _mm256_set1_ps(qdq_group(x + g, q));
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + g + 8 * i, _mm256_mul_ps(q[i], scale));
    }
}

/* avx2.c's integer FP4 products read a QDQ'd row by pairs of 32-groups, as the decoder splits 32 weight bytes (two
 * groups) into their low nibbles (even elements) and high ones (odd elements). A value is E4M3 value * 512 (an
 * integer below 2^18 in magnitude), in three signed 6-bit planes (VPMADDUBSW's signed operand). Per pair, 224
 * bytes: for each plane, the even elements of both groups, then the odd ones (32 bytes each: 16 of the first group,
 * 16 of the second); then 8 int32, 12 times the sum of elements 8j .. 8j + 7 of the first group (j < 4) or of the
 * second (the weights' offset of 12 adds it to product lane j). After the pairs, 8 floats a pair: each group's
 * scale / 1024 (for the 512 and the weights' factor of 2) four times, as the lanes hold them. x is QDQ'd here
 * (again: QDQ'd values are their own QDQ). A group with a value that is not finite gets a NaN scale and zero
 * planes, so that its products are NaN as the float ones would be; an odd row's last pair is padded with zeros. */
static int int_pairs(int K) { return (K / 32 + 1) / 2; }
size_t int_planes_bytes(int K) { return (size_t)int_pairs(K) * (224 + 8 * sizeof(float)); }

/* Four int32 vectors (elements 0-7, .., 24-31, each below 2^7 in magnitude) -> bytes: the 16 even elements in the
 * low half, the 16 odd ones in the high half. */
AVX2 INLINE __m256i even_odd_bytes(const __m256i v[4]) {
    /* the packs interleave 128-bit lanes: dwords hold elements 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31 */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    b = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8,
                                                10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return _mm256_permute4x64_epi64(b, _MM_SHUFFLE(3, 1, 2, 0));
}

/* [sum of v[0], .., sum of v[3]] */
AVX2 INLINE __m128i lane_sums(const __m256i v[4]) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

AVX2 void fp4_int_planes(const float *x, uint8_t *out, int rows, int K) {
    const int G = K / 32, P = int_pairs(K);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int r = 0; r < rows; r++) {
        uint8_t *pairs = out + (size_t)r * int_planes_bytes(K);
        float *scales = (float *)(pairs + (size_t)P * 224);
        if (G % 2) memset(pairs + (size_t)(P - 1) * 224, 0, 224), memset(scales + 8 * (P - 1), 0, 32);
        for (int g = 0; g < G; g++) {
            __m256 q[4];
            const float s = qdq_group(x + (size_t)r * K + 32 * g, q);
            __m256i n[4], sign[4], plane[4];
            __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            for (int i = 0; i < 4; i++) {
                const __m256 a = _mm256_mul_ps(_mm256_and_ps(q[i], magnitude), _mm256_set1_ps(512.0f));
                finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, _mm256_set1_ps(448.0f * 512.0f), _CMP_LE_OQ));
                n[i] = _mm256_cvttps_epi32(a); /* |value| * 512 */
                sign[i] = _mm256_castps_si256(q[i]); /* VPSIGND reads the float's sign bit as the int's */
            }
            const int ok = _mm256_movemask_ps(finite) == 0xFF;
            if (!ok)
                for (int i = 0; i < 4; i++) n[i] = _mm256_setzero_si256();
            uint8_t *pair = pairs + (size_t)(g / 2) * 224;
            for (int slot = 0; slot < 3; slot++) {
                for (int i = 0; i < 4; i++) /* bits 6 slot .. 6 slot + 5 of the magnitude, signed */
                    plane[i] = _mm256_sign_epi32(_mm256_and_si256(_mm256_srli_epi32(n[i], 6 * slot),
                                                                  _mm256_set1_epi32(63)), sign[i]);
                const __m256i bytes = even_odd_bytes(plane);
                _mm_storeu_si128((__m128i *)(pair + 64 * slot + 16 * (g % 2)), _mm256_castsi256_si128(bytes));
                _mm_storeu_si128((__m128i *)(pair + 64 * slot + 32 + 16 * (g % 2)), _mm256_extracti128_si256(bytes, 1));
            }
            for (int i = 0; i < 4; i++) n[i] = _mm256_sign_epi32(n[i], sign[i]);
            _mm_storeu_si128((__m128i *)(pair + 192 + 16 * (g % 2)), _mm_mullo_epi32(lane_sums(n), _mm_set1_epi32(12)));
            for (int i = 0; i < 4; i++) scales[8 * (g / 2) + 4 * (g % 2) + i] = ok ? s * (1.0f / 1024.0f) : NAN;
        }
    }
}

/* avx2.c's FP4 decoder yields a 32-group's weights in 4 vectors of 8: vector i lanes 0-3 hold even elements
 * 8i, 8i + 2, 8i + 4, 8i + 6, lanes 4-7 the odd ones 8i + 1, .., 8i + 7. */
static int fp4_lane_element(int lane) { return 8 * (lane / 8) + 2 * (lane % 4) + (lane % 8) / 4; }

void fp4_lane_order(const float *x, float *out, int rows, int K) {
    float group[32];
    for (long g = 0; g < (long)rows * K; g += 32) {
        memcpy(group, x + g, sizeof group);
        for (int lane = 0; lane < 32; lane++) out[g + lane] = group[fp4_lane_element(lane)];
    }
}

static uint16_t bf16_bits(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (uint16_t)(bits >> 16);
}

AVX2 void to_bf16(const float *x, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = bf16_bits(x[i]);
}

/* avx512.c's FP4 decoder reads two 32-groups (32 bytes) at once as 32 words, byte i in word i, and looks up the
 * low nibbles (elements 0, 2, .., 62 of the 64) and the high ones (1, 3, .., 63) apart: each 64 channels become
 * their 32 even elements, then their 32 odd ones, as bf16; a row is padded with zeros to whole 64s. */
size_t bf16_pairs_width(int K) { return ((size_t)K + 63) / 64 * 64; }

void fp4_bf16_pairs(const float *x, uint16_t *out, int rows, int K) {
    const size_t width = bf16_pairs_width(K);
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * K;
        uint16_t *o = out + (size_t)r * width;
        for (int base = 0; base < K; base += 64, o += 64)
            for (int i = 0; i < 32; i++) {
                int even = base + 2 * i; /* K is a multiple of 32: an element and its odd neighbour exist together */
                o[i] = even < K ? bf16_bits(xr[even]) : 0;
                o[32 + i] = even < K ? bf16_bits(xr[even + 1]) : 0;
            }
    }
}
