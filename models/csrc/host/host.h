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
