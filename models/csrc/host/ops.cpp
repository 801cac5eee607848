// The host library's extern "C" ops (host.h): the loaded kernel set's kernels, and plain loops
// for what works without a set (rms_norm, add_rms_norm_ and rotary_ in float32 and bf16,
// write_kv_cache, apply_token_bitmask_). models/cpu_ops.py wraps each one for tensors, and
// `python -m benchmarks.bench_kernels` measures them against PyTorch:
//
//  * linear_bf16     y = x @ W.T + b for bf16, W pre-packed once into 64-column blocks of
//    input-feature pairs (models/cpu_ops.py); quant_linear the same for int8 / int4 weights in
//    groups (models/quantization.py), activations quantized per row and group.
//  * paged_decode_attention  one query token per request attending over its keys/values in
//    place in the paged cache (no gather copy), GQA-aware; paged_prefill_attention flash-style
//    causal attention for a prompt chunk.
//  * logprobs_topk, argmax_bf16  the sampler's reductions over rows of logits.
//  * rms_norm, add_rms_norm_, rotary_, silu_and_mul, rms_norm_heads_  fused per-layer ops with
//    PyTorch's roundings.
//
// Threads: kvserve's own pool (pool.cpp), as many threads as torch_get_num_threads says (a C
// function of libtorch_cpu, found by models/cpu_ops.py and handed to kv_init), so
// torch.set_num_threads sets both; a nested parallel_for runs inline, as at::parallel_for does.
// With torch_parallel_for handed over too, torch's OpenMP pool instead (models/cpu_ops.py's
// use_own_pool says when). Without either, one thread.

#include <dlfcn.h>

#include <cmath>
#include <cstring>
#include <string>

#include "host.h"

namespace kvserve::host_lib {
namespace {

// libtorch_cpu's C shim (torch/csrc/stable/c/shim.h); both return 0 on success.
using TorchParallelFor = int32_t (*)(int64_t begin, int64_t end, int64_t grain,
                                     void (*body)(int64_t begin, int64_t end, void* ctx), void* ctx);
using TorchNumThreads = int32_t (*)(uint32_t* out);

TorchParallelFor torch_parallel_for = nullptr;
TorchNumThreads torch_num_threads = nullptr;
const KernelSet* current = nullptr;

struct Call {
  void (*body)(void*, int64_t, int64_t);
  void* ctx;
};

int host_num_threads();

void host_parallel_for(int64_t begin, int64_t end, int64_t grain, void (*body)(void*, int64_t, int64_t), void* ctx) {
  if (torch_parallel_for) {
    Call call{body, ctx};
    // a non-zero code means the body threw, which none of ours does
    torch_parallel_for(begin, end, grain, [](int64_t b, int64_t e, void* c) {
      const Call* call = static_cast<const Call*>(c);
      call->body(call->ctx, b, e);
    }, &call);
    return;
  }
  pool_parallel_for(host_num_threads(), begin, end, grain, body, ctx);
}

int host_num_threads() {
  uint32_t n = 1;
  if (torch_num_threads && torch_num_threads(&n) == 0 && n > 0) return static_cast<int>(n);
  return 1;
}

// One object for the library's life: a set keeps its address, so kv_init changes what it does in place.
const Host kHost{host_parallel_for, host_num_threads};
const bool kHostSet = (host() = &kHost, true);

template <typename T> float to_float(T v) { return static_cast<float>(v); }
template <> float to_float(uint16_t v) { return bf16_to_float(v); }
template <typename T> T from_float(float v) { return static_cast<T>(v); }
template <> uint16_t from_float(float v) { return float_to_bf16(v); }
template <typename T> T round_to(float v) { return from_float<T>(v); }

// RMSNorm as Hugging Face computes it: normalize in fp32, round to the model dtype, then multiply
// by the weight in the model dtype (uint16_t: bf16).
template <typename T>
void rms_norm_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      T* o = out + r * n;
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_float(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) o[i] = round_to<T>(to_float(w[i]) * to_float(round_to<T>(to_float(xr[i]) * inv)));
    }
  });
}

// residual += x, rounded to the model dtype as `residual + x` is.
void add_rows_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, int64_t rows, int64_t n) {
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < n; ++i)
        residual[r * n + i] = float_to_bf16(bf16_to_float(residual[r * n + i]) + bf16_to_float(x[r * ldx + i]));
  });
}

// Neox rotary in place on the first `num_heads` heads of each row (models/layers.py's cache layout:
// cos_sin[t] = [cos, cos], [-sin, sin]); each product and the sum rounded to the model dtype, as
// `x * cos + swapped * sin` does.
template <typename T>
void rotary_rows(T* x, int64_t ldx, const T* cos_sin, int64_t rows, int64_t num_heads, int64_t d) {
  const int64_t half = d / 2;
  parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cos_sin + t * 2 * d;
      const T* sin = cos + d;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + t * ldx + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
          const float lo = to_float(round_to<T>(x1 * to_float(cos[i]))) + to_float(round_to<T>(x2 * to_float(sin[i])));
          const float hi = to_float(round_to<T>(x2 * to_float(cos[i + half]))) +
                           to_float(round_to<T>(x1 * to_float(sin[i + half])));
          v[i] = round_to<T>(lo);
          v[i + half] = round_to<T>(hi);
        }
      }
    }
  });
}

// Bit j of word w of a row's mask allows token 32w + j; every other token of that row gets -inf
// (`neg_inf`: its bits in the logits' type). Words wholly allowed are skipped and banned bits are
// visited one by one, so the cost follows the number of banned tokens, as xgrammar's CPU kernel's
// does (benchmarks/bench_structured.py).
template <typename T>
void apply_token_bitmask_rows(T* logits, int64_t ld, int64_t vocab, const uint32_t* mask, int64_t words,
                              const int64_t* rows, int64_t num_rows, T neg_inf) {
  parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = logits + rows[i] * ld;
      const uint32_t* m = mask + rows[i] * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        uint32_t banned = w < words ? ~m[w] : 0xFFFFFFFFu;  // ids past the mask are banned
        const int64_t base = w * 32;
        if (vocab - base < 32) {
          banned &= (1u << (vocab - base)) - 1;
        } else if (banned == 0xFFFFFFFFu) {  // a wholly banned word: one contiguous fill
          std::fill_n(row + base, 32, neg_inf);
          continue;
        }
        for (; banned != 0; banned &= banned - 1) row[base + __builtin_ctz(banned)] = neg_inf;
      }
    }
  });
}

constexpr const char* kNoSet = "no CPU kernel set is loaded (models/cpu_ops.load)";

}  // namespace

const KernelSet* kernel_set() { return current; }

const char* fail(std::string message) {
  thread_local std::string last;
  last = std::move(message);
  return last.c_str();
}

void rotary(void* x, int64_t ldx, const void* cos_sin, int64_t rows, int64_t num_heads, int64_t d, int dtype) {
  if (dtype == kBF16 && current && d % 32 == 0)
    current->rotary_bf16(static_cast<uint16_t*>(x), ldx, static_cast<const uint16_t*>(cos_sin), rows, num_heads, d);
  else if (dtype == kBF16)
    rotary_rows(static_cast<uint16_t*>(x), ldx, static_cast<const uint16_t*>(cos_sin), rows, num_heads, d);
  else
    rotary_rows(static_cast<float*>(x), ldx, static_cast<const float*>(cos_sin), rows, num_heads, d);
}

void rms_norm_heads(uint16_t* x, int64_t ldx, int64_t rows, int64_t num_heads, int64_t d, const uint16_t* w,
                    float eps) {
  // each token's heads are num_heads rows of d side by side: normalized in place
  if (rows == 1) return current->rms_norm_bf16(x, d, w, x, num_heads, d, eps);
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) current->rms_norm_bf16(x + t * ldx, d, w, x + t * ldx, num_heads, d, eps);
  });
}

const char* write_kv_cache(const void* k, int64_t k_ld, const void* v, int64_t v_ld, int64_t rows, int64_t row_bytes,
                           void* k_cache, void* v_cache, int64_t num_slots, const int64_t* slots) {
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots)
      return fail("write_kv_cache: slot " + std::to_string(slots[t]) + " out of range");
  const char* ks = static_cast<const char*>(k);
  const char* vs = static_cast<const char*>(v);
  char* kd = static_cast<char*>(k_cache);
  char* vd = static_cast<char*>(v_cache);
  parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slots[t] * row_bytes, ks + t * k_ld, row_bytes);
      std::memcpy(vd + slots[t] * row_bytes, vs + t * v_ld, row_bytes);
    }
  });
  return nullptr;
}

}  // namespace kvserve::host_lib

using namespace kvserve;
using namespace kvserve::host_lib;

// ---- threads and kernel sets -------------------------------------------------------------------

// torch's torch_get_num_threads (null: one thread) and torch_parallel_for (null: kvserve's own
// pool) -> 1 when threaded.
KV_EXPORT int kv_init(void* parallel_for, void* num_threads) {
  torch_num_threads = reinterpret_cast<TorchNumThreads>(num_threads);
  torch_parallel_for = num_threads ? reinterpret_cast<TorchParallelFor>(parallel_for) : nullptr;
  return num_threads ? 1 : 0;
}

KV_EXPORT int kv_num_threads() { return host_num_threads(); }

// Load set `name` from the library at `path` and make it the one every op calls -> 0, or -1 with
// what is wrong (a CPU without the set's instructions) in `error`.
KV_EXPORT int kv_load_kernel_set(const char* path, const char* name, char* error, int64_t error_len) {
  auto refuse = [&](const std::string& message) {
    if (error_len > 0) {
      std::strncpy(error, message.c_str(), error_len - 1);
      error[error_len - 1] = '\0';
    }
    return -1;
  };
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return refuse(std::string("cannot load the CPU kernel set ") + path + ": " + dlerror());
  using Entry = const KernelSet* (*)(const Host*);
  auto entry = reinterpret_cast<Entry>(dlsym(lib, (std::string("kvserve_kernels_") + name).c_str()));
  if (!entry) return refuse(std::string(path) + " has no kernel set named " + name);
  const KernelSet* set = entry(&kHost);
  if (!set) return refuse(std::string("this CPU lacks instructions the ") + name + " kernel set was built for");
  if (set->abi != kKernelAbi)
    return refuse(std::string("kernel set ") + name + " has interface " + std::to_string(set->abi) + ", the host " +
                  std::to_string(kKernelAbi));
  current = set;
  return 0;
}

KV_EXPORT void kv_unload_kernel_set() { current = nullptr; }

KV_EXPORT const char* kv_kernel_set() { return current ? current->name : ""; }

KV_EXPORT int kv_has_amx() { return current && current->has_amx && current->has_amx(); }

KV_EXPORT int kv_set_amx(int enabled) { return current && current->set_amx && current->set_amx(enabled != 0); }

// ---- the ops ----------------------------------------------------------------------------------------
// Each takes one struct of arguments, checked by models/cpu_ops.py and packed there with `struct`
// (every field 8 bytes: pointers, int64_t, double; the same layout without padding on both sides):
// one ctypes argument instead of a dozen, whose conversions cost more than a small op at batch 1.

struct LinearBf16Args {
  const uint16_t* x;
  int64_t ldx, m;
  const uint16_t* w;
  int64_t half_k, col_blocks;
  const float* bias;
  uint16_t* y;
  int64_t n;
};
static_assert(sizeof(LinearBf16Args) == 9 * 8, "models/cpu_ops.py packs 9 fields of 8 bytes");

KV_EXPORT const char* kv_linear_bf16(const LinearBf16Args* args) {
  const LinearBf16Args& a = *args;
  if (!current) return fail(kNoSet);
  if (a.m > 0) current->linear_bf16(a.x, a.ldx, a.m, a.w, a.half_k, a.col_blocks, a.bias, a.y, a.n);
  return nullptr;
}

struct QuantLinearArgs {
  const void* x;
  int64_t x_bf16, ldx, m, k;
  const uint8_t* w;
  const uint16_t* scales;
  int64_t bits, group;
  const float* bias;
  void* y;
  int64_t n, col_blocks;
};
static_assert(sizeof(QuantLinearArgs) == 13 * 8, "models/cpu_ops.py packs 13 fields of 8 bytes");

KV_EXPORT const char* kv_quant_linear(const QuantLinearArgs* args) {
  const QuantLinearArgs& a = *args;
  if (!current) return fail(kNoSet);
  if (a.m > 0)
    current->quant_linear(a.x, a.x_bf16 != 0, a.ldx, a.m, a.k, a.w, a.scales, a.bits, a.group, a.bias, a.y, a.n,
                          a.col_blocks);
  return nullptr;
}

// q [B, H, D] bf16 (strides q_stride_req, q_stride_head; d contiguous) over caches
// [blocks, block_size, KvH, D] -> out [B, H * D]; bias: float32 [H, bias_len] or null (DecodeArgs::bias).
struct DecodeAttentionArgs {
  const uint16_t* q;
  int64_t q_stride_req, q_stride_head, num_reqs, num_heads, head_dim;
  const uint16_t *k_cache, *v_cache;
  int64_t num_kv_heads, block_size;
  const int64_t* table;
  int64_t table_stride;
  const int64_t* seq_lens;
  int64_t window;
  double scale;
  const float* bias;
  int64_t bias_stride, bias_len;
  uint16_t* out;
  double softcap;  // 0: none
};
static_assert(sizeof(DecodeAttentionArgs) == 20 * 8, "models/cpu_ops.py packs 20 fields of 8 bytes");

KV_EXPORT const char* kv_paged_decode_attention(const DecodeAttentionArgs* args) {
  const DecodeAttentionArgs& a = *args;
  if (!current) return fail(kNoSet);
  DecodeArgs d{a.num_kv_heads, a.num_heads / a.num_kv_heads, a.head_dim, a.block_size, a.q_stride_req,
               a.q_stride_head, a.block_size * a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim,
               a.table_stride, a.window, static_cast<float>(a.scale)};
  if (a.bias) {
    for (int64_t b = 0; b < a.num_reqs; ++b)
      if (a.seq_lens[b] > a.bias_len) return fail("bias is shorter than the longest sequence");
    d.bias = a.bias, d.bias_stride = a.bias_stride, d.bias_len = a.bias_len;
  }
  d.softcap = static_cast<float>(a.softcap);
  current->decode_attention(d, a.q, a.k_cache, a.v_cache, a.table, a.seq_lens, a.num_reqs, a.out);
  return nullptr;
}

// One request's q [lq, H, D] bf16 for positions seq_len - lq .. seq_len - 1 -> out [lq, H * D].
struct PrefillAttentionArgs {
  const uint16_t* q;
  int64_t q_stride_tok, q_stride_head, lq, num_heads, head_dim;
  const uint16_t *k_cache, *v_cache;
  int64_t num_kv_heads, block_size;
  const int64_t* table;
  int64_t seq_len, window;
  double scale;
  uint16_t* out;
  double softcap;  // 0: none
};
static_assert(sizeof(PrefillAttentionArgs) == 16 * 8, "models/cpu_ops.py packs 16 fields of 8 bytes");

KV_EXPORT const char* kv_paged_prefill_attention(const PrefillAttentionArgs* args) {
  const PrefillAttentionArgs& a = *args;
  if (!current) return fail(kNoSet);
  PrefillArgs p{a.num_heads / a.num_kv_heads, a.head_dim, a.block_size, a.q_stride_tok, a.q_stride_head,
                a.block_size * a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.seq_len - a.lq, a.seq_len,
                a.window, static_cast<float>(a.scale), static_cast<float>(a.softcap)};
  current->prefill_attention(p, a.q, a.k_cache, a.v_cache, a.table, a.num_kv_heads, a.lq, a.out,
                             a.num_heads * a.head_dim);
  return nullptr;
}

struct LogprobsTopkArgs {
  const void* x;
  int64_t x_bf16, ld, rows, v;
  const int64_t* tokens;
  int64_t k;
  float *sampled, *top_vals;
  int64_t* top_ids;
};
static_assert(sizeof(LogprobsTopkArgs) == 10 * 8, "models/cpu_ops.py packs 10 fields of 8 bytes");

KV_EXPORT const char* kv_logprobs_topk(const LogprobsTopkArgs* args) {
  const LogprobsTopkArgs& a = *args;
  if (!current) return fail(kNoSet);
  for (int64_t r = 0; r < a.rows; ++r)
    if (a.tokens[r] < 0 || a.tokens[r] >= a.v)
      return fail("logprobs_topk: token " + std::to_string(a.tokens[r]) + " out of range");
  current->logprobs_topk(a.x, a.x_bf16 != 0, a.ld, a.rows, a.v, a.tokens, a.k, a.sampled, a.top_vals, a.top_ids);
  return nullptr;
}

struct ArgmaxArgs {
  const uint16_t* logits;
  int64_t ld, rows, v;
  int64_t* out;
};
static_assert(sizeof(ArgmaxArgs) == 5 * 8, "models/cpu_ops.py packs 5 fields of 8 bytes");

KV_EXPORT const char* kv_argmax_bf16(const ArgmaxArgs* args) {
  const ArgmaxArgs& a = *args;
  if (!current) return fail(kNoSet);
  current->argmax_bf16(a.logits, a.ld, a.rows, a.v, a.out);
  return nullptr;
}

// x [rows, n] (rows ldx apart) -> out [rows, n]; float32 or bf16 (the set's kernel where loaded).
struct RmsNormArgs {
  const void* x;
  int64_t ldx;
  const void* w;
  void* out;
  int64_t rows, n;
  double eps;
  int64_t dtype;
};
static_assert(sizeof(RmsNormArgs) == 8 * 8, "models/cpu_ops.py packs 8 fields of 8 bytes");

KV_EXPORT const char* kv_rms_norm(const RmsNormArgs* args) {
  const RmsNormArgs& a = *args;
  const float eps = static_cast<float>(a.eps);
  if (a.dtype == kBF16 && current) {
    current->rms_norm_bf16(static_cast<const uint16_t*>(a.x), a.ldx, static_cast<const uint16_t*>(a.w),
                           static_cast<uint16_t*>(a.out), a.rows, a.n, eps);
  } else if (a.dtype == kBF16) {
    rms_norm_rows(static_cast<const uint16_t*>(a.x), a.ldx, static_cast<const uint16_t*>(a.w),
                  static_cast<uint16_t*>(a.out), a.rows, a.n, eps);
  } else {
    rms_norm_rows(static_cast<const float*>(a.x), a.ldx, static_cast<const float*>(a.w), static_cast<float*>(a.out),
                  a.rows, a.n, eps);
  }
  return nullptr;
}

// The pre-norm residual step, bf16: residual [rows, n] contiguous += x, then out = rms_norm(residual).
struct AddRmsNormArgs {
  uint16_t* residual;
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  uint16_t* out;
  int64_t rows, n;
  double eps;
};
static_assert(sizeof(AddRmsNormArgs) == 8 * 8, "models/cpu_ops.py packs 8 fields of 8 bytes");

KV_EXPORT const char* kv_add_rms_norm_(const AddRmsNormArgs* args) {
  const AddRmsNormArgs& a = *args;
  const float eps = static_cast<float>(a.eps);
  if (current) {
    current->add_rms_norm_bf16(a.residual, a.x, a.ldx, a.w, a.out, a.rows, a.n, eps);
  } else {
    add_rows_bf16(a.residual, a.x, a.ldx, a.rows, a.n);
    rms_norm_rows(static_cast<const uint16_t*>(a.residual), a.n, a.w, a.out, a.rows, a.n, eps);
  }
  return nullptr;
}

struct RotaryArgs {
  void* x;
  int64_t ldx;
  const void* cos_sin;
  int64_t rows, num_heads, d, dtype;
};
static_assert(sizeof(RotaryArgs) == 7 * 8, "models/cpu_ops.py packs 7 fields of 8 bytes");

KV_EXPORT const char* kv_rotary_(const RotaryArgs* args) {
  const RotaryArgs& a = *args;
  rotary(a.x, a.ldx, a.cos_sin, a.rows, a.num_heads, a.d, static_cast<int>(a.dtype));
  return nullptr;
}

struct SiluAndMulArgs {
  const uint16_t* x;
  int64_t ldx;
  uint16_t* out;
  int64_t rows, n;
};
static_assert(sizeof(SiluAndMulArgs) == 5 * 8, "models/cpu_ops.py packs 5 fields of 8 bytes");

KV_EXPORT const char* kv_silu_and_mul(const SiluAndMulArgs* args) {
  const SiluAndMulArgs& a = *args;
  if (!current) return fail(kNoSet);
  current->silu_and_mul_bf16(a.x, a.ldx, a.out, a.rows, a.n);
  return nullptr;
}

// Qwen3's per-head q/k norm: `num_heads` heads of `d` at x's start in each of `rows` rows (ldx
// apart), normalized in place by the set's rms_norm_bf16.
struct RmsNormHeadsArgs {
  uint16_t* x;
  int64_t ldx, rows, num_heads, d;
  const uint16_t* w;
  double eps;
};
static_assert(sizeof(RmsNormHeadsArgs) == 7 * 8, "models/cpu_ops.py packs 7 fields of 8 bytes");

KV_EXPORT const char* kv_rms_norm_heads_(const RmsNormHeadsArgs* args) {
  const RmsNormHeadsArgs& a = *args;
  if (!current) return fail(kNoSet);
  if (a.rows > 0) rms_norm_heads(a.x, a.ldx, a.rows, a.num_heads, a.d, a.w, static_cast<float>(a.eps));
  return nullptr;
}

// k, v rows (ld bytes apart, row_bytes each) into slots of caches with num_slots rows.
struct WriteKvCacheArgs {
  const void* k;
  int64_t k_ld;
  const void* v;
  int64_t v_ld, rows, row_bytes;
  void *k_cache, *v_cache;
  int64_t num_slots;
  const int64_t* slots;
};
static_assert(sizeof(WriteKvCacheArgs) == 10 * 8, "models/cpu_ops.py packs 10 fields of 8 bytes");

KV_EXPORT const char* kv_write_kv_cache(const WriteKvCacheArgs* args) {
  const WriteKvCacheArgs& a = *args;
  return write_kv_cache(a.k, a.k_ld, a.v, a.v_ld, a.rows, a.row_bytes, a.k_cache, a.v_cache, a.num_slots, a.slots);
}

// logits [num_logit_rows, vocab] (rows ld apart) of `dtype`; bitmask [num_logit_rows, words] int32;
// rows: which logit rows to mask.
struct TokenBitmaskArgs {
  void* logits;
  int64_t ld, vocab, num_logit_rows, dtype;
  const int32_t* bitmask;
  int64_t words;
  const int64_t* rows;
  int64_t num_rows;
};
static_assert(sizeof(TokenBitmaskArgs) == 9 * 8, "models/cpu_ops.py packs 9 fields of 8 bytes");

KV_EXPORT const char* kv_apply_token_bitmask_(const TokenBitmaskArgs* args) {
  const TokenBitmaskArgs& a = *args;
  for (int64_t i = 0; i < a.num_rows; ++i)
    if (a.rows[i] < 0 || a.rows[i] >= a.num_logit_rows)
      return fail("apply_token_bitmask_: row " + std::to_string(a.rows[i]) + " out of range");
  const auto* mask = reinterpret_cast<const uint32_t*>(a.bitmask);
  switch (a.dtype) {  // -inf's bits in each type: only the fill differs
    case kF32:
      apply_token_bitmask_rows(static_cast<uint32_t*>(a.logits), a.ld, a.vocab, mask, a.words, a.rows, a.num_rows,
                               0xFF800000u);
      break;
    case kF64:
      apply_token_bitmask_rows(static_cast<uint64_t*>(a.logits), a.ld, a.vocab, mask, a.words, a.rows, a.num_rows,
                               uint64_t{0xFFF0000000000000u});
      break;
    case kBF16:
      apply_token_bitmask_rows(static_cast<uint16_t*>(a.logits), a.ld, a.vocab, mask, a.words, a.rows, a.num_rows,
                               uint16_t{0xFF80});
      break;
    case kF16:
      apply_token_bitmask_rows(static_cast<uint16_t*>(a.logits), a.ld, a.vocab, mask, a.words, a.rows, a.num_rows,
                               uint16_t{0xFC00});
      break;
    default:
      return fail("apply_token_bitmask_: logits must be float32, float64, bf16 or float16");
  }
  return nullptr;
}
