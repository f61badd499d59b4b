// Vector helpers shared by the kernels (AVX2, FMA; `exp16` AVX-512, for its callers that check the CPU).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

// Asks for the `bytes` from `row` on into the caches, a 64-byte line at a time; reads nothing (a
// prefetch never faults, even past the end of a buffer).
inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(static_cast<const char*>(row) + at, _MM_HINT_T0);
}

// A 16-bit value (fp16, or bf16 where bf16) widened exactly to fp32.
inline float widen(uint16_t x, bool bf16) {
    if (!bf16) return _cvtsh_ss(x);
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

inline float hsum8(__m256 s) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

// e^x in 8 lanes, to about 1 ulp: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so r is
// exact), e^r by Cephes' expf polynomial, 2^n from exponent bits. x is clamped to [-87, 88].
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// `exp8` in 16 lanes: the same operations, so each lane gives exp8's float bit for bit.
__attribute__((target("avx512f")))
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

// out[0..d) <- x[0..d) in fp16, rounded to nearest even (as torch's half()); d a multiple of 8.
inline void narrow_fp16(const float* x, uint16_t* out, int64_t d) {
    for (int64_t i = 0; i < d; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x[0..d) <- x rounded to fp16 (nearest even) and widened back, in place; d a multiple of 8.
inline void round_fp16(float* x, int64_t d) {
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

// 8 fp16 values widened exactly to fp32.
inline __m256 load8_fp16(const uint16_t* x) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

// out[0..d) <- x[0..d) (fp16) widened exactly to fp32; d a multiple of 8.
inline void widen_fp16(const uint16_t* x, float* out, int64_t d) {
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(out + i, load8_fp16(x + i));
}

}  // namespace
