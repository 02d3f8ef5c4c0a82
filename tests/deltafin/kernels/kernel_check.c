// The CPU kernels of deltafin/kernels/cpu.c against a float64 reference, as a program: built for this CPU or
// cross-built for another (aarch64 NEON, run under qemu-aarch64) by tests/deltafin/kernels/test_cpu.py.
//   cc -O2 [ISA flags] -I deltafin/kernels tests/deltafin/kernels/kernel_check.c -lm && ./a.out
// Prints the ISA and the worst relative L2 error of each format; exits 0 when every one is below 1e-5
// (fp32 sums of up to 3584 exact products: about sqrt(3584) * 2^-24 = 3.6e-6 when summed in a plain loop).

#include <stdio.h>
#include <stdlib.h>

#include "cpu.c"

static uint64_t lcg_state = 88172645463325252ull;
static uint32_t next_u32(void) {
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(lcg_state >> 33);
}
static float next_f(void) { return (float)(next_u32() % 2000001) / 1000000.0f - 1.0f; }

static const double kE2M1[16] = {0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6};

static double rel_err(const float *got, const double *want, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; ++i) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double check(int64_t rows, int64_t cols, int64_t ntok, int format) {
    float *x = malloc(sizeof(float) * ntok * cols), *y = malloc(sizeof(float) * ntok * rows);
    double *want = calloc(ntok * rows, sizeof(double));
    uint8_t *packed = malloc(rows * cols / 2), *scales = malloc(rows * cols / 32);
    uint16_t *bf = malloc(sizeof(uint16_t) * rows * cols);
    int8_t *q = malloc(rows * cols);
    float *qs = malloc(sizeof(float) * rows);
    for (int64_t i = 0; i < ntok * cols; ++i) x[i] = next_f();
    for (int64_t i = 0; i < rows * cols / 2; ++i) packed[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < rows * cols / 32; ++i) scales[i] = (uint8_t)(118 + next_u32() % 12);
    for (int64_t i = 0; i < rows * cols; ++i) bf[i] = (uint16_t)(next_u32() & 0xBFFF);  // finite, |w| < 2
    for (int64_t i = 0; i < rows * cols; ++i) q[i] = (int8_t)((int)(next_u32() % 255) - 127);
    for (int64_t r = 0; r < rows; ++r) qs[r] = 0.001f + 0.01f * (float)(next_u32() % 1000) / 1000.0f;
    for (int64_t t = 0; t < ntok; ++t)
        for (int64_t r = 0; r < rows; ++r) {
            double acc = 0;
            for (int64_t c = 0; c < cols; ++c) {
                double w;
                if (format == 0) {
                    uint8_t b = packed[r * cols / 2 + c / 2];
                    w = kE2M1[c % 2 ? b >> 4 : b & 15] * ldexp(1.0, scales[r * cols / 32 + c / 32] - 127);
                } else if (format == 1) {
                    w = bf16_to_f32(bf[r * cols + c]);
                } else {
                    w = (double)q[r * cols + c] * qs[r];
                }
                acc += w * x[t * cols + c];
            }
            want[t * rows + r] = acc;
        }
    if (format == 0) deltafin_mxfp4_matmul(packed, scales, x, y, rows, cols, ntok, 0, rows);
    if (format == 1) deltafin_bf16_matmul(bf, x, y, rows, cols, ntok, 0, rows);
    if (format == 2) deltafin_int8_matmul(q, qs, x, y, rows, cols, ntok, 0, rows);
    double err = rel_err(y, want, ntok * rows);
    free(x); free(y); free(want); free(packed); free(scales); free(bf); free(q); free(qs);
    return err;
}

int main(void) {
    static const int64_t shapes[][3] = {{96, 256, 1}, {64, 512, 3}, {40, 160, 5}, {13, 96, 4}, {300, 3584, 1}};
    static const char *names[3] = {"mxfp4", "bf16", "int8"};
    double worst[3] = {0, 0, 0};
    for (int f = 0; f < 3; ++f)
        for (unsigned i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
            double e = check(shapes[i][0], shapes[i][1], shapes[i][2], f);
            if (e > worst[f]) worst[f] = e;
        }
    printf("isa %d", deltafin_isa());
    for (int f = 0; f < 3; ++f) printf(" %s %.3g", names[f], worst[f]);
    printf("\n");
    return worst[0] < 1e-5 && worst[1] < 1e-5 && worst[2] < 1e-5 ? 0 : 1;
}
