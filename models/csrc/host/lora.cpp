// LoRA adapters on the CPU (models/lora_cpu.py, docs/lora.md): y[t] += (x[t] @ A[slot].T) @ B[slot].T for
// the rows t of each slot, as models/lora.py's torch reference groups them: each slot's rows
// gathered, shrunk on A (the output rounded to bf16, as torch's bf16 matmul rounds it), expanded
// on each shard's own block of B (rounded to bf16), and added to y (rounded once, as the torch
// path's index_add_).
//
// The matmuls are narrow (rank r is 8-64), so they have kernels of their own rather than the set's
// 64-column linear: the shrink streams A in 16-column groups ([k][16] each), so a rank-16 adapter
// reads only its own A; the expand streams B transposed ([rank][columns]) and adds its rounded
// output straight into y. Every output element is one fp32 sum in a fixed order (over k for the
// shrink, over the rank for the expand) whatever the tile, chunk or thread: a row gets the same
// bits alone or among others, and the decoder stack gives the Python forward's bits. On x86 with
// an x86 set loaded (avx2, avx512vnni, avx512: each implies AVX2 + FMA) the tiles are AVX2
// intrinsics, elsewhere plain loops.
//
// Threads: with enough chunks of a slot's rows (at most 32 each) for every thread, one parallel
// region where a task shrinks and then expands its chunk; with fewer (a long prefill of one
// adapter), one region for the shrinks and one for the expands, split by columns as well. A
// linear's LoRA work at batch 1 is a few microseconds, less than waking the threads costs, so
// small work runs on the calling thread with no region at all.

#include <cstring>
#include <string>

#include "host.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KV_LORA_X86 1
#define KV_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace kvserve::host_lib {
namespace {

constexpr int64_t kRowChunk = 32;         // rows per task
constexpr int64_t kColChunk = 256;        // output columns per expand task (a multiple of 16)
constexpr int64_t kInlineWork = 1 << 18;  // multiply-adds below which one thread does everything
constexpr int64_t kTileRows = 4;          // rows per register tile

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// ---- plain loops (any CPU): the same sums in the same order as the AVX2 tiles, without FMA

// out [mr, 16 * ng] = x [mr, k] (fp32, rows ldx apart) @ the groups' A ([k][16] each, gs apart), rounded to bf16.
void shrink_plain(int mr, int ng, const float* x, int64_t ldx, int64_t k, const uint16_t* a, int64_t gs, float* out,
                  int64_t ldo) {
  for (int i = 0; i < mr; ++i)
    for (int g = 0; g < ng; ++g) {
      float acc[16] = {};
      const uint16_t* ag = a + g * gs;
      for (int64_t kk = 0; kk < k; ++kk) {
        const float xv = x[i * ldx + kk];
        for (int c = 0; c < 16; ++c) {
          const float p = xv * bf16_to_float(ag[kk * 16 + c]);
          acc[c] += p;
        }
      }
      for (int c = 0; c < 16; ++c) out[i * ldo + 16 * g + c] = round_bf16(acc[c]);
    }
}

// y rows (pointers) [:, :n] += round(s [mr, rank] (rows lds apart) @ B^T [rank][16 * nv] (rows ldb apart)).
void expand_plain(int mr, int nv16, const float* s, int64_t lds, int64_t rank, const uint16_t* b, int64_t ldb,
                  uint16_t* const* y, int64_t n) {
  for (int i = 0; i < mr; ++i)
    for (int64_t c0 = 0; c0 < 16 * nv16 && c0 < n; c0 += 16) {
      float acc[16] = {};
      for (int64_t r = 0; r < rank; ++r) {
        const float sv = s[i * lds + r];
        for (int c = 0; c < 16; ++c) {
          const float p = sv * bf16_to_float(b[r * ldb + c0 + c]);
          acc[c] += p;
        }
      }
      for (int64_t c = 0; c < 16 && c0 + c < n; ++c)
        y[i][c0 + c] = float_to_bf16(bf16_to_float(y[i][c0 + c]) + round_bf16(acc[c]));
    }
}

#ifdef KV_LORA_X86
KV_AVX2 inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 8 fp32 -> 8 bf16 bits (round to nearest even, NaN -> quiet NaN), as kernel_common.h's float_to_bf16
KV_AVX2 inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// bf16 rounding of fp32 lanes, kept in fp32 (to_bf16's bits, without packing them)
KV_AVX2 inline __m256 round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

// shrink_plain's tile with FMA: MR rows x NG groups of 16 columns.
template <int MR, int NG>
KV_AVX2 void shrink_tile(const float* x, int64_t ldx, int64_t k, const uint16_t* a, int64_t gs, float* out,
                         int64_t ldo) {
  __m256 acc[MR][2 * NG];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NG; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
      const __m256 w0 = load8(a + g * gs + kk * 16), w1 = load8(a + g * gs + kk * 16 + 8);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256 xb = _mm256_broadcast_ss(x + i * ldx + kk);
        acc[i][2 * g] = _mm256_fmadd_ps(w0, xb, acc[i][2 * g]);
        acc[i][2 * g + 1] = _mm256_fmadd_ps(w1, xb, acc[i][2 * g + 1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2 * NG; ++j) _mm256_storeu_ps(out + i * ldo + 8 * j, round8(acc[i][j]));
}

// expand_plain's tile with FMA: MR rows x NV vectors of 8 columns (16 * nv16 columns padded in B).
template <int MR, int NV>
KV_AVX2 void expand_tile(const float* s, int64_t lds, int64_t rank, const uint16_t* b, int64_t ldb,
                         uint16_t* const* y, int64_t n) {
  __m256 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      const __m256 w = load8(b + r * ldb + 8 * j);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(s + i * lds + r), acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV && 8 * j < n; ++j) {
      const int64_t width = std::min<int64_t>(8, n - 8 * j);
      uint16_t* out = y[i] + 8 * j;
      if (width == 8) {
        const __m256 sum = _mm256_add_ps(load8(out), round8(acc[i][j]));
        _mm_storeu_si128((__m128i*)out, to_bf16(sum));
        continue;
      }
      alignas(16) uint16_t tmp[8] = {};
      std::memcpy(tmp, out, width * 2);
      const __m256 sum = _mm256_add_ps(load8(tmp), round8(acc[i][j]));
      _mm_store_si128((__m128i*)tmp, to_bf16(sum));
      std::memcpy(out, tmp, width * 2);
    }
}

using ShrinkFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t);
using ExpandFn = void (*)(const float*, int64_t, int64_t, const uint16_t*, int64_t, uint16_t* const*, int64_t);

// Tiles of at most 12 accumulators: a row takes up to 4 groups (or 64 columns), 4 rows one group.
ShrinkFn shrink_fn(int mr, int ng) {
  static const ShrinkFn fns[4][4] = {
      {shrink_tile<1, 1>, shrink_tile<1, 2>, shrink_tile<1, 3>, shrink_tile<1, 4>},
      {shrink_tile<2, 1>, shrink_tile<2, 2>, shrink_tile<2, 3>, shrink_tile<2, 3>},
      {shrink_tile<3, 1>, shrink_tile<3, 2>, shrink_tile<3, 2>, shrink_tile<3, 2>},
      {shrink_tile<4, 1>, shrink_tile<4, 1>, shrink_tile<4, 1>, shrink_tile<4, 1>}};
  return fns[mr - 1][ng - 1];
}
int max_groups(int mr) { return mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1; }

ExpandFn expand_fn(int mr, int nv16) {
  static const ExpandFn fns[4][4] = {
      {expand_tile<1, 2>, expand_tile<1, 4>, expand_tile<1, 6>, expand_tile<1, 8>},
      {expand_tile<2, 2>, expand_tile<2, 4>, expand_tile<2, 6>, expand_tile<2, 6>},
      {expand_tile<3, 2>, expand_tile<3, 4>, expand_tile<3, 4>, expand_tile<3, 4>},
      {expand_tile<4, 2>, expand_tile<4, 2>, expand_tile<4, 2>, expand_tile<4, 2>}};
  return fns[mr - 1][nv16 - 1];
}
#endif

// Which tiles this process runs: AVX2 + FMA where the loaded set implies them.
bool use_avx2() {
#ifdef KV_LORA_X86
  const char* name = kernel_set() ? kernel_set()->name : "";
  return !std::strncmp(name, "avx", 3);  // the x86 sets
#else
  return false;
#endif
}

// shrunk rows [rows][16 * groups] of x rows [rows][k] (fp32, contiguous) through one slot's A.
void shrink_rows(bool avx2, const float* x, int64_t rows, int64_t k, const uint16_t* a, int64_t groups, float* out,
                 int64_t ldo) {
  for (int64_t i = 0; i < rows; i += kTileRows) {
    const int mr = static_cast<int>(std::min(kTileRows, rows - i));
    for (int64_t g = 0; g < groups;) {
#ifdef KV_LORA_X86
      const int ng = static_cast<int>(std::min<int64_t>(avx2 ? max_groups(mr) : 4, groups - g));
      if (avx2)
        shrink_fn(mr, ng)(x + i * k, k, k, a + g * k * 16, k * 16, out + i * ldo + 16 * g, ldo);
      else
#else
      const int ng = static_cast<int>(std::min<int64_t>(4, groups - g));
#endif
        shrink_plain(mr, ng, x + i * k, k, k, a + g * k * 16, k * 16, out + i * ldo + 16 * g, ldo);
      g += ng;
    }
  }
}

// y rows (pointers) [:, :n] += round(s [rows][rank] @ B^T [rank][n, padded to 16] (rows ldb apart)).
void expand_rows(bool avx2, const float* s, int64_t lds, int64_t rows, int64_t rank, const uint16_t* b, int64_t ldb,
                 uint16_t* const* y, int64_t col, int64_t n) {
  uint16_t* out[kTileRows];
  for (int64_t i = 0; i < rows; i += kTileRows) {
    const int mr = static_cast<int>(std::min(kTileRows, rows - i));
    for (int64_t c = 0; c < n;) {
      const int64_t left16 = (n - c + 15) / 16;
      for (int t = 0; t < mr; ++t) out[t] = y[i + t] + col + c;
#ifdef KV_LORA_X86
      const int nv16 = static_cast<int>(std::min<int64_t>(avx2 ? (mr == 1 ? 4 : mr == 2 ? 3 : mr == 3 ? 2 : 1) : 4, left16));
      if (avx2)
        expand_fn(mr, nv16)(s + i * lds, lds, rank, b + c, ldb, out, n - c);
      else
#else
      const int nv16 = static_cast<int>(std::min<int64_t>(4, left16));
#endif
        expand_plain(mr, nv16, s + i * lds, lds, rank, b + c, ldb, out, n - c);
      c += 16 * nv16;
    }
  }
}

}  // namespace

const char* lora_linear(LoraLinear& l, const uint16_t* a, const uint16_t* b, int64_t k, int64_t n, int64_t num_shards,
                        int64_t rank_pad, const int64_t* shard_n, int64_t num_slots) {
  if (num_shards < 1 || num_shards > LoraLinear::kMaxShards || rank_pad < 1 || k < 1 || num_slots < 1)
    return fail("LoRA: 1-4 shards, a rank and input features");
  l = LoraLinear{a, b, k, n, num_shards, rank_pad, num_slots, {}, {}, {}, 0, 0};
  l.a_groups = (num_shards * rank_pad + 15) / 16;
  int64_t offset = 0;
  for (int64_t s = 0; s < num_shards; ++s) {
    if (shard_n[s] < 1) return fail("LoRA: a shard has no output columns");
    l.shard_n[s] = shard_n[s], l.shard_offset[s] = offset, l.shard_col[s] = l.b_cols;
    offset += shard_n[s], l.b_cols += round16(shard_n[s]);
  }
  if (offset != n) return fail("LoRA: the shards' output sizes do not add up to the linear's");
  return nullptr;
}

const char* check_segments(const LoraSegments& s, int64_t num_tokens, int64_t num_slots) {
  int64_t covered = 0;
  for (int64_t g = 0; g < s.num_segments; ++g) {
    if (s.slots[g] < 0 || s.slots[g] >= num_slots || s.starts[g] != covered || s.lens[g] < 1)
      return fail("LoRA: segment " + std::to_string(g) + " is not the next run of rows of a slot in range");
    covered += s.lens[g];
  }
  if (covered != s.num_rows) return fail("LoRA: the segments do not cover the adapted rows");
  for (int64_t i = 0; i < s.num_rows; ++i)
    if (s.token_order[i] < 0 || s.token_order[i] >= num_tokens)
      return fail("LoRA: row " + std::to_string(s.token_order[i]) + " is out of range");
  return nullptr;
}

void lora_apply(const LoraLinear& l, const LoraSegments& s, const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy,
                LoraScratch& scratch) {
  const int64_t rows = s.num_rows, k = l.k, rp = l.rank_pad, width = 16 * l.a_groups;
  if (rows == 0) return;
  const bool avx2 = use_avx2();
  // (start, len, slot) chunks of rows within one slot, and (shard, first column, columns) chunks
  std::vector<LoraScratch::Chunk>& row_chunks = scratch.row_chunks;
  std::vector<LoraScratch::Chunk>& col_chunks = scratch.col_chunks;
  row_chunks.clear(), col_chunks.clear();
  // small work runs on this thread: whole segments and shards, the fewest calls
  const bool small = rows * (k * width + l.n * rp) < kInlineWork;
  const int64_t row_chunk = small ? rows : kRowChunk;
  for (int64_t g = 0; g < s.num_segments; ++g)
    for (int64_t r = 0; r < s.lens[g]; r += row_chunk)
      row_chunks.push_back({s.starts[g] + r, std::min(row_chunk, s.lens[g] - r), s.slots[g]});
  for (int64_t sh = 0; sh < l.num_shards; ++sh) {
    const int64_t col_chunk = small ? l.shard_n[sh] : kColChunk;
    for (int64_t c = 0; c < l.shard_n[sh]; c += col_chunk)
      col_chunks.push_back({sh, c, std::min(col_chunk, l.shard_n[sh] - c)});
  }
  const int64_t num_rc = static_cast<int64_t>(row_chunks.size()), num_cc = static_cast<int64_t>(col_chunks.size());
  float* shrunk = grow(scratch.shrunk, rows * width);  // [rows, 16 * a_groups], slot by slot, bf16 values
  uint16_t** y_rows = grow(scratch.y_rows, rows);      // [rows]: y's row of each adapted row
  for (int64_t i = 0; i < rows; ++i) y_rows[i] = y + s.token_order[i] * ldy;
  const int64_t a_slot = l.a_groups * k * 16, b_slot = rp * l.b_cols;
  auto shrink = [&](int64_t c) {
    thread_local std::vector<float> xs_buffer;
    const LoraScratch::Chunk& rc = row_chunks[c];
    float* xs = grow(xs_buffer, rc.b * k);  // [len, k]: the chunk's rows of x in fp32
    for (int64_t i = 0; i < rc.b; ++i) {
      const uint16_t* src = x + s.token_order[rc.a + i] * ldx;
      for (int64_t j = 0; j < k; ++j) xs[i * k + j] = bf16_to_float(src[j]);
    }
    shrink_rows(avx2, xs, rc.b, k, l.a + rc.c * a_slot, l.a_groups, shrunk + rc.a * width, width);
  };
  auto expand = [&](int64_t c, int64_t col_task) {
    const LoraScratch::Chunk &rc = row_chunks[c], &cc = col_chunks[col_task];
    const int64_t sh = cc.a, col = cc.b;
    expand_rows(avx2, shrunk + rc.a * width + sh * rp, width, rc.b, rp, l.b + rc.c * b_slot + l.shard_col[sh] + col,
                l.b_cols, y_rows + rc.a, l.shard_offset[sh] + col, cc.c);
  };
  if (small || num_rc >= 2 * num_threads()) {  // one region: a task shrinks and expands its rows
    parallel_for(0, num_rc, small ? num_rc : 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        shrink(c);
        for (int64_t cc = 0; cc < num_cc; ++cc) expand(c, cc);
      }
    });
    return;
  }
  // few chunks of rows (one slot's prefill): the expands split by columns too, after every shrink
  parallel_for(0, num_rc, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) shrink(c);
  });
  parallel_for(0, num_rc * num_cc, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) expand(task / num_cc, task % num_cc);
  });
}

}  // namespace kvserve::host_lib
using namespace kvserve::host_lib;

// One LoRA'd linear applied on its own (the model's Python forward; models/lora_cpu.py): x [num_tokens, k]
// rows ldx apart, y [num_tokens, n] rows ldy apart, both bf16; shard_n [num_shards] int64.
struct LoraApplyArgs {
  const uint16_t* x;
  int64_t ldx;
  uint16_t* y;
  int64_t ldy, num_tokens;
  const uint16_t *a, *b;
  int64_t k, n, num_shards, rank_pad;
  const int64_t* shard_n;
  int64_t num_slots;
  const int64_t* token_order;
  const int32_t *starts, *lens, *slots;
  int64_t num_segments, num_rows;
};
static_assert(sizeof(LoraApplyArgs) == 19 * 8, "models/cpu_ops.py packs 19 fields of 8 bytes");

KV_EXPORT const char* kv_lora_apply(const LoraApplyArgs* p) {
  if (!kernel_set()) return fail("LoRA on the CPU needs a kernel set");
  LoraLinear l;
  if (const char* err = lora_linear(l, p->a, p->b, p->k, p->n, p->num_shards, p->rank_pad, p->shard_n, p->num_slots))
    return err;
  const LoraSegments s{p->token_order, p->starts, p->lens, p->slots, p->num_segments, p->num_rows};
  if (const char* err = check_segments(s, p->num_tokens, p->num_slots)) return err;
  thread_local LoraScratch scratch;
  lora_apply(l, s, p->x, p->ldx, p->y, p->ldy, scratch);
  return nullptr;
}
