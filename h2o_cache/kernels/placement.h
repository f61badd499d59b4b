// A recall window's keys rotated to where their tokens stood in the text among the row's own tokens
// (`recall.text_positions`, `RopeTable.at`): for the choices' copies and the placement after an
// eviction (`recall_choice.cpp`).
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <stddef.h>

#include <algorithm>

namespace {

// Where a token of origin `origin` stands among own tokens of ascending origins own[0..m), which sit
// in slots first .. first + m - 1: at slot + share, share in (0, 1] (`recall.text_positions`): between
// the slots of the own tokens around it, by its origin's share of the gap between theirs; past the
// newest own token as if the next one came right after it.
struct TextPosition {
    int64_t slot;
    float share;
};

inline TextPosition text_position(const int64_t* own, int64_t m, int64_t origin, int64_t first) {
    const int64_t after = std::lower_bound(own, own + m, origin) - own;  // own tokens older than it
    const int64_t since = after > 0 ? own[after - 1] : -1;
    const int64_t until = after < m ? own[after] : origin + 1;
    const double share = static_cast<double>(origin - since) / static_cast<double>(std::max<int64_t>(until - since, 1));
    return {first - 1 + after, static_cast<float>(share)};
}

// sin(a) = a SINE(a^2), cos(a) = COSINE(a^2) for |a| <= 1: their Taylor series to the 9th and 10th
// powers (error < 3e-8), as coefficients of a^0, a^2, a^4, ...
constexpr float SINE[] = {1.0f, -1.0f / 6, 1.0f / 120, -1.0f / 5040, 1.0f / 362880};
constexpr float COSINE[] = {1.0f, -0.5f, 1.0f / 24, -1.0f / 720, 1.0f / 40320, -1.0f / 3628800};

// c[0] + x (c[1] + x (...)), in eight lanes (`__m256`) or one (`float`).
template <size_t N>
inline __m256 polynomial(__m256 x, const float (&c)[N]) {
    __m256 p = _mm256_set1_ps(c[N - 1]);
    for (size_t i = N - 1; i-- > 0;) p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(c[i]));
    return p;
}

template <size_t N>
inline float polynomial(float x, const float (&c)[N]) {
    float p = c[N - 1];
    for (size_t i = N - 1; i-- > 0;) p = p * x + c[i];
    return p;
}

// out = x rotated to position slot + share, RoPE in transformers' layout (dim/2 frequencies, the two
// halves of cos and sin repeated): angles are position x frequency, so the slot's rotation (cos, sin:
// the model's table row `slot`, its attention scaling included) composed with share x frequency's
// (`SINE`, `COSINE`: |angle| <= 1 for frequencies <= 1). Eight frequencies at a time.
inline void rotate_placed(const float* x, const float* cos, const float* sin, const float* frequencies, float share,
                          float* out, int64_t dim) {
    const int64_t half = dim / 2;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        const __m256 a = _mm256_mul_ps(_mm256_set1_ps(share), _mm256_loadu_ps(frequencies + i)), a2 = _mm256_mul_ps(a, a);
        const __m256 s = _mm256_mul_ps(a, polynomial(a2, SINE)), c = polynomial(a2, COSINE);
        const __m256 tc = _mm256_loadu_ps(cos + i), ts = _mm256_loadu_ps(sin + i);
        const __m256 rc = _mm256_fmsub_ps(tc, c, _mm256_mul_ps(ts, s)), rs = _mm256_fmadd_ps(ts, c, _mm256_mul_ps(tc, s));
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        _mm256_storeu_ps(out + i, _mm256_fmsub_ps(x1, rc, _mm256_mul_ps(x2, rs)));
        _mm256_storeu_ps(out + half + i, _mm256_fmadd_ps(x2, rc, _mm256_mul_ps(x1, rs)));
    }
    for (; i < half; ++i) {
        const float a = share * frequencies[i], s = a * polynomial(a * a, SINE), c = polynomial(a * a, COSINE);
        const float rc = cos[i] * c - sin[i] * s, rs = sin[i] * c + cos[i] * s;
        const float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * rc - x2 * rs;
        out[half + i] = x2 * rc + x1 * rs;
    }
}

}  // namespace
