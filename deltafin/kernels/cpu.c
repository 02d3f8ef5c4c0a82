// Deltafin CPU kernels: y[t, r] = sum_c W[r, c] * x[t, c] with fp32 activations, for the weight formats
// the runtime holds in memory:
//   MXFP4     routed experts: packed[r, c/2] (low nibble = even element) + E8M0 scales[r, c/32]
//   bf16      spine as stored (bf16 -> fp32 is exact: a 16-bit shift)
//   row-int8  spine with --spine int8: int8 q[r, c] and an fp32 scale per row
//   q4        spine with --spine q4: MLX's affine 4-bit, packed[r, c/2] + fp16 scales and biases [r, c/64]
//   q3        the routed experts' 3-bit copy: MLX's affine 3-bit, packed[r, 3c/8] + fp16 scales, biases [r, c/G]
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

// ---- q4: group-wise affine 4-bit, MLX's layout ----------------------------------------------------------
// packed[r, c/2] (low nibble = even element), fp16 scales and biases [r, c/64]; W = code * scale + bias.
// Per group of 64: sum_j (code_j s + b) x_j = s * sum_j code_j x_j + b * sum_j x_j, so the codes are
// multiplied as small integers and the bias needs only each group's sum of x (once per call).
// The unpack has no shuffles: a vector load puts Q4_NPL nibbles in each 32-bit lane; one AND with 0xF << 4k
// isolates nibble k of every lane as the integer code * 16^k, which converts to fp32 exactly and meets x
// scaled by 16^-k (exact: a power of two, unless |x| < 2^-102 where the scaled value is subnormal); x is
// permuted and scaled once per call (deltafin_q4_prepare), so that lane i of the k-th vector meets its own
// element. With 8 nibbles a lane the top one is a shift instead (code << 28 would not fit a signed lane).
// Costs one AND, one convert and one FMA per VLEN codes: about the int8 kernel's work per value (measured
// 0.8x its speed from cache on AVX2), for 0.56x its bytes, so it is faster wherever decode is memory-bound.

#define Q4_GROUP 64
#define Q4_ROWS 8  // rows a decode pass streams at once (as rows8_i8; 2 and 4 measured slower)
#define Q4_CHUNK 64  // groups whose fp16 scales and biases are converted to fp32 at a time (a stack buffer)

// IEEE half -> float for any input (the vector paths use the hardware conversion; this is the tails' and the
// portable build's).
static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);  // inf, nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
        const float f = (float)man * 5.9604644775390625e-8f;  // subnormal or zero: man * 2^-24
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(DF_AVX512)
#define Q4_NPL 4  // nibbles a lane: 32 bytes zero-extended from 16-bit words into 16 lanes, one group a vector
#define Q4_LANES 16
#define Q4_TOP_SHIFT 0
#define Q4_VECS 4  // vectors of codes a group
ALWAYS_INLINE VEC load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
typedef __m512i Q4RAW;  // one group's codes as loaded
ALWAYS_INLINE Q4RAW q4_load(const uint8_t *p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
ALWAYS_INLINE VEC q4_code(Q4RAW v, int k) {  // nibble k of every lane, times 16^k
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF << (4 * k))));
}
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#elif defined(DF_AVX2)
#define Q4_NPL 8  // one 32-byte load is one group: 8 lanes of 8 nibbles
#define Q4_LANES 8
#define Q4_TOP_SHIFT 1
#define Q4_VECS 8
#if defined(__F16C__)
ALWAYS_INLINE VEC load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else  // AVX2 without F16C (not a real CPU, but a possible -m flag set): convert in software
ALWAYS_INLINE VEC load_f16(const uint16_t *p) {
    float f[8];
    for (int i = 0; i < 8; ++i) f[i] = f16_to_f32(p[i]);
    return _mm256_loadu_ps(f);
}
#endif
typedef __m256i Q4RAW;
ALWAYS_INLINE Q4RAW q4_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE VEC q4_code(Q4RAW v, int k) {
    return k == 7 ? _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28))
                  : _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * k))));
}
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#elif defined(DF_NEON)
#define Q4_NPL 8  // two 16-byte loads a group: 4 lanes of 8 nibbles each
#define Q4_LANES 4
#define Q4_TOP_SHIFT 1
#define Q4_VECS 16
ALWAYS_INLINE VEC load_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
typedef uint32x4x2_t Q4RAW;
ALWAYS_INLINE Q4RAW q4_load(const uint8_t *p) {
    Q4RAW v = {{vreinterpretq_u32_u8(vld1q_u8(p)), vreinterpretq_u32_u8(vld1q_u8(p + 16))}};
    return v;
}
ALWAYS_INLINE VEC q4_code(Q4RAW v, int i) {  // vector i of 16: nibble i % 8 of the half i / 8
    const uint32x4_t h = v.val[i / 8];
    return i % 8 == 7 ? vcvtq_f32_u32(vshrq_n_u32(h, 28))
                      : vcvtq_f32_u32(vandq_u32(h, vdupq_n_u32(0xFu << (4 * (i % 8)))));
}
#define VSTORE(p, v) vst1q_f32(p, v)
#define VMUL(a, b) vmulq_f32(a, b)
#else
#define Q4_NPL 8  // portable C: one "lane", the 8 nibbles of 4 bytes read as a little-endian word
#define Q4_LANES 1
#define Q4_TOP_SHIFT 1
#endif

// The permuted, scaled activations: within each block of Q4_NPL * Q4_LANES values, xp[k * Q4_LANES + i] =
// x[Q4_NPL * i + k] / 16^k (nibble k of lane i), and after all tokens' values each group's sum of x.
static void q4_prepare(const float *x, float *xp, float *xsum, int64_t cols, int64_t ntok) {
    const int64_t block = Q4_NPL * Q4_LANES;
    float scale[Q4_NPL];
    for (int k = 0; k < Q4_NPL; ++k) scale[k] = (Q4_TOP_SHIFT && k == 7) ? 1.0f : ldexpf(1.0f, -4 * k);
    for (int64_t t = 0; t < ntok; ++t) {
        const float *xt = x + t * cols;
        float *pt = xp + t * cols;
        for (int64_t b0 = 0; b0 < cols; b0 += block)
            for (int k = 0; k < Q4_NPL; ++k)
                for (int i = 0; i < Q4_LANES; ++i) pt[b0 + k * Q4_LANES + i] = xt[b0 + Q4_NPL * i + k] * scale[k];
        for (int64_t g = 0; g < cols / Q4_GROUP; ++g) {
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight independent sums (a vector add), then in double
            for (int j = 0; j < Q4_GROUP; j += 8)
                for (int l = 0; l < 8; ++l) part[l] += xt[g * Q4_GROUP + j + l];
            double s = 0;
            for (int l = 0; l < 8; ++l) s += part[l];
            xsum[t * (cols / Q4_GROUP) + g] = (float)s;
        }
    }
}

#if defined(VLEN)
ALWAYS_INLINE void q4_codes(const uint8_t *p, VEC *c) {  // one group's codes, vector by vector
    const Q4RAW v = q4_load(p);
    for (int i = 0; i < Q4_VECS; ++i) c[i] = q4_code(v, i);
}
// n fp16 values to fp32 into f (a chunk of a row's scales).
ALWAYS_INLINE void q4_f16_chunk(const uint16_t *h, float *f, int n) {
    int j = 0;
    for (; j + VLEN <= n; j += VLEN) VSTORE(f + j, load_f16(h + j));
    for (; j < n; ++j) f[j] = f16_to_f32(h[j]);
}
// sum_j bias_j * xs_j over n groups: the bias term of a chunk of a row.
ALWAYS_INLINE float q4_bias_dot(const uint16_t *h, const float *xs, int n) {
    VEC acc = VZERO();
    int j = 0;
    for (; j + VLEN <= n; j += VLEN) acc = VFMA(load_f16(h + j), VLOAD(xs + j), acc);
    float sum = VSUM(acc);
    for (; j < n; ++j) sum += f16_to_f32(h[j]) * xs[j];
    return sum;
}
// One group's codes (as q4_codes decoded them) times its permuted x: per-lane partial sums, two chains.
ALWAYS_INLINE VEC q4_dot(const VEC *c, const float *xp) {
    VEC a0 = VMUL(c[0], VLOAD(xp)), a1 = VMUL(c[1], VLOAD(xp + VLEN));
    for (int i = 2; i < Q4_VECS; i += 2) {
        a0 = VFMA(c[i], VLOAD(xp + i * VLEN), a0);
        a1 = VFMA(c[i + 1], VLOAD(xp + (i + 1) * VLEN), a1);
    }
    return VADD(a0, a1);
}

// R rows against one token (decode): R independent streams keep enough memory requests in flight, and each
// vector of x is loaded once for all R rows (as rows8_i8 does): rows a multiple of 4 KB apart map onto few L1
// sets, and re-reading x per row then went to L2 (K3's o_proj, 6 KB rows, was 0.74x the int8 kernel). The next
// block's rows are prefetched while this one runs: q4 rows are short (3.5 KB at K3's width), so the hardware
// prefetcher restarts often; one block ahead made a core's decode from DRAM 1.4-1.5x faster (AVX2, Zen 3).
ALWAYS_INLINE void rows_q4(const uint8_t *p, const uint16_t *s, const uint16_t *b, const float *xp, const float *xs,
                           int64_t cols, const int R, float *out) {
    const int64_t G = cols / Q4_GROUP, ps = cols / 2;
    VEC acc[8];
    float bsum[8], sf[8][Q4_CHUNK];
    for (int r = 0; r < R; ++r) acc[r] = VZERO(), bsum[r] = 0.0f;
    for (int64_t g0 = 0; g0 < G; g0 += Q4_CHUNK) {
        const int n = G - g0 < Q4_CHUNK ? (int)(G - g0) : Q4_CHUNK;
        for (int r = 0; r < R; ++r) {
            q4_f16_chunk(s + r * G + g0, sf[r], n);
            bsum[r] += q4_bias_dot(b + r * G + g0, xs + g0, n);
        }
        for (int j = 0; j < n; ++j) {
            const int64_t g = g0 + j;
            const float *xg = xp + g * Q4_GROUP;
            Q4RAW raw[8];
            VEC dot[8];
            if ((j & 1) == 0)  // the next R rows' line, one block ahead (a prefetch past the end does not fault)
                for (int r = 0; r < R; ++r) __builtin_prefetch(p + (R + r) * ps + g * (Q4_GROUP / 2));
            for (int r = 0; r < R; ++r) raw[r] = q4_load(p + r * ps + g * (Q4_GROUP / 2));
            for (int r = 0; r < R; ++r) dot[r] = VMUL(q4_code(raw[r], 0), VLOAD(xg));
            for (int i = 1; i < Q4_VECS; ++i) {
                const VEC xv = VLOAD(xg + i * VLEN);
                for (int r = 0; r < R; ++r) dot[r] = VFMA(q4_code(raw[r], i), xv, dot[r]);
            }
            for (int r = 0; r < R; ++r) acc[r] = VFMA(dot[r], VSET1(sf[r][j]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r] = VSUM(acc[r]) + bsum[r];
}

// One row against n (1..4) tokens: each group's codes are decoded once for all of them.
ALWAYS_INLINE void row_q4(const uint8_t *p, const uint16_t *s, const uint16_t *b, const float *xp, const float *xs,
                          int64_t cols, const int n, float *out) {
    const int64_t G = cols / Q4_GROUP;
    VEC acc[4];
    float bsum[4], sf[Q4_CHUNK];
    for (int t = 0; t < n; ++t) acc[t] = VZERO(), bsum[t] = 0.0f;
    for (int64_t g0 = 0; g0 < G; g0 += Q4_CHUNK) {
        const int m = G - g0 < Q4_CHUNK ? (int)(G - g0) : Q4_CHUNK;
        q4_f16_chunk(s + g0, sf, m);
        for (int t = 0; t < n; ++t) bsum[t] += q4_bias_dot(b + g0, xs + t * G + g0, m);
        for (int j = 0; j < m; ++j) {
            const int64_t g = g0 + j;
            VEC c[Q4_VECS];
            q4_codes(p + g * (Q4_GROUP / 2), c);
            const VEC sc = VSET1(sf[j]);
            for (int t = 0; t < n; ++t) acc[t] = VFMA(q4_dot(c, xp + t * cols + g * Q4_GROUP), sc, acc[t]);
        }
    }
    for (int t = 0; t < n; ++t) out[t] = VSUM(acc[t]) + bsum[t];
}
#define HAVE_ROWS_Q4 1
#else  // portable C, the same arithmetic one word (8 codes) at a time
static void row_q4(const uint8_t *p, const uint16_t *s, const uint16_t *b, const float *xp, const float *xs,
                   int64_t cols, const int n, float *out) {
    const int64_t G = cols / Q4_GROUP;
    for (int t = 0; t < n; ++t) {
        float sum = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
            float dot = 0.0f;
            for (int w = 0; w < Q4_GROUP / 8; ++w) {
                const uint8_t *q = p + g * (Q4_GROUP / 2) + 4 * w;
                const uint32_t v = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
                const float *xw = xp + t * cols + g * Q4_GROUP + 8 * w;
                for (int k = 0; k < 7; ++k) dot += (float)(v & (0xFu << (4 * k))) * xw[k];
                dot += (float)(v >> 28) * xw[7];
            }
            sum += dot * f16_to_f32(s[g]) + f16_to_f32(b[g]) * xs[t * G + g];
        }
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


// q4: x [ntok, cols] permuted and scaled into xp [ntok, cols], each group's sum into xsum [ntok, cols/64]
// (once per call, before deltafin_q4_matmul; the layout depends on this build's vector width).
void deltafin_q4_prepare(const float *x, float *xp, float *xsum, int64_t cols, int64_t ntok) {
    q4_prepare(x, xp, xsum, cols, ntok);
}

void deltafin_q4_matmul(const uint8_t *packed, const uint16_t *scales, const uint16_t *biases, const float *xp,
                        const float *xsum, float *y, int64_t rows, int64_t cols, int64_t ntok, int64_t r0,
                        int64_t r1) {
    const float row_scale = 1.0f;
    const int64_t G = cols / Q4_GROUP;
#if defined(HAVE_ROWS_Q4)
    if (ntok == 1) {
        for (; r0 + Q4_ROWS <= r1; r0 += Q4_ROWS)
            rows_q4(packed + r0 * (cols / 2), scales + r0 * G, biases + r0 * G, xp, xsum, cols, Q4_ROWS, y + r0);
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *p = packed + r * (cols / 2);
        const uint16_t *s = scales + r * G, *b = biases + r * G;
#define CALL_Q4(n) row_q4(p, s, b, xp + t0 * cols, xsum + t0 * G, cols, n, out)
        FOR_TOKEN_BLOCKS(ntok, CALL_Q4)
    }
}

// Rows [r0, r1) of a q4 W decoded to fp32 into out [rows, cols] for BLAS (more tokens than the kernel takes), in
// the kernel's own column order and scaled by 16^k where deltafin_q4_prepare scales x by 16^-k: out times that xp
// is W times x (both scalings are exact powers of two), and the decode needs no shuffles either.
void deltafin_q4_decode(const uint8_t *packed, const uint16_t *scales, const uint16_t *biases, float *out,
                        int64_t rows, int64_t cols, int64_t r0, int64_t r1) {
    (void)rows;
    const int64_t G = cols / Q4_GROUP;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *p = packed + r * (cols / 2);
        float *o = out + r * cols;
        for (int64_t g = 0; g < G; ++g) {
            const float sc = f16_to_f32(scales[r * G + g]), bi = f16_to_f32(biases[r * G + g]);
#if defined(VLEN)
            const Q4RAW v = q4_load(p + g * (Q4_GROUP / 2));
            for (int i = 0; i < Q4_VECS; ++i) {  // vector i holds nibble i % Q4_NPL, the code times 16^k
                const int k = i % Q4_NPL;
                const float up = (Q4_TOP_SHIFT && k == 7) ? 1.0f : (float)(1u << (4 * k));
                VSTORE(o + g * Q4_GROUP + i * VLEN, VFMA(q4_code(v, i), VSET1(sc), VSET1(bi * up)));
            }
#else
            for (int w = 0; w < Q4_GROUP / 8; ++w) {
                const uint8_t *q = p + g * (Q4_GROUP / 2) + 4 * w;
                const uint32_t v = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
                float *ow = o + g * Q4_GROUP + 8 * w;
                for (int k = 0; k < 7; ++k) ow[k] = (float)(v & (0xFu << (4 * k))) * sc + bi * (float)(1u << (4 * k));
                ow[7] = (float)(v >> 28) * sc + bi;
            }
#endif
        }
    }
}


// ---- q3: the routed experts' 3-bit copy (deltafin/formats/q3.py) -----------------------------------------------
// MLX's affine 3-bit layout: a row's codes are one little-endian bit stream (8 codes in 3 bytes), and a group of
// `group` values (32, 64 or 128) has an fp16 scale and bias: W = code * scale + bias. A group's codes are decoded
// once into fp32 and dotted with each token's x (up to 32 tokens); the bias term takes the group's x sum (xsum
// [ntok, cols/group], the caller's). Codes are exact in fp32, so y equals the decoded product up to summation order.
static float kQ3Codes[4096][4];  // 12 bits -> their 4 codes as fp32: a 3-byte word's 8 codes in two lookups
__attribute__((constructor)) static void init_q3_codes(void) {
    for (int v = 0; v < 4096; ++v)
        for (int k = 0; k < 4; ++k) kQ3Codes[v][k] = (float)((v >> (3 * k)) & 7);
}

static void q3_codes(const uint8_t *p, int64_t group, float *c) {
    for (int64_t w = 0; w < group / 8; ++w) {
        const uint32_t v = (uint32_t)p[3 * w] | (uint32_t)p[3 * w + 1] << 8 | (uint32_t)p[3 * w + 2] << 16;
        memcpy(c + 8 * w, kQ3Codes[v & 0xFFF], 4 * sizeof(float));
        memcpy(c + 8 * w + 4, kQ3Codes[v >> 12], 4 * sizeof(float));
    }
}

static float q3_dot(const float *c, const float *x, int64_t n) {
#if defined(VLEN)
    VEC a = VZERO(), b = VZERO();
    int64_t i = 0;
    for (; i + 2 * VLEN <= n; i += 2 * VLEN) {
        a = VFMA(VLOAD(c + i), VLOAD(x + i), a);
        b = VFMA(VLOAD(c + i + VLEN), VLOAD(x + i + VLEN), b);
    }
    for (; i + VLEN <= n; i += VLEN) a = VFMA(VLOAD(c + i), VLOAD(x + i), a);
    float sum = VSUM(VADD(a, b));
#else
    float sum = 0.0f;
    int64_t i = 0;
#endif
    for (; i < n; ++i) sum += c[i] * x[i];
    return sum;
}

void deltafin_q3_matmul(const uint8_t *packed, const uint16_t *scales, const uint16_t *biases, const float *x,
                        const float *xsum, float *y, int64_t rows, int64_t cols, int64_t group, int64_t ntok,
                        int64_t r0, int64_t r1) {
    const int64_t G = cols / group, row_bytes = cols / 8 * 3;
    float c[128];
    for (int64_t r = r0; r < r1; ++r) {
        float acc[32] = {0.0f};
        for (int64_t g = 0; g < G; ++g) {
            q3_codes(packed + r * row_bytes + g * (group / 8 * 3), group, c);
            const float sc = f16_to_f32(scales[r * G + g]), bi = f16_to_f32(biases[r * G + g]);
            for (int64_t t = 0; t < ntok; ++t)
                acc[t] += sc * q3_dot(c, x + t * cols + g * group, group) + bi * xsum[t * G + g];
        }
        for (int64_t t = 0; t < ntok; ++t) y[t * rows + r] = acc[t];
    }
}
