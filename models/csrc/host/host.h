// kvserve's CPU host library: plain C++17 with no torch or Python headers, called from Python
// through ctypes (models/cpu_ops.py). It loads one kernel set (kernels.h), gives it torch's
// thread pool through the C functions libtorch exports, and exports each op as an extern "C"
// function on raw pointers and integers (one struct of them, ops.cpp): Python checks shapes,
// dtypes and strides and allocates the outputs; these functions check what depends on the data
// (slots, rows, lengths) and return nullptr, or a message (valid until the calling thread's next
// call) instead of throwing.
#pragma once

#include <cstdint>
#include <string>

#include "../kernel_common.h"

namespace kvserve::host_lib {

// Element types of the ops that take more than one (models/cpu_ops.py's _DTYPES).
enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

// fn(ctx, b, e) over chunks of [begin, end) on `threads` threads of kvserve's pool (pool.cpp), with
// at::parallel_for's split: at most one chunk a thread, each of at least `grain` items.
void pool_parallel_for(int threads, int64_t begin, int64_t end, int64_t grain,
                       void (*body)(void*, int64_t, int64_t), void* ctx);

// The loaded set, or nullptr.
const KernelSet* kernel_set();

// Sets the calling thread's error message and returns it (the ops' failure result).
const char* fail(std::string message);

// The scalar fallbacks and helpers decoder_stack.cpp shares with ops.cpp.
void rotary(void* x, int64_t ldx, const void* cos_sin, int64_t rows, int64_t num_heads, int64_t d, int dtype);
// The set's rms_norm_bf16, in place, on `num_heads` heads of `d` at the start of each row of x.
void rms_norm_heads(uint16_t* x, int64_t ldx, int64_t rows, int64_t num_heads, int64_t d, const uint16_t* w,
                    float eps);
// k, v rows (ld bytes apart, row_bytes each) into cache slots; an error for a slot out of range.
const char* write_kv_cache(const void* k, int64_t k_ld, const void* v, int64_t v_ld, int64_t rows, int64_t row_bytes,
                           void* k_cache, void* v_cache, int64_t num_slots, const int64_t* slots);

}  // namespace kvserve::host_lib

namespace kvserve::host_lib {

// A LoRA'd linear's adapter slots as models/lora_cpu.py packs them for lora.cpp's narrow kernels:
// A of every shard stacked (rank_pad rows per shard; the shrink's output is [rows, num_shards *
// rank_pad], padded to 16 columns) in groups of 16 output columns, and B transposed, each shard's
// block of the block-diagonal B on its own columns (padded to 16).
struct LoraLinear {
  static constexpr int kMaxShards = 4;
  const uint16_t* a;  // [num_slots][a_groups][k][16]
  const uint16_t* b;  // [num_slots][rank_pad][b_cols]: shard s's columns from shard_col[s]
  int64_t k, n, num_shards, rank_pad, num_slots;
  int64_t shard_n[kMaxShards], shard_offset[kMaxShards], shard_col[kMaxShards];
  int64_t a_groups, b_cols;
};

// One step's rows that use an adapter, grouped by slot (models/lora.py's LoRABatchMeta).
struct LoraSegments {
  const int64_t* token_order = nullptr;  // [num_rows]: rows of x / y, slot by slot
  const int32_t *starts = nullptr, *lens = nullptr, *slots = nullptr;  // [num_segments]
  int64_t num_segments = 0, num_rows = 0;
};

// Scratch grown to the largest step, reused after that.
struct LoraScratch {
  struct Chunk { int64_t a, b, c; };  // rows: (start, len, slot); columns: (shard, first column, columns)
  std::vector<Chunk> row_chunks, col_chunks;
  std::vector<float> shrunk;
  std::vector<uint16_t*> y_rows;
};

// Fills `l` from the packed shapes; an error for shapes that do not fit.
const char* lora_linear(LoraLinear& l, const uint16_t* a, const uint16_t* b, int64_t k, int64_t n, int64_t num_shards,
                        int64_t rank_pad, const int64_t* shard_n, int64_t num_slots);
// An error unless every segment lies within the rows and slots, and every row is < num_tokens.
const char* check_segments(const LoraSegments& s, int64_t num_tokens, int64_t num_slots);
// y rows (ldy apart) += the adapters' outputs for x rows (ldx apart), each row through its slot's
// A then B; y is rounded to bf16 once, as y.index_add_ of the bf16 expand output does.
void lora_apply(const LoraLinear& l, const LoraSegments& s, const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy,
                LoraScratch& scratch);

}  // namespace kvserve::host_lib
