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
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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

}  // namespace

extern "C" {

// Compacts the rows of one eviction (see Compaction); 0, or nonzero with nothing written for a head
// dim that is not a multiple of 16 (1) or an index that is not the kept slots of a compaction (2).
int h2o_compact(const Compaction* compaction) { return compact(*compaction); }

}
