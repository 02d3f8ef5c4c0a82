// MXFP4 x fp32 matmul for the CPU: y[t, r] = sum_c W[r, c] * x[t, c].
//
// W is stored as compressed-tensors MXFP4: packed[r, c/2] holds two E2M1 codes (low nibble = even
// element), scales[r, c/32] one E8M0 exponent per 32 values. Activations stay fp32 (no int8 rounding of
// x, unlike llama.cpp's Q8_0 path), so results equal a dense fp32 product up to summation order.
//
// Codes are decoded with a 16-entry byte table lookup (AVX2 vpshufb / NEON tbl) to 2*E2M1 as int8, widened
// to fp32 and multiplied into per-group accumulators; each group sum is scaled by 2**(s-127)/2 once.
// Built at first use by deltafin/kernels/mxfp4_cpu.py with the system C compiler (-O3 -march=native).

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DF_AVX2 1
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define DF_NEON 1
#endif

static const int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static float scale_of(uint8_t s) {
    // 2**(s-127) / 2: the table values are doubled
    return ldexpf(0.5f, (int)s - 127);
}

int deltafin_mxfp4_isa(void) {
#if defined(DF_AVX2)
    return 2;
#elif defined(DF_NEON)
    return 3;
#else
    return 1;
#endif
}

// Decode one row to fp32 (scales applied).
static void decode_row(const uint8_t *p, const uint8_t *s, int64_t cols, float *out) {
#if defined(DF_AVX2)
    const __m128i lut = _mm_loadu_si128((const __m128i *)kE2M1x2);
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < cols / 32; ++g) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(p + g * 16));
        const __m128i lo = _mm_and_si128(b, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
        const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
        const __m256 sc = _mm256_set1_ps(scale_of(s[g]));
        float *o = out + g * 32;
        _mm256_storeu_ps(o, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0))));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)))));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1))));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)))));
    }
    return;
#endif
    for (int64_t g = 0; g < cols / 32; ++g) {
        const float sc = scale_of(s[g]);
        for (int j = 0; j < 16; ++j) {
            const uint8_t b = p[g * 16 + j];
            out[g * 32 + 2 * j] = sc * (float)kE2M1x2[b & 0xF];
            out[g * 32 + 2 * j + 1] = sc * (float)kE2M1x2[b >> 4];
        }
    }
}

static float dot(const float *a, const float *b, int64_t n) {
#if defined(DF_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    acc0 = _mm256_add_ps(acc0, acc1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    float sum = _mm_cvtss_f32(h);
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
#else
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
#endif
}

#if defined(DF_AVX2)
// One row times one fp32 vector, fused: decode 32 codes per step in registers.
static float row_dot_avx2(const uint8_t *p, const uint8_t *s, const float *x, int64_t cols) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kE2M1x2);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 row = _mm256_setzero_ps();
    for (int64_t g = 0; g < cols / 32; ++g) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(p + g * 16));
        const __m128i lo = _mm_and_si128(b, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));  // elements 0..15
        const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));  // elements 16..31
        const float *xg = x + g * 32;
        __m256 acc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), _mm256_loadu_ps(xg));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8))),
                              _mm256_loadu_ps(xg + 8), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), _mm256_loadu_ps(xg + 16), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8))),
                              _mm256_loadu_ps(xg + 24), acc);
        row = _mm256_fmadd_ps(acc, _mm256_set1_ps(scale_of(s[g])), row);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(row), _mm256_extractf128_ps(row, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
#endif

#if defined(DF_AVX2)
// One row times 4 fp32 vectors: each group's codes are decoded once and used for all four tokens.
static void row_dot4_avx2(const uint8_t *p, const uint8_t *s, const float *x, int64_t cols, float *out) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kE2M1x2);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 row[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < cols / 32; ++g) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(p + g * 16));
        const __m128i lo = _mm_and_si128(b, low);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
        const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
        const __m256 sc = _mm256_set1_ps(scale_of(s[g]));
        for (int t = 0; t < 4; ++t) {
            const float *xg = x + t * cols + g * 32;
            __m256 acc = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
            acc = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), acc);
            acc = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), acc);
            acc = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), acc);
            row[t] = _mm256_fmadd_ps(acc, sc, row[t]);
        }
    }
    for (int t = 0; t < 4; ++t) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(row[t]), _mm256_extractf128_ps(row[t], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        out[t] = _mm_cvtss_f32(h);
    }
}
#endif

#if defined(DF_NEON)
static float row_dot_neon(const uint8_t *p, const uint8_t *s, const float *x, int64_t cols) {
    const int8x16_t lut = vld1q_s8(kE2M1x2);
    const uint8x16_t low = vdupq_n_u8(0x0F);
    float32x4_t row = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < cols / 32; ++g) {
        const uint8x16_t b = vld1q_u8(p + g * 16);
        const uint8x16x2_t z = vzipq_u8(vandq_u8(b, low), vshrq_n_u8(b, 4));  // element order
        const float *xg = x + g * 32;
        float32x4_t acc = vdupq_n_f32(0.0f);
        for (int h = 0; h < 2; ++h) {
            const int8x16_t v = vqtbl1q_s8(lut, z.val[h]);
            const int16x8_t w0 = vmovl_s8(vget_low_s8(v)), w1 = vmovl_s8(vget_high_s8(v));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w0))), vld1q_f32(xg + 16 * h));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_high_s16(w0))), vld1q_f32(xg + 16 * h + 4));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w1))), vld1q_f32(xg + 16 * h + 8));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(vmovl_s16(vget_high_s16(w1))), vld1q_f32(xg + 16 * h + 12));
        }
        row = vfmaq_n_f32(row, acc, scale_of(s[g]));
    }
    return vaddvq_f32(row);
}
#endif

static float row_dot(const uint8_t *p, const uint8_t *s, const float *x, int64_t cols) {
#if defined(DF_AVX2)
    return row_dot_avx2(p, s, x, cols);
#elif defined(DF_NEON)
    return row_dot_neon(p, s, x, cols);
#else
    float sum = 0.0f;
    for (int64_t g = 0; g < cols / 32; ++g) {
        float acc = 0.0f;
        for (int j = 0; j < 16; ++j) {
            const uint8_t b = p[g * 16 + j];
            acc += (float)kE2M1x2[b & 0xF] * x[g * 32 + 2 * j] + (float)kE2M1x2[b >> 4] * x[g * 32 + 2 * j + 1];
        }
        sum += acc * scale_of(s[g]);
    }
    return sum;
#endif
}

// Rows [r0, r1) of y = x @ W.T; x [ntok, cols], y [ntok, rows], scratch >= cols floats (ntok > 1 only).
void deltafin_mxfp4_matmul(const uint8_t *packed, const uint8_t *scales, const float *x, float *y,
                           int64_t rows, int64_t cols, int64_t ntok, int64_t r0, int64_t r1, float *scratch) {
    const int64_t pstride = cols / 2, sstride = cols / 32;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *p = packed + r * pstride, *s = scales + r * sstride;
        int64_t t = 0;
#if defined(DF_AVX2)
        float out4[4];
        for (; t + 4 <= ntok; t += 4) {
            row_dot4_avx2(p, s, x + t * cols, cols, out4);
            for (int i = 0; i < 4; ++i) y[(t + i) * rows + r] = out4[i];
        }
#endif
        if (ntok - t <= 2) {
            for (; t < ntok; ++t) y[t * rows + r] = row_dot(p, s, x + t * cols, cols);
        } else {  // decode the row once, reuse it for the remaining tokens
            decode_row(p, s, cols, scratch);
            for (; t < ntok; ++t) y[t * rows + r] = dot(scratch, x + t * cols, cols);
        }
    }
}

// Rows [r0, r1) of W decoded to fp32 into out [rows, cols] (for multi-token products via BLAS).
void deltafin_mxfp4_decode(const uint8_t *packed, const uint8_t *scales, float *out, int64_t rows, int64_t cols,
                           int64_t r0, int64_t r1) {
    (void)rows;
    for (int64_t r = r0; r < r1; ++r) decode_row(packed + r * (cols / 2), scales + r * (cols / 32), cols, out + r * cols);
}
