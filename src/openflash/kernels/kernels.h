/* What the kernel files share: the instruction sets they are compiled for, the UE8M0 table, the activation
 * preparation (activations.c) and each instruction set's products (avx2.c, avx512.c), called by gemv.c. */
#ifndef OPENFLASH_KERNELS_H
#define OPENFLASH_KERNELS_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* Each function is compiled for its instruction set only (target attributes), and called only where
 * of_cpu_features() found it. */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))
#define INLINE static inline __attribute__((always_inline))

#define MAX_ROWS 16 /* activation rows per call: decode, batched decode, speculative verification */
#define CHUNK 8     /* activation rows accumulated together */

/* Calls `call` with nr a constant 1..CHUNK (the row loops unroll and the accumulators stay in registers). */
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

/* y[r, o] for every output row o (threads split them) and each CHUNK of activation rows r0 .. r0 + nr - 1: `call`
 * computes them (it reads o, r0 and nr; the caller's thread count is named `threads`). */
#define EACH_OUTPUT_ROW(N, R, call)                                                                           \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                          \
    for (int o = 0; o < (N); o++)                                                                              \
        for (int r0 = 0; r0 < (R); r0 += CHUNK) {                                                              \
            int nr = (R) - r0 < CHUNK ? (R) - r0 : CHUNK;                                                      \
            DISPATCH_ROWS(call)                                                                                \
        }

/* of_cpu_features() bits, and the `isa` argument of the entry points: ISA_INTEGER_FP4 lets AVX2 take FP4 products
 * with QDQ'd activations in integers (avx2.c), the default; without it they stay in floats (their oracle). */
enum { ISA_AVX2 = 1, ISA_AVX512_BF16 = 2, ISA_INTEGER_FP4 = 4 };

extern float UE8M0[256]; /* byte -> 2^(byte - 127) (0: 2^-127, subnormal; 255: NaN), read-only once loaded */

/* activations.c */
void qdq_activations(const float *x, float *out, int rows, int K); /* formats.act_quant_qdq; out may be x */
void fp4_lane_order(const float *x, float *out, int rows, int K);  /* avx2.c's FP4 lane order; out may be x */
size_t bf16_pairs_width(int K);                                    /* bf16 per row of the AVX-512 FP4 layout */
void fp4_bf16_pairs(const float *x, uint16_t *out, int rows, int K);
void to_bf16(const float *x, uint16_t *out, size_t n); /* truncation: exact for QDQ'd values */
size_t int_planes_bytes(int K);                                    /* bytes per row of fp4_int_planes */
void fp4_int_planes(const float *x, uint8_t *out, int rows, int K); /* QDQ'd, for avx2.c's integer FP4 */

/* avx2.c: fp32 activations, lane order for FP4, times 256 for FP8; fp4_int_planes for the integer FP4 */
void avx2_fp4_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                   int threads);
float avx2_fp4_dot(const uint8_t *wrow, const uint8_t *srow, const void *x, int K);
void avx2_fp8_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                   int threads);
void avx2_fp4_int_gemv(const uint8_t *x, const uint8_t *w, const uint8_t *scale, float *y, int N, int K,
                       int threads); /* one row */
float avx2_fp4_int_dot(const uint8_t *wrow, const uint8_t *srow, const void *x, int K);
void avx2_bf16_gemv(const float *x, const uint16_t *w, float *y, int R, int N, int K, int threads);

/* avx512.c: QDQ'd activations in bf16 (exact), fp4_bf16_pairs for FP4, natural order for FP8 */
void avx512_fp4_gemv(const uint16_t *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                     int threads);
float avx512_fp4_dot(const uint8_t *wrow, const uint8_t *srow, const void *x, int K);
void avx512_fp8_gemv(const uint16_t *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K,
                     int threads);

#endif
