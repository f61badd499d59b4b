// Products of activations with GGUF block-quantized weights, dequantized in registers (AVX2, FMA, F16C).
//
// out[b, n] (+)= sum_k x[b, k] * w[n, k] for b < B, n < N, where row n of w is K / 32 GGUF blocks:
//   Q4_1: 20 bytes {fp16 d, fp16 m, 16 bytes of nibbles}; w = d * q + m, q = low nibbles (elements
//         0..15) then high nibbles (16..31);
//   Q8_0: 34 bytes {fp16 d, 32 int8}; w = d * q.
// Each weight is formed with one rounding (d * q is exact in fp32), so it equals, bit for bit, the
// fp32 value gguf's dequantize gives. Every output row sums in the same order whatever B is and
// whichever rows share its tile (4 accumulators of 8 lanes, added pairwise at the end), so a row's
// result never depends on its batch. Threads split the N output features.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

struct Q4_1 {
    static constexpr int bytes = 20;
    static inline void dequant(const uint8_t* blk, __m256 w[4]) {
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(hm));
        const __m128i nibble = _mm_set1_epi8(0x0F);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        const __m128i lo = _mm_and_si128(q, nibble);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), nibble);
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
    }
};

struct Q8_0 {
    static constexpr int bytes = 34;
    static inline void dequant(const uint8_t* blk, __m256 w[4]) {
        uint16_t hd;
        memcpy(&hd, blk, 2);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(hd));
        const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
        const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), d);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), d);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), d);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), d);
    }
};

inline float hsum(__m256 a[4]) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

// Rows b0 .. b0 + T - 1 of x against weight row n: the block is dequantized once for the T rows.
template <class Q, int T>
inline void tile(const uint8_t* row, int64_t blocks, const float* x, int64_t x_stride, float* out,
                 int64_t out_stride, int accumulate) {
    __m256 acc[T][4];
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; ++k) {
        __m256 w[4];
        Q::dequant(row + k * Q::bytes, w);
        for (int t = 0; t < T; ++t) {
            const float* xk = x + t * x_stride + k * 32;
            for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xk + 8 * j), acc[t][j]);
        }
    }
    for (int t = 0; t < T; ++t) {
        const float dot = hsum(acc[t]);
        out[t * out_stride] = accumulate ? out[t * out_stride] + dot : dot;
    }
}

// Several rows against weight row n: the row is dequantized once into `w` (K floats, in L1), then
// rows are taken two at a time; each accumulator sums the same products in the same order as `tile`.
inline void dense_pair(const float* w, int64_t K, const float* x0, const float* x1, float* out0, float* out1,
                       int accumulate) {
    __m256 a0[4], a1[4];
    for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        for (int j = 0; j < 4; ++j) {
            const __m256 wj = _mm256_loadu_ps(w + k + 8 * j);
            a0[j] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x0 + k + 8 * j), a0[j]);
            a1[j] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(x1 + k + 8 * j), a1[j]);
        }
    }
    const float d0 = hsum(a0), d1 = hsum(a1);
    *out0 = accumulate ? *out0 + d0 : d0;
    *out1 = accumulate ? *out1 + d1 : d1;
}

template <class Q>
void matmul(const uint8_t* w, const float* x, float* out, int64_t B, int64_t N, int64_t K,
            int64_t x_stride, int64_t out_stride, int accumulate, int threads) {
    const int64_t blocks = K / 32, row_bytes = blocks * Q::bytes;
#pragma omp parallel num_threads(threads)
    {
        float* dense = B >= 4 ? static_cast<float*>(_mm_malloc(K * sizeof(float), 64)) : nullptr;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; ++n) {
            const uint8_t* row = w + n * row_bytes;
            int64_t b = 0;
            if (dense) {
                for (int64_t k = 0; k < blocks; ++k) {
                    __m256 v[4];
                    Q::dequant(row + k * Q::bytes, v);
                    for (int j = 0; j < 4; ++j) _mm256_store_ps(dense + k * 32 + 8 * j, v[j]);
                }
                for (; b + 2 <= B; b += 2)
                    dense_pair(dense, K, x + b * x_stride, x + (b + 1) * x_stride, out + b * out_stride + n,
                               out + (b + 1) * out_stride + n, accumulate);
            } else {
                for (; b + 2 <= B; b += 2)
                    tile<Q, 2>(row, blocks, x + b * x_stride, x_stride, out + b * out_stride + n, out_stride, accumulate);
            }
            if (b < B) tile<Q, 1>(row, blocks, x + b * x_stride, x_stride, out + b * out_stride + n, out_stride, accumulate);
        }
        if (dense) _mm_free(dense);
    }
}

}  // namespace

extern "C" {

int h2o_qmatmul_abi() { return 1; }

// kind: 0 = Q4_1, 1 = Q8_0. w: [N, K / 32 blocks]; x: [B, K] with row stride x_stride; out: [B, N]
// with row stride out_stride, added to when accumulate is nonzero. K must be a multiple of 32.
int h2o_qmatmul(int kind, const uint8_t* w, const float* x, float* out, int64_t B, int64_t N, int64_t K,
                int64_t x_stride, int64_t out_stride, int accumulate, int threads) {
    if (K % 32 != 0) return 1;
    if (kind == 0) matmul<Q4_1>(w, x, out, B, N, K, x_stride, out_stride, accumulate, threads);
    else if (kind == 1) matmul<Q8_0>(w, x, out, B, N, K, x_stride, out_stride, accumulate, threads);
    else return 2;
    return 0;
}

}
