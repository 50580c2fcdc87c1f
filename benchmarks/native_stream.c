/* The native products timed from C, on weights streamed from memory: many copies of one shape (1.2 GB in all, or
 * COPIES of them), each read once per pass, the best of `passes` (no Python in the process; see
 * docs/benchmarks.md for why that matters here). Build against a checkout's kernel sources and run:
 *
 *   cc -O3 -fopenmp -std=c11 -o /tmp/native_stream benchmarks/native_stream.c src/openflash/kernels/activations.c \
 *      src/openflash/kernels/avx2.c src/openflash/kernels/avx512.c src/openflash/kernels/gemv.c -lm
 *   /tmp/native_stream fp4 2304 5120 1 2 5 [isa]     # format N K rows threads passes; isa 5: AVX2 integer FP4
 *
 * COPIES=1 keeps one weight (in the cache); COPIES=1 with N=8 times little but the activation preparation.
 * -DINT_PREFETCH_BYTES=N builds avx2.c's integer FP4 products with another prefetch distance. */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int of_fp4_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K, int act_qdq,
                int isa, int threads);
int of_fp8_gemv(const float *x, const uint8_t *w, const uint8_t *scale, float *y, int R, int N, int K, int act_qdq,
                int isa, int threads);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s fp4|fp8 N K rows threads passes [isa]\n", argv[0]);
        return 2;
    }
    const int fp8 = !strcmp(argv[1], "fp8"), N = atoi(argv[2]), K = atoi(argv[3]), R = atoi(argv[4]);
    const int threads = atoi(argv[5]), passes = atoi(argv[6]), isa = argc > 7 ? atoi(argv[7]) : 5;
    const size_t wb = fp8 ? (size_t)N * K : (size_t)N * K / 2;
    const size_t sb = fp8 ? (size_t)((N + 31) / 32) * (K / 32) : (size_t)N * K / 32;
    const int copies = getenv("COPIES") ? atoi(getenv("COPIES")) : (int)((1200L << 20) / (wb + sb));
    uint8_t **w = malloc(copies * sizeof *w), **s = malloc(copies * sizeof *s);
    srand(1);
    for (int c = 0; c < copies; c++) {
        w[c] = malloc(wb), s[c] = malloc(sb);
        for (size_t i = 0; i < wb; i++) w[c][i] = fp8 && (rand() & 0x7F) == 0x7F ? 0 : (uint8_t)rand(); /* no NaN */
        for (size_t i = 0; i < sb; i++) s[c][i] = (uint8_t)(120 + rand() % 10);
    }
    float *x = malloc((size_t)R * K * sizeof *x), *y = malloc((size_t)R * N * sizeof *y);
    for (int i = 0; i < R * K; i++) x[i] = (float)((rand() % 2001) - 1000) / 300.0f;
    double best = 1e9;
    for (int p = 0; p < passes; p++) {
        const double t0 = now();
        for (int c = 0; c < copies; c++)
            if ((fp8 ? of_fp8_gemv : of_fp4_gemv)(x, w[c], s[c], y, R, N, K, 1, isa, threads)) return 1;
        const double t = (now() - t0) / copies;
        best = t < best ? t : best;
    }
    printf("%s %dx%d rows %d, %d copies, %d threads: %.4f ms, %.2f GB/s\n", argv[1], N, K, R, copies, threads,
           best * 1e3, (wb + sb) / best / 1e9);
    return 0;
}
