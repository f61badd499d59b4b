// A decode step's choice of one row's recall window over all layers, on the CPU, in one call:
// `Archive.select(everywhere=True)` followed by `recall.fill`, the same math with no per-op Python or
// dispatch (which was most of the ~13 ms the torch ops took per row and choice).
//
// Per layer and KV head (threads split the heads; every head's result is computed alone, in a fixed
// order, so it does not depend on the thread count):
//   1. bound: for each of the head's G queries, softmax over its N full blocks of the digests' upper
//      bound of q.k * scaling, sum_d max(q_d lo_d, q_d hi_d) (= q+ . hi + q- . lo), summed over the
//      queries; the `candidates` blocks of most mass (ties: the lower block first).
//   2. exact: softmax over the candidates' keys of q.k * scaling, summed over the queries: each
//      candidate key's attention mass.
// Then, in head order (one thread: the sums' order is fixed), every candidate key's mass is added to
// the vote of its original position modulo `positions`; each position's vote plus the votes of the
// positions within `span` of it (summed in fp64, as `selection.span_votes`) scores every archived
// token of every head, and each head takes its `window` tokens of most score (ties: the lower index),
// in ascending order. Slot j of a head is rewritten only where its token differs from `held` (a
// window that keeps its first tokens keeps their slots): key, value and origin copied from the
// archive, the key rotated to position j, score 0.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "vector_math.h"

namespace {

struct Choice {
    int64_t layers, heads, dim, group;  // KV heads; queries per KV head
    int64_t blocks, block, capacity, digest_capacity;  // full blocks; tokens per block; strides per head
    int64_t window, candidates, span, positions, threads;
    double scaling;
    const float* queries;  // [L, H, G, D], before RoPE
    const float* lo;       // [L, H, digest_capacity, D]
    const float* hi;
    const float* keys;     // [L, H, capacity, D], before RoPE
    const float* values;
    const int64_t* origins;  // [L, H, capacity]
    const float* cos;      // [window, D]
    const float* sin;
    float* cache_keys;     // the row's slot j of layer l, head h: l * kv_layer_stride + h * kv_head_stride + j * D
    float* cache_rotated;
    float* cache_values;
    int64_t kv_layer_stride, kv_head_stride;
    float* cache_scores;   // nullable; l * score_layer_stride + h * score_head_stride + j
    int64_t score_layer_stride, score_head_stride;
    int64_t* cache_origins;
    int64_t origin_layer_stride, origin_head_stride;
    int64_t* held;         // [L, H, window] in/out: the archive token each slot holds (-1: unknown)
};

// out[g] = a . q[g] for g < 4 (q: 4 rows of d floats; d a multiple of 8): one pass over a, four
// accumulators reduced together.
inline __m128 dot4(const float* a, const float* q, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + i), s0);
        s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + d + i), s1);
        s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + 2 * d + i), s2);
        s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + 3 * d + i), s3);
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// out[g] = hi . p[g] + lo . n[g] for g < 4: the digests' bound for four queries split into their
// positive (p) and negative (n) parts.
inline __m128 bound4(const float* lo, const float* hi, const float* p, const float* n, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 l = _mm256_loadu_ps(lo + i), h = _mm256_loadu_ps(hi + i);
        s0 = _mm256_fmadd_ps(l, _mm256_loadu_ps(n + i), _mm256_fmadd_ps(h, _mm256_loadu_ps(p + i), s0));
        s1 = _mm256_fmadd_ps(l, _mm256_loadu_ps(n + d + i), _mm256_fmadd_ps(h, _mm256_loadu_ps(p + d + i), s1));
        s2 = _mm256_fmadd_ps(l, _mm256_loadu_ps(n + 2 * d + i), _mm256_fmadd_ps(h, _mm256_loadu_ps(p + 2 * d + i), s2));
        s3 = _mm256_fmadd_ps(l, _mm256_loadu_ps(n + 3 * d + i), _mm256_fmadd_ps(h, _mm256_loadu_ps(p + 3 * d + i), s3));
    }
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// logits [G][stride]: row g, column j <- score of item j for query g, items taken 4 queries at a time.
template <class Score>
inline void score_items(int64_t G, int64_t count, int64_t stride, float* logits, Score score) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t width = std::min<int64_t>(4, G - g0);
        alignas(16) float four[4];
        for (int64_t j = 0; j < count; ++j) {
            _mm_store_ps(four, score(g0, j));
            for (int64_t g = 0; g < width; ++g) logits[(g0 + g) * stride + j] = four[g];
        }
    }
}

// p[0..n) <- softmax(p[0..n) * scaling), then mass[i] += p[i].
inline void softmax_into(float* p, int64_t n, float scaling, float* mass) {
    const __m256 scale = _mm256_set1_ps(scaling);
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + i), scale);
        _mm256_storeu_ps(p + i, x);
        top8 = _mm256_max_ps(top8, x);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = -INFINITY;
    for (float lane : lanes) top = std::max(top, lane);
    for (int64_t j = i; j < n; ++j) top = std::max(top, p[j] *= scaling);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
        _mm256_storeu_ps(p + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float total = hsum8(sum8);
    for (int64_t j = i; j < n; ++j) total += (p[j] = expf(p[j] - top));
    const float inverse = 1.0f / total;
    const __m256 inverse8 = _mm256_set1_ps(inverse);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(mass + i, _mm256_fmadd_ps(_mm256_loadu_ps(p + i), inverse8, _mm256_loadu_ps(mass + i)));
    for (int64_t j = i; j < n; ++j) mass[j] += p[j] * inverse;
}

// A score >= 0 and an index packed so that a greater key is a greater score, then a lower index
// (the bits of a non-negative float order as the float does).
inline uint64_t rank_key(float score, int64_t index) {
    uint32_t bits;
    memcpy(&bits, &score, 4);
    return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}

inline int64_t key_index(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// The k indices of most score[0..n) (scores >= 0; ties: the lower index), ascending, into out.
void best_of(const float* score, int64_t n, int64_t k, std::vector<uint64_t>& keys, int64_t* out) {
    keys.resize(n);
    for (int64_t i = 0; i < n; ++i) keys[i] = rank_key(score[i], i);
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint64_t>());
    for (int64_t i = 0; i < k; ++i) out[i] = key_index(keys[i]);
    std::sort(out, out + k);
}

// Stages 1-2 for one head: its candidates' key indices (storage order) and their masses.
struct Scratch {
    std::vector<float> queries, logits, mass;
    std::vector<int64_t> best;
    std::vector<uint64_t> keys;
};

void rank_head(const Choice& c, int64_t head, Scratch& s, int64_t* keys_out, float* mass_out) {
    const int64_t N = c.blocks, B = c.block, D = c.dim, G = c.group, C = c.candidates, K = C * B;
    const int64_t padded = (G + 3) / 4 * 4, stride = std::max(N, K);
    const float scaling = static_cast<float>(c.scaling);
    const float* lo = c.lo + head * c.digest_capacity * D;
    const float* hi = c.hi + head * c.digest_capacity * D;
    // [3][padded][D]: the queries, their positive parts, their negative parts (padding rows 0)
    s.queries.assign(3 * padded * D, 0.0f);
    float *q = s.queries.data(), *positive = q + padded * D, *negative = positive + padded * D;
    memcpy(q, c.queries + head * G * D, G * D * sizeof(float));
    for (int64_t i = 0; i < G * D; ++i) {
        positive[i] = std::max(q[i], 0.0f);
        negative[i] = std::min(q[i], 0.0f);
    }
    s.logits.resize(padded * stride);
    float* logits = s.logits.data();
    s.mass.assign(N, 0.0f);
    score_items(G, N, stride, logits, [&](int64_t g, int64_t n) {
        return bound4(lo + n * D, hi + n * D, positive + g * D, negative + g * D, D);
    });
    for (int64_t g = 0; g < G; ++g) softmax_into(logits + g * stride, N, scaling, s.mass.data());
    s.best.resize(C);
    best_of(s.mass.data(), N, C, s.keys, s.best.data());
    for (int64_t j = 0; j < C; ++j)
        for (int64_t i = 0; i < B; ++i) keys_out[j * B + i] = s.best[j] * B + i;
    const float* keys = c.keys + head * c.capacity * D;
    // the candidates' blocks are scattered over an archive larger than the caches: each is fetched
    // two blocks before it is needed
    constexpr int64_t ahead = 2;
    score_items(G, K, stride, logits, [&](int64_t g, int64_t k) {
        if (k % B == 0 && k + ahead * B < K)
            for (int64_t i = 0; i < B * D; i += 16)
                _mm_prefetch(reinterpret_cast<const char*>(keys + keys_out[k + ahead * B] * D + i), _MM_HINT_T0);
        return dot4(keys + keys_out[k] * D, q + g * D, D);
    });
    std::fill(mass_out, mass_out + K, 0.0f);
    for (int64_t g = 0; g < G; ++g) softmax_into(logits + g * stride, K, scaling, mass_out);
}

// The window slots of one head whose token changed <- copies of the archive tokens `tokens` (keys
// rotated to their slot positions, scores 0); returns how many were written.
int32_t fill_head(const Choice& c, int64_t layer, int64_t h, const int64_t* tokens, int64_t* held) {
    const int64_t D = c.dim, half = D / 2, head = layer * c.heads + h;
    const float* keys = c.keys + head * c.capacity * D;
    const float* values = c.values + head * c.capacity * D;
    const int64_t* origins = c.origins + head * c.capacity;
    const int64_t at = layer * c.kv_layer_stride + h * c.kv_head_stride;
    float* scores = c.cache_scores ? c.cache_scores + layer * c.score_layer_stride + h * c.score_head_stride : nullptr;
    int32_t written = 0;
    for (int64_t j = 0; j < c.window; ++j) {
        if (held[j] == tokens[j]) continue;
        held[j] = tokens[j];
        ++written;
        const float* k = keys + tokens[j] * D;
        const float* cos = c.cos + j * D;
        const float* sin = c.sin + j * D;
        float* rotated = c.cache_rotated + at + j * D;
        memcpy(c.cache_keys + at + j * D, k, D * sizeof(float));
        memcpy(c.cache_values + at + j * D, values + tokens[j] * D, D * sizeof(float));
        for (int64_t d = 0; d < half; ++d) rotated[d] = k[d] * cos[d] - k[d + half] * sin[d];
        for (int64_t d = half; d < D; ++d) rotated[d] = k[d] * cos[d] + k[d - half] * sin[d];
        c.cache_origins[layer * c.origin_layer_stride + h * c.origin_head_stride + j] = origins[tokens[j]];
        if (scores) scores[j] = 0.0f;
    }
    return written;
}

int choose(const Choice& c, int32_t* written) {
    const int64_t heads = c.layers * c.heads, r = c.window, B = c.block, n = c.blocks * B;
    const int64_t K = c.candidates * B, mask = c.positions - 1;
    if (c.positions <= 0 || (c.positions & mask) || r > n || r <= 0 || c.candidates > c.blocks || c.dim % 8)
        return 1;
    const int threads = static_cast<int>(c.threads);
    std::vector<int64_t> chosen(heads * r);
    if (K <= r) {  // the archive fills the window: every head takes all of it
        for (int64_t head = 0; head < heads; ++head)
            std::iota(chosen.begin() + head * r, chosen.begin() + (head + 1) * r, 0);
    } else {
        std::vector<int64_t> candidates(heads * K);
        std::vector<float> mass(heads * K);
#pragma omp parallel num_threads(threads)
        {
            Scratch scratch;
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head)
                rank_head(c, head, scratch, candidates.data() + head * K, mass.data() + head * K);
        }
        // one thread, in head order: the votes' sums do not depend on the thread count
        static thread_local std::vector<float> votes, scores;
        static thread_local std::vector<double> prefix;
        votes.assign(c.positions, 0.0f);
        for (int64_t head = 0; head < heads; ++head)
            for (int64_t k = 0; k < K; ++k)
                votes[c.origins[head * c.capacity + candidates[head * K + k]] & mask] += mass[head * K + k];
        // scores[p] = votes[p] + the votes of positions max(0, p - span) .. min(P - 1, p + span), summed in fp64
        prefix.resize(c.positions + 1);
        scores.resize(c.positions);
        prefix[0] = 0.0;
        for (int64_t p = 0; p < c.positions; ++p) prefix[p + 1] = prefix[p] + votes[p];
        for (int64_t p = 0; p < c.positions; ++p) {
            const int64_t first = std::max<int64_t>(0, p - c.span), last = std::min<int64_t>(c.positions - 1, p + c.span);
            scores[p] = votes[p] + static_cast<float>(prefix[last + 1] - prefix[first]);
        }
        const float* score_of = scores.data();
#pragma omp parallel num_threads(threads)
        {
            std::vector<float> score(n);
            std::vector<uint64_t> keys;
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head) {
                const int64_t* origins = c.origins + head * c.capacity;
                for (int64_t t = 0; t < n; ++t) score[t] = score_of[origins[t] & mask];
                best_of(score.data(), n, r, keys, chosen.data() + head * r);
            }
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t head = 0; head < heads; ++head)
        written[head] = fill_head(c, head / c.heads, head % c.heads, chosen.data() + head * r, c.held + head * r);
    return 0;
}

}  // namespace

extern "C" {

// Choose and fill one row's recall window over all layers (see Choice); written: [L, H] int32, the
// slots rewritten per head. Returns 0, or nonzero with nothing written for a shape it cannot run.
int h2o_recall_choose(const Choice* choice, int32_t* written) { return choose(*choice, written); }

}
