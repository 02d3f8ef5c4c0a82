// Deltafin CPU kernels: y[t, r] = sum_c W[r, c] * x[t, c] with fp32 activations, for the weight formats
// the runtime holds in memory:
//   MXFP4     routed experts: packed[r, c/2] (low nibble = even element) + E8M0 scales[r, c/32]
//   bf16      spine as stored (bf16 -> fp32 is exact: a 16-bit shift)
//   row-int8  spine with --spine int8: int8 q[r, c] and an fp32 scale per row
// Activations stay fp32 (no int8 rounding of x, unlike llama.cpp's Q8_0 path), so results equal a dense
// fp32 product up to summation order. Up to 4 tokens share one pass over W (each weight vector is decoded
// once); callers use BLAS for larger batches. Memory-bound by design: the goal is W's bytes at DRAM speed.
//
// ISA chosen at compile time (-march=native): AVX-512 (F+BW), AVX2+FMA, NEON, or portable C.
// Built at first use by deltafin/kernels/cpu.py.

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DF_AVX512 1
#define DF_ISA 4
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DF_AVX2 1
#define DF_ISA 2
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#define DF_NEON 1
#define DF_ISA 3
#else
#define DF_ISA 1
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

int deltafin_isa(void) { return DF_ISA; }

static const int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2**(s-127) / 2 for every E8M0 byte (the E2M1 table values are doubled); filled when the library loads.
static float kE8M0Half[256];
__attribute__((constructor)) static void init_tables(void) {
    for (int s = 0; s < 256; ++s) kE8M0Half[s] = ldexpf(0.5f, s - 127);
}
#define e8m0_half(s) kE8M0Half[(uint8_t)(s)]

static float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// ---- vector primitives: VEC holds VLEN fp32 lanes ------------------------------------------------------

#if defined(DF_AVX512)
typedef __m512 VEC;
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(s) _mm512_set1_ps(s)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUM(a) _mm512_reduce_add_ps(a)
ALWAYS_INLINE VEC load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
ALWAYS_INLINE VEC load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(DF_AVX2)
typedef __m256 VEC;
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(s) _mm256_set1_ps(s)
#define VADD(a, b) _mm256_add_ps(a, b)
ALWAYS_INLINE float VSUM(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
ALWAYS_INLINE VEC load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
ALWAYS_INLINE VEC load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#elif defined(DF_NEON)
typedef float32x4_t VEC;
#define VLEN 4
#define VZERO() vdupq_n_f32(0.0f)
#define VLOAD(p) vld1q_f32(p)
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VSET1(s) vdupq_n_f32(s)
#define VADD(a, b) vaddq_f32(a, b)
#define VSUM(a) vaddvq_f32(a)
ALWAYS_INLINE VEC load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
ALWAYS_INLINE VEC load_i8(const int8_t *p) {
    int8x8_t v = vld1_s8(p);  // reads 8, uses the first 4
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(v))));
}
#endif

// ---- MXFP4: decode one 32-value group into 32/VLEN vectors (scale not applied) --------------------------

#if defined(DF_AVX512) || defined(DF_AVX2)
ALWAYS_INLINE void mx_group(const uint8_t *p, VEC *w) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kE2M1x2);
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));  // elements 0..15
    const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));  // elements 16..31
#if defined(DF_AVX512)
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v0));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v1));
#else
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
#endif
}
#elif defined(DF_NEON)
ALWAYS_INLINE void mx_group(const uint8_t *p, VEC *w) {
    const int8x16_t lut = vld1q_s8(kE2M1x2);
    const uint8x16_t b = vld1q_u8(p), low = vdupq_n_u8(0x0F);
    const uint8x16x2_t z = vzipq_u8(vandq_u8(b, low), vshrq_n_u8(b, 4));  // element order
    for (int h = 0; h < 2; ++h) {
        const int8x16_t v = vqtbl1q_s8(lut, z.val[h]);
        const int16x8_t a = vmovl_s8(vget_low_s8(v)), c = vmovl_s8(vget_high_s8(v));
        w[4 * h + 0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(a)));
        w[4 * h + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(a)));
        w[4 * h + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(c)));
        w[4 * h + 3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(c)));
    }
}
#endif

// ---- row kernels: one row of W against n (1..4) tokens; n is a literal at every call site ---------------

#if defined(VLEN)
ALWAYS_INLINE void row_mxfp4(const uint8_t *p, const uint8_t *s, const float *x, int64_t cols, const int n,
                             float *out) {
    VEC row[4][2];
    for (int t = 0; t < n; ++t) row[t][0] = row[t][1] = VZERO();
    VEC w[32 / VLEN];
    for (int64_t g = 0; g < cols / 32; ++g) {
        mx_group(p + g * 16, w);
        const VEC sc = VSET1(e8m0_half(s[g]));
        for (int t = 0; t < n; ++t) {
            const float *xg = x + t * cols + g * 32;
            VEC a0 = VZERO(), a1 = VZERO();  // two chains per group
            for (int i = 0; i < 32 / VLEN; i += 2) {
                a0 = VFMA(w[i], VLOAD(xg + i * VLEN), a0);
                a1 = VFMA(w[i + 1], VLOAD(xg + (i + 1) * VLEN), a1);
            }
            row[t][g & 1] = VFMA(VADD(a0, a1), sc, row[t][g & 1]);
        }
    }
    for (int t = 0; t < n; ++t) out[t] = VSUM(VADD(row[t][0], row[t][1]));
}

// Each token gets 4 independent accumulators: one chain of dependent FMAs would bound the loop by FMA
// latency (4 cycles), far below memory speed.
ALWAYS_INLINE void row_bf16(const uint16_t *w, const float *x, int64_t cols, const int n, float *out) {
    VEC acc[4][4];
    for (int t = 0; t < n; ++t)
        for (int u = 0; u < 4; ++u) acc[t][u] = VZERO();
    int64_t c = 0;
    for (; c + 4 * VLEN <= cols; c += 4 * VLEN) {
        for (int u = 0; u < 4; ++u) {
            const VEC wv = load_bf16(w + c + u * VLEN);
            for (int t = 0; t < n; ++t) acc[t][u] = VFMA(wv, VLOAD(x + t * cols + c + u * VLEN), acc[t][u]);
        }
    }
    for (int t = 0; t < n; ++t) {
        float sum = VSUM(acc[t][0]) + VSUM(acc[t][1]) + VSUM(acc[t][2]) + VSUM(acc[t][3]);
        for (int64_t k = c; k < cols; ++k) sum += bf16_to_f32(w[k]) * x[t * cols + k];
        out[t] = sum;
    }
}

ALWAYS_INLINE void row_i8(const int8_t *q, const float *x, int64_t cols, const int n, float *out) {
    VEC acc[4][4];
    for (int t = 0; t < n; ++t)
        for (int u = 0; u < 4; ++u) acc[t][u] = VZERO();
    int64_t c = 0;
    for (; c + 4 * VLEN <= cols && c + 3 * VLEN + 16 <= cols; c += 4 * VLEN) {  // load_i8 may read 16 bytes
        for (int u = 0; u < 4; ++u) {
            const VEC wv = load_i8(q + c + u * VLEN);
            for (int t = 0; t < n; ++t) acc[t][u] = VFMA(wv, VLOAD(x + t * cols + c + u * VLEN), acc[t][u]);
        }
    }
    for (int t = 0; t < n; ++t) {
        float sum = VSUM(acc[t][0]) + VSUM(acc[t][1]) + VSUM(acc[t][2]) + VSUM(acc[t][3]);
        for (int64_t k = c; k < cols; ++k) sum += (float)q[k] * x[t * cols + k];
        out[t] = sum;
    }
}
// Four rows against one token (decode): four independent streams share each load of x, which keeps
// enough memory requests in flight to run at DRAM bandwidth (one row at a time reaches ~75% of it).
ALWAYS_INLINE void rows4_bf16(const uint16_t *w, int64_t cols, const float *x, float *out) {
    VEC a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    int64_t c = 0;
    for (; c + VLEN <= cols; c += VLEN) {
        const VEC xv = VLOAD(x + c);
        a0 = VFMA(load_bf16(w + c), xv, a0);
        a1 = VFMA(load_bf16(w + cols + c), xv, a1);
        a2 = VFMA(load_bf16(w + 2 * cols + c), xv, a2);
        a3 = VFMA(load_bf16(w + 3 * cols + c), xv, a3);
    }
    out[0] = VSUM(a0), out[1] = VSUM(a1), out[2] = VSUM(a2), out[3] = VSUM(a3);
    for (int i = 0; i < 4; ++i)
        for (int64_t k = c; k < cols; ++k) out[i] += bf16_to_f32(w[i * cols + k]) * x[k];
}

// int8 decodes faster than DRAM delivers it, so eight rows (eight streams) keep more requests in flight.
ALWAYS_INLINE void rows8_i8(const int8_t *q, int64_t cols, const float *x, float *out) {
    VEC a[8];
    for (int i = 0; i < 8; ++i) a[i] = VZERO();
    int64_t c = 0;
    for (; c + 16 <= cols; c += VLEN) {  // load_i8 may read 16 bytes
        const VEC xv = VLOAD(x + c);
        for (int i = 0; i < 8; ++i) a[i] = VFMA(load_i8(q + i * cols + c), xv, a[i]);
    }
    for (int i = 0; i < 8; ++i) {
        out[i] = VSUM(a[i]);
        for (int64_t k = c; k < cols; ++k) out[i] += (float)q[i * cols + k] * x[k];
    }
}

ALWAYS_INLINE void rows4_mxfp4(const uint8_t *p, const uint8_t *s, int64_t cols, const float *x, float *out) {
    VEC row[4] = {VZERO(), VZERO(), VZERO(), VZERO()};
    VEC w[32 / VLEN];
    const int64_t ps = cols / 2, ss = cols / 32;
    for (int64_t g = 0; g < cols / 32; ++g) {
        VEC xv[32 / VLEN];
        for (int i = 0; i < 32 / VLEN; ++i) xv[i] = VLOAD(x + g * 32 + i * VLEN);
        for (int r = 0; r < 4; ++r) {
            mx_group(p + r * ps + g * 16, w);
            VEC acc = VZERO();
            for (int i = 0; i < 32 / VLEN; ++i) acc = VFMA(w[i], xv[i], acc);
            row[r] = VFMA(acc, VSET1(e8m0_half(s[r * ss + g])), row[r]);
        }
    }
    for (int r = 0; r < 4; ++r) out[r] = VSUM(row[r]);
}
#define HAVE_ROWS4 1
#else  // portable C
static void row_mxfp4(const uint8_t *p, const uint8_t *s, const float *x, int64_t cols, const int n, float *out) {
    for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int64_t g = 0; g < cols / 32; ++g) {
            float acc = 0.0f;
            for (int j = 0; j < 16; ++j) {
                const uint8_t b = p[g * 16 + j];
                const float *xg = x + t * cols + g * 32 + 2 * j;
                acc += (float)kE2M1x2[b & 0xF] * xg[0] + (float)kE2M1x2[b >> 4] * xg[1];
            }
            sum += acc * e8m0_half(s[g]);
        }
        out[t] = sum;
    }
}
static void row_bf16(const uint16_t *w, const float *x, int64_t cols, const int n, float *out) {
    for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int64_t k = 0; k < cols; ++k) sum += bf16_to_f32(w[k]) * x[t * cols + k];
        out[t] = sum;
    }
}
static void row_i8(const int8_t *q, const float *x, int64_t cols, const int n, float *out) {
    for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int64_t k = 0; k < cols; ++k) sum += (float)q[k] * x[t * cols + k];
        out[t] = sum;
    }
}
#endif

// Dispatch a row against tokens t0..t0+n-1 with a literal n, so the compiler unrolls the token loop.
#define FOR_TOKEN_BLOCKS(ntok, CALL)                                    \
    for (int64_t t0 = 0; t0 < (ntok); t0 += 4) {                        \
        const int64_t left = (ntok) - t0;                               \
        float out[4];                                                   \
        if (left >= 4) { CALL(4); } else if (left == 3) { CALL(3); }    \
        else if (left == 2) { CALL(2); } else { CALL(1); }              \
        for (int i = 0; i < 4 && i < left; ++i) y[(t0 + i) * rows + r] = out[i] * row_scale; \
    }

// ---- exported: rows [r0, r1) of y [ntok, rows] = x [ntok, cols] @ W.T ----------------------------------

void deltafin_mxfp4_matmul(const uint8_t *packed, const uint8_t *scales, const float *x, float *y, int64_t rows,
                           int64_t cols, int64_t ntok, int64_t r0, int64_t r1) {
    const float row_scale = 1.0f;
#if defined(HAVE_ROWS4)
    if (ntok == 1) {
        for (; r0 + 4 <= r1; r0 += 4) rows4_mxfp4(packed + r0 * (cols / 2), scales + r0 * (cols / 32), cols, x, y + r0);
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *p = packed + r * (cols / 2), *s = scales + r * (cols / 32);
#define CALL_MX(n) row_mxfp4(p, s, x + t0 * cols, cols, n, out)
        FOR_TOKEN_BLOCKS(ntok, CALL_MX)
    }
}

void deltafin_bf16_matmul(const uint16_t *w, const float *x, float *y, int64_t rows, int64_t cols, int64_t ntok,
                          int64_t r0, int64_t r1) {
    const float row_scale = 1.0f;
#if defined(HAVE_ROWS4)
    if (ntok == 1) {
        for (; r0 + 4 <= r1; r0 += 4) rows4_bf16(w + r0 * cols, cols, x, y + r0);
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
        const uint16_t *wr = w + r * cols;
#define CALL_BF(n) row_bf16(wr, x + t0 * cols, cols, n, out)
        FOR_TOKEN_BLOCKS(ntok, CALL_BF)
    }
}

void deltafin_int8_matmul(const int8_t *q, const float *scale, const float *x, float *y, int64_t rows,
                          int64_t cols, int64_t ntok, int64_t r0, int64_t r1) {
#if defined(HAVE_ROWS4)
    if (ntok == 1) {
        for (; r0 + 8 <= r1; r0 += 8) {
            rows8_i8(q + r0 * cols, cols, x, y + r0);
            for (int i = 0; i < 8; ++i) y[r0 + i] *= scale[r0 + i];
        }
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
        const int8_t *qr = q + r * cols;
        const float row_scale = scale[r];
#define CALL_I8(n) row_i8(qr, x + t0 * cols, cols, n, out)
        FOR_TOKEN_BLOCKS(ntok, CALL_I8)
    }
}

// Rows [r0, r1) of an MXFP4 W decoded to fp32 into out [rows, cols] (multi-token products go to BLAS).
void deltafin_mxfp4_decode(const uint8_t *packed, const uint8_t *scales, float *out, int64_t rows, int64_t cols,
                           int64_t r0, int64_t r1) {
    (void)rows;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *p = packed + r * (cols / 2), *s = scales + r * (cols / 32);
        float *o = out + r * cols;
        for (int64_t g = 0; g < cols / 32; ++g) {
            const float sc = e8m0_half(s[g]);
            for (int j = 0; j < 16; ++j) {
                const uint8_t b = p[g * 16 + j];
                o[g * 32 + 2 * j] = sc * (float)kE2M1x2[b & 0xF];
                o[g * 32 + 2 * j + 1] = sc * (float)kE2M1x2[b >> 4];
            }
        }
    }
}
