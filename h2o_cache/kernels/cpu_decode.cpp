// The CPU decode step of a Llama model over GGUF block-quantized weights (AVX2, FMA, F16C).
//
// Two entry points: h2o_qmatmul, one product with a GGUF matrix, and h2o_decode_step, a whole
// one-token step (embedding, 30-odd layers, head) in one call, so that a step pays no Python or
// dispatch cost per op. The step's math is `decode.decode_step`'s; see it below.
//
// Products take their fp32 input either as it is (the exact path, below) or quantized per 32-block
// to int8 for integer dot products (the integer path, `int8_products.h`, with AVX2 or, where the CPU
// has it, AVX-512 VNNI: see "The integer path").
//
// Exact products:
// out[b, n] (+)= sum_k x[b, k] * w[n, k] for b < B, n < N, where row n of w is K / 32 GGUF blocks:
//   Q4_1: 20 bytes {fp16 d, fp16 m, 16 bytes of nibbles}; w = d * q + m, q = low nibbles (elements
//         0..15) then high nibbles (16..31);
//   Q8_0: 34 bytes {fp16 d, 32 int8}; w = d * q.
// Each weight is formed with one rounding (d * q is exact in fp32), so it equals, bit for bit, the
// fp32 value gguf's dequantize gives. Every output row sums in the same order whatever B is and
// whichever rows share its tile, so a row's result never depends on its batch: accumulator j (of 4,
// 8 lanes each) sums, in k order, the products of the 8 weights at 32 k' + 8 j, and the four are
// added pairwise at the end. With 1-2 rows of x a block is dequantized in registers (`tile`); with
// more, 3 weight rows are dequantized into L1 and taken against 4 rows of x at a time (`dense_tile`),
// one accumulator index at a time so the tile fits the registers. Threads split the N output features.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vector_math.h"

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

// R dequantized weight rows (`w`, K floats each) against T rows of x: out[t, r] (+)= w[r] . x[t].
// Each output keeps the 4 accumulators `tile` gives it, summed in the same order, but they are run
// one after another (accumulator j takes the 8 floats at 32 k + 8 j), so only R * T are live at once:
// enough registers to reuse each load of w over T rows and each load of x over R rows.
template <int R, int T>
inline void dense_tile(const float* w, int64_t K, const float* x, int64_t x_stride, float* out, int64_t out_stride,
                       int accumulate) {
    // k in equal segments of at most 768 (whole blocks), so that the tile's w and x stay in L1 whatever K
    const int64_t parts = (K + 767) / 768, SEGMENT = (K / 32 + parts - 1) / parts * 32;
    __m256 acc[4][R][T];
    for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < T; ++t) acc[j][r][t] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += SEGMENT) {
        const int64_t k1 = K - k0 < SEGMENT ? K : k0 + SEGMENT;
        for (int j = 0; j < 4; ++j) {
            __m256 a[R][T];
            for (int r = 0; r < R; ++r)
                for (int t = 0; t < T; ++t) a[r][t] = acc[j][r][t];
            for (int64_t k = k0 + 8 * j; k < k1; k += 32) {
                __m256 wr[R];
                for (int r = 0; r < R; ++r) wr[r] = _mm256_load_ps(w + r * K + k);
                for (int t = 0; t < T; ++t) {
                    const __m256 xt = _mm256_loadu_ps(x + t * x_stride + k);
                    for (int r = 0; r < R; ++r) a[r][t] = _mm256_fmadd_ps(wr[r], xt, a[r][t]);
                }
            }
            for (int r = 0; r < R; ++r)
                for (int t = 0; t < T; ++t) acc[j][r][t] = a[r][t];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) {
            __m256 s[4] = {acc[0][r][t], acc[1][r][t], acc[2][r][t], acc[3][r][t]};
            const float dot = hsum(s);
            float* o = out + t * out_stride + r;
            *o = accumulate ? *o + dot : dot;
        }
}

// Weight rows n0 .. n0 + R - 1 against every row of x: dequantized once into `dense`, then taken
// against x in tiles of 4 rows (the last tile smaller).
template <class Q, int R>
inline void dense_rows(const uint8_t* rows, int64_t blocks, float* dense, const float* x, float* out, int64_t B,
                       int64_t x_stride, int64_t out_stride, int accumulate) {
    const int64_t K = blocks * 32;
    for (int r = 0; r < R; ++r)
        for (int64_t k = 0; k < blocks; ++k) {
            __m256 v[4];
            Q::dequant(rows + (r * blocks + k) * Q::bytes, v);
            for (int j = 0; j < 4; ++j) _mm256_store_ps(dense + r * K + k * 32 + 8 * j, v[j]);
        }
    int64_t b = 0;
    for (; b + 4 <= B; b += 4) dense_tile<R, 4>(dense, K, x + b * x_stride, x_stride, out + b * out_stride, out_stride, accumulate);
    const float* xb = x + b * x_stride;
    float* ob = out + b * out_stride;
    if (B - b == 3) dense_tile<R, 3>(dense, K, xb, x_stride, ob, out_stride, accumulate);
    else if (B - b == 2) dense_tile<R, 2>(dense, K, xb, x_stride, ob, out_stride, accumulate);
    else if (B - b == 1) dense_tile<R, 1>(dense, K, xb, x_stride, ob, out_stride, accumulate);
}

// A step reads its ~100 MB of weights once, from memory, row after row; the hardware prefetcher alone
// left a batch-1 step waiting on memory (3 GB/s): each row asks for the one PREFETCH_ROWS ahead (a
// prefetch past the end of the matrix is harmless: prefetches never fault).
constexpr int64_t PREFETCH_ROWS = 16;  // `prefetch_row` (vector_math.h)

// Weight rows go DENSE_ROWS at a time through `dense_rows` once x has DENSE_MIN_B rows or more;
// with fewer, each block is dequantized in registers for one or two rows of x (`tile`).
constexpr int DENSE_ROWS = 3;
constexpr int64_t DENSE_MIN_B = 3;

template <class Q>
void matmul(const uint8_t* w, const float* x, float* out, int64_t B, int64_t N, int64_t K,
            int64_t x_stride, int64_t out_stride, int accumulate, int threads) {
    const int64_t blocks = K / 32, row_bytes = blocks * Q::bytes;
#pragma omp parallel num_threads(threads)
    {
        if (B >= DENSE_MIN_B) {
            float* dense = static_cast<float*>(_mm_malloc(DENSE_ROWS * K * sizeof(float), 64));
            const int64_t groups = N / DENSE_ROWS;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < groups; ++g) {
                prefetch_row(w + (g + PREFETCH_ROWS) * DENSE_ROWS * row_bytes, DENSE_ROWS * row_bytes);
                dense_rows<Q, DENSE_ROWS>(w + g * DENSE_ROWS * row_bytes, blocks, dense, x, out + g * DENSE_ROWS, B,
                                          x_stride, out_stride, accumulate);
            }
#pragma omp for schedule(static)
            for (int64_t n = groups * DENSE_ROWS; n < N; ++n)
                dense_rows<Q, 1>(w + n * row_bytes, blocks, dense, x, out + n, B, x_stride, out_stride, accumulate);
            _mm_free(dense);
        } else {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; ++n) {
                const uint8_t* row = w + n * row_bytes;
                prefetch_row(row + PREFETCH_ROWS * row_bytes, row_bytes);
                int64_t b = 0;
                for (; b + 2 <= B; b += 2)
                    tile<Q, 2>(row, blocks, x + b * x_stride, x_stride, out + b * out_stride + n, out_stride, accumulate);
                if (b < B) tile<Q, 1>(row, blocks, x + b * x_stride, x_stride, out + b * out_stride + n, out_stride, accumulate);
            }
        }
    }
}


// ---- The decode step ------------------------------------------------------------------------------
//
// Per layer, as `decode.decode_step` does it: RMSNorm; q/k/v product; RoPE of q and k at the row's
// slot (position rolling: a new token's position is its slot); the new key (as fed and rotated), value
// and origin written at the slot, its score zeroed; fp32 attention of each KV head's query group over
// slots 0..slot, each key's softmax weight summed over the group and added to its score; o product
// onto the residual; RMSNorm; gate/up product; SiLU(gate) * up; down product onto the residual. Then
// the final norm and the head. Everything a row computes depends on that row alone, in a fixed order.

// The layout of one model and its batch cache; mirrored by `quantized.StepLayout` (all 8-byte fields).
struct Layout {
    int64_t layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, capacity, positions, threads;
    double eps, scaling;
    const void* const* layer_weights;  // per layer: input_norm, qkv, o, post_norm, gate_up, down
    const int64_t* layer_kinds;        // per layer: the kinds of qkv, o, gate_up, down
    const float* embed;                // [vocab, hidden], dense
    const float* norm;                 // [hidden]
    const uint8_t* lm_head;
    int64_t lm_head_kind;
    const float* cos;                  // [positions, head_dim]
    const float* sin;
    // [layers, rows, kv_heads, capacity, head_dim] (scores, origins: [.., capacity]); strides in elements,
    // each row's heads, slots and features contiguous
    float* keys;                       // as fed when `rotated` is set, else rotated
    float* values;
    float* rotated;                    // may be null
    float* scores;                     // may be null (a policy without scores)
    int64_t* origins;
    int64_t kv_layer_stride, kv_row_stride, score_layer_stride, score_row_stride, origin_layer_stride,
        origin_row_stride;
    float* queries;                    // may be null; else [layers, rows, heads, head_dim]: each row's
    int64_t query_layer_stride;        // queries before RoPE (what chooses a recall window)
    int64_t activations;               // EXACT, INT8_AVX2 or INT8_VNNI: how products take their input
    // May be null: else an fp16 copy of every row's recall window ([layers, rows, kv_heads,
    // window_capacity, head_dim] each, strides in elements), equal to slots 0 .. recalled[b] - 1 of
    // `rotated` and `values` (which hold fp16 values there), read instead of them: half the bytes.
    const uint16_t* window_keys;
    const uint16_t* window_values;
    int64_t window_layer_stride, window_row_stride, window_capacity;
    const int64_t* recalled;           // [B]: row b's window slots
    // May be null: else [B], row b's window slots when every held key is read at its rank in the order
    // of the text (`recall_positions` "rank"): row b's keys as fed (`keys`, `rotated` set) rotated to
    // their ranks among its held tokens (`held_ranks`); rows of 0 read `rotated` and the window's copy
    // (the text layout; a row without a window: ranks are slots).
    const int64_t* ranked;
    // Set wherever a row is `ranked`: the keys rotated to their ranks, kept from call to
    // call so that a row whose held tokens did not change reads them as they are (`keys`' shape and
    // strides; a head's window keys in fp16 at the start of its buffer: `ranked_front`); `rank_tags`
    // (`origins`' shape) says what each slot holds there: its origin << 17, 1 << 16
    // for a window slot, its rank; `rank_meta` ([layers, rows, kv_heads, 4] contiguous, `rank_rows` rows)
    // what a row's head last read: the row's epoch, its window slots, its slots, its split (-1: nothing);
    // `rank_epochs` ([B]) each row's epoch now, which changes whenever the row may hold other tokens under
    // the same origins (another sequence copied in): within one epoch an origin names one key as fed.
    float* rank_keys;
    int64_t* rank_tags;
    int64_t* rank_meta;
    int64_t rank_rows;
    const int64_t* rank_epochs;
};

// transformers' LlamaRMSNorm: x / sqrt(mean(x^2) + eps), times the weight. n: a multiple of 8.
inline void rms_norm(const float* x, const float* weight, float* out, int64_t n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), scale)));
}

// RoPE as transformers applies it: x * cos + rotate_half(x) * sin. out must not alias x.
inline void rope(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// p[0..n) = softmax(p[0..n)) in fp32; p has room for n rounded up to 8.
inline void softmax(float* p, int64_t n) {
    const int64_t whole = n / 8 * 8;
    for (int64_t t = n; t < whole + 8; ++t) p[t] = -INFINITY;  // the last chunk's unused lanes: e^-inf = 0
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(p + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(h));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
        const __m256 x = _mm256_loadu_ps(p + t);
        // exp8 clamps, so a masked lane (-inf) is zeroed here, not by the exponent
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
        _mm256_storeu_ps(p + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    for (int64_t t = 0; t < n; t += 8) _mm256_storeu_ps(p + t, _mm256_mul_ps(_mm256_loadu_ps(p + t), inv));
}

// 8 fp32 values from fp32 or (widened exactly) fp16 storage.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) { return load8_fp16(x); }

// `rope` in AVX2 from fp32 or (widened exactly) fp16 keys, for d a multiple of 16.
template <typename T>
inline void rope8(const T* x, const float* cos, const float* sin, float* out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 lo = load8(x + i), hi = load8(x + i + half);
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                                _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
        _mm256_storeu_ps(out + i + half, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + i + half)),
                                                       _mm256_mul_ps(lo, _mm256_loadu_ps(sin + i + half))));
    }
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    return hsum8(acc);
}

// Rows of keys or values an attention loop fetches ahead of the one it reads. A KV head's rows are one
// run of 48-96 KB a layer, cold after the layers between, and the hardware prefetcher stops at every
// 4 KB page and starts again slowly: fetched 32 rows ahead, a decode step took 0.94x as long at batch 1
// and 0.90-0.91x at batch 8 (the default model, in one process, toggled between windows of 32 steps).
constexpr int64_t ATTENTION_AHEAD = 32;

// p[g * stride + t] = scale * (q_g . key t) for the GQ queries q_g = q + g d and the keys t in
// [from, to) (rows of `keys`, fp32 or fp16, d apart; d a multiple of 8): a KV head's query group at
// once, so each key is read (and widened) once for the group, not once per query.
template <int GQ, typename T>
inline void group_logits(const float* q, const T* keys, int64_t from, int64_t to, int64_t d, float scale,
                         float* p, int64_t stride) {
    const __m128 factor = _mm_set1_ps(scale);
    int64_t t = from;
    for (; t + 4 <= to; t += 4) {
        __m256 a[GQ][4];
        for (int g = 0; g < GQ; ++g)
            for (int k = 0; k < 4; ++k) a[g][k] = _mm256_setzero_ps();
        const T* key = keys + t * d;
        if (t + ATTENTION_AHEAD + 4 <= to) prefetch_row(keys + (t + ATTENTION_AHEAD) * d, 4 * d * sizeof(T));
        for (int64_t i = 0; i < d; i += 8) {
            __m256 qi[GQ];
            for (int g = 0; g < GQ; ++g) qi[g] = _mm256_loadu_ps(q + g * d + i);
            for (int k = 0; k < 4; ++k) {
                const __m256 ki = load8(key + k * d + i);
                for (int g = 0; g < GQ; ++g) a[g][k] = _mm256_fmadd_ps(qi[g], ki, a[g][k]);
            }
        }
        for (int g = 0; g < GQ; ++g) {  // lane k of the sum: key t + k
            const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
            const __m128 four = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
            _mm_storeu_ps(p + g * stride + t, _mm_mul_ps(four, factor));
        }
    }
    for (; t < to; ++t)
        for (int g = 0; g < GQ; ++g) p[g * stride + t] = dot(q + g * d, keys + t * d, d) * scale;
}

// a[g] += sum over t in [from, to) of p[g * stride + t] * features i .. i + 8 W of value t (rows of
// `values`, fp32 or fp16, d apart), for GQ rows of probabilities.
template <int GQ, int W, typename T>
inline void group_weighted_add(const float* p, int64_t stride, const T* values, int64_t from, int64_t to, int64_t d,
                               int64_t i, __m256 (&a)[GQ][W]) {
    for (int64_t t = from; t < to; ++t) {
        const T* v = values + t * d + i;
        if (i == 0 && t + ATTENTION_AHEAD < to)  // the first chunk's pass: the rows' other chunks follow it
            prefetch_row(values + (t + ATTENTION_AHEAD) * d, d * sizeof(T));
        __m256 pt[GQ];
        for (int g = 0; g < GQ; ++g) pt[g] = _mm256_set1_ps(p[g * stride + t]);
        for (int j = 0; j < W; ++j) {
            const __m256 vj = load8(v + 8 * j);
            for (int g = 0; g < GQ; ++g) a[g][j] = _mm256_fmadd_ps(pt[g], vj, a[g][j]);
        }
    }
}

// Features i .. i + 8 W of out_g = sum over t < n of p[g * stride + t] * value t, for GQ rows of
// probabilities: values below r from `window` (fp16), the others from `values` (slot 0 first), d apart.
template <int GQ, int W>
inline void group_weighted_chunk(const float* p, int64_t stride, const uint16_t* window, int64_t r, const float* values,
                                 int64_t n, int64_t d, int64_t i, float* out) {
    __m256 a[GQ][W];
    for (int g = 0; g < GQ; ++g)
        for (int j = 0; j < W; ++j) a[g][j] = _mm256_setzero_ps();
    group_weighted_add<GQ, W>(p, stride, window, 0, r, d, i, a);
    group_weighted_add<GQ, W>(p, stride, values, r, n, d, i, a);
    for (int g = 0; g < GQ; ++g)
        for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + g * d + i + 8 * j, a[g][j]);
}

// out_g[0..d) (out_g = out + g d) for the GQ rows of probabilities (see group_weighted_chunk); each
// value read once for the group. d a multiple of 8.
template <int GQ>
inline void group_weighted_sum(const float* p, int64_t stride, const uint16_t* window, int64_t r, const float* values,
                               int64_t n, int64_t d, float* out) {
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) group_weighted_chunk<GQ, 4>(p, stride, window, r, values, n, d, i, out);
    for (; i + 8 <= d; i += 8) group_weighted_chunk<GQ, 1>(p, stride, window, r, values, n, d, i, out);
}

// A KV head's attention for its query group (q: G rows of d, rotated): p (G rows, stride apart) takes
// the softmax weights over slots 0..n-1 (keys below w read from the fp16 `window_keys`, those from w
// below `split` from `front`, the others from the cache's `keys`; values below r from the window's fp16
// copy `window_values`, the others from the cache's `values`; slot 0 first), out the G outputs. Up to
// three queries share a pass over the keys.
inline void group_attention(const float* q, int64_t G, const uint16_t* window_keys, int64_t w, const float* front,
                            int64_t split, const uint16_t* window_values, int64_t r, const float* keys,
                            const float* values, int64_t n, int64_t d, float scale, float* p, int64_t stride,
                            float* out) {
    for (int64_t g = 0; g < G; g += 3) {
        const int64_t m = G - g < 3 ? G - g : 3;
        const float* qg = q + g * d;
        float* pg = p + g * stride;
        float* og = out + g * d;
        switch (m) {
            case 3: group_logits<3>(qg, window_keys, 0, w, d, scale, pg, stride);
                    group_logits<3>(qg, front, w, split, d, scale, pg, stride);
                    group_logits<3>(qg, keys, split, n, d, scale, pg, stride); break;
            case 2: group_logits<2>(qg, window_keys, 0, w, d, scale, pg, stride);
                    group_logits<2>(qg, front, w, split, d, scale, pg, stride);
                    group_logits<2>(qg, keys, split, n, d, scale, pg, stride); break;
            default: group_logits<1>(qg, window_keys, 0, w, d, scale, pg, stride);
                     group_logits<1>(qg, front, w, split, d, scale, pg, stride);
                     group_logits<1>(qg, keys, split, n, d, scale, pg, stride);
        }
        for (int64_t j = 0; j < m; ++j) softmax(pg + j * stride, n);
        switch (m) {
            case 3: group_weighted_sum<3>(pg, stride, window_values, r, values, n, d, og); break;
            case 2: group_weighted_sum<2>(pg, stride, window_values, r, values, n, d, og); break;
            default: group_weighted_sum<1>(pg, stride, window_values, r, values, n, d, og);
        }
    }
}

// Each held slot's rank in the order of the text among slots 0..n-1 (`recall.held_ranks`): the
// window's r slots in any order, the own slots r..n-1 ascending (as eviction keeps them), so one
// sort of the window's origins (each packed above its slot: origins < 2^47) and a merge. order:
// scratch of r.
inline void held_ranks(const int64_t* origins, int64_t r, int64_t n, std::vector<int64_t>& order, int32_t* ranks) {
    if (static_cast<int64_t>(order.size()) < r) order.resize(r);
    for (int64_t j = 0; j < r; ++j) order[j] = (origins[j] << 16) | j;
    std::sort(order.begin(), order.begin() + r);
    int64_t i = 0, j = r, k = 0;
    while (i < r && j < n)
        ranks[(order[i] >> 16) <= origins[j] ? order[i++] & 0xffff : j++] = static_cast<int32_t>(k++);
    while (i < r) ranks[order[i++] & 0xffff] = static_cast<int32_t>(k++);
    while (j < n) ranks[j++] = static_cast<int32_t>(k++);
}

// Row b's held keys of KV head h at their ranks, from the kept `rank_keys` (see Layout), for the n
// slots of a row with `held` window slots (rotated from `fed`, the keys as fed; the window's kept
// in fp16, as a window holds its keys at whatever position they are read: window slot t's at element
// t * D of the head's buffer read as fp16, i.e. in the first half of the window's fp32 slots, which no
// own slot's key (at t * D as fp32, t >= held) overlaps; so the step reads the window's keys in half
// the bytes, as the text layout reads its fp16 copy):
// where the row's epoch and window are as the head last read them and its first `split` slots hold the
// same origins (its newer slots then hold own tokens newer than every window token: ranks as slots),
// as they are; else each slot whose origin, kind or rank changed rotated again. split: the slots
// read from the result, the others at their slots from `rotated`.
inline const float* ranked_front(const Layout& s, int64_t layer, int64_t b, int64_t h, int64_t held, int64_t n,
                                 const float* fed, const int64_t* origins,
                                 std::vector<int64_t>& order, std::vector<int32_t>& ranks, float* scratch,
                                 int64_t& split) {
    const int64_t D = s.head_dim, cap = s.capacity;
    float* kept = s.rank_keys + layer * s.kv_layer_stride + b * s.kv_row_stride + h * cap * D;
    uint16_t* kept16 = reinterpret_cast<uint16_t*>(kept);
    int64_t* tags = s.rank_tags + layer * s.origin_layer_stride + b * s.origin_row_stride + h * cap;
    int64_t* meta = s.rank_meta + ((layer * s.rank_rows + b) * s.kv_heads + h) * 4;
    const int64_t epoch = s.rank_epochs[b];
    const bool known = meta[0] == epoch;
    if (known && meta[1] == held && meta[3] <= n) {
        bool same = true;
        int64_t newest = -1;  // the newest window origin
        for (int64_t t = 0; t < meta[3] && same; ++t) {
            same = (tags[t] >> 17) == origins[t];
            if (t < held && origins[t] > newest) newest = origins[t];
        }
        if (same && (meta[3] == n || origins[meta[3]] > newest)) {
            split = meta[3];
            return kept;
        }
    }
    if (static_cast<int64_t>(ranks.size()) < n) ranks.resize(n);
    held_ranks(origins, held, n, order, ranks.data());
    split = n;
    while (split > held && ranks[split - 1] == split - 1) --split;
    if (!known)  // what the slots past the split hold is of another epoch
        for (int64_t t = split; t < cap; ++t) tags[t] = -1;
    for (int64_t t = 0; t < split; ++t) {
        const int64_t tag = (origins[t] << 17) | (static_cast<int64_t>(t < held) << 16) | ranks[t];
        if (known && tags[t] == tag) continue;
        const float* c = s.cos + ranks[t] * D;
        const float* si = s.sin + ranks[t] * D;
        if (t < held) {  // through `scratch` into the fp16 half (see above)
            rope8(fed + t * D, c, si, scratch, D);
            narrow_fp16(scratch, kept16 + t * D, D);
        } else {
            rope8(fed + t * D, c, si, kept + t * D, D);
        }
        tags[t] = tag;
    }
    meta[0] = epoch;
    meta[1] = held;
    meta[2] = n;
    meta[3] = split;
    return kept;
}

// One layer's attention for B rows: qkv [B, (H + 2 H_kv) D] -> out [B, H D], and the cache writes.
void attend(const Layout& s, int64_t layer, const float* qkv, const int64_t* slots, int64_t B, float* out) {
    const int64_t H = s.heads, Hkv = s.kv_heads, D = s.head_dim, G = H / Hkv, cap = s.capacity;
    const int64_t width = (H + 2 * Hkv) * D, padded = (cap + 7) / 8 * 8 + 8;
    const float scaling = static_cast<float>(s.scaling);
#pragma omp parallel num_threads(static_cast<int>(s.threads))
    {
        std::vector<float> q(G * D), probs(G * padded), scratch(D);
        // with ranks: scratch kept by each thread from call to call
        static thread_local std::vector<int64_t> order;
        static thread_local std::vector<int32_t> ranks;
        // tasks are handed out one at a time: a row's cost grows with its slots, and rows differ
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hkv; ++task) {
            const int64_t b = task / Hkv, h = task % Hkv, slot = slots[b], n = slot + 1;
            const float* cos = s.cos + slot * D;
            const float* sin = s.sin + slot * D;
            const float* x = qkv + b * width;
            const int64_t at = layer * s.kv_layer_stride + b * s.kv_row_stride + h * cap * D;
            float* keys = (s.rotated ? s.rotated : s.keys) + at;  // written: the new key rotated to its slot
            const float* values = s.values + at;
            if (s.rotated) memcpy(s.keys + at + slot * D, x + (H + h) * D, D * sizeof(float));
            rope(x + (H + h) * D, cos, sin, keys + slot * D, D);
            memcpy(s.values + at + slot * D, x + (H + Hkv + h) * D, D * sizeof(float));
            if (s.queries)
                memcpy(s.queries + layer * s.query_layer_stride + (b * H + h * G) * D, x + h * G * D, G * D * sizeof(float));
            // the window's slots from its fp16 copy (the same values: half the bytes from memory; the
            // loops widen them), the row's own from the cache
            const int64_t r = s.window_keys ? s.recalled[b] : 0;
            const int64_t at16 = r ? layer * s.window_layer_stride + b * s.window_row_stride + h * s.window_capacity * D : 0;
            const uint16_t* window_keys = r ? s.window_keys + at16 : nullptr;
            const uint16_t* window_values = r ? s.window_values + at16 : nullptr;
            for (int64_t g = 0; g < G; ++g) rope(x + (h * G + g) * D, cos, sin, q.data() + g * D, D);
            const int64_t held = s.ranked && s.rotated ? s.ranked[b] : 0;  // window slots: keys read at their ranks
            if (held > 0 && held < n) {
                // every held key as fed rotated to its rank, but the own keys newer than
                // every window key: their ranks are their slots, where `rotated` holds them
                const int64_t* row_origins = s.origins + layer * s.origin_layer_stride + b * s.origin_row_stride + h * cap;
                int64_t split;
                const float* front = ranked_front(s, layer, b, h, held, n, s.keys + at, row_origins, order, ranks,
                                                  scratch.data(), split);
                group_attention(q.data(), G, reinterpret_cast<const uint16_t*>(front), held, front, split,
                                window_values, r, keys, values, n, D, scaling, probs.data(), padded,
                                out + b * H * D + h * G * D);
            } else {
                group_attention(q.data(), G, window_keys, r, keys, r, window_values, r, keys, values, n, D, scaling,
                                probs.data(), padded, out + b * H * D + h * G * D);
            }
            if (s.scores) {
                float* scores = s.scores + layer * s.score_layer_stride + b * s.score_row_stride + h * cap;
                scores[slot] = 0.0f;
                for (int64_t t = 0; t < n; ++t) {
                    float group = probs[t];
                    for (int64_t g = 1; g < G; ++g) group += probs[g * padded + t];
                    scores[t] += group;
                }
            }
        }
    }
}

// SiLU(gate) * up: gu [B, 2 I] (gate then up) -> out [B, I]; I a multiple of 8.
void swiglu(const float* gu, int64_t B, int64_t I, float* out) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < I; i += 8) {
            const __m256 g = _mm256_loadu_ps(gu + b * 2 * I + i);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(out + b * I + i, _mm256_mul_ps(silu, _mm256_loadu_ps(gu + b * 2 * I + I + i)));
        }
}

// ---- The integer path ------------------------------------------------------------------------------
//
// Products whose fp32 input is first quantized per 32-block to int8 (llama.cpp's Q8_1 activations),
// then multiplied by the blocks' integers: a block costs a few integer ops instead of 32 conversions
// and FMAs. The results differ from the exact path's by the activations' rounding; the exact path
// stays for whoever needs the dense model's values (`--exact`).

enum Activations : int64_t { EXACT = 0, INT8_AVX2 = 1, INT8_VNNI = 2 };

// B rows of K activations as 32-blocks: q [B, K] int8; d, s [B, K / 32]: x ~ d q, s = d sum(q).
struct ActRows {
    const int8_t* q;
    const float* d;
    const float* s;
    int64_t blocks;
};

struct ActBuffer {
    std::vector<int8_t> q;
    std::vector<float> d, s;

    // x [B, K] (row stride x_stride) quantized as llama.cpp's quantize_row_q8_1: d = max|x| / 127,
    // q = round(x / d), each block's own d.
    ActRows quantize(const float* x, int64_t B, int64_t K, int64_t x_stride) {
        const int64_t blocks = K / 32;
        q.resize(B * K);
        d.resize(B * blocks);
        s.resize(B * blocks);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int64_t b = 0; b < B; ++b)
            for (int64_t k = 0; k < blocks; ++k) {
                const float* xk = x + b * x_stride + k * 32;
                __m256 v[4], top = _mm256_setzero_ps();
                for (int j = 0; j < 4; ++j) {
                    v[j] = _mm256_loadu_ps(xk + 8 * j);
                    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
                }
                __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
                h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                h = _mm_max_ss(h, _mm_movehdup_ps(h));
                const float amax = _mm_cvtss_f32(h), scale = amax / 127.0f;
                const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 1.0f / scale : 0.0f);
                __m256i i[4];
                for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));  // to nearest
                const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
                // packs interleave the 128-bit lanes; the permutation puts the 32 values back in order
                const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + b * K + k * 32),
                                    _mm256_permutevar8x32_epi32(packed, order));
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
                d[b * blocks + k] = scale;
                s[b * blocks + k] = scale * static_cast<float>(_mm_cvtsi128_si32(t));
            }
        return {q.data(), d.data(), s.data(), blocks};
    }
};

namespace avx2 {
#include "int8_products.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
#define H2O_VNNI 1
namespace vnni {
#include "int8_products.h"
}  // namespace vnni
#undef H2O_VNNI
#pragma GCC pop_options

bool has_vnni() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// out (+)= x @ w.T on the path `activations` names; `buffer` holds the quantized x.
int product(int64_t activations, ActBuffer& buffer, int64_t kind, const uint8_t* w, const float* x, float* out,
            int64_t B, int64_t N, int64_t K, int64_t x_stride, int64_t out_stride, int accumulate, int threads) {
    if (K % 32 != 0) return 1;
    if (kind < 0 || kind > 3 || (kind >= 2 && N % 8 != 0)) return 2;
    if (activations == EXACT) {
        if (kind >= 2) return 7;  // packed blocks are for the integer path
        if (kind == 0) matmul<Q4_1>(w, x, out, B, N, K, x_stride, out_stride, accumulate, threads);
        else matmul<Q8_0>(w, x, out, B, N, K, x_stride, out_stride, accumulate, threads);
        return 0;
    }
    if (activations == INT8_VNNI && !has_vnni()) return 5;
    if (activations != INT8_AVX2 && activations != INT8_VNNI) return 6;
    const ActRows a = buffer.quantize(x, B, K, x_stride);
    if (activations == INT8_VNNI) vnni::product(kind, w, a, out, B, N, out_stride, accumulate, threads);
    else avx2::product(kind, w, a, out, B, N, out_stride, accumulate, threads);
    return 0;
}

int decode_step(const Layout& s, const int64_t* tokens, const int64_t* slots, const int64_t* origins, int64_t B,
                float* logits) {
    const int64_t E = s.hidden, I = s.intermediate, D = s.head_dim, H = s.heads, Hkv = s.kv_heads;
    if (E % 32 || I % 32 || D % 16 || H % Hkv) return 1;
    for (int64_t b = 0; b < B; ++b) {
        if (tokens[b] < 0 || tokens[b] >= s.vocab) return 3;
        if (slots[b] < 0 || slots[b] >= s.capacity || slots[b] >= s.positions) return 4;
        if (s.window_keys && (s.recalled[b] < 0 || s.recalled[b] > s.window_capacity || s.recalled[b] > slots[b]))
            return 7;
        if (s.ranked && (s.ranked[b] < 0 || s.ranked[b] > slots[b] || s.ranked[b] > 0xffff || (s.ranked[b] && !s.rank_keys)))
            return 7;
    }
    const int threads = static_cast<int>(s.threads);
    const float eps = static_cast<float>(s.eps);
    ActBuffer buffer;
    // products whose input rows are K wide and packed, as every product of the step
    auto mul = [&](int64_t kind, const void* w, const float* in, float* out, int64_t N, int64_t K, int accumulate) {
        return product(s.activations, buffer, kind, static_cast<const uint8_t*>(w), in, out, B, N, K, K, N, accumulate,
                       threads);
    };
    std::vector<float> x(B * E), normed(B * E), qkv(B * (H + 2 * Hkv) * D), att(B * H * D), gu(B * 2 * I), act(B * I);
    for (int64_t b = 0; b < B; ++b) {
        memcpy(x.data() + b * E, s.embed + tokens[b] * E, E * sizeof(float));
        for (int64_t l = 0; l < s.layers; ++l)
            for (int64_t h = 0; h < Hkv; ++h)
                s.origins[l * s.origin_layer_stride + b * s.origin_row_stride + h * s.capacity + slots[b]] = origins[b];
    }
    int status = 0;
    for (int64_t l = 0; l < s.layers && !status; ++l) {
        const void* const* w = s.layer_weights + 6 * l;
        const int64_t* kind = s.layer_kinds + 4 * l;
        for (int64_t b = 0; b < B; ++b) rms_norm(x.data() + b * E, static_cast<const float*>(w[0]), normed.data() + b * E, E, eps);
        status |= mul(kind[0], w[1], normed.data(), qkv.data(), (H + 2 * Hkv) * D, E, 0);
        attend(s, l, qkv.data(), slots, B, att.data());
        status |= mul(kind[1], w[2], att.data(), x.data(), E, H * D, 1);
        for (int64_t b = 0; b < B; ++b) rms_norm(x.data() + b * E, static_cast<const float*>(w[3]), normed.data() + b * E, E, eps);
        status |= mul(kind[2], w[4], normed.data(), gu.data(), 2 * I, E, 0);
        swiglu(gu.data(), B, I, act.data());
        status |= mul(kind[3], w[5], act.data(), x.data(), E, I, 1);
    }
    for (int64_t b = 0; b < B; ++b) rms_norm(x.data() + b * E, s.norm, normed.data() + b * E, E, eps);
    status |= mul(s.lm_head_kind, s.lm_head, normed.data(), logits, s.vocab, E, 0);
    return status ? 2 : 0;
}

}  // namespace

extern "C" {

// kind: 0 = Q4_1, 1 = Q8_0, 2 and 3 the same packed 8 rows at a time (`quantized.pack_rows`; integer
// paths only, N a multiple of 8). w: [N, K / 32 blocks]; x: [B, K] with row stride x_stride; out: [B, N]
// with row stride out_stride, added to when accumulate is nonzero. K must be a multiple of 32.
// activations: 0 exact, 1 int8 with AVX2, 2 int8 with AVX-512 VNNI (5 where the CPU has none).
int h2o_qmatmul(int kind, const uint8_t* w, const float* x, float* out, int64_t B, int64_t N, int64_t K,
                int64_t x_stride, int64_t out_stride, int accumulate, int threads, int activations) {
    ActBuffer buffer;
    return product(activations, buffer, kind, w, x, out, B, N, K, x_stride, out_stride, accumulate, threads);
}

// A prefill pass's held keys at their ranks (`recall.rank_rotated`), for each of `heads` KV heads:
// out[t] <- keys[t] (before RoPE) rotated by the table's row ranks[t] for the n slots t, the ranks
// `held_ranks` gives (the window's r slots in any order, the own slots after them ascending); the
// window's keys (t < r) then rounded to fp16 and widened back, as an fp32 cache holds a window's keys
// (`recall.stored`). Rows of keys, origins and out per head at the given strides;
// cos, sin: [>= n, dim] (transformers' layout). Returns 1, nothing written, for shapes it cannot run
// or own slots out of order.
int h2o_rank_rotate(const float* keys, int64_t key_head_stride, const int64_t* origins, int64_t origin_head_stride,
                    int64_t heads, int64_t r, int64_t n, int64_t dim, const float* cos, const float* sin, float* out,
                    int64_t out_head_stride) {
    if (dim % 16 || r < 0 || r > n || n > 0xffff) return 1;
    for (int64_t h = 0; h < heads; ++h) {
        const int64_t* o = origins + h * origin_head_stride;
        for (int64_t j = r + 1; j < n; ++j)
            if (o[j] <= o[j - 1]) return 1;
        for (int64_t j = 0; j < n; ++j)
            if (o[j] < 0 || o[j] >= (int64_t{1} << 47)) return 1;
    }
    std::vector<int64_t> order;
    std::vector<int32_t> ranks(n);
    for (int64_t h = 0; h < heads; ++h) {
        held_ranks(origins + h * origin_head_stride, r, n, order, ranks.data());
        for (int64_t t = 0; t < n; ++t) {
            float* to = out + h * out_head_stride + t * dim;
            rope8(keys + h * key_head_stride + t * dim, cos + ranks[t] * dim, sin + ranks[t] * dim, to, dim);
            if (t < r) round_fp16(to, dim);
        }
    }
    return 0;
}

// Whether this CPU runs the AVX-512 VNNI products.
int h2o_has_vnni() { return has_vnni(); }

// One decode step of B rows (see Layout): feeds tokens[b] to row b at slot slots[b] (also its RoPE
// position), writing origins[b] as that slot's origin; logits: [B, vocab]. Returns 0, or nonzero
// (nothing meaningful written) for shapes it cannot run, a token outside the vocabulary (3) or a
// slot outside the cache (4) or a recall window that does not fit its copy or its row (7, also for
// `ranked`).
int h2o_decode_step(const Layout* layout, const int64_t* tokens, const int64_t* slots, const int64_t* origins,
                    int64_t B, float* logits) {
    return decode_step(*layout, tokens, slots, origins, B, logits);
}

}
