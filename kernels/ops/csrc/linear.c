/* Native CPU linear layer (fp32) over weights packed once at load, loaded by
 * kvrelay.kernels.cpu_native through ctypes. Same contract as
 * kvrelay.kernels.reference.packed_linear: y[m, n] = sum_k x[m, k] * w[n, k] + bias[n].
 *
 * Why: on an AVX2 AMD EPYC, MKL's sgemm runs the decode-sized products of an engine step (a few
 * to a few dozen rows against every weight) at 50-70 GFLOPS, against ~130 for prefill-sized ones;
 * this kernel runs them at 95-130 (1.4-3.1x MKL's speed at 1-64 rows) and runs 1.06x MKL's speed
 * at 512-2048 rows (benchmarks/linear.py). So the weights are packed once, and no row-major copy
 * is kept.
 *
 * Packed layout: [ceil(N / 16)][K][16], panel j holding output columns 16j .. 16j+15 (zero rows
 * past N), so the inner loop reads one 64-byte line of weights per k, front to back. A tile of up
 * to 6 rows x 16 columns keeps its 12 accumulators in registers (the 6x16 AVX2 micro-kernel:
 * 12 accumulators + 2 weight vectors + 1 broadcast = 15 of 16 registers). K runs in blocks of
 * 128 (8 KiB of a panel, which stays in L1 across the row tiles): each block sums from zero and
 * adds into y, which also keeps the fp32 rounding error at MKL's level (one 512-long running sum
 * had 5x MKL's error). Rows run in blocks of 96 (x's block stays in L2 across the panels); the
 * threads share the (row block, panel) pairs.
 *
 * Built only where AVX2 and FMA exist and AVX-512 does not: on the AVX-512 Intel machine measured,
 * MKL ran these shapes at ~145 GFLOPS, and this 8-lane kernel was not measured there.
 */

#include <stdint.h>

#define PANEL 16 /* output columns per packed panel */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define TILE_ROWS 6
#define K_BLOCK 128
#define ROW_BLOCK 96
#define PARALLEL_MIN_FLOPS (1 << 18) /* below this an OpenMP fork costs more than it saves */

int packed_linear_f32_available(void) { return 1; }

/* y[0:rows, 0:ncols] (+)= x[0:rows, 0:kn] . panel[0:kn] (+ bias): stores when `first`, else adds;
 * bias (ncols entries) only with the last K block. Inlined with rows constant, so acc stays in
 * registers. A full panel's epilogue stays in vectors (a scalar one cost ~8% at 512+ rows); a
 * partial one goes through buf. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panel, int64_t kn,
                                                       float *y, int64_t ldy, int64_t ncols, int first,
                                                       const float *bias, const int rows) {
    __m256 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kn; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * PANEL), w1 = _mm256_loadu_ps(panel + k * PANEL + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    if (ncols == PANEL) {
        for (int r = 0; r < rows; r++) {
            float *yr = y + r * ldy;
            __m256 lo = acc[r][0], hi = acc[r][1];
            if (!first) lo = _mm256_add_ps(lo, _mm256_loadu_ps(yr)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(yr + 8));
            if (bias) lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
            _mm256_storeu_ps(yr, lo);
            _mm256_storeu_ps(yr + 8, hi);
        }
        return;
    }
    float buf[TILE_ROWS * PANEL];
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(buf + r * PANEL, acc[r][0]);
        _mm256_storeu_ps(buf + r * PANEL + 8, acc[r][1]);
    }
    for (int r = 0; r < rows; r++) {
        float *yr = y + r * ldy;
        const float *br = buf + r * PANEL;
        for (int64_t c = 0; c < ncols; c++) {
            float v = first ? br[c] : yr[c] + br[c];
            yr[c] = bias ? v + bias[c] : v;
        }
    }
}

void packed_linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *packed, int64_t N,
                       const float *bias, float *y, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, row_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (2 * M * N * K >= PARALLEL_MIN_FLOPS)
    for (int64_t it = 0; it < row_blocks * panels; it++) {
        const int64_t j = it % panels, m0 = (it / panels) * ROW_BLOCK;
        const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
        const int64_t ncols = N - j * PANEL < PANEL ? N - j * PANEL : PANEL;
        float *yj = y + j * PANEL;
        for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
            const int64_t kn = K - k0 < K_BLOCK ? K - k0 : K_BLOCK;
            const float *pj = packed + (j * K + k0) * PANEL, *xk = x + k0;
            const int first = k0 == 0;
            const float *bj = bias && k0 + kn == K ? bias + j * PANEL : NULL;
            int64_t m = m0;
            for (; m + TILE_ROWS <= m1; m += TILE_ROWS)
                tile(xk + m * ldx, ldx, pj, kn, yj + m * N, N, ncols, first, bj, TILE_ROWS);
            switch (m1 - m) {
                case 5: tile(xk + m * ldx, ldx, pj, kn, yj + m * N, N, ncols, first, bj, 5); break;
                case 4: tile(xk + m * ldx, ldx, pj, kn, yj + m * N, N, ncols, first, bj, 4); break;
                case 3: tile(xk + m * ldx, ldx, pj, kn, yj + m * N, N, ncols, first, bj, 3); break;
                case 2: tile(xk + m * ldx, ldx, pj, kn, yj + m * N, N, ncols, first, bj, 2); break;
                case 1: tile(xk + m * ldx, ldx, pj, kn, yj + m * N, N, ncols, first, bj, 1); break;
            }
        }
    }
}

#else

int packed_linear_f32_available(void) { return 0; }

void packed_linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *packed, int64_t N,
                       const float *bias, float *y, int num_threads) {
    (void)x, (void)M, (void)K, (void)ldx, (void)packed, (void)N, (void)bias, (void)y, (void)num_threads;
}

#endif
