// A decode step's choice of one row's recall window over all layers, on the CPU, in one call:
// `Archive.select(everywhere=True)` followed by `recall.fill`, the same math with no per-op Python or
// dispatch (which was most of the ~13 ms the torch ops took per row and choice).
//
// Per layer and KV head (threads split the heads; every head's result is computed alone, in a fixed
// order, so it does not depend on the thread count):
//   1. bound: for each of the head's G queries, softmax over its N full blocks of the digests' upper
//      bound of q.k * scaling, sum_d max(q_d lo_d, q_d hi_d) (= q+ . hi + q- . lo; q . centre where
//      lo and hi are one buffer, the "centre" digest), summed over the queries; the `candidates`
//      blocks of most mass (ties: the lower block first). With a sweep (`kept`), a head that kept its
//      candidates ranks only those, its reply's first choice's and a stripe of `sweep` blocks in turn.
//   2. exact: softmax over the candidates' keys (their fp16 copies, `Archive`) of q.k * scaling,
//      summed over the queries: each candidate key's attention mass. Where every block is a candidate,
//      stage 1 is skipped (it could only rank them).
// Stages 1-2 run for the heads of the `voters` layers alone where the Choice names some (the choices
// after a reply's burst, `CacheConfig.recall_voters`): only their keys are read.
// Then, in head order (one thread: the sums' order is fixed), every candidate key's mass is added to
// the vote of its original position modulo `positions`; each position's vote plus the votes of the
// positions within `span` of it (summed in fp64, as `selection.span_votes`) scores every archived
// token of every head, and each head takes its `window` tokens of most score (ties: the lower index),
// in ascending order: by ranking only its tokens at the few hundred positions of the best scores, found
// through the row's position index where the Choice has one (`best_indexed`: the positions walked best
// first, no origin read but those of the tokens it holds) or among its origins (`best_above`), or,
// where those cannot decide, all its tokens (`best_by_scan`). A slot whose token `held`
// names is among them keeps it; the other slots take the tokens not held yet (`recall.assign`): key,
// value and origin copied from the archive, the key rotated to where its token stood in the text among
// the row's own tokens (slots window .. length - 1; `recall.text_positions`), score 0. A slot that
// keeps its token keeps its place: the own tokens have not moved since it was placed (an eviction
// places the whole window).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <vector>

#include "amx_products.h"
#include "placement.h"
#include "vector_math.h"

namespace {

struct Choice {
    int64_t layers, heads, dim, group;  // KV heads; queries per KV head
    int64_t blocks, block, capacity, digest_capacity;  // full blocks; tokens per block; strides per head
    int64_t window, candidates, span, positions, threads;
    double scaling;
    const float* queries;  // [L, H, G, D], before RoPE
    const uint16_t* lo;    // [L, H, digest_capacity, D] fp16
    const uint16_t* hi;
    const void* keys;      // [L, H, capacity, D], before RoPE: fp32, or fp16 where archive_fp16
    const void* values;
    const int64_t* origins;  // [L, H, capacity]
    const float* cos;      // [length, D]: the model's RoPE table
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
    const float* frequencies;  // [D / 2], RoPE's, each <= 1
    int64_t length;        // the row's slots: its own tokens are window .. length - 1
    const uint16_t* half;  // [L, H, capacity, D]: the keys of the full blocks in 16 bits, for ranking
    int64_t half_bf16;     // half holds bf16 (a bf16 archive ranks by its own keys), else fp16
    int64_t archive_fp16;  // keys and values hold fp16 (an fp32 cache's archive), widened as copied
    uint16_t* window_keys;  // nullable: the window's fp16 copy (`recall.WindowCopy`), kept equal to
    uint16_t* window_values;  // cache_rotated and cache_values at l * window_layer_stride + h * window_head_stride + j * D
    int64_t window_layer_stride, window_head_stride;
    const int64_t* voters;  // nullable: the layers (ascending, voter_layers of them) whose heads' attention
    int64_t voter_layers;   // votes; every head of every layer still takes its tokens by those votes
    double margin;          // a decode choice ranks a head's held tokens by their scores x (1 + margin)
    int64_t query_layer_stride;  // floats from one layer's queries to the next (0: heads x group x dim,
                                 // contiguous); a row of a batch's query buffer is read in place
    int32_t* index;         // nullable: the row's position index (`PositionIndex`), [index_rows + 1][L x H]
    int64_t index_rows;     // positions the index has rows for
    int64_t* index_state;   // [1]: tokens per head indexed so far (0: the index is to be cleared first)
    int64_t* total;         // nullable: [1] <- the slots the choice rewrote, all heads summed
    // A decode choice's running candidates (`archive.Sweep`): where `kept` is given, each head's candidate
    // blocks are written there (ascending) and counted in kept_count, and a choice that ranked every
    // block also writes them into `question` (a reply's first choice: its question's); a head that kept
    // `candidates` of them ranks, where `sweep` > 0, only those, the question's and the `sweep` blocks
    // from *sweep_cursor on (modulo the blocks), not every block, and the cursor moves on by `sweep` after
    // a choice that ranked by the bound.
    int64_t* kept;          // nullable: [L, H, candidates] in/out
    int64_t* question;      // [L, H, candidates] in/out
    int64_t* kept_count;    // [L, H] in/out: 0 where a head keeps none (its next choice ranks every block)
    int64_t* sweep_cursor;  // [1] in/out
    int64_t sweep;
};

// The queries of `head` (layer * heads + h, of the call's layers): `group` rows of `dim` floats.
inline const float* head_queries(const Choice& c, int64_t head) {
    const int64_t per_layer = c.heads * c.group * c.dim;
    const int64_t stride = c.query_layer_stride ? c.query_layer_stride : per_layer;
    return c.queries + (head / c.heads) * stride + (head % c.heads) * c.group * c.dim;
}

// Whether `voters` names at least one layer, each of the choice's, ascending.
bool voters_valid(const Choice& c) {
    if (!c.voters) return true;
    for (int64_t i = 0; i < c.voter_layers; ++i)
        if (c.voters[i] < 0 || c.voters[i] >= c.layers || (i && c.voters[i] <= c.voters[i - 1])) return false;
    return c.voter_layers > 0;
}

// The heads (layer * heads + head) whose attention votes: those of `voters`' layers, else every head.
std::vector<int64_t> voting_heads(const Choice& c) {
    std::vector<int64_t> heads;
    const int64_t layers = c.voters ? c.voter_layers : c.layers;
    for (int64_t i = 0; i < layers; ++i)
        for (int64_t h = 0; h < c.heads; ++h) heads.push_back((c.voters ? c.voters[i] : i) * c.heads + h);
    return heads;
}
// cache_keys null: only `held` and `written` are written, and cos, sin, frequencies, keys, values and
// the cache's pointers are not read (a window on a device: the slots that changed are copied there).

// 8 16-bit values (fp16, or bf16 where bf16) widened exactly to fp32.
inline __m256 load8_16(const uint16_t* a, bool bf16) {
    if (!bf16) return load8_fp16(a);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// out[g] = hi . p[g] + lo . n[g] for g < 4: the digests' bound for four queries split into their
// positive (p) and negative (n) parts.
inline __m128 bound4(const uint16_t* lo, const uint16_t* hi, const float* p, const float* n, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < d; i += 8) {
        const __m256 l = load8_fp16(lo + i), h = load8_fp16(hi + i);
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

// p[0..n) <- softmax(p[0..n) * scaling), then mass[i] += p[i] (first: mass[i] = p[i], no zeros
// written before). The AVX2 version; `softmax_into` takes the AVX-512 one where the CPU has it.
inline void softmax_into_avx2(float* p, int64_t n, float scaling, float* mass, bool first) {
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
    if (first) {
        for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(mass + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), inverse8));
        for (int64_t j = i; j < n; ++j) mass[j] = p[j] * inverse;
        return;
    }
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(mass + i, _mm256_fmadd_ps(_mm256_loadu_ps(p + i), inverse8, _mm256_loadu_ps(mass + i)));
    for (int64_t j = i; j < n; ++j) mass[j] += p[j] * inverse;
}

// `softmax_into_avx2` with AVX-512: the same floats bit for bit. Each element gets the same operations
// (those past the last multiple of 8 the same scalar ones), the maximum is exact in any order, and the
// sum keeps the AVX2 version's order: 8 lanes, each adding its elements in turn (a 16-lane block's low
// half, then its high half), then `hsum8`, then the scalar tail.
__attribute__((target("avx512f")))
void softmax_into_avx512(float* p, int64_t n, float scaling, float* mass, bool first) {
    const __m512 scale = _mm512_set1_ps(scaling);
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    const int64_t wide = n / 16 * 16, vector = n / 8 * 8;
    int64_t i = 0;
    for (; i < wide; i += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(p + i), scale);
        _mm512_storeu_ps(p + i, x);
        top16 = _mm512_max_ps(top16, x);
    }
    float top = _mm512_reduce_max_ps(top16);
    for (; i < vector; ++i) top = std::max(top, p[i] *= scaling);  // a last 8: the same products
    for (int64_t j = vector; j < n; ++j) top = std::max(top, p[j] *= scaling);
    const __m512 shift = _mm512_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (i = 0; i < wide; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + i), shift));
        _mm512_storeu_ps(p + i, e);
        sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(e));
        sum8 = _mm256_add_ps(sum8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    if (i < vector) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(top)));
        _mm256_storeu_ps(p + i, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float total = hsum8(sum8);
    for (int64_t j = vector; j < n; ++j) total += (p[j] = expf(p[j] - top));
    const float inverse = 1.0f / total;
    const __m512 inverse16 = _mm512_set1_ps(inverse);
    if (first) {
        for (i = 0; i < wide; i += 16) _mm512_storeu_ps(mass + i, _mm512_mul_ps(_mm512_loadu_ps(p + i), inverse16));
        for (; i < n; ++i) mass[i] = p[i] * inverse;
        return;
    }
    for (i = 0; i < wide; i += 16)
        _mm512_storeu_ps(mass + i, _mm512_fmadd_ps(_mm512_loadu_ps(p + i), inverse16, _mm512_loadu_ps(mass + i)));
    for (; i < vector; ++i) mass[i] = fmaf(p[i], inverse, mass[i]);  // the AVX2 version's fused products
    for (int64_t j = vector; j < n; ++j) mass[j] += p[j] * inverse;
}

inline void softmax_into(float* p, int64_t n, float scaling, float* mass, bool first = false) {
    static const bool wide = __builtin_cpu_supports("avx512f");
    (wide ? softmax_into_avx512 : softmax_into_avx2)(p, n, scaling, mass, first);
}

// Items packed for `panel_product`: tiles of 16 items, each [depth][16] (item i of a tile at
// column i), the items past the last zero.
constexpr int64_t TILE = 16;

// out[g * ldo + j] = q[g] . item j, for queries g < G (rows of `depth` floats, G a multiple of 4) and
// the items of `tiles` packed tiles (j < 16 * tiles): 4 queries x 16 items per pass over the depth,
// eight accumulators, every item loaded once per 4 queries and every query value broadcast once.
void panel_product_avx2(const float* q, int64_t G, int64_t depth, const float* panel, int64_t tiles, float* out,
                        int64_t ldo) {
    for (int64_t g = 0; g < G; g += 4) {
        const float *q0 = q + g * depth, *q1 = q0 + depth, *q2 = q1 + depth, *q3 = q2 + depth;
        for (int64_t t = 0; t < tiles; ++t) {
            const float* p = panel + t * depth * TILE;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
            for (int64_t d = 0; d < depth; ++d) {
                const __m256 lo = _mm256_loadu_ps(p + d * TILE), hi = _mm256_loadu_ps(p + d * TILE + 8);
                __m256 x = _mm256_broadcast_ss(q0 + d);
                a0 = _mm256_fmadd_ps(lo, x, a0);
                a1 = _mm256_fmadd_ps(hi, x, a1);
                x = _mm256_broadcast_ss(q1 + d);
                b0 = _mm256_fmadd_ps(lo, x, b0);
                b1 = _mm256_fmadd_ps(hi, x, b1);
                x = _mm256_broadcast_ss(q2 + d);
                c0 = _mm256_fmadd_ps(lo, x, c0);
                c1 = _mm256_fmadd_ps(hi, x, c1);
                x = _mm256_broadcast_ss(q3 + d);
                d0 = _mm256_fmadd_ps(lo, x, d0);
                d1 = _mm256_fmadd_ps(hi, x, d1);
            }
            float* o = out + g * ldo + t * TILE;
            _mm256_storeu_ps(o, a0);
            _mm256_storeu_ps(o + 8, a1);
            _mm256_storeu_ps(o + ldo, b0);
            _mm256_storeu_ps(o + ldo + 8, b1);
            _mm256_storeu_ps(o + 2 * ldo, c0);
            _mm256_storeu_ps(o + 2 * ldo + 8, c1);
            _mm256_storeu_ps(o + 3 * ldo, d0);
            _mm256_storeu_ps(o + 3 * ldo + 8, d1);
        }
    }
}

// The same with AVX-512: two tiles (32 items) per pass, one register each. Every output is the same
// sequence of fused multiply-adds over the depth as in the AVX2 version, so the two agree bit for bit.
__attribute__((target("avx512f")))
void panel_product_avx512(const float* q, int64_t G, int64_t depth, const float* panel, int64_t tiles, float* out,
                          int64_t ldo) {
    for (int64_t g = 0; g < G; g += 4) {
        const float *q0 = q + g * depth, *q1 = q0 + depth, *q2 = q1 + depth, *q3 = q2 + depth;
        int64_t t = 0;
        for (; t + 2 <= tiles; t += 2) {
            const float* p = panel + t * depth * TILE;
            const float* p1 = p + depth * TILE;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
            for (int64_t d = 0; d < depth; ++d) {
                const __m512 x0 = _mm512_loadu_ps(p + d * TILE), x1 = _mm512_loadu_ps(p1 + d * TILE);
                __m512 y = _mm512_set1_ps(q0[d]);
                a0 = _mm512_fmadd_ps(x0, y, a0);
                a1 = _mm512_fmadd_ps(x1, y, a1);
                y = _mm512_set1_ps(q1[d]);
                b0 = _mm512_fmadd_ps(x0, y, b0);
                b1 = _mm512_fmadd_ps(x1, y, b1);
                y = _mm512_set1_ps(q2[d]);
                c0 = _mm512_fmadd_ps(x0, y, c0);
                c1 = _mm512_fmadd_ps(x1, y, c1);
                y = _mm512_set1_ps(q3[d]);
                d0 = _mm512_fmadd_ps(x0, y, d0);
                d1 = _mm512_fmadd_ps(x1, y, d1);
            }
            float* o = out + g * ldo + t * TILE;
            _mm512_storeu_ps(o, a0);
            _mm512_storeu_ps(o + TILE, a1);
            _mm512_storeu_ps(o + ldo, b0);
            _mm512_storeu_ps(o + ldo + TILE, b1);
            _mm512_storeu_ps(o + 2 * ldo, c0);
            _mm512_storeu_ps(o + 2 * ldo + TILE, c1);
            _mm512_storeu_ps(o + 3 * ldo, d0);
            _mm512_storeu_ps(o + 3 * ldo + TILE, d1);
        }
        if (t < tiles) panel_product_avx2(q + g * depth, 4, depth, panel + t * depth * TILE, 1, out + g * ldo + t * TILE, ldo);
    }
}

// panel_product_avx512 where the CPU has AVX-512, else panel_product_avx2 (the same results).
void panel_product(const float* q, int64_t G, int64_t depth, const float* panel, int64_t tiles, float* out,
                   int64_t ldo) {
    static const bool wide = __builtin_cpu_supports("avx512f");
    (wide ? panel_product_avx512 : panel_product_avx2)(q, G, depth, panel, tiles, out, ldo);
}

// r[i] <- column i of the 8 x 8 matrix whose rows are r[0..8).
inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// Rows offset .. offset + width of the tiles (`panel_product`, `depth` rows each) <- items j0 .. j1
// (j0 a multiple of 16), item j's width 16-bit values (fp16, or bf16 where bf16) at rows(j), widened
// exactly; width a multiple of 8. Whole tiles go 8 items x 8 values at a time, transposed in
// registers; the items past the last whole tile one by one, the rest of their tile zeroed.
template <class Row>
void pack_tiles(int64_t j0, int64_t j1, int64_t width, int64_t depth, int64_t offset, Row rows, float* panel,
                bool bf16 = false) {
    int64_t j = j0;
    for (; j + TILE <= j1; j += TILE) {
        float* tile = panel + (j / TILE) * depth * TILE + offset * TILE;
        for (int64_t half = 0; half < TILE; half += 8) {
            const uint16_t* from[8];
            for (int i = 0; i < 8; ++i) from[i] = rows(j + half + i);
            for (int64_t d = 0; d < width; d += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; ++i) r[i] = load8_16(from[i] + d, bf16);
                transpose8(r);
                for (int i = 0; i < 8; ++i) _mm256_storeu_ps(tile + (d + i) * TILE + half, r[i]);
            }
        }
    }
    if (j == j1) return;
    float* tile = panel + (j / TILE) * depth * TILE + offset * TILE;
    for (int64_t d = 0; d < width; ++d) std::fill(tile + d * TILE, tile + (d + 1) * TILE, 0.0f);
    for (; j < j1; ++j) {
        const uint16_t* row = rows(j);
        for (int64_t d = 0; d < width; ++d) tile[d * TILE + j % TILE] = widen(row[d], bf16);
    }
}

// A score >= 0 and an index packed so that a greater key is a greater score, then a lower index
// (the bits of a non-negative float order as the float does).
inline uint64_t rank_key(float score, int64_t index) {
    uint32_t bits;
    memcpy(&bits, &score, 4);
    return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}

inline int64_t key_index(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// keys[0..n) (`rank_key`s, all distinct) -> a pool whose first k are the k greatest (in no order), its
// size into size: keys itself, reordered, or where n >= 3k, `passed`: every 4th key gives a threshold
// that lets ~1.5k of them through, and the k greatest are among those whenever at least k pass (else
// all n are selected from). A selection's branches mispredict about every other key: the fewer keys
// it sees, the less it costs (a head's ~500 keys of a decode choice: ~40% less).
uint64_t* greatest_first(uint64_t* keys, int64_t n, int64_t k, std::vector<uint64_t>& passed, int64_t& size) {
    uint64_t* pool = keys;
    size = n;
    constexpr int64_t stride = 4;
    if (n >= 3 * k && n >= 64) {
        const int64_t m = n / stride, at = std::min<int64_t>(m - 1, 3 * k / (2 * stride));
        passed.resize(n);  // the sample, then the keys that pass
        for (int64_t i = 0; i < m; ++i) passed[i] = keys[i * stride];
        std::nth_element(passed.begin(), passed.begin() + at, passed.begin() + m, std::greater<uint64_t>());
        const uint64_t threshold = passed[at];
        int64_t count = 0;
        for (int64_t i = 0; i < n; ++i) {  // no branch: every key written, the count moved by those that pass
            passed[count] = keys[i];
            count += keys[i] >= threshold;
        }
        if (count >= k) {
            pool = passed.data();
            size = count;
        }
    }
    std::nth_element(pool, pool + (k - 1), pool + size, std::greater<uint64_t>());
    return pool;
}

// keys[0..n) (`rank_key`s, all distinct) -> the indices of the k greatest, ascending, into out; keys is
// reordered.
void best_of_keys(std::vector<uint64_t>& keys, int64_t n, int64_t k, std::vector<uint64_t>& passed, int64_t* out) {
    int64_t size;
    const uint64_t* pool = greatest_first(keys.data(), n, k, passed, size);
    for (int64_t i = 0; i < k; ++i) out[i] = key_index(pool[i]);
    std::sort(out, out + k);
}

// The k indices of most score[0..n) (scores >= 0; ties: the lower index), ascending, into out (resized
// to k): the k-th greatest key found, then every index whose key is at least it, in order, not sorted
// (a head's 256 of ~1,000 blocks: the sort took as long as the selection).
void best_of(const float* score, int64_t n, int64_t k, std::vector<uint64_t>& keys, std::vector<uint64_t>& passed,
             std::vector<int64_t>& out) {
    keys.resize(n);
    for (int64_t i = 0; i < n; ++i) keys[i] = rank_key(score[i], i);
    int64_t size;
    const uint64_t least = greatest_first(keys.data(), n, k, passed, size)[k - 1];
    out.resize(n + 1);  // no branch: every index written, the count moved by those of the k
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
        out[count] = i;
        count += rank_key(score[i], i) >= least;
    }
    out.resize(k);
}

// The shared scores of a decode choice, for each head to take its tokens by: every position's score,
// the positions of a score above `threshold` as a bitmap (bit p of above[p / 64]; `rank_positions`),
// the mask that maps an origin to its position, and the factor of a held token's score.
struct Ranked {
    const uint64_t* above;
    const float* score;
    int64_t mask;
    float bonus;
};

// The positions first .. last of a positive score[p] (score[p]: the score of origins p modulo
// mask + 1; a held token's counts `bonus` times) marked in `above` where their score is above a
// threshold: 0 where at most `want` positions score, else the score of the want-th best, so that at
// most `want` are marked (heads rarely need more than their window's r and what they hold themselves).
// Every position above the threshold is marked, and none at or below it: a head's tokens at the marked
// positions are all its tokens of a score above the threshold (`best_above`).
Ranked rank_positions(const float* score, int64_t first, int64_t last, int64_t want, int64_t mask, float bonus,
                      std::vector<float>& scores, std::vector<uint64_t>& above) {
    above.assign((mask + 64) / 64, 0);
    scores.clear();
    for (int64_t p = first; p <= last; ++p)
        if (score[p] > 0.0f) scores.push_back(score[p]);
    float threshold = 0.0f;
    if (want < static_cast<int64_t>(scores.size())) {
        std::nth_element(scores.begin(), scores.begin() + (want - 1), scores.end(), std::greater<float>());
        threshold = scores[want - 1];
    }
    for (int64_t p = first; p <= last; ++p)
        if (score[p] > threshold) above[p >> 6] |= 1ull << (p & 63);
    return {above.data(), score, mask, bonus};
}

// flag[t] = to for every token t of held[0..r) that is one of the n (-1 or beyond: none).
inline void mark_held(uint8_t* flag, const int64_t* held, int64_t r, int64_t n, uint8_t to) {
    for (int64_t j = 0; j < r; ++j)
        if (held[j] >= 0 && held[j] < n) flag[held[j]] = to;
}

// One thread's scratch for heads taking their tokens: ranking keys, the tokens at marked positions,
// held-token flags (zero between calls).
struct HeadScratch {
    std::vector<uint64_t> keys, passed, held, chosen;
    std::vector<int64_t> hits;
    std::vector<uint8_t> flag;
};

inline uint64_t token_key(const Ranked& s, const int64_t* origins, int64_t t, bool held) {
    const float score = s.score[origins[t] & s.mask];
    return rank_key(held ? score * s.bonus : score, t);
}

// The ranking key of the token t that a head's window slot j holds: its origin read from the window
// (held_origins: the window's origins, which a slot's copy of its token holds; nullable: the archive's,
// a scattered read, cold after the step, for each of the r held tokens of each of the 90 heads).
inline uint64_t held_key(const Ranked& s, const int64_t* origins, const int64_t* held_origins, int64_t j, int64_t t) {
    const int64_t origin = held_origins ? held_origins[j] : origins[t];
    return rank_key(s.score[origin & s.mask] * s.bonus, t);
}

// The window's origins of a Choice that writes the window (cache_origins given), of layer `layer`'s
// KV head h: slot j's at [j].
inline int64_t* window_origins(const Choice& c, int64_t layer, int64_t h) {
    return c.cache_origins + layer * c.origin_layer_stride + h * c.origin_head_stride;
}

// The head's r tokens of most score (a held token's times the bonus; ties: the lower index), ascending,
// into out: every one of its n tokens ranked.
void best_by_scan(const Ranked& s, const int64_t* origins, int64_t n, const int64_t* held, int64_t r, HeadScratch& h,
                  int64_t* out) {
    h.keys.resize(n);
    h.flag.resize(n);
    const bool favour = s.bonus != 1.0f;
    if (favour) mark_held(h.flag.data(), held, r, n, 1);
    for (int64_t t = 0; t < n; ++t) h.keys[t] = token_key(s, origins, t, favour && h.flag[t]);
    if (favour) mark_held(h.flag.data(), held, r, n, 0);
    best_of_keys(h.keys, n, r, h.passed, out);
}

// The indices of the r greatest of h.keys (`rank_key`s of the head's n tokens, all distinct), ascending,
// into out by their bits in h.chosen; h.keys is reordered.
void best_ascending(HeadScratch& h, int64_t n, int64_t r, int64_t* out) {
    const int64_t words = (n + 63) / 64;
    h.chosen.assign(words, 0);
    uint64_t* const chosen = h.chosen.data();  // a local: a store through it may alias what h holds
    int64_t size;
    const uint64_t* const best = greatest_first(h.keys.data(), static_cast<int64_t>(h.keys.size()), r, h.passed, size);
    for (int64_t j = 0; j < r; ++j) {
        const int64_t t = key_index(best[j]);
        chosen[t >> 6] |= 1ull << (t & 63);
    }
    int64_t k = 0;
    for (int64_t w = 0; w < words; ++w)
        for (uint64_t word = chosen[w]; word; word &= word - 1) out[k++] = w * 64 + __builtin_ctzll(word);
}

// The same tokens as `best_by_scan`, ranking only the head's tokens at the marked positions (those of a
// score above the threshold: ~the threshold's `want` of them, not all n) that it does not hold, and
// (with a bonus) every token it holds. Where at least r tokens it does not hold score above the
// threshold, every other token it does not hold scores at most the threshold, below all of them, and
// cannot be among the r best: the same tokens as ranking them all, whatever the positions (two of its
// tokens at one position of a conversation longer than the positions rank as the scan ranks them).
// Returns false, having written nothing, where fewer than r do (the rest tie at or below the
// threshold, where the lower index decides).
bool best_above(const Ranked& s, const int64_t* origins, int64_t n, const int64_t* held, const int64_t* held_origins,
                int64_t r, HeadScratch& h, int64_t* out) {
    const int64_t words = (n + 63) / 64;
    h.held.assign(words, 0);
    h.hits.resize(n);
    // locals, not members: a store through the hits or the bits may alias anything read through s or h
    uint64_t* const held_bits = h.held.data();
    int64_t* const hits = h.hits.data();
    const uint64_t* const above = s.above;
    const int64_t mask = s.mask;
    const bool favour = s.bonus != 1.0f;
    if (favour)
        for (int64_t j = 0; j < r; ++j)
            if (held[j] >= 0 && held[j] < n) held_bits[held[j] >> 6] |= 1ull << (held[j] & 63);
    // the tokens at marked positions, 64 at a time as the bits of a word (no branch per token), less
    // those held, then each set bit's token; the origins (cold: the step since read ~100 MB of weights)
    // fetched 4 words ahead
    int64_t count = 0;
    for (int64_t w = 0; w < words; ++w) {
        const int64_t first = w * 64, m = std::min<int64_t>(64, n - first);
        for (int64_t b = 0; b < 64; b += 8)  // a 64-byte line of 8 origins each
            _mm_prefetch(reinterpret_cast<const char*>(origins + std::min(first + 256 + b, n - 1)), _MM_HINT_T0);
        uint64_t word = 0;
        for (int64_t i = 0; i < m; ++i) {
            const uint64_t p = static_cast<uint64_t>(origins[first + i] & mask);
            word |= ((above[p >> 6] >> (p & 63)) & 1) << i;
        }
        for (word &= ~held_bits[w]; word; word &= word - 1) hits[count++] = first + __builtin_ctzll(word);
    }
    if (count < r) return false;
    h.keys.resize(count);
    for (int64_t i = 0; i < count; ++i) h.keys[i] = rank_key(s.score[origins[hits[i]] & mask], hits[i]);
    if (favour) {
        for (int64_t j = 0; j < r; ++j) {
            const int64_t t = held[j];
            if (t >= 0 && t < n && (held_bits[t >> 6] >> (t & 63) & 1)) {
                held_bits[t >> 6] &= ~(1ull << (t & 63));  // once
                h.keys.push_back(held_key(s, origins, held_origins, j, t));
            }
        }
    }
    best_ascending(h, n, r, out);  // the r best of ~want + what the head holds
    return true;
}

// A decode choice's position index of a row's archive, for each head to find its tokens at the best
// positions without reading all its origins (which, cold after the step, took most of the picks' time):
// entry [p][head] (p < index_rows, head = layer * H + h of all the row's layers) is the head's archived
// token at position p (its origin modulo `positions`) among the full blocks, -1 for none, or -2 where it
// holds two there (a conversation longer than `positions`); row index_rows holds a flag per head, 1
// where one of its tokens lay past the rows. A head with either takes its tokens as without the index.
// Full blocks keep their indices until the archive drops its oldest blocks (`Archive.epoch`), when the
// caller zeroes index_state; between, each call indexes the tokens of the blocks formed since the last.
void update_index(const int64_t* origins_of, int64_t capacity, int64_t heads, int64_t n, int64_t mask,
                  int32_t* index, int64_t rows, int64_t* state, int threads) {
    int32_t* const flags = index + rows * heads;
    int64_t from = *state;
    if (from == 0 || from > n) {  // cleared (a new archive, epoch or table), or not this archive's: again
        std::fill(index, index + (rows + 1) * heads, -1);
        std::fill(flags, flags + heads, 0);
        from = 0;
    }
    if (from == n) return;
#pragma omp parallel for num_threads(threads) schedule(static) if (n - from > 256)
    for (int64_t head = 0; head < heads; ++head) {
        const int64_t* origins = origins_of + head * capacity;
        for (int64_t t = from; t < n; ++t) {
            const int64_t p = origins[t] & mask;
            if (p >= rows) {
                flags[head] = 1;
                continue;
            }
            int32_t& entry = index[p * heads + head];
            entry = entry == -1 ? static_cast<int32_t>(t) : -2;
        }
    }
    *state = n;
}

// The marked positions (a score above the threshold) as (score, position), the greatest score first
// (ties: any order).
struct Marked {
    float score;
    int32_t position;
};
void marked_by_score(const Ranked& s, int64_t first, int64_t last, std::vector<Marked>& order) {
    order.clear();
    for (int64_t w = first >> 6; w <= (last >> 6); ++w)
        for (uint64_t word = s.above[w]; word; word &= word - 1) {
            const int64_t p = w * 64 + __builtin_ctzll(word);
            order.push_back({s.score[p], static_cast<int32_t>(p)});
        }
    std::sort(order.begin(), order.end(), [](const Marked& a, const Marked& b) { return a.score > b.score; });
}

// The tokens of `best_above` read from the position index: the head's tokens at the marked positions
// that it does not hold, the best first, until r are taken and the next scores less than the r-th (the
// ties of the r-th all taken, the lower index deciding among them as `rank_key` does), and with a
// margin every token it holds (its score times the bonus, its position read from its origin); the r
// best of those, ascending, into out. Returns false, having written nothing, where the index cannot
// answer for the head (a position it holds twice) or fewer than r of the tokens it does not hold are
// marked (as `best_above`).
bool best_indexed(const Ranked& s, const std::vector<Marked>& order, const int32_t* index, int64_t heads,
                  int64_t head, const int64_t* origins, int64_t n, const int64_t* held, const int64_t* held_origins,
                  int64_t r, HeadScratch& h, int64_t* out) {
    const int64_t words = (n + 63) / 64;
    const bool favour = s.bonus != 1.0f;
    h.keys.clear();
    uint64_t* held_bits = nullptr;
    if (favour) {
        h.held.assign(words, 0);
        held_bits = h.held.data();
        for (int64_t j = 0; j < r; ++j) {
            const int64_t t = held[j];
            if (t >= 0 && t < n && !(held_bits[t >> 6] >> (t & 63) & 1)) {  // once
                held_bits[t >> 6] |= 1ull << (t & 63);
                h.keys.push_back(held_key(s, origins, held_origins, j, t));
            }
        }
    }
    const int64_t base = static_cast<int64_t>(h.keys.size());
    float rth = 0.0f;
    for (const Marked& m : order) {
        const float score = m.score;
        const int64_t taken = static_cast<int64_t>(h.keys.size()) - base;
        if (taken >= r && score < rth) break;
        const int32_t t = index[m.position * heads + head];
        if (t == -1) continue;
        if (t < 0) return false;
        if (favour && (held_bits[t >> 6] >> (t & 63) & 1)) continue;
        h.keys.push_back(rank_key(score, t));
        if (taken + 1 == r) rth = score;
    }
    if (static_cast<int64_t>(h.keys.size()) - base < r) return false;
    best_ascending(h, n, r, out);
    return true;
}

// Scratch of one thread: queries split into their parts, logits, masses, ranking keys.
struct Scratch {
    std::vector<float> queries, logits, mass;
    std::vector<int64_t> best, scanned, both;
    std::vector<uint64_t> keys, passed;
};

// Queries g0 .. g1 of one head, into s.queries as [3][padded][D]: the queries, their positive parts,
// their negative parts (padding rows 0). Returns the padded count.
int64_t load_queries(const Choice& c, int64_t head, int64_t g0, int64_t g1, Scratch& s) {
    const int64_t D = c.dim, G = g1 - g0, padded = (G + 3) / 4 * 4;
    s.queries.assign(3 * padded * D, 0.0f);
    float *q = s.queries.data(), *positive = q + padded * D, *negative = positive + padded * D;
    memcpy(q, head_queries(c, head) + g0 * D, G * D * sizeof(float));
    for (int64_t i = 0; i < G * D; ++i) {
        positive[i] = std::max(q[i], 0.0f);
        negative[i] = std::min(q[i], 0.0f);
    }
    return padded;
}

// logits[g * stride + j] <- q[g] . key j for queries g < W (rows of d floats) and the 4 keys at[0..3]
// (d 16-bit values each, widened exactly to fp32; d a multiple of 8): one pass over the 4 keys, each
// widened once for the W queries, W x 4 accumulators (W <= 3: they and a key fit the 16 registers).
// Each logit is 8 lanes of fused multiply-adds over the depth, the lanes then summed pairwise
// ((0+1)+(2+3)) + ((4+5)+(6+7)): the sums of the loop it replaced (one key against 4 queries), so the
// windows chosen are the same bit for bit, with 4 logits of a query stored at once and no products
// for a padding 4th query of the default model's groups of 3 (the choice of 8 rows: 2% less time).
template <int W, bool BF16>
inline void dot_keys4(const uint16_t* const at[4], const float* q, int64_t d, float* logits, int64_t stride) {
    __m256 s[W][4];
    for (int g = 0; g < W; ++g)
        for (int j = 0; j < 4; ++j) s[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        for (int j = 0; j < 4; ++j) {
            const __m256 x = load8_16(at[j] + i, BF16);
            for (int g = 0; g < W; ++g) s[g][j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(q + g * d + i), s[g][j]);
        }
    for (int g = 0; g < W; ++g) {
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s[g][0], s[g][1]), _mm256_hadd_ps(s[g][2], s[g][3]));
        _mm_storeu_ps(logits + g * stride, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
}

// logits[g * K + k] <- q[g] . key k for g < G, k < K, the key k at key(k): queries 3 at a time, keys 4 at
// a time (`dot_keys4`); the last 1-3 keys go through a scratch.
template <bool BF16, class Key>
void dot_keys(const float* q, int64_t G, int64_t D, int64_t K, Key key, float* logits) {
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int64_t width = std::min<int64_t>(3, G - g0);
        const float* rows = q + g0 * D;
        float* out = logits + g0 * K;
        auto four = [&](const uint16_t* const at[4], float* to, int64_t stride) {
            if (width == 3) dot_keys4<3, BF16>(at, rows, D, to, stride);
            else if (width == 2) dot_keys4<2, BF16>(at, rows, D, to, stride);
            else dot_keys4<1, BF16>(at, rows, D, to, stride);
        };
        int64_t k = 0;
        for (; k + 4 <= K; k += 4) {
            const uint16_t* const at[4] = {key(k), key(k + 1), key(k + 2), key(k + 3)};
            four(at, out + k, K);
        }
        if (k < K) {  // the last keys, the missing ones repeated, into a scratch
            const uint16_t* at[4];
            for (int64_t j = 0; j < 4; ++j) at[j] = key(std::min(k + j, K - 1));
            alignas(16) float scratch[3 * 4];
            four(at, scratch, 4);
            for (int64_t g = 0; g < width; ++g)
                for (int64_t j = k; j < K; ++j) out[g * K + j] = scratch[g * 4 + j - k];
        }
    }
}

// `dot_keys` for keys of 16-bit values that are bf16 where bf16, else fp16.
template <class Key>
void key_logits(const float* q, int64_t G, int64_t D, int64_t K, Key key, bool bf16, float* logits) {
    if (bf16) dot_keys<true>(q, G, D, K, key, logits);
    else dot_keys<false>(q, G, D, K, key, logits);
}

// Items a choice reads in storage order (keys, digests) are asked for this many ahead: the hardware
// prefetcher stops at each 4 KB page and ramps up again after it, and they are cold after the step (a
// head's 1,808 keys after 64 MB of other reads: 51 us without, 32 us with; 16 to 128 ahead alike).
constexpr int64_t IN_ORDER_AHEAD = 32;

// Stage 1 for queries g0 .. g1 of one head: mass[n] += each query's softmax over the M blocks at[0..M)
// (null: the first M, in order) of the digests' bound (mass: M floats, not cleared). Digests of no width
// (lo and hi one buffer: "centre") score q . centre, the exact stage's products with the centres for
// keys: half the arithmetic of the box's two products, and no padding query.
void bound_part(const Choice& c, int64_t head, int64_t g0, int64_t g1, const int64_t* at, int64_t M, Scratch& s,
                float* mass) {
    const int64_t D = c.dim, G = g1 - g0;
    const int64_t padded = load_queries(c, head, g0, g1, s);
    const float* positive = s.queries.data() + padded * D;
    const float* negative = positive + padded * D;
    const uint16_t* lo = c.lo + head * c.digest_capacity * D;
    const uint16_t* hi = c.hi + head * c.digest_capacity * D;
    s.logits.resize(padded * M);
    float* logits = s.logits.data();
    const auto block = [at](int64_t n) { return at ? at[n] : n; };
    if (c.lo == c.hi) {  // the digests fetched IN_ORDER_AHEAD blocks early, as the exact stage's keys
        key_logits(s.queries.data(), G, D, M, [&](int64_t n) {
            if (n % 4 == 0 && n + IN_ORDER_AHEAD + 4 <= M)
                for (int64_t j = 0; j < 4; ++j) prefetch_row(lo + block(n + IN_ORDER_AHEAD + j) * D, D * 2);
            return lo + block(n) * D;
        }, false, logits);
    } else {
        score_items(G, M, M, logits, [&](int64_t g, int64_t n) {
            return bound4(lo + block(n) * D, hi + block(n) * D, positive + g * D, negative + g * D, D);
        });
    }
    for (int64_t g = 0; g < G; ++g) softmax_into(logits + g * M, M, static_cast<float>(c.scaling), mass);
}

// The blocks a swept head ranks: its kept candidates and its question's (`kept`, `question`: C each,
// ascending) and the `sweep` blocks from `cursor` on, modulo N, ascending and each once, into out (and
// `both`, scratch). Returns their count.
int64_t swept_blocks(const int64_t* kept, const int64_t* question, int64_t C, int64_t cursor, int64_t sweep,
                     int64_t N, std::vector<int64_t>& both, std::vector<int64_t>& out) {
    both.resize(2 * C);
    const int64_t K = std::set_union(kept, kept + C, question, question + C, both.begin()) - both.begin();
    // the stripe as one or two ascending runs: [0, wrap) and [cursor, end)
    const int64_t end = std::min(cursor + sweep, N), wrap = cursor + sweep - end;
    out.resize(K + sweep);
    int64_t m = 0, i = 0;
    const auto merge_run = [&](int64_t from, int64_t to) {
        for (int64_t b = from; b < to; ++b) {
            while (i < K && both[i] < b) out[m++] = both[i++];
            if (i < K && both[i] == b) ++i;
            out[m++] = b;
        }
    };
    merge_run(0, wrap);
    merge_run(cursor, end);
    while (i < K) out[m++] = both[i++];
    out.resize(m);
    return m;
}

// Stage 2 for queries g0 .. g1 of one head: mass[k] <- each query's softmax over the K candidate keys
// (storage indices `keys_at`; null: the first K) of q.k * scaling, summed over the queries (mass: K
// floats, written over: the first query's as adding it to zeros gives). The queries must be loaded
// (`load_queries`, the same range).
void exact_part(const Choice& c, int64_t head, int64_t g0, int64_t g1, const int64_t* keys_at, int64_t K,
                Scratch& s, float* mass) {
    const int64_t B = c.block, D = c.dim, G = g1 - g0;
    const float* q = s.queries.data();
    const uint16_t* keys = c.half + head * c.capacity * D;
    s.logits.resize(G * K);
    float* logits = s.logits.data();
    if (!keys_at) {  // every key, in storage order, fetched IN_ORDER_AHEAD keys early
        const int64_t* origins = c.origins + head * c.capacity;  // read after this stage, `rank_head`
        key_logits(q, G, D, K, [&](int64_t k) {
            if (k % 4 == 0 && k + IN_ORDER_AHEAD + 4 <= K) {
                prefetch_row(keys + (k + IN_ORDER_AHEAD) * D, 4 * D * 2);
                if (k % 8 == 0) prefetch_row(origins + k + IN_ORDER_AHEAD, 8 * sizeof(int64_t));
            }
            return keys + k * D;
        }, c.half_bf16, logits);
    } else {
        // the candidates' blocks are scattered over an archive larger than the caches: each is fetched
        // `ahead` blocks before it is needed, with its origins (read after this stage, `rank_head`)
        constexpr int64_t ahead = 2;
        const int64_t* origins = c.origins + head * c.capacity;
        key_logits(q, G, D, K, [&](int64_t k) {
            if (k % B == 0 && k + ahead * B < K) {
                const int64_t at = keys_at[k + ahead * B];
                prefetch_row(keys + at * D, B * D * 2);
                prefetch_row(origins + at, B * sizeof(int64_t));
            }
            return keys + keys_at[k] * D;
        }, c.half_bf16, logits);
    }
    for (int64_t g = 0; g < G; ++g) softmax_into(logits + g * K, K, static_cast<float>(c.scaling), mass, g == 0);
}

// Stages 1-2 for one head, all its queries: its candidates' positions (their origins modulo `positions`,
// in storage order, the blocks ascending: read here, beside the keys, where the heads share the
// threads, not in the votes' one thread, where scattered blocks' origins cost a cache miss each) and
// their masses.
void rank_head(const Choice& c, int64_t head, Scratch& s, int64_t* positions_out, float* mass_out) {
    const int64_t N = c.blocks, B = c.block, C = c.candidates, K = C * B;
    s.best.resize(C);
    if (C == N) {  // every block: the bound could only rank them
        load_queries(c, head, 0, c.group, s);
        std::iota(s.best.begin(), s.best.end(), 0);
        if (c.kept) c.kept_count[head] = 0;  // nothing ranked: the next choice with fewer candidates ranks all
    } else {
        int64_t* const kept = c.kept ? c.kept + head * C : nullptr;
        if (kept && c.sweep > 0 && C + c.sweep < N && c.kept_count[head] == C) {  // kept candidates and a stripe
            const int64_t M = swept_blocks(kept, c.question + head * C, C, *c.sweep_cursor % N, c.sweep, N, s.both,
                                           s.scanned);
            s.mass.assign(M, 0.0f);
            bound_part(c, head, 0, c.group, s.scanned.data(), M, s, s.mass.data());
            best_of(s.mass.data(), M, C, s.keys, s.passed, s.best);
            for (int64_t j = 0; j < C; ++j) s.best[j] = s.scanned[s.best[j]];  // ascending still
        } else {
            s.mass.assign(N, 0.0f);
            bound_part(c, head, 0, c.group, nullptr, N, s, s.mass.data());
            best_of(s.mass.data(), N, C, s.keys, s.passed, s.best);
            if (kept) std::copy(s.best.begin(), s.best.end(), c.question + head * C);  // every block ranked
        }
        if (kept) {
            std::copy(s.best.begin(), s.best.end(), kept);
            c.kept_count[head] = C;
        }
    }
    const int64_t* const origins = c.origins + head * c.capacity;
    const int64_t mask = c.positions - 1;
    if (C == N) {  // every key, in storage order: no indices to write
        exact_part(c, head, 0, c.group, nullptr, K, s, mass_out);
        for (int64_t k = 0; k < K; ++k) positions_out[k] = origins[k] & mask;
        return;
    }
    int64_t* const keys = positions_out;  // the candidates' key indices, then their positions
    for (int64_t j = 0; j < C; ++j)
        for (int64_t i = 0; i < B; ++i) keys[j * B + i] = s.best[j] * B + i;
    exact_part(c, head, 0, c.group, keys, K, s, mass_out);
    for (int64_t k = 0; k < K; ++k) positions_out[k] = origins[keys[k]] & mask;
}

// One head's window <- the archive tokens `tokens` (ascending): a slot whose token is among them keeps
// it; the others take the tokens not held yet, both in ascending order (`recall.assign`), as copies
// (keys rotated to their places in the text, scores 0; with cache_keys null, `held` alone is
// written). mark: `capacity` zeros, left zero. Returns
// how many slots were written, or -1 (nothing written) where `held` named a token twice.
int32_t fill_head(const Choice& c, int64_t layer, int64_t h, const int64_t* tokens, int64_t* held,
                  std::vector<uint8_t>& mark, std::vector<int64_t>& moves) {
    const int64_t D = c.dim, head = layer * c.heads + h, r = c.window;
    const int64_t* origins = c.origins + head * c.capacity;
    // mark 1: chosen; 2: chosen and held (its slot keeps it)
    for (int64_t j = 0; j < r; ++j) mark[tokens[j]] = 1;
    moves.resize(2 * r);
    int64_t* freed = moves.data();
    int64_t* incoming = freed + r;
    int64_t count = 0, fresh = 0;
    for (int64_t j = 0; j < r; ++j) {
        const int64_t t = held[j];
        if (t >= 0 && t < c.capacity && mark[t] == 1) mark[t] = 2;
        else freed[count++] = j;
    }
    for (int64_t j = 0; j < r; ++j) {
        if (mark[tokens[j]] == 1) incoming[fresh++] = tokens[j];
        mark[tokens[j]] = 0;
    }
    if (fresh != count) return -1;  // held named a token twice: cannot happen, refused
    if (!c.cache_keys) {  // the window lives elsewhere: only which slot takes which token
        for (int64_t i = 0; i < count; ++i) held[freed[i]] = incoming[i];
        return static_cast<int32_t>(count);
    }
    const bool narrow = c.archive_fp16;
    const int64_t bytes = narrow ? 2 : 4;  // per archived value
    const char* keys = static_cast<const char*>(c.keys) + head * c.capacity * D * bytes;
    const char* values = static_cast<const char*>(c.values) + head * c.capacity * D * bytes;
    float widened[2 * 512];  // an fp16 archive's key and value, in fp32 (D <= 512)
    const int64_t at = layer * c.kv_layer_stride + h * c.kv_head_stride;
    float* scores = c.cache_scores ? c.cache_scores + layer * c.score_layer_stride + h * c.score_head_stride : nullptr;
    int64_t* cache_origins = window_origins(c, layer, h);
    constexpr int64_t ahead = 4;  // the archive's rows are scattered and cold: fetched a few slots early
    for (int64_t i = 0; i < count; ++i) {
        if (i + 2 * ahead < count) _mm_prefetch(reinterpret_cast<const char*>(origins + incoming[i + 2 * ahead]), _MM_HINT_T0);
        if (i + ahead < count)
            for (int64_t b = 0; b < D * bytes; b += 64) {
                _mm_prefetch(keys + incoming[i + ahead] * D * bytes + b, _MM_HINT_T0);
                _mm_prefetch(values + incoming[i + ahead] * D * bytes + b, _MM_HINT_T0);
            }
        const int64_t j = freed[i], token = incoming[i];
        held[j] = token;
        const float* k = reinterpret_cast<const float*>(keys + token * D * bytes);
        const float* v = reinterpret_cast<const float*>(values + token * D * bytes);
        if (narrow) {
            widen_fp16(reinterpret_cast<const uint16_t*>(keys) + token * D, widened, D);
            widen_fp16(reinterpret_cast<const uint16_t*>(values) + token * D, widened + 512, D);
            k = widened;
            v = widened + 512;
        }
        memcpy(c.cache_keys + at + j * D, k, D * sizeof(float));
        memcpy(c.cache_values + at + j * D, v, D * sizeof(float));
        if (!narrow) round_fp16(c.cache_values + at + j * D, D);  // a window holds fp16 values (`recall.stored`)
        const TextPosition place = text_position(cache_origins + r, c.length - r, origins[token], r);
        rotate_placed(k, c.cos + place.slot * D, c.sin + place.slot * D, c.frequencies, place.share,
                      c.cache_rotated + at + j * D, D);
        round_fp16(c.cache_rotated + at + j * D, D);
        if (c.window_keys) {  // exact: both hold fp16 values
            const int64_t at16 = layer * c.window_layer_stride + h * c.window_head_stride + j * D;
            narrow_fp16(c.cache_rotated + at + j * D, c.window_keys + at16, D);
            narrow_fp16(c.cache_values + at + j * D, c.window_values + at16, D);
        }
        cache_origins[j] = origins[token];
        if (scores) scores[j] = 0.0f;
    }
    return static_cast<int32_t>(count);
}

// Every head's window <- its `window` tokens of `chosen` ([heads][window], each ascending); written[head]:
// the slots rewritten (their sum into c.total, where given). Returns nonzero where a head's held tokens
// were not distinct (nothing is lost: that head is left as it was).
int fill_all(const Choice& c, const int64_t* chosen, int32_t* written) {
    const int64_t heads = c.layers * c.heads, r = c.window;
    int status = 0;
#pragma omp parallel num_threads(static_cast<int>(c.threads))
    {
        std::vector<uint8_t> mark(c.capacity, 0);
        std::vector<int64_t> moves;
#pragma omp for schedule(static)
        for (int64_t head = 0; head < heads; ++head) {
            const int32_t count = fill_head(c, head / c.heads, head % c.heads, chosen + head * r, c.held + head * r,
                                            mark, moves);
            written[head] = std::max(count, 0);
            if (count < 0) {
#pragma omp atomic write
                status = 3;
            }
        }
    }
    if (c.total) *c.total = std::accumulate(written, written + heads, int64_t{0});
    return status;
}

// A decode choice's time by stage, summed over the choices made while counting is on
// (`h2o_recall_stages`; off by default, when a choice reads one flag and no clock): "rank" the voting
// heads' bound and exact stages, "votes" their votes pooled and the positions of the best scores,
// "index" the position index brought up to date, "picks" every head's tokens, "fill" the copies into
// the window. Nanoseconds, added atomically (several rows choose side by side).
enum Stage { RANK, VOTES, INDEX, PICKS, FILL, STAGES };
struct StageClock {
    std::atomic<bool> on{false};
    std::atomic<int64_t> choices{0}, nanoseconds[STAGES] = {};
};
StageClock& stage_clock() {
    static StageClock clock;
    return clock;
}

// Marks the end of each stage of one choice, where counting is on.
class StageTimer {
public:
    StageTimer() : on_(stage_clock().on.load(std::memory_order_relaxed)) {
        if (on_) last_ = now();
    }
    void mark(Stage stage) {
        if (!on_) return;
        const int64_t t = now();
        stage_clock().nanoseconds[stage].fetch_add(t - last_, std::memory_order_relaxed);
        last_ = t;
    }
    ~StageTimer() {
        if (on_) stage_clock().choices.fetch_add(1, std::memory_order_relaxed);
    }

private:
    static int64_t now() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }
    bool on_;
    int64_t last_ = 0;
};

int choose(const Choice& c, int32_t* written) {
    const int64_t heads = c.layers * c.heads, r = c.window, B = c.block, n = c.blocks * B;
    const int64_t K = c.candidates * B, mask = c.positions - 1;
    if (c.positions <= 0 || (c.positions & mask) || r > n || r <= 0 || c.candidates > c.blocks || c.dim % 8 || c.length < r
        || (c.archive_fp16 && c.dim > 512) || !voters_valid(c))
        return 1;
    const int threads = static_cast<int>(c.threads);
    StageTimer timer;
    // kept between calls (fresh pages of these sizes would fault on every touch of every choice); the
    // threads of a parallel region see the caller's through pointers (each has its own thread_local)
    static thread_local std::vector<int64_t> chosen_store, positions_store;
    static thread_local std::vector<float> mass_store;
    chosen_store.resize(heads * r);
    int64_t* const chosen = chosen_store.data();
    if (K <= r) {  // the archive fills the window: every head takes all of it
        for (int64_t head = 0; head < heads; ++head)
            std::iota(chosen + head * r, chosen + (head + 1) * r, 0);
    } else {
        positions_store.resize(heads * K);
        mass_store.resize(heads * K);
        int64_t* const positions = positions_store.data();  // each voting head's candidates' positions
        float* const mass = mass_store.data();
        const std::vector<int64_t> voting = voting_heads(c);  // only these heads' keys are read
        const int64_t voters = static_cast<int64_t>(voting.size());
#pragma omp parallel num_threads(threads)
        {
            static thread_local Scratch scratch;  // kept, as the picks' (every value a head reads, it writes first)
#pragma omp for schedule(static)
            for (int64_t i = 0; i < voters; ++i)
                rank_head(c, voting[i], scratch, positions + voting[i] * K, mass + voting[i] * K);
        }
        timer.mark(RANK);
        if (c.kept && c.sweep > 0 && c.candidates < c.blocks)  // the next stripe
            *c.sweep_cursor = (*c.sweep_cursor % c.blocks + c.sweep) % c.blocks;
        // one thread, in head order: the votes' sums do not depend on the thread count. votes and
        // scores are zero between calls outside what a call writes, which it clears again.
        static thread_local std::vector<float> votes, scores;
        static thread_local std::vector<double> prefix;
        if (static_cast<int64_t>(votes.size()) != c.positions) {
            votes.assign(c.positions, 0.0f);
            scores.assign(c.positions, 0.0f);
            prefix.resize(c.positions + 1);
        }
        int64_t low = c.positions, high = -1;  // the positions voted for lie in [low, high]
        for (const int64_t head : voting)
            for (int64_t k = 0; k < K; ++k) {
                const int64_t p = positions[head * K + k];
                votes[p] += mass[head * K + k];
                low = std::min(low, p);
                high = std::max(high, p);
            }
        // scores[p] = votes[p] + the votes of positions max(0, p - span) .. min(P - 1, p + span), summed
        // in fp64 by a running sum (prefix[i]: positions below i), which is 0 up to low and constant
        // after high: positions beyond span of [low, high] keep score 0
        prefix[low] = 0.0;
        for (int64_t p = low; p <= high; ++p) prefix[p + 1] = prefix[p] + votes[p];
        const auto running = [&](int64_t i) { return prefix[std::min(std::max(i, low), high + 1)]; };
        const int64_t first = std::max<int64_t>(0, low - c.span), last = std::min<int64_t>(c.positions - 1, high + c.span);
        for (int64_t p = first; p <= last; ++p)
            scores[p] = votes[p] + static_cast<float>(running(std::min(c.positions - 1, p + c.span) + 1) -
                                                      running(std::max<int64_t>(0, p - c.span)));
        const float* score_of = scores.data();
        // a token the head holds is ranked by its score x (1 + margin), rounded to fp32 as the torch ops
        // round it (`archive._favour_held`): a held token stays unless another beats it by the margin
        const float bonus = static_cast<float>(1.0 + c.margin);
        // the positions of the best scores: every head ranks its tokens there (`best_above`)
        static thread_local std::vector<float> positive;
        static thread_local std::vector<uint64_t> above;
        const Ranked ranked = rank_positions(score_of, first, last, std::max<int64_t>(4 * r, 512), mask, bonus,
                                             positive, above);
        timer.mark(VOTES);
        // each head reads its tokens at the best positions from the row's position index, where it has one
        const bool by_index = c.index != nullptr;
        static thread_local std::vector<Marked> order_store;
        const std::vector<Marked>& order = order_store;  // the parallel region's threads read this thread's
        if (by_index) {
            update_index(c.origins, c.capacity, heads, n, mask, c.index, c.index_rows, c.index_state, threads);
            marked_by_score(ranked, first, last, order_store);
        }
        timer.mark(INDEX);
        const int32_t* const flags = by_index ? c.index + c.index_rows * heads : nullptr;
#pragma omp parallel num_threads(threads)
        {
            static thread_local HeadScratch scratch;  // kept: its vectors' pages are touched once
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head) {
                const int64_t* origins = c.origins + head * c.capacity;
                const int64_t* held_origins =
                    c.cache_origins ? window_origins(c, head / c.heads, head % c.heads) : nullptr;
                if (by_index && !flags[head] && best_indexed(ranked, order, c.index, heads, head, origins, n,
                                                             c.held + head * r, held_origins, r, scratch,
                                                             chosen + head * r))
                    continue;
                if (!best_above(ranked, origins, n, c.held + head * r, held_origins, r, scratch, chosen + head * r))
                    best_by_scan(ranked, origins, n, c.held + head * r, r, scratch, chosen + head * r);
            }
        }
        std::fill(votes.begin() + low, votes.begin() + high + 1, 0.0f);
        std::fill(scores.begin() + first, scores.begin() + last + 1, 0.0f);
    }
    timer.mark(PICKS);
    const int status = fill_all(c, chosen, written);
    timer.mark(FILL);
    return status;
}

// A prefill chunk's choice for the heads of a few layers (`Archive.select` without `everywhere`):
// per head, the `candidates` blocks of most bound mass (ranked: most first, ties the lower block; where
// every block is a candidate, the blocks in order, and the bound is not computed);
// every candidate key's exact mass added to the vote of its position, over all the heads of the call
// in head order; each head's candidate blocks scored by their tokens' votes, the `window / block` best
// taken (ties: the better-ranked candidate), their tokens in ascending order into the window.
// A chunk's queries are many (a query group times the chunk): both stages are products of the
// queries with packed tiles of digests or keys (`panel_product`), and each head's queries are split
// into parts of a fixed size whose masses are summed in part order, so that the threads share the
// work and the result does not depend on their count.
int choose_blocks(const Choice& c, int32_t* written) {
    const int64_t heads = c.layers * c.heads, r = c.window, B = c.block, N = c.blocks, C = c.candidates;
    const int64_t D = c.dim, K = C * B, want = r / B, mask = c.positions - 1;
    if (c.positions <= 0 || (c.positions & mask) || r % B || want > N || r <= 0 || C > N || C < want || D % 8 || c.length < r
        || (c.archive_fp16 && D > 512))
        return 1;
    const int threads = static_cast<int>(c.threads);
    constexpr int64_t part = 48;  // queries per task, a multiple of 4
    const int64_t parts = (c.group + part - 1) / part, tasks = heads * parts;
    const float scaling = static_cast<float>(c.scaling);
    // kept between calls, as `choose` keeps its own (fresh pages of these sizes fault on every touch of
    // every call: ~0.1 s of a 4k prompt's prefill); every value a call reads, it writes first. The
    // threads of its parallel regions see the caller's through these references (each thread has its
    // own thread_local)
    static thread_local std::vector<int64_t> chosen_store, candidates_store, ranked_store;
    static thread_local std::vector<float> panels_store, partial_store, mass_store;
    std::vector<int64_t> &chosen = chosen_store, &candidates = candidates_store, &ranked = ranked_store;
    std::vector<float> &panels = panels_store, &partial = partial_store, &mass = mass_store;
    chosen.resize(heads * r);
    if (C == want) {  // every candidate is taken: the archive's blocks fill the window
        for (int64_t head = 0; head < heads; ++head)
            std::iota(chosen.begin() + head * r, chosen.begin() + (head + 1) * r, 0);
    } else {
        // the products on the tile unit where there is one (`amx_products.h`), else packed fp32 tiles
        const bool amx = amx_on();
        const int64_t bound_tiles = (N + TILE - 1) / TILE, key_tiles = (K + TILE - 1) / TILE;
        // digests of no width (lo and hi one buffer, "centre") score q . centre: one product of depth D,
        // the queries as they are; boxes their best corner, the queries split against rows hi then lo
        const bool centre = c.lo == c.hi;
        const int64_t bound_depth = centre ? D : 2 * D;
        const int64_t bound_size = bound_tiles * (amx ? amx_tile_floats(bound_depth) : TILE * bound_depth);
        const int64_t key_size = key_tiles * (amx ? amx_tile_floats(D) : TILE * D);
        const int64_t stride = std::max(N, K);
        const bool everything = C == N;  // every block a candidate: no bound stage
        panels.resize(heads * std::max(bound_size, key_size));
        partial.resize(tasks * stride);
        candidates.resize(heads * K);
        ranked.resize(heads * C);
        // one task of a stage: queries g0 .. g1 of a head ([part][D] as they are, or split into their
        // positive and negative parts, [part][2D], against the digests' rows hi then lo) times the head's
        // panel of `tiles` tiles; partial[task] <- each query's softmax over the `items` items, summed
        auto stage = [&](int64_t task, bool split, int64_t panel_size, int64_t tiles, int64_t items,
                         std::vector<float>& q, std::vector<uint16_t>& terms, std::vector<float>& logits) {
            const int64_t head = task / parts, g0 = task % parts * part, g1 = std::min(c.group, g0 + part);
            const int64_t depth = split ? 2 * D : D;
            q.assign(part * depth, 0.0f);
            for (int64_t g = g0; g < g1; ++g) {
                const float* from = head_queries(c, head) + g * D;
                float* to = q.data() + (g - g0) * depth;
                for (int64_t d = 0; d < D; ++d) {
                    if (split) {
                        to[d] = std::max(from[d], 0.0f);
                        to[D + d] = std::min(from[d], 0.0f);
                    } else {
                        to[d] = from[d];
                    }
                }
            }
            const int64_t ldo = tiles * TILE;
            if (amx) {
                const int64_t rows = (g1 - g0 + 15) / 16 * 16;
                split_queries(q.data(), g1 - g0, depth, rows, terms);
                logits.resize(rows * ldo);
                amx_product(terms.data(), rows, depth, reinterpret_cast<const uint16_t*>(panels.data() + head * panel_size),
                            tiles, logits.data(), ldo);
            } else {
                const int64_t rows = (g1 - g0 + 3) / 4 * 4;
                logits.resize(rows * ldo);
                panel_product(q.data(), rows, depth, panels.data() + head * panel_size, tiles, logits.data(), ldo);
            }
            float* mass = partial.data() + task * stride;
            std::fill(mass, mass + items, 0.0f);
            for (int64_t g = 0; g < g1 - g0; ++g) softmax_into(logits.data() + g * ldo, items, scaling, mass);
        };
        // the panels are packed in `pieces` runs of whole tiles per head, so that the threads share a
        // layer's few heads evenly
        constexpr int64_t pieces = 4;
        auto run = [](int64_t piece, int64_t n) {  // items of a piece: whole tiles, the last one's rest
            const int64_t tiles = (n + TILE - 1) / TILE;
            return std::pair<int64_t, int64_t>{std::min(n, tiles * piece / pieces * TILE),
                                               std::min(n, tiles * (piece + 1) / pieces * TILE)};
        };
        mass.resize(heads * K);
#pragma omp parallel num_threads(threads)
        {
            static thread_local std::vector<float> q, logits;  // each thread's own, kept
            static thread_local std::vector<uint16_t> terms;
#pragma omp for schedule(static)
            for (int64_t task = 0; task < (everything ? 0 : heads * pieces); ++task) {  // digests: rows [0, D) hi (or the centre), [D, 2D) lo
                const int64_t head = task / pieces;
                const auto [j0, j1] = run(task % pieces, N);
                float* panel = panels.data() + head * bound_size;
                const uint16_t* hi = c.hi + head * c.digest_capacity * D;
                const uint16_t* lo = c.lo + head * c.digest_capacity * D;
                const auto his = [&](int64_t n) { return hi + n * D; };
                const auto los = [&](int64_t n) { return lo + n * D; };
                if (amx) {
                    pack_amx(j0, j1, D, bound_depth, 0, his, reinterpret_cast<uint16_t*>(panel));
                    if (!centre) pack_amx(j0, j1, D, bound_depth, D, los, reinterpret_cast<uint16_t*>(panel));
                } else {
                    pack_tiles(j0, j1, D, bound_depth, 0, his, panel);
                    if (!centre) pack_tiles(j0, j1, D, bound_depth, D, los, panel);
                }
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < (everything ? 0 : tasks); ++task)
                stage(task, !centre, bound_size, bound_tiles, N, q, terms, logits);
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head) {
                int64_t* at = candidates.data() + head * K;
                if (everything) {  // every block, in order: the bound could only rank them
                    std::iota(ranked.begin() + head * C, ranked.begin() + (head + 1) * C, 0);
                    std::iota(at, at + K, 0);
                    continue;
                }
                std::vector<float> total(N, 0.0f);
                for (int64_t p = 0; p < parts; ++p)
                    for (int64_t n = 0; n < N; ++n) total[n] += partial[(head * parts + p) * stride + n];
                std::vector<uint64_t> keys(N);
                for (int64_t n = 0; n < N; ++n) keys[n] = rank_key(total[n], n);
                std::partial_sort(keys.begin(), keys.begin() + C, keys.end(), std::greater<uint64_t>());
                for (int64_t j = 0; j < C; ++j) {
                    const int64_t b = key_index(keys[j]);
                    ranked[head * C + j] = b;
                    for (int64_t i = 0; i < B; ++i) at[j * B + i] = b * B + i;
                }
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < heads * pieces; ++task) {  // the digests' panels are spent
                const int64_t head = task / pieces;
                const auto [j0, j1] = run(task % pieces, K);
                const int64_t* at = candidates.data() + head * K;
                const uint16_t* stored = c.half + head * c.capacity * D;
                const auto rows = [&](int64_t k) { return stored + at[k] * D; };
                if (amx) pack_amx(j0, j1, D, D, 0, rows, reinterpret_cast<uint16_t*>(panels.data() + head * key_size), c.half_bf16);
                else pack_tiles(j0, j1, D, D, 0, rows, panels.data() + head * key_size, c.half_bf16);
            }
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; ++task) stage(task, false, key_size, key_tiles, K, q, terms, logits);
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head) {  // each key's mass, its parts summed in order
                float* sum = mass.data() + head * K;
                std::fill(sum, sum + K, 0.0f);
                for (int64_t p = 0; p < parts; ++p)
                    for (int64_t k = 0; k < K; ++k) sum[k] += partial[(head * parts + p) * stride + k];
            }
        }
        // one thread, in head and key order: the votes' sums do not depend on the thread count
        static thread_local std::vector<float> votes;
        votes.assign(c.positions, 0.0f);
        for (int64_t head = 0; head < heads; ++head) {
            const int64_t* origins = c.origins + head * c.capacity;
            const float* sum = mass.data() + head * K;
            for (int64_t k = 0; k < K; ++k) votes[origins[candidates[head * K + k]] & mask] += sum[k];
        }
        const float* vote = votes.data();
#pragma omp parallel num_threads(threads)
        {
            std::vector<uint64_t> keys(C);
            std::vector<int64_t> best(want);
#pragma omp for schedule(static)
            for (int64_t head = 0; head < heads; ++head) {
                const int64_t* origins = c.origins + head * c.capacity;
                for (int64_t j = 0; j < C; ++j) {
                    float score = 0.0f;
                    for (int64_t i = 0; i < B; ++i) score += vote[origins[candidates[head * K + j * B + i]] & mask];
                    keys[j] = rank_key(score, j);
                }
                std::partial_sort(keys.begin(), keys.begin() + want, keys.end(), std::greater<uint64_t>());
                for (int64_t j = 0; j < want; ++j) best[j] = ranked[head * C + key_index(keys[j])];
                std::sort(best.begin(), best.end());
                for (int64_t j = 0; j < want; ++j)
                    for (int64_t i = 0; i < B; ++i) chosen[head * r + j * B + i] = best[j] * B + i;
            }
        }
    }
    return fill_all(c, chosen.data(), written);
}

// The recall windows of a few rows (slots [0, recalled[i]) of row row_ids[i], which holds lengths[i]
// slots) placed in the text: every window key rotated to where its token stood among the row's own
// tokens (`recall.place`), after an eviction moved those.
struct Placement {
    int64_t layers, rows_capacity, heads, capacity, dim;
    const float* keys;          // the cache's [layers, rows, heads, capacity, dim], before RoPE
    float* rotated;
    const int64_t* origins;     // [layers, rows, heads, capacity]; the own tokens' ascending
    const float* cos;           // [>= max length, dim]: the model's RoPE table
    const float* sin;
    const float* frequencies;   // [dim / 2], each <= 1
    const int64_t* row_ids;     // [rows]
    const int64_t* recalled;
    const int64_t* lengths;
    int64_t rows, threads;
    uint16_t* window_keys;      // nullable: the windows' fp16 copy of `rotated` (`recall.WindowCopy`), slot j
    int64_t window_layer_stride, window_row_stride, window_head_stride;  // of layer l, row, head h at
                                // l * window_layer_stride + row * window_row_stride + h * window_head_stride + j * dim
};

int place(const Placement& p) {
    const int64_t tasks = p.layers * p.rows * p.heads, D = p.dim;
    for (int64_t i = 0; i < p.rows; ++i)
        if (p.recalled[i] < 0 || p.lengths[i] < p.recalled[i] || p.lengths[i] > p.capacity) return 1;
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(p.threads))
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t l = task / (p.rows * p.heads), i = task / p.heads % p.rows, h = task % p.heads;
        const int64_t r = p.recalled[i], base = ((l * p.rows_capacity + p.row_ids[i]) * p.heads + h) * p.capacity;
        const int64_t* origins = p.origins + base;
        for (int64_t j = 0; j < r; ++j) {
            const TextPosition at = text_position(origins + r, p.lengths[i] - r, origins[j], r);
            rotate_placed(p.keys + (base + j) * D, p.cos + at.slot * D, p.sin + at.slot * D, p.frequencies, at.share,
                          p.rotated + (base + j) * D, D);
            round_fp16(p.rotated + (base + j) * D, D);  // as every window key (`recall.stored`)
            if (p.window_keys)
                narrow_fp16(p.rotated + (base + j) * D, p.window_keys + l * p.window_layer_stride
                            + p.row_ids[i] * p.window_row_stride + h * p.window_head_stride + j * D, D);
        }
    }
    return 0;
}

}  // namespace

extern "C" {

// Choose and fill one row's recall window over all layers (see Choice); written: [L, H] int32, the
// slots rewritten per head. Returns 0; 1 with nothing written for a shape it cannot run; 3 where a
// head's `held` named a token twice (that head left as it was, the others filled; never by `fill`).
int h2o_recall_choose(const Choice* choice, int32_t* written) { return choose(*choice, written); }

// Several rows' choices (as h2o_recall_choose, each its own Choice): each row's on one thread, up to
// `threads` rows at a time (a choice's ranking is bound by memory and its votes run on one thread,
// so rows side by side beat rows one after the other on all threads). statuses[i] and written[i]: row
// i's, as h2o_recall_choose returns and writes them. Returns 0.
int h2o_recall_choose_rows(const Choice* choices, int64_t rows, int32_t* const* written, int32_t* statuses,
                           int64_t threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast<int>(threads))
    for (int64_t i = 0; i < rows; ++i) {
        Choice c = choices[i];
        c.threads = 1;  // a row's result does not depend on its threads
        statuses[i] = choose(c, written[i]);
    }
    return 0;
}

// Counting of decode choices' time by stage (`StageClock`): on 1 starts it from zero, 0 stops it, -1
// leaves it. out (nullable): [1 + 5] <- the choices counted and the seconds of rank, votes, index,
// picks and fill, summed over them. Returns whether it counts now.
int h2o_recall_stages(int on, double* out) {
    StageClock& clock = stage_clock();
    if (on == 1) {
        clock.choices.store(0);
        for (auto& n : clock.nanoseconds) n.store(0);
    }
    if (on >= 0) clock.on.store(on != 0);
    if (out) {
        out[0] = static_cast<double>(clock.choices.load());
        for (int i = 0; i < STAGES; ++i) out[1 + i] = 1e-9 * static_cast<double>(clock.nanoseconds[i].load());
    }
    return clock.on.load() ? 1 : 0;
}

// panel_product with a chosen instruction set (wide: AVX-512, where the CPU has it), for the tests;
// returns nonzero where it cannot run.
int h2o_recall_panel_product(const float* q, int64_t G, int64_t depth, const float* panel, int64_t tiles, float* out,
                             int64_t ldo, int wide) {
    if (G % 4 || ldo < tiles * TILE || (wide && !__builtin_cpu_supports("avx512f"))) return 1;
    (wide ? panel_product_avx512 : panel_product_avx2)(q, G, depth, panel, tiles, out, ldo);
    return 0;
}

// logits [G, ldo] <- queries [G, depth] times items [N, depth] (16-bit: fp16, or bf16 where bf16) on the tile
// unit, as a prefill choice's products (`amx_product`); halves: the items packed in two calls, the
// first and the second half of their values (as the digests' hi and lo are). For the tests; returns
// nonzero where it cannot run (no AMX, or a shape it does not take).
int h2o_recall_amx_product(const float* q, int64_t G, int64_t depth, const uint16_t* items, int64_t N, int bf16,
                           int halves, float* out, int64_t ldo) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    if (!amx_supported() || G < 1 || N < 1 || depth % 8 || (halves && depth % 16) || ldo < tiles * TILE) return 1;
    std::vector<float> panel(tiles * amx_tile_floats(depth), std::nanf(""));  // what packing leaves unwritten shows
    uint16_t* packed = reinterpret_cast<uint16_t*>(panel.data());
    if (halves) {
        const int64_t half = depth / 2;
        pack_amx(0, N, half, depth, 0, [&](int64_t j) { return items + j * depth; }, packed, bf16 != 0);
        pack_amx(0, N, half, depth, half, [&](int64_t j) { return items + j * depth + half; }, packed, bf16 != 0);
    } else {
        pack_amx(0, N, depth, depth, 0, [&](int64_t j) { return items + j * depth; }, packed, bf16 != 0);
    }
    const int64_t rows = (G + 15) / 16 * 16;
    std::vector<uint16_t> terms;
    split_queries(q, G, depth, rows, terms);
    std::vector<float> logits(rows * ldo, std::nanf(""));
    amx_product(terms.data(), rows, depth, packed, tiles, logits.data(), ldo);
    std::copy(logits.begin(), logits.begin() + G * ldo, out);
    return 0;
}

// Whether a prefill choice's products run on the tile unit: want 0 or 1 switches it off or back on
// (on: where the CPU and the OS allow it), -1 leaves it. Returns whether it now does.
int h2o_recall_amx(int want) {
    if (want >= 0) amx_wanted().store(want != 0);
    return amx_on() ? 1 : 0;
}

// softmax_into with a chosen instruction set (wide: AVX-512, where the CPU has it), for the tests;
// returns nonzero where it cannot run.
int h2o_recall_softmax_into(float* p, int64_t n, float scaling, float* mass, int first, int wide) {
    if (n < 1 || (wide && !__builtin_cpu_supports("avx512f"))) return 1;
    (wide ? softmax_into_avx512 : softmax_into_avx2)(p, n, scaling, mass, first != 0);
    return 0;
}

// logits [G, K] <- queries [G, D] times keys [K, D] (fp16, or bf16 where bf16), as a decode step's choice
// scores its candidates (`dot_keys`), for the tests; returns nonzero where it cannot run.
int h2o_recall_key_logits(const float* queries, int64_t G, int64_t D, const uint16_t* keys, int64_t K, int bf16,
                          float* logits) {
    if (D % 8 || G < 1 || K < 1) return 1;
    key_logits(queries, G, D, K, [&](int64_t k) { return keys + k * D; }, bf16, logits);
    return 0;
}

// One head's r tokens of a decode choice (ascending, into out) from the scores of `positions` positions
// (a power of 2) and the head's n tokens' origins, as the choice takes them (margin: its held tokens'
// factor is 1 + margin), by ranking its tokens of a score above the threshold (above nonzero,
// `best_above`; cut > 0: the threshold that marks at most the best `cut` positions, else 0; above 2:
// the same, read from a position index of the tokens, `best_indexed`) or by ranking
// every token (`best_by_scan`), for the tests. Returns 0; 2 where the tokens above the threshold, or
// the index, could not decide (nothing written); 1 where it cannot run.
int h2o_recall_best_tokens(const float* score, int64_t positions, const int64_t* origins, int64_t n,
                           const int64_t* held, int64_t r, double margin, int above, int64_t cut, int64_t* out) {
    if (positions <= 0 || (positions & (positions - 1)) || r <= 0 || r > n || positions > (1ll << 32)) return 1;
    std::vector<float> positive;
    std::vector<uint64_t> marked;
    const Ranked ranked = rank_positions(score, 0, positions - 1, cut > 0 ? cut : positions, positions - 1,
                                         static_cast<float>(1.0 + margin), positive, marked);
    HeadScratch scratch;
    if (!above) {
        best_by_scan(ranked, origins, n, held, r, scratch, out);
        return 0;
    }
    if (above == 2) {
        std::vector<int32_t> index(positions + 1);
        std::vector<Marked> order;
        int64_t indexed = 0;
        update_index(origins, n, 1, n / 2, positions - 1, index.data(), positions, &indexed, 1);  // in two calls
        update_index(origins, n, 1, n, positions - 1, index.data(), positions, &indexed, 1);
        marked_by_score(ranked, 0, positions - 1, order);
        return !index[positions] && best_indexed(ranked, order, index.data(), 1, 0, origins, n, held, nullptr, r, scratch, out)
               ? 0 : 2;
    }
    return best_above(ranked, origins, n, held, nullptr, r, scratch, out) ? 0 : 2;
}

// Choose and fill one row's recall window in a few layers by whole blocks, for a prefill chunk's
// queries (see choose_blocks); the Choice's pointers start at the first of those layers.
int h2o_recall_choose_blocks(const Choice* choice, int32_t* written) { return choose_blocks(*choice, written); }

// Places the recall windows of a few rows in the text (see Placement); 0, or nonzero with nothing
// written for a row whose counts do not fit the buffers (1).
int h2o_recall_place(const Placement* placement) { return place(*placement); }

}
