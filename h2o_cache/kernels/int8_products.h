// Integer products of GGUF blocks with 8-bit activations; included by cpu_decode.cpp once per
// instruction set (namespace avx2, and namespace vnni under `#pragma GCC target` with H2O_VNNI), so the
// library loads on any AVX2 CPU and picks the VNNI copy at run time. No includes here: the includer
// has them.
//
// As llama.cpp's ggml_vec_dot_q4_1_q8_1 and ggml_vec_dot_q8_0_q8_0: per 32-block,
//   Q4_1: sum_i (dw q_i + m) dx y_i = dw dx sum_i q_i y_i + m sx,   sx = dx sum_i y_i
//   Q8_0: sum_i dw q_i dx y_i      = dw dx sum_i q_i y_i,
// the integer sums exact in int32, then scaled and summed over blocks in fp32, in k order, so a row's
// result never depends on its batch. Activation blocks keep d and s in fp32 (llama.cpp rounds them to
// fp16): the only rounding beyond the exact path's is y_i = round(x_i / dx).

// 8 int32 sums of 4 adjacent products u8 x s8. maddubs adds pairs into int16 with saturation, which
// never happens here: |s| <= 127 and u <= 15 (Q4_1) or u <= 128 (|Q8_0|), so a pair is at most 32,512.
inline __m256i dot_us(__m256i u, __m256i s) {
#ifdef H2O_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A block's 32 weights as 8-bit integers, its scale and (Q4_1) its minimum. `unsigned_q`: what
// `dot_us` takes as its first operand; for Q8_0, |q|, whose signs go onto the activations.
struct IntQ4_1 {
    static constexpr int bytes = 20;
    static constexpr bool has_min = true;
    static inline __m256i load(const uint8_t* blk, float& d, float& m) {
        uint16_t hd, hm;
        memcpy(&hd, blk, 2);
        memcpy(&hm, blk + 2, 2);
        d = _cvtsh_ss(hd);
        m = _cvtsh_ss(hm);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));  // elements 0..15 low nibbles, 16..31 high
    }
    static inline __m256i unsigned_q(__m256i q) { return q; }
    static inline __m256i signed_y(__m256i, __m256i y) { return y; }
};

struct IntQ8_0 {
    static constexpr int bytes = 34;
    static constexpr bool has_min = false;
    static inline __m256i load(const uint8_t* blk, float& d, float& m) {
        uint16_t hd;
        memcpy(&hd, blk, 2);
        d = _cvtsh_ss(hd);
        m = 0.0f;
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    }
    static inline __m256i unsigned_q(__m256i q) { return _mm256_abs_epi8(q); }
    static inline __m256i signed_y(__m256i q, __m256i y) { return _mm256_sign_epi8(y, q); }
};

// Weight row `row` against T quantized activation rows: out[t * out_stride] (+)= the dot product.
template <class Q, int T>
inline void int_tile(const uint8_t* row, int64_t blocks, const ActRows& a, int64_t t0, float* out,
                     int64_t out_stride, int accumulate) {
    __m256 acc[T];
    float mins[T];
    for (int t = 0; t < T; ++t) {
        acc[t] = _mm256_setzero_ps();
        mins[t] = 0.0f;
    }
    for (int64_t k = 0; k < blocks; ++k) {
        float d, m;
        const __m256i q = Q::load(row + k * Q::bytes, d, m);
        const __m256i u = Q::unsigned_q(q);
        for (int t = 0; t < T; ++t) {
            const int64_t at = (t0 + t) * blocks + k;
            const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + at * 32));
            const __m256 sum = _mm256_cvtepi32_ps(dot_us(u, Q::signed_y(q, y)));
            acc[t] = _mm256_fmadd_ps(sum, _mm256_set1_ps(d * a.d[at]), acc[t]);
            if (Q::has_min) mins[t] = fmaf(m, a.s[at], mins[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        const float dot = hsum8(acc[t]) + mins[t];
        out[t * out_stride] = accumulate ? out[t * out_stride] + dot : dot;
    }
}

// out[b, n] (+)= x[b] . w[n] for the B rows of `a`; threads split the N output features, and every
// weight row is unpacked once per 4 activation rows.
template <class Q>
void int_matmul(const uint8_t* w, const ActRows& a, float* out, int64_t B, int64_t N, int64_t out_stride,
                int accumulate, int threads) {
    const int64_t blocks = a.blocks, row_bytes = blocks * Q::bytes;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* row = w + n * row_bytes;
        prefetch_row(row + PREFETCH_ROWS * row_bytes, row_bytes);
        int64_t b = 0;
        for (; b + 4 <= B; b += 4) int_tile<Q, 4>(row, blocks, a, b, out + b * out_stride + n, out_stride, accumulate);
        float* o = out + b * out_stride + n;
        if (B - b == 3) int_tile<Q, 3>(row, blocks, a, b, o, out_stride, accumulate);
        else if (B - b == 2) int_tile<Q, 2>(row, blocks, a, b, o, out_stride, accumulate);
        else if (B - b == 1) int_tile<Q, 1>(row, blocks, a, b, o, out_stride, accumulate);
    }
}

inline void product(int kind, const uint8_t* w, const ActRows& a, float* out, int64_t B, int64_t N,
                    int64_t out_stride, int accumulate, int threads) {
    if (kind == 0) int_matmul<IntQ4_1>(w, a, out, B, N, out_stride, accumulate, threads);
    else int_matmul<IntQ8_0>(w, a, out, B, N, out_stride, accumulate, threads);
}
