// LoRA adapters on the CPU (models/lora_cpu.py, docs/lora.md): y[t] += (x[t] @ A[slot].T) @ B[slot].T for
// the rows t of each slot, as models/lora.py's torch reference groups them: the rows gathered slot
// by slot, one shrink per slot and one expand per (slot, shard), both on the set's linear_bf16 (the
// shrink's output rounded to bf16 as torch's bf16 matmul rounds it), then one add per element.
// Plain host code over the set's kernel: nothing here depends on the instruction set.
//
// Threads: with at least as many matmuls in a step as threads, the matmuls are spread over the
// threads (each one then runs on its thread alone: a nested parallel_for is inline); with fewer
// (one or two adapters), each matmul splits its own columns and rows over all of them.

#include <string>

#include "host.h"

namespace kvserve::host_lib {
namespace {

template <typename T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

int64_t blocks_of(int64_t n) { return (n + 63) / 64; }

template <typename Fn>
void for_each_task(int64_t n, const Fn& fn) {
  if (n >= num_threads()) {
    parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(i);
    });
  } else {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
}

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
  uint16_t* xs = grow(scratch.x, rows * k);           // [rows, k]: x's adapted rows, slot by slot
  uint16_t* shrunk = grow(scratch.shrunk, rows * width);  // [rows, shards * rank_pad]
  uint16_t* delta = grow(scratch.delta, rows * l.n);  // shard s: [rows, shard_n[s]] from rows * shard_offset[s]
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(xs + i * k, x + s.token_order[i] * ldx, k * 2);
  });
  const int64_t a_slot = l.a_blocks * k * 64, b_slot = l.b_blocks * rp * 64;
  for_each_task(s.num_segments, [&](int64_t g) {
    const int64_t start = s.starts[g];
    set.linear_bf16(xs + start * k, k, s.lens[g], l.a + s.slots[g] * a_slot, k / 2, l.a_blocks, nullptr,
                    shrunk + start * width, width);
  });
  for_each_task(s.num_segments * l.num_shards, [&](int64_t task) {
    const int64_t g = task / l.num_shards, sh = task % l.num_shards, start = s.starts[g], n = l.shard_n[sh];
    set.linear_bf16(shrunk + start * width + sh * rp, width, s.lens[g],
                    l.b + s.slots[g] * b_slot + l.shard_block[sh] * rp * 64, rp / 2, blocks_of(n), nullptr,
                    delta + rows * l.shard_offset[sh] + start * n, n);
  });
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint16_t* out = y + s.token_order[i] * ldy;
      for (int64_t sh = 0; sh < l.num_shards; ++sh) {
        const int64_t n = l.shard_n[sh], offset = l.shard_offset[sh];
        const uint16_t* d = delta + rows * offset + i * n;
        for (int64_t j = 0; j < n; ++j)
          out[offset + j] = float_to_bf16(bf16_to_float(out[offset + j]) + bf16_to_float(d[j]));
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
