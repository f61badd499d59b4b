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

// isum + 8 int32 sums of 4 adjacent products u8 x s8. maddubs adds pairs into int16 with saturation,
// which never happens here: |s| <= 127 and u <= 15 (Q4_1) or u <= 128 (|Q8_0|), so a pair is at most
// 32,512.
inline __m256i dot_us_add(__m256i isum, __m256i u, __m256i s) {
#ifdef H2O_VNNI
    return _mm256_dpbusd_epi32(isum, u, s);
#else
    return _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i dot_us(__m256i u, __m256i s) { return dot_us_add(_mm256_setzero_si256(), u, s); }

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

// ---- Weights packed 8 rows at a time ---------------------------------------------------------------
//
// `quantized.pack_rows` rewrites a matrix's blocks so that, per group of 8 output rows and per 32-block,
// the 8 rows' fp16 scales (and Q4_1 minimums) come first, then their quants interleaved 4 at a time:
// lane r (4 bytes) of a 32-byte vector holds the same 4 positions of row r. One activation block's 4
// bytes, broadcast, then meet all 8 rows in one dot_us, whose 8 int32 lanes are the 8 rows' sums: no
// horizontal sums, and the scales apply as vectors. The same integers as `int_tile` sums, so the same
// exact per-block sums; only the fp32 accumulation differs (one lane per row, blocks in k order, the
// Q4_1 minimum's term added per block).
//   Q4_1 group block (160 bytes): d[8] fp16, m[8] fp16, then 4 vectors: vector i, lane r, byte b =
//         q[r][4 i + b] | q[r][16 + 4 i + b] << 4 (positions 4i.. in the low nibbles, 16 + 4i.. high)
//   Q8_0 group block (272 bytes): d[8] fp16, then 8 vectors: vector j, lane r, byte b = q[r][4 j + b]

struct PackedQ4_1 {
    static constexpr int bytes = 160;
    static constexpr bool has_min = true;
    // y: the T activation rows' blocks as 8 int32 (4 bytes each), rows `stride` int32 apart
    template <int T>
    static inline void sums(const uint8_t* blk, const int32_t* y, int64_t stride, __m256i isum[T]) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        for (int i = 0; i < 4; ++i) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * i));
            const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int t = 0; t < T; ++t) {
                isum[t] = dot_us_add(isum[t], lo, _mm256_set1_epi32(y[t * stride + i]));
                isum[t] = dot_us_add(isum[t], hi, _mm256_set1_epi32(y[t * stride + 4 + i]));
            }
        }
    }
};

struct PackedQ8_0 {
    static constexpr int bytes = 272;
    static constexpr bool has_min = false;
    template <int T>
    static inline void sums(const uint8_t* blk, const int32_t* y, int64_t stride, __m256i isum[T]) {
        for (int j = 0; j < 8; ++j) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
            const __m256i u = _mm256_abs_epi8(w);
            for (int t = 0; t < T; ++t)
                isum[t] = dot_us_add(isum[t], u, _mm256_sign_epi8(_mm256_set1_epi32(y[t * stride + j]), w));
        }
    }
};

// Rows 8 g .. 8 g + 7 of a packed matrix against T activation rows from t0: out[t * out_stride + r] (+)=.
template <class P, int T>
inline void packed_tile(const uint8_t* group, int64_t blocks, const ActRows& a, int64_t t0, float* out,
                        int64_t out_stride, int accumulate) {
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    const int32_t* y = reinterpret_cast<const int32_t*>(a.q) + t0 * blocks * 8;
    for (int64_t k = 0; k < blocks; ++k) {
        const uint8_t* blk = group + k * P::bytes;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
        __m256i isum[T];
        for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
        P::template sums<T>(blk, y + k * 8, blocks * 8, isum);
        for (int t = 0; t < T; ++t) {
            const int64_t at = (t0 + t) * blocks + k;
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[at])), acc[t]);
            if (P::has_min) {
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
                acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[at]), acc[t]);
            }
        }
    }
    for (int t = 0; t < T; ++t) {
        float* o = out + t * out_stride;
        _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), acc[t]) : acc[t]);
    }
}

// out[b, n] (+)= x[b] . w[n] for a packed w (N a multiple of 8); threads split the groups of 8 rows,
// and every group is taken against 8 activation rows at a time where AVX-512's 32 vector registers hold
// the tile, else 4 (a row's sums are the same whichever tile it is in).
template <class P>
void packed_matmul(const uint8_t* w, const ActRows& a, float* out, int64_t B, int64_t N, int64_t out_stride,
                   int accumulate, int threads) {
    const int64_t blocks = a.blocks, group_bytes = blocks * P::bytes;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < N / 8; ++g) {
        const uint8_t* group = w + g * group_bytes;
        prefetch_row(group + PREFETCH_ROWS / 8 * group_bytes, group_bytes);
        float* o = out + 8 * g;
        int64_t b = 0;
#ifdef H2O_VNNI
        for (; b + 8 <= B; b += 8) packed_tile<P, 8>(group, blocks, a, b, o + b * out_stride, out_stride, accumulate);
#endif
        for (; b + 4 <= B; b += 4) packed_tile<P, 4>(group, blocks, a, b, o + b * out_stride, out_stride, accumulate);
        if (B - b == 3) packed_tile<P, 3>(group, blocks, a, b, o + b * out_stride, out_stride, accumulate);
        else if (B - b == 2) packed_tile<P, 2>(group, blocks, a, b, o + b * out_stride, out_stride, accumulate);
        else if (B - b == 1) packed_tile<P, 1>(group, blocks, a, b, o + b * out_stride, out_stride, accumulate);
    }
}

// kind: 0 Q4_1, 1 Q8_0 (row by row), 2 Q4_1, 3 Q8_0 (packed 8 rows at a time)
inline void product(int kind, const uint8_t* w, const ActRows& a, float* out, int64_t B, int64_t N,
                    int64_t out_stride, int accumulate, int threads) {
    if (kind == 0) int_matmul<IntQ4_1>(w, a, out, B, N, out_stride, accumulate, threads);
    else if (kind == 1) int_matmul<IntQ8_0>(w, a, out, B, N, out_stride, accumulate, threads);
    else if (kind == 2) packed_matmul<PackedQ4_1>(w, a, out, B, N, out_stride, accumulate, threads);
    else packed_matmul<PackedQ8_0>(w, a, out, B, N, out_stride, accumulate, threads);
}
