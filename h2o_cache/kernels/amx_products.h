// A prefill choice's products on AMX, Intel's tile unit (Sapphire Rapids and later), where the CPU and
// the OS allow it: the same q . item logits as `panel_product`, ~2x sooner on the tile unit, to about
// the same accuracy as fp32 fused multiply-adds.
//
// The unit multiplies bf16 (8-bit significand) and sums in fp32. The items (fp16 keys and digests, or
// bf16 keys) are split exactly into two bf16 terms, hi + lo (an fp16's 11 bits: 8 in hi, the rest in lo),
// the fp32 queries exactly into three, hi + mid + low (8 bits each); the products of every pair but
// low x lo (a 2^-24 relative part, below fp32's own rounding of the sum) are summed. Measured against
// fp64 products: no worse than the fused multiply-adds (tests/h2o_cache/test_native_recall.py).
//
// Layouts. Queries: 3 terms x [rows][S * 32] bf16 (rows a multiple of 16, depth zero-padded to S steps
// of 32). Items: tiles of 16 items, each 2 terms (hi, lo) x S steps x [16 rows][32] bf16, where row r
// of step s holds, for item i, its values 32s + 2r and 32s + 2r + 1 at columns 2i and 2i + 1: the pairs
// the unit multiplies (a 16 x 16 transpose of the items' rows read as 32-bit pairs).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "vector_math.h"

namespace {

constexpr int64_t AMX_ITEMS = 16;  // items per tile, as `TILE`
constexpr int64_t AMX_STEP = 32;   // depth per tile product

// Whether this CPU has AMX-BF16 and the OS lets this process use the tile data (Linux asks a process
// to request it once; the request covers every thread).
inline bool amx_supported() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return false;
        constexpr long request_permission = 0x1023, tile_data = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        return syscall(SYS_arch_prctl, request_permission, tile_data) == 0;
    }();
    return ok;
}

// Whether the prefill choice uses AMX: where supported, unless switched off (`h2o_recall_amx`).
inline std::atomic<int>& amx_wanted() {
    static std::atomic<int> wanted{1};
    return wanted;
}

inline bool amx_on() { return amx_wanted().load(std::memory_order_relaxed) && amx_supported(); }

// Floats one packed tile of 16 items of `depth` values takes (2 terms x steps x 16 x 32 bf16).
inline int64_t amx_tile_floats(int64_t depth) { return (depth + AMX_STEP - 1) / AMX_STEP * AMX_STEP * AMX_ITEMS; }

inline uint16_t bf16_bits(float x) {  // rounded to nearest even (finite x)
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return static_cast<uint16_t>((bits + 0x7fff + (bits >> 16 & 1)) >> 16);
}

// 16 floats -> their bf16 roundings (16-bit, in the low halves of 32-bit lanes) and those as floats.
__attribute__((target("avx512f")))
inline __m512i round_bf16x16(__m512 x, __m512& rounded) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    rounded = _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    return _mm512_srli_epi32(up, 16);
}

// The 32 16-bit values at v (fp16, or bf16 where bf16) as two rows of 32 bf16: hi + lo, exactly.
__attribute__((target("avx512f,f16c")))
inline void split_row32(const uint16_t* v, bool bf16, __m512i& hi, __m512i& lo) {
    if (bf16) {
        hi = _mm512_loadu_si512(v);
        lo = _mm512_setzero_si512();
        return;
    }
    __m512i h[2], l[2];
    for (int half = 0; half < 2; ++half) {
        const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * half)));
        __m512 rounded, unused;
        h[half] = round_bf16x16(x, rounded);
        l[half] = round_bf16x16(_mm512_sub_ps(x, rounded), unused);  // exact: at most 3 bits are left
    }
    hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(h[0])), _mm512_cvtepi32_epi16(h[1]), 1);
    lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(l[0])), _mm512_cvtepi32_epi16(l[1]), 1);
}

// r[i] <- column i of the 16 x 16 matrix of 32-bit lanes whose rows are r[0..16).
__attribute__((target("avx512f")))
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

// Values offset .. offset + width of the packed tiles (`depth` values per item) <- items j0 .. j1 (j0 a
// multiple of 16), item j's width 16-bit values (fp16, or bf16 where bf16) at rows(j). A call with
// offset 0 first clears its tiles (the depth's padding and the items past j1 stay zero). Whole tiles
// of whole steps go 16 items at a time, transposed in registers; the rest one value at a time.
template <class Row>
__attribute__((target("avx512f,f16c")))
void pack_amx(int64_t j0, int64_t j1, int64_t width, int64_t depth, int64_t offset, Row rows, uint16_t* panel,
              bool bf16 = false) {
    const int64_t steps = (depth + AMX_STEP - 1) / AMX_STEP, plane = steps * AMX_STEP * AMX_ITEMS;
    const int64_t first = j0 / AMX_ITEMS, last = (j1 + AMX_ITEMS - 1) / AMX_ITEMS;
    if (offset == 0) std::fill(panel + first * 2 * plane, panel + last * 2 * plane, uint16_t{0});
    int64_t j = j0;
    if (offset % AMX_STEP == 0 && width % AMX_STEP == 0) {
        for (; j + AMX_ITEMS <= j1; j += AMX_ITEMS) {
            uint16_t* tile = panel + j / AMX_ITEMS * 2 * plane;
            for (int64_t d = 0; d < width; d += AMX_STEP) {
                __m512i hi[16], lo[16];
                for (int i = 0; i < 16; ++i) split_row32(rows(j + i) + d, bf16, hi[i], lo[i]);
                transpose16(hi);
                transpose16(lo);
                uint16_t* at = tile + (offset + d) / AMX_STEP * AMX_STEP * AMX_ITEMS;
                for (int i = 0; i < 16; ++i) {
                    _mm512_storeu_si512(at + i * 2 * AMX_ITEMS, hi[i]);
                    _mm512_storeu_si512(at + plane + i * 2 * AMX_ITEMS, lo[i]);
                }
            }
        }
    }
    for (; j < j1; ++j) {
        uint16_t* tile = panel + j / AMX_ITEMS * 2 * plane;
        const uint16_t* row = rows(j);
        for (int64_t d = 0; d < width; ++d) {
            const int64_t at = offset + d;
            const float x = widen(row[d], bf16);
            const uint16_t h = bf16_bits(x);
            const int64_t place = at / AMX_STEP * AMX_STEP * AMX_ITEMS + at % AMX_STEP / 2 * 2 * AMX_ITEMS
                                  + 2 * (j % AMX_ITEMS) + at % 2;
            tile[place] = h;
            tile[plane + place] = bf16_bits(x - widen(h, true));
        }
    }
}

// q ([G][depth] floats) -> 3 terms x [rows][steps * 32] bf16, hi + mid + low = q exactly; the rows past G
// and the depth's padding zero. rows: G rounded up to 16. 16 values at a time, the rest one by one.
__attribute__((target("avx512f")))
inline void split_queries(const float* q, int64_t G, int64_t depth, int64_t rows, std::vector<uint16_t>& out) {
    const int64_t width = (depth + AMX_STEP - 1) / AMX_STEP * AMX_STEP, term = rows * width;
    out.assign(3 * term, 0);
    for (int64_t g = 0; g < G; ++g) {
        int64_t d = 0;
        for (; d + 16 <= depth; d += 16) {
            __m512 rounded, unused;
            const __m512 x = _mm512_loadu_ps(q + g * depth + d);
            const __m512i hi = round_bf16x16(x, rounded);
            const __m512 rest = _mm512_sub_ps(x, rounded);
            const __m512i mid = round_bf16x16(rest, rounded);
            const __m512i low = round_bf16x16(_mm512_sub_ps(rest, rounded), unused);
            uint16_t* at = out.data() + g * width + d;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_cvtepi32_epi16(hi));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + term), _mm512_cvtepi32_epi16(mid));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 2 * term), _mm512_cvtepi32_epi16(low));
        }
        for (; d < depth; ++d) {
            const float x = q[g * depth + d];
            const uint16_t hi = bf16_bits(x);
            const float rest = x - widen(hi, true);
            const uint16_t mid = bf16_bits(rest);
            out[g * width + d] = hi;
            out[term + g * width + d] = mid;
            out[2 * term + g * width + d] = bf16_bits(rest - widen(mid, true));
        }
    }
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

// The product of 16 queries (`split_queries`' layout: hi at q, mid and low `term` apart, rows `stride`
// bytes) with the packed tile at a (and, where two, the next one): tile 0 (1) accumulates, 2 holds a
// term of the queries, 3 and 5 (4 and 6) the items' hi and lo of the step; stored at out (out + 16).
template <bool two>
__attribute__((target("amx-tile,amx-bf16")))
inline void amx_tiles(const uint16_t* q, int64_t term, int64_t stride, int64_t steps, int64_t plane, const uint16_t* a,
                      float* out, int64_t store) {
    const uint16_t* b = a + 2 * plane;
    _tile_zero(0);
    if constexpr (two) _tile_zero(1);
    for (int64_t s = 0; s < steps; ++s) {
        const int64_t at = s * AMX_STEP * AMX_ITEMS;
        _tile_loadd(3, a + at, 64);
        _tile_loadd(5, a + plane + at, 64);
        if constexpr (two) {
            _tile_loadd(4, b + at, 64);
            _tile_loadd(6, b + plane + at, 64);
        }
        for (int t = 0; t < 3; ++t) {  // hi, mid, low; low x lo (2^-24 of the product) left out
            _tile_loadd(2, q + t * term + s * AMX_STEP, stride);
            _tile_dpbf16ps(0, 2, 3);
            if constexpr (two) _tile_dpbf16ps(1, 2, 4);
            if (t == 2) continue;
            _tile_dpbf16ps(0, 2, 5);
            if constexpr (two) _tile_dpbf16ps(1, 2, 6);
        }
    }
    _tile_stored(0, out, store);
    if constexpr (two) _tile_stored(1, out + AMX_ITEMS, store);
}

// out[g * ldo + j] = q[g] . item j for g < rows (a multiple of 16) and the items of `tiles` packed tiles
// (j < 16 * tiles), the queries as `split_queries` lays them out: two tiles of items per pass, the last
// one alone.
__attribute__((target("amx-tile,amx-bf16")))
void amx_product(const uint16_t* q, int64_t rows, int64_t depth, const uint16_t* panel, int64_t tiles, float* out,
                 int64_t ldo) {
    TileConfig config{};
    config.palette = 1;
    for (int i = 0; i < 8; ++i) {
        config.bytes_per_row[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
    const int64_t steps = (depth + AMX_STEP - 1) / AMX_STEP, width = steps * AMX_STEP;
    const int64_t plane = steps * AMX_STEP * AMX_ITEMS, term = rows * width, stride = width * 2;
    const int64_t store = ldo * static_cast<int64_t>(sizeof(float));
    for (int64_t m = 0; m < rows; m += 16) {
        int64_t t = 0;
        for (; t + 2 <= tiles; t += 2)
            amx_tiles<true>(q + m * width, term, stride, steps, plane, panel + t * 2 * plane, out + m * ldo + t * AMX_ITEMS,
                            store);
        if (t < tiles)
            amx_tiles<false>(q + m * width, term, stride, steps, plane, panel + t * 2 * plane, out + m * ldo + t * AMX_ITEMS,
                             store);
    }
    _tile_release();
}

}  // namespace
