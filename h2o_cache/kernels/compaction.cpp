// An eviction's compaction of cache rows in one C++ call: per layer, row and KV head, the kept slots'
// keys and values moved down to the front of the row in place, and every kept key rotated to its new
// slot (position rolling). `compaction.evict` does the same with torch ops: a gather of the kept
// vectors into a scratch buffer, the rotation as four strided ops over half-vectors, and two copies
// back, 30-38 ms for 8 rows at 272 slots on a 2-core Zen 5 (10.5-13.9 ms with this kernel, the rest
// of the eviction included), every `evict_slack` steps of the batch.
//
// The rotation is `rope.rotate_into`'s, rounding for rounding: x1 c rounded, then x2 s subtracted
// in one fused multiply-add (as torch's addcmul_ does it), and x2 c + x1 s alike, so the rotated keys
// equal the torch path's bit for bit.
//
// With recall, what an eviction drops goes to the row's archive first (`archive_dropped`): per layer
// and KV head, the slots below the row's length that the kept index does not name, in slot order,
// copied straight into the archive's storage (`compaction.archive` does the same with ~10 torch ops
// per row and a copy per field; ~13 ms per eviction of 8 rows at 272 slots against ~2 ms here).
// And the archive's tail is formed into blocks in one call (`form_blocks`): the tokens archived since
// the last full block sorted by original position per head, then each new full block's digests
// (the mean -/+ mean absolute deviation of its keys per channel, or their min and max) and, in an
// fp32 archive, its keys in fp16 for ranking, as `Archive._digests` does with torch ops (the same
// rounding to nearest even as torch's `half()`). An fp32 cache archives in fp16: `archive_dropped`
// rounds what it copies the same way.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "vector_math.h"

namespace {

// The buffers of an H2OCache ([layers, rows, kv_heads, capacity, dim], contiguous) and one eviction.
struct Compaction {
    int64_t layers, rows_capacity, heads, capacity, dim;
    float* keys;              // as fed when `rotated` is set
    float* values;
    float* rotated;           // may be null (no rolling: nothing is rotated)
    const float* cos;         // [>= still + width, dim], transformers' layout (the two halves repeated)
    const float* sin;
    const int64_t* row_ids;   // [rows] the rows evicted
    int64_t rows;
    const int64_t* index;     // [layers, rows, heads, width]: slot still + j keeps slot index[..., j]
    int64_t still, width, threads;
};

// out = x rotated by (cos, sin) as rope.rotate_into computes it; dim a multiple of 16.
inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i += 8) {
        const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
        _mm256_storeu_ps(out + i, _mm256_fnmadd_ps(x2, s, _mm256_mul_ps(x1, c)));
        _mm256_storeu_ps(out + half + i, _mm256_fmadd_ps(x1, s, _mm256_mul_ps(x2, c)));
    }
}

int compact(const Compaction& s) {
    if (s.dim % 16) return 1;
    const int64_t tasks = s.layers * s.rows * s.heads, D = s.dim;
    for (int64_t t = 0; t < tasks * s.width; ++t) {
        const int64_t slot = s.still + t % s.width;
        // ascending and never below its slot, so moving slots in order reads none already overwritten
        if (s.index[t] < slot || s.index[t] >= s.capacity) return 2;
    }
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(s.threads))
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t l = task / (s.rows * s.heads), i = task / s.heads % s.rows, h = task % s.heads;
        const int64_t base = ((l * s.rows_capacity + s.row_ids[i]) * s.heads + h) * s.capacity * D;
        const int64_t* index = s.index + task * s.width;
        for (int64_t j = 0; j < s.width; ++j) {
            const int64_t slot = s.still + j, from = index[j];
            if (from != slot) {
                memcpy(s.keys + base + slot * D, s.keys + base + from * D, D * sizeof(float));
                memcpy(s.values + base + slot * D, s.values + base + from * D, D * sizeof(float));
            }
            if (s.rotated)
                rotate(s.keys + base + slot * D, s.cos + slot * D, s.sin + slot * D, s.rotated + base + slot * D, D);
        }
    }
    return 0;
}

// One row's dropped tokens, from its cache buffers into its archive's storage at `offset`.
struct Dropping {
    int64_t layers, rows_capacity, heads, capacity, dim;
    const float* keys;         // the cache's [layers, rows, heads, capacity, dim] (keys before RoPE)
    const float* values;
    const float* scores;       // [layers, rows, heads, capacity]; null: the archive stores 0
    const int64_t* origins;
    int64_t row, length;       // the row, and the slots it held before the eviction
    const int64_t* index;      // [layers, heads, width]: the slots kept (any order, duplicates allowed)
    int64_t width, dropped;    // every head drops exactly `dropped` slots
    void* out_keys;            // the archive's [layers, heads, out_capacity, dim], written at offset..
    void* out_values;          // (fp32, or fp16 where out_fp16: rounded to nearest even, as torch's half())
    float* out_scores;         // [layers, heads, out_capacity]
    int64_t* out_origins;
    int64_t out_capacity, offset, threads, out_fp16;
};

int archive_dropped(const Dropping& s) {
    const int64_t tasks = s.layers * s.heads, D = s.dim, C = s.capacity;
    if (s.length > C || s.offset + s.dropped > s.out_capacity || (s.out_fp16 && D % 8)) return 1;
    int status = 0;
#pragma omp parallel num_threads(static_cast<int>(s.threads))
    {
        std::vector<char> kept(s.length);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t l = task / s.heads, h = task % s.heads;
            const int64_t at = (l * s.rows_capacity + s.row) * s.heads + h;  // the head's slot 0, in slots
            std::fill(kept.begin(), kept.end(), 0);
            for (int64_t j = 0; j < s.width; ++j) {
                const int64_t slot = s.index[task * s.width + j];
                if (slot >= 0 && slot < s.length) kept[slot] = 1;
            }
            const int64_t out = task * s.out_capacity + s.offset;
            int64_t m = 0;
            for (int64_t slot = 0; slot < s.length; ++slot) {
                if (kept[slot]) continue;
                if (m == s.dropped) { m = -1; break; }
                if (s.out_fp16) {
                    narrow_fp16(s.keys + (at * C + slot) * D, static_cast<uint16_t*>(s.out_keys) + (out + m) * D, D);
                    narrow_fp16(s.values + (at * C + slot) * D, static_cast<uint16_t*>(s.out_values) + (out + m) * D, D);
                } else {
                    memcpy(static_cast<float*>(s.out_keys) + (out + m) * D, s.keys + (at * C + slot) * D, D * sizeof(float));
                    memcpy(static_cast<float*>(s.out_values) + (out + m) * D, s.values + (at * C + slot) * D, D * sizeof(float));
                }
                s.out_scores[out + m] = s.scores ? s.scores[at * C + slot] : 0.0f;
                s.out_origins[out + m] = s.origins[at * C + slot];
                ++m;
            }
            if (m != s.dropped) {
#pragma omp atomic write
                status = 2;
            }
        }
    }
    return status;
}

// An archive's storage ([layers * heads] heads of `capacity` tokens; digests of `digest_capacity`
// blocks): the tokens [start * block, stored) of every head sorted by origin (stable), then the digests
// of blocks start .. stored / block.
struct Forming {
    int64_t heads, capacity, digest_capacity, dim, block, start, stored, threads;
    void* keys;      // fp32, or fp16 where fp16
    void* values;
    float* scores;
    int64_t* origins;
    uint16_t* lo;  // fp16, rounded to nearest from the fp32 digests
    uint16_t* hi;
    uint16_t* half;  // [heads, capacity, dim] fp16 copies of an fp32 archive's keys; null for an fp16 one
    int64_t fp16;
    int64_t mean;    // digests: 0 the channel-wise min and max; 1 the mean -/+ the mean absolute deviation;
                     // 2 the mean alone (lo and hi may be one buffer)
};

int form_blocks(const Forming& s) {
    const int64_t D = s.dim, B = s.block, first = s.start * B, n = s.stored - first, full = s.stored / B;
    if (first < 0 || n < 0 || s.stored > s.capacity || full > s.digest_capacity || D % 8 || (!s.fp16 && !s.half))
        return 1;
    const int64_t bytes = s.fp16 ? 2 : 4, vector = D * bytes;  // one key or value
#pragma omp parallel num_threads(static_cast<int>(s.threads))
    {
        std::vector<int64_t> order(n), origins(n);
        std::vector<char> keys(n * vector), values(n * vector);
        std::vector<float> scores(n), wide(s.fp16 ? B * D : 0);
#pragma omp for schedule(static)
        for (int64_t head = 0; head < s.heads; ++head) {
            const int64_t base = head * s.capacity + first;
            int64_t* origin = s.origins + base;
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return origin[a] < origin[b]; });
            bool moved = false;
            for (int64_t i = 0; i < n && !moved; ++i) moved = order[i] != i;
            if (moved) {
                char* key = static_cast<char*>(s.keys) + base * vector;
                char* value = static_cast<char*>(s.values) + base * vector;
                float* score = s.scores + base;
                memcpy(keys.data(), key, n * vector);
                memcpy(values.data(), value, n * vector);
                memcpy(scores.data(), score, n * sizeof(float));
                memcpy(origins.data(), origin, n * sizeof(int64_t));
                for (int64_t i = 0; i < n; ++i) {
                    const int64_t j = order[i];
                    memcpy(key + i * vector, keys.data() + j * vector, vector);
                    memcpy(value + i * vector, values.data() + j * vector, vector);
                    score[i] = scores[j];
                    origin[i] = origins[j];
                }
            }
            for (int64_t b = s.start; b < full; ++b) {
                const int64_t at = (head * s.capacity + b * B) * D;  // the block's first value
                const float* k = wide.data();
                if (s.fp16) {  // digests of the fp16 keys, widened exactly (the keys the choice ranks)
                    widen_fp16(static_cast<const uint16_t*>(s.keys) + at, wide.data(), B * D);
                } else {
                    k = static_cast<const float*>(s.keys) + at;
                    narrow_fp16(k, s.half + at, B * D);
                }
                uint16_t* lo = s.lo + (head * s.digest_capacity + b) * D;
                uint16_t* hi = s.hi + (head * s.digest_capacity + b) * D;
                for (int64_t d = 0; d < D; d += 8) {
                    __m256 low = _mm256_loadu_ps(k + d), high = low;
                    if (s.mean) {  // in the order and rounding of `Archive._digest`'s torch ops
                        const __m256 count = _mm256_set1_ps(static_cast<float>(B)), sign = _mm256_set1_ps(-0.0f);
                        __m256 sum = low;
                        for (int64_t t = 1; t < B; ++t) sum = _mm256_add_ps(sum, _mm256_loadu_ps(k + t * D + d));
                        const __m256 centre = _mm256_div_ps(sum, count);
                        low = high = centre;
                        if (s.mean == 1) {  // -/+ the mean absolute deviation
                            __m256 spread = _mm256_andnot_ps(sign, _mm256_sub_ps(_mm256_loadu_ps(k + d), centre));
                            for (int64_t t = 1; t < B; ++t) {
                                const __m256 x = _mm256_loadu_ps(k + t * D + d);
                                spread = _mm256_add_ps(spread, _mm256_andnot_ps(sign, _mm256_sub_ps(x, centre)));
                            }
                            spread = _mm256_div_ps(spread, count);
                            low = _mm256_sub_ps(centre, spread);
                            high = _mm256_add_ps(centre, spread);
                        }
                    } else {
                        for (int64_t t = 1; t < B; ++t) {
                            const __m256 x = _mm256_loadu_ps(k + t * D + d);
                            low = _mm256_min_ps(low, x);
                            high = _mm256_max_ps(high, x);
                        }
                    }
                    // fp16, rounded to nearest, within its finite range (`FP16_MAX`): a key channel past
                    // it (an fp32 or bf16 archive's) must not make the bound an inf, nor 0 x inf a NaN
                    const __m256 top = _mm256_set1_ps(65504.0f), bottom = _mm256_set1_ps(-65504.0f);
                    low = _mm256_max_ps(_mm256_min_ps(low, top), bottom);
                    high = _mm256_max_ps(_mm256_min_ps(high, top), bottom);
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + d), _mm256_cvtps_ph(low, _MM_FROUND_TO_NEAREST_INT));
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + d), _mm256_cvtps_ph(high, _MM_FROUND_TO_NEAREST_INT));
                }
            }
        }
    }
    return 0;
}

}  // namespace

extern "C" {

// Copies one row's dropped tokens into its archive (see Dropping); 0, or nonzero with the archive's
// slots past `offset` undefined: a row that does not fit (1), a head that drops another count (2).
int h2o_archive_dropped(const Dropping* dropping) { return archive_dropped(*dropping); }

// Sorts an archive's unformed tail by origin and digests its new full blocks (see Forming); 0, or
// nonzero with nothing written for shapes it cannot take.
int h2o_form_blocks(const Forming* forming) { return form_blocks(*forming); }

// Compacts the rows of one eviction (see Compaction); 0, or nonzero with nothing written for a head
// dim that is not a multiple of 16 (1) or an index that is not the kept slots of a compaction (2).
int h2o_compact(const Compaction* compaction) { return compact(*compaction); }

}
