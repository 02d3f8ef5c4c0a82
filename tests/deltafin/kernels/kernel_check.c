// The CPU kernels of deltafin/kernels/cpu.c against a float64 reference, as a program: built for this CPU or
// cross-built for another (aarch64 NEON, run under qemu-aarch64) by tests/deltafin/kernels/test_cpu.py.
//   cc -O2 [ISA flags] -I deltafin/kernels tests/deltafin/kernels/kernel_check.c -lm && ./a.out
// Prints the ISA and the worst relative L2 error of each format (MXFP4, bf16, row-int8, q4, q3); exits 0 when every
// one is below 1e-5 (fp32 sums of up to 4160 exact products: about sqrt(4160) * 2^-24 = 3.8e-6 when summed in a
// plain loop), q4's decode for BLAS included.

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

// An IEEE half as a double, written independently of cpu.c's f16_to_f32 (finite values only).
static double half_to_double(uint16_t h) {
    const int exp = (h >> 10) & 31, man = h & 1023;
    const double mag = exp ? ldexp(1024 + man, exp - 25) : ldexp(man, -24);
    return h & 0x8000 ? -mag : mag;
}
static uint16_t random_half(int exp_lo, int exp_hi) {  // random sign and mantissa, exponent field in [lo, hi]
    return (uint16_t)((next_u32() & 0x8000) | (uint16_t)(exp_lo + next_u32() % (exp_hi - exp_lo + 1)) << 10 |
                      (next_u32() & 1023));
}

// q4 (MLX's affine 4-bit, groups of 64): random codes, scales from fp16 subnormals to 0.5 (either sign), biases
// of either sign, through deltafin_q4_prepare + deltafin_q4_matmul, against W = code * scale + bias in double.
static double check_q4(int64_t rows, int64_t cols, int64_t ntok) {
    const int64_t G = cols / 64;
    float *x = malloc(sizeof(float) * ntok * cols), *y = malloc(sizeof(float) * ntok * rows);
    float *xp = malloc(sizeof(float) * ntok * cols), *xsum = malloc(sizeof(float) * ntok * G);
    double *want = calloc(ntok * rows, sizeof(double));
    uint8_t *packed = malloc(rows * cols / 2);
    uint16_t *scales = malloc(sizeof(uint16_t) * rows * G), *biases = malloc(sizeof(uint16_t) * rows * G);
    for (int64_t i = 0; i < ntok * cols; ++i) x[i] = next_f();
    for (int64_t i = 0; i < rows * cols / 2; ++i) packed[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < rows * G; ++i) scales[i] = random_half(0, 14), biases[i] = random_half(8, 15);
    for (int64_t t = 0; t < ntok; ++t)
        for (int64_t r = 0; r < rows; ++r) {
            double acc = 0;
            for (int64_t c = 0; c < cols; ++c) {
                const uint8_t b = packed[r * cols / 2 + c / 2];
                const int code = c % 2 ? b >> 4 : b & 15;  // the lower nibble is the even element
                acc += (code * half_to_double(scales[r * G + c / 64]) + half_to_double(biases[r * G + c / 64])) *
                       x[t * cols + c];
            }
            want[t * rows + r] = acc;
        }
    deltafin_q4_prepare(x, xp, xsum, cols, ntok);
    deltafin_q4_matmul(packed, scales, biases, xp, xsum, y, rows, cols, ntok, 0, rows);
    double err = rel_err(y, want, ntok * rows);
    // The BLAS path's decode (in the prepared x's column order, scaled inversely to it): dense times xp, summed
    // in double, is W times x up to the rounding of each decoded value.
    float *dense = malloc(sizeof(float) * rows * cols), *y2 = malloc(sizeof(float) * ntok * rows);
    deltafin_q4_decode(packed, scales, biases, dense, rows, cols, 0, rows);
    for (int64_t t = 0; t < ntok; ++t)
        for (int64_t r = 0; r < rows; ++r) {
            double acc = 0;
            for (int64_t c = 0; c < cols; ++c) acc += (double)dense[r * cols + c] * xp[t * cols + c];
            y2[t * rows + r] = (float)acc;
        }
    const double err2 = rel_err(y2, want, ntok * rows);
    if (err2 > err) err = err2;
    free(y2);
    free(x); free(y); free(xp); free(xsum); free(want); free(packed); free(scales); free(biases); free(dense);
    return err;
}

// q3 (MLX's affine 3-bit: 8 codes in 3 bytes, little-endian; groups of 32, 64 or 128): random bytes, scales and
// biases as q4's, through deltafin_q3_matmul, against W = code * scale + bias in double, a code read bit by bit.
static double check_q3(int64_t rows, int64_t cols, int64_t group, int64_t ntok) {
    const int64_t G = cols / group, row_bytes = cols / 8 * 3;
    float *x = malloc(sizeof(float) * ntok * cols), *y = malloc(sizeof(float) * ntok * rows);
    float *xsum = calloc(ntok * G, sizeof(float));
    double *want = calloc(ntok * rows, sizeof(double));
    uint8_t *packed = malloc(rows * row_bytes);
    uint16_t *scales = malloc(sizeof(uint16_t) * rows * G), *biases = malloc(sizeof(uint16_t) * rows * G);
    for (int64_t i = 0; i < ntok * cols; ++i) x[i] = next_f();
    for (int64_t i = 0; i < rows * row_bytes; ++i) packed[i] = (uint8_t)next_u32();
    for (int64_t i = 0; i < rows * G; ++i) scales[i] = random_half(0, 14), biases[i] = random_half(8, 15);
    for (int64_t t = 0; t < ntok; ++t)
        for (int64_t c = 0; c < cols; ++c) xsum[t * G + c / group] += x[t * cols + c];
    for (int64_t t = 0; t < ntok; ++t)
        for (int64_t r = 0; r < rows; ++r) {
            double acc = 0;
            for (int64_t c = 0; c < cols; ++c) {
                int code = 0;
                for (int k = 0; k < 3; ++k) {
                    const int64_t bit = 3 * c + k;
                    code |= ((packed[r * row_bytes + bit / 8] >> (bit % 8)) & 1) << k;
                }
                acc += (code * half_to_double(scales[r * G + c / group]) + half_to_double(biases[r * G + c / group]))
                       * x[t * cols + c];
            }
            want[t * rows + r] = acc;
        }
    deltafin_q3_matmul(packed, scales, biases, x, xsum, y, rows, cols, group, ntok, 0, rows);
    const double err = rel_err(y, want, ntok * rows);
    free(x); free(y); free(xsum); free(want); free(packed); free(scales); free(biases);
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
    // q4: rows off the 8-row decode block, 1 to 3 and 65 groups (a 64-group chunk and its tail), 1..5 tokens
    static const int64_t q4_shapes[][3] = {{96, 256, 1}, {13, 192, 1}, {21, 4160, 1}, {40, 128, 5}, {7, 64, 3}};
    double worst_q4 = 0;
    for (unsigned i = 0; i < sizeof(q4_shapes) / sizeof(q4_shapes[0]); ++i) {
        double e = check_q4(q4_shapes[i][0], q4_shapes[i][1], q4_shapes[i][2]);
        if (e > worst_q4) worst_q4 = e;
    }
    // q3: each group size, rows of 1 to 28 groups, 1 to 5 tokens (K3's rows: 3584 = 28 x 128)
    static const int64_t q3_shapes[][4] = {{96, 256, 128, 1}, {13, 96, 32, 4}, {21, 3584, 128, 1}, {40, 192, 64, 5}};
    double worst_q3 = 0;
    for (unsigned i = 0; i < sizeof(q3_shapes) / sizeof(q3_shapes[0]); ++i) {
        double e = check_q3(q3_shapes[i][0], q3_shapes[i][1], q3_shapes[i][2], q3_shapes[i][3]);
        if (e > worst_q3) worst_q3 = e;
    }
    printf("isa %d", deltafin_isa());
    for (int f = 0; f < 3; ++f) printf(" %s %.3g", names[f], worst[f]);
    printf(" q4 %.3g q3 %.3g\n", worst_q4, worst_q3);
    return worst[0] < 1e-5 && worst[1] < 1e-5 && worst[2] < 1e-5 && worst_q4 < 1e-5 && worst_q3 < 1e-5 ? 0 : 1;
}
