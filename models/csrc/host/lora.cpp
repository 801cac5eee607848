// LoRA adapters on the CPU (models/lora_cpu.py, docs/lora.md): y[t] += (x[t] @ A[slot].T) @ B[slot].T for
// the rows t of each slot, as models/lora.py's torch reference groups them: each slot's rows
// gathered, shrunk on A (the output rounded to bf16, as torch's bf16 matmul rounds it), expanded
// on each shard's own block of B, and added to y (rounded once, as the torch path's index_add_).
// Both matmuls are the set's linear_bf16, whose output bits do not depend on how rows and columns
// are split: plain host code, nothing here depends on the instruction set.
//
// Threads: one parallel region for the shrinks (a task per slot and chunk of rows) and one for the
// expands and adds (a task per chunk of rows and chunk of a shard's columns); the kernel calls in
// a task run on its thread alone (a nested parallel_for is inline). A linear's LoRA work at batch 1
// is a few microseconds, less than waking the threads costs, so small work runs on the calling
// thread with no region at all.

#include <string>

#include "host.h"

namespace kvserve::host_lib {
namespace {

constexpr int64_t kRowChunk = 32;         // rows per task
constexpr int64_t kColChunk = 256;       // output columns per expand task (a multiple of 64)
constexpr int64_t kInlineWork = 1 << 18;  // multiply-adds below which one thread does everything

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

int64_t blocks_of(int64_t n) { return (n + 63) / 64; }

}  // namespace

const char* lora_linear(LoraLinear& l, const uint16_t* a, const uint16_t* b, int64_t k, int64_t n, int64_t num_shards,
                        int64_t rank_pad, const int64_t* shard_n, int64_t num_slots) {
  if (num_shards < 1 || num_shards > LoraLinear::kMaxShards || rank_pad < 2 || rank_pad % 2 || k < 2 || k % 2 ||
      num_slots < 1)
    return fail("LoRA: 1-4 shards, an even padded rank and an even number of input features");
  l = LoraLinear{a, b, k, n, num_shards, rank_pad, num_slots, {}, {}, {}, 0, 0};
  l.a_blocks = blocks_of(num_shards * rank_pad);
  int64_t offset = 0;
  for (int64_t s = 0; s < num_shards; ++s) {
    if (shard_n[s] < 1) return fail("LoRA: a shard has no output columns");
    l.shard_n[s] = shard_n[s], l.shard_offset[s] = offset, l.shard_block[s] = l.b_blocks;
    offset += shard_n[s], l.b_blocks += blocks_of(shard_n[s]);
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
  const int64_t rows = s.num_rows, k = l.k, rp = l.rank_pad, width = l.num_shards * rp;
  if (rows == 0) return;
  const KernelSet& set = *kernel_set();
  // (start, len, slot) chunks of rows within one slot, and (shard, first column, columns) chunks
  std::vector<LoraScratch::Chunk>& row_chunks = scratch.row_chunks;
  std::vector<LoraScratch::Chunk>& col_chunks = scratch.col_chunks;
  row_chunks.clear(), col_chunks.clear();
  // small work runs on this thread: whole segments and shards, the fewest kernel calls
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
  uint16_t* shrunk = grow(scratch.shrunk, rows * width);  // [rows, shards * rank_pad], slot by slot
  const int64_t a_slot = l.a_blocks * k * 64, b_slot = l.b_blocks * rp * 64;
  parallel_for(0, num_rc, small ? num_rc : 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> xs_buffer;
    for (int64_t c = begin; c < end; ++c) {
      const LoraScratch::Chunk& rc = row_chunks[c];
      uint16_t* xs = grow(xs_buffer, rc.b * k);  // [len, k]: the chunk's rows of x
      for (int64_t i = 0; i < rc.b; ++i) std::memcpy(xs + i * k, x + s.token_order[rc.a + i] * ldx, k * 2);
      set.linear_bf16(xs, k, rc.b, l.a + rc.c * a_slot, k / 2, l.a_blocks, nullptr, shrunk + rc.a * width, width);
    }
  });
  parallel_for(0, num_rc * num_cc, small ? num_rc * num_cc : 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> delta_buffer;
    for (int64_t task = begin; task < end; ++task) {
      const LoraScratch::Chunk &rc = row_chunks[task / num_cc], &cc = col_chunks[task % num_cc];
      const int64_t sh = cc.a, col = cc.b, n = cc.c;
      uint16_t* delta = grow(delta_buffer, rc.b * n);  // [len, columns]
      set.linear_bf16(shrunk + rc.a * width + sh * rp, width, rc.b,
                      l.b + rc.c * b_slot + (l.shard_block[sh] + col / 64) * rp * 64, rp / 2, blocks_of(n), nullptr,
                      delta, n);
      for (int64_t i = 0; i < rc.b; ++i) {
        uint16_t* out = y + s.token_order[rc.a + i] * ldy + l.shard_offset[sh] + col;
        const uint16_t* d = delta + i * n;
        for (int64_t j = 0; j < n; ++j) out[j] = float_to_bf16(bf16_to_float(out[j]) + bf16_to_float(d[j]));
      }
    }
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
