// kvserve's CPU ops for torch (torch.ops.kvserve.*): each checks its tensors and calls the
// loaded kernel set (kernels.h; models/cpu_ops.py builds and loads the set the CPU runs, and
// `python -m benchmarks.bench_kernels` measures each op against PyTorch):
//
//  * linear_bf16     y = x @ W.T + b for bf16, W pre-packed once into 64-column blocks of
//    input-feature pairs (models/cpu_ops.py); quant_linear the same for int8 / int4 weights in
//    groups (models/quantization.py), activations quantized per row and group.
//  * paged_decode_attention  one query token per request attending over its keys/values in
//    place in the paged cache (no gather copy), GQA-aware; paged_prefill_attention flash-style
//    causal attention for a prompt chunk.
//  * logprobs_topk, argmax_bf16  the sampler's reductions over rows of logits.
//  * rms_norm, add_rms_norm_, rotary_, silu_and_mul  fused per-layer ops with PyTorch's
//    roundings (float32 and bf16 without a set: plain loops here); write_kv_cache and
//    apply_token_bitmask_ are plain copies and fills, for any CPU.
//  * torch.classes.kvserve.DecoderStack (decoder_stack.cpp)  a Llama-family model's layers as
//    one call per step.
// Threads come from ATen's pool (at::parallel_for), the same one torch's ops use.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "binding.h"

namespace kvserve {
namespace {

const KernelSet* current = nullptr;

void host_parallel_for(int64_t begin, int64_t end, int64_t grain, void (*body)(void*, int64_t, int64_t), void* ctx) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { body(ctx, b, e); });
}

int host_num_threads() { return at::get_num_threads(); }

const Host kHost{host_parallel_for, host_num_threads};

// Load the set `name` from the library at `path` (models/cpu_ops.py built it) and make it the
// one every op calls; an error names what is wrong (a CPU without the set's instructions).
std::string load_kernel_set(const std::string& path, const std::string& name) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib, "cannot load the CPU kernel set ", path, ": ", dlerror());
  using Entry = const KernelSet* (*)(const Host*);
  auto entry = reinterpret_cast<Entry>(dlsym(lib, ("kvserve_kernels_" + name).c_str()));
  TORCH_CHECK(entry, path, " has no kernel set named ", name);
  const KernelSet* set = entry(&kHost);
  TORCH_CHECK(set, "this CPU lacks instructions the ", name, " kernel set was built for");
  TORCH_CHECK(set->abi == kKernelAbi, "kernel set ", name, " has interface ", set->abi, ", the binding ", kKernelAbi);
  current = set;
  return set->name;
}

std::string kernel_set_name() { return current ? current->name : ""; }

void unload_kernel_set() { current = nullptr; }

bool has_amx_op() { return current && current->has_amx && current->has_amx(); }

bool set_amx_enabled_op(bool enabled) { return current && current->set_amx && current->set_amx(enabled); }

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* mutable_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// A linear's optional bias: float32 [>= n], or nullptr.
const float* linear_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() >= n,
              "bias must be float32 [N]");
  return bias->data_ptr<float>();
}

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

}  // namespace

const KernelSet& kernels() {
  TORCH_CHECK(current, "no CPU kernel set is loaded (models/cpu_ops.load)");
  return *current;
}

bool has_kernel_set() { return current != nullptr; }

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  const KernelSet& set = kernels();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 64 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed weight must be bf16 [N/64, K/2, 64, 2]");
  const int64_t m = x.size(0), half_k = packed.size(1), col_blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * half_k, "x has ", x.size(1), " features, the weight ", 2 * half_k);
  TORCH_CHECK(n <= 64 * col_blocks && n > 64 * (col_blocks - 1), "n=", n, " does not match the packed weight");
  const float* bias_ptr = linear_bias(bias, n);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  set.linear_bf16(bits(x), x.stride(0), m, bits(packed), half_k, col_blocks, bias_ptr, mutable_bits(y), n);
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& bias, int64_t n, int64_t bits, int64_t group) {
  const KernelSet& set = kernels();
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be [M, K] bf16 or float32 rows");
  const int64_t step_bytes = bits == 8 ? 256 : 128;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == step_bytes && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              "packed weight must be uint8 [N/64, K/4, ", step_bytes, "]");
  const int64_t m = x.size(0), k = x.size(1), col_blocks = packed.size(0);
  TORCH_CHECK(group > 0 && group % 16 == 0 && k % group == 0, "group ", group, " must be a multiple of 16 dividing K=", k);
  TORCH_CHECK(packed.size(1) * 4 == k, "x has ", k, " features, the weight ", packed.size(1) * 4);
  TORCH_CHECK(n <= 64 * col_blocks && n > 64 * (col_blocks - 1), "n=", n, " does not match the packed weight");
  const int64_t groups = k / group;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == col_blocks && scales.size(1) == groups && scales.size(2) == 64,
              "scales must be float16 [N/64, K/G, 64]");
  const float* bias_ptr = linear_bias(bias, n);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  set.quant_linear(x.data_ptr(), x.scalar_type() == at::kBFloat16, x.stride(0), m, k, packed.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), bits, group, bias_ptr, y.data_ptr(),
                   n, col_blocks);
  return y;
}

// q [B, H, D] (d contiguous), k_cache/v_cache [num_blocks, block_size, KvH, D],
// block_table [B, max_blocks] int64, seq_lens [B] int64 (>= 1) -> out [B, H * D].
// bias: float32 [H, L] with L >= every seq_len, see DecodeArgs::bias.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const c10::optional<at::Tensor>& bias) {
  const KernelSet& set = kernels();
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with contiguous D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [blocks, block_size, KvH, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "paged_decode_attention: q and the caches must be bf16");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.stride(1) == 1 &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "block_table and seq_lens must be int64");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && head_dim % 32 == 0 && head_dim <= 256,
              "head shapes do not match (or head_dim is not a multiple of 32 up to 256)");
  TORCH_CHECK(block_table.size(0) >= num_reqs && seq_lens.numel() >= num_reqs, "one table row per request");
  DecodeArgs a{num_kv_heads, num_heads / num_kv_heads, head_dim, k_cache.size(1),
               q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
               block_table.stride(0), window, static_cast<float>(scale)};
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 2 && b.size(0) == num_heads &&
                    (b.stride(1) == 1 || b.size(1) == 1),
                "bias must be float32 [H, L] with contiguous rows");
    TORCH_CHECK(seq_lens.narrow(0, 0, num_reqs).max().item<int64_t>() <= b.size(1),
                "bias is shorter than the longest sequence");
    a.bias = b.data_ptr<float>(), a.bias_stride = b.stride(0), a.bias_len = b.size(1);
  }
  at::Tensor out = at::empty({num_reqs, num_heads * head_dim}, q.options());
  set.decode_attention(a, bits(q), bits(k_cache), bits(v_cache), block_table.data_ptr<int64_t>(),
                       seq_lens.data_ptr<int64_t>(), num_reqs, mutable_bits(out));
  return out;
}

// q [Lq, H, D] bf16 (d contiguous) for positions seq_len - Lq .. seq_len - 1; caches
// [blocks, block_size, KvH, D]; block_table [max_blocks] int64 (this request's row) -> [Lq, H * D].
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t seq_len, double scale, int64_t window) {
  const KernelSet& set = kernels();
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16, "q must be [Lq, H, D] bf16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kBFloat16,
              "caches must be contiguous bf16 [blocks, block_size, KvH, D]");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "block_table must be one int64 row");
  const int64_t lq = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && head_dim % 32 == 0 && head_dim <= 256,
              "head shapes do not match (or head_dim is not a multiple of 32 up to 256)");
  TORCH_CHECK(seq_len >= lq && lq > 0 && block_table.numel() * k_cache.size(1) >= seq_len,
              "seq_len must cover the queries and fit the block table");
  const int64_t group = num_heads / num_kv_heads;
  PrefillArgs a{group, head_dim, k_cache.size(1), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                seq_len - lq, seq_len, window, static_cast<float>(scale)};
  at::Tensor out = at::empty({lq, num_heads * head_dim}, q.options());
  set.prefill_attention(a, bits(q), bits(k_cache), bits(v_cache), block_table.data_ptr<int64_t>(), num_kv_heads, lq,
                        mutable_bits(out), num_heads * head_dim);
  return out;
}

// logits [B, V] (bf16 or fp32, contiguous rows), token_ids [B] int64, k >= 0 ->
// (sampled logprobs [B], top-k logprobs [B, k], their ids [B, k] int64), all fp32 log-softmax.
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprobs_topk(const at::Tensor& logits, const at::Tensor& token_ids,
                                                             int64_t k) {
  const KernelSet& set = kernels();
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits must be [B, V] float32 or bf16 rows");
  const int64_t b = logits.size(0), v = logits.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == b && token_ids.scalar_type() == at::kLong,
              "token_ids must be int64 [B]");
  TORCH_CHECK(k >= 0 && k <= v, "k must be in [0, V]");
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor sampled = at::empty({b}, f32), top_vals = at::empty({b, k}, f32);
  at::Tensor top_ids = at::empty({b, k}, logits.options().dtype(at::kLong));
  set.logprobs_topk(logits.data_ptr(), logits.scalar_type() == at::kBFloat16, logits.stride(0), b, v,
                    token_ids.data_ptr<int64_t>(), k, sampled.data_ptr<float>(), top_vals.data_ptr<float>(),
                    top_ids.data_ptr<int64_t>());
  return {sampled, top_vals, top_ids};
}

at::Tensor argmax_bf16(const at::Tensor& logits) {
  const KernelSet& set = kernels();
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16 && logits.stride(1) == 1 &&
                  logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "argmax_bf16: logits must be [B, V] bf16 rows");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  set.argmax_bf16(bits(logits), logits.stride(0), logits.size(0), logits.size(1), out.data_ptr<int64_t>());
  return out;
}

// RMSNorm as Hugging Face computes it: normalize in fp32, round to the model dtype,
// then multiply by the weight in the model dtype. x [T, N] rows (N contiguous).
template <typename T>
void rms_norm_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      T* o = out + r * n;
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i)
        o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(static_cast<float>(xr[i]) * inv)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  x.scalar_type() == weight.scalar_type(), "rms_norm: x [T, N] rows and weight [N] of one dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kBFloat16 && has_kernel_set()) {
    kernels().rms_norm_bf16(bits(x), x.stride(0), bits(weight), mutable_bits(out), x.size(0), x.size(1),
                            static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm supports float32 and bfloat16");
    rms_norm_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
                  x.size(1), static_cast<float>(eps));
  }
  return out;
}

// The pre-norm residual step of a decoder layer, fused: residual += x (rounded to the
// model dtype, as `residual + x` is), then the RMSNorm above of the new residual.
template <typename T>
void add_rows(T* residual, const T* x, int64_t ldx, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < n; ++i)
        residual[r * n + i] = round_to<T>(static_cast<float>(residual[r * n + i]) + static_cast<float>(x[r * ldx + i]));
  });
}

at::Tensor add_rms_norm_(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && x.dim() == 2 && x.stride(1) == 1 &&
                  x.sizes() == residual.sizes() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "add_rms_norm_: residual [T, N] contiguous, x [T, N] rows and weight [N] of one dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm_ supports bfloat16");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (has_kernel_set()) {
    kernels().add_rms_norm_bf16(mutable_bits(residual), bits(x), x.stride(0), bits(weight), mutable_bits(out),
                                x.size(0), x.size(1), static_cast<float>(eps));
  } else {
    add_rows(residual.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), x.size(1));
    rms_norm_rows(residual.data_ptr<at::BFloat16>(), x.size(1), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
  }
  return out;
}

// The new tokens' keys and values into their cache slots (one op for both caches instead
// of two index_copy_ calls; per layer, the dispatch was most of their cost).
// k, v [T, KvH, D] with contiguous heads (any row stride); caches [blocks, block_size, KvH, D].
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv_cache: k and v must be [T, KvH, D] with contiguous heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "write_kv_cache: caches must be contiguous [blocks, block_size, KvH, D] matching k");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(), "write_kv_cache: one dtype for k, v and the caches");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(), "write_kv_cache: slots must be int64 [T]");
  const int64_t rows = k.size(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_cache: slot ", slot[t], " out of range");
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_ld = k.stride(0) * k.element_size(), v_ld = v.stride(0) * v.element_size();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + slot[t] * row_bytes, ks + t * k_ld, row_bytes);
      std::memcpy(vd + slot[t] * row_bytes, vs + t * v_ld, row_bytes);
    }
  });
}

// Neox rotary in place on the first `num_heads` heads of each row of x [T, heads * D]
// (any row stride): x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin, with the
// cache layout of models/layers.py: cos_sin[t] = [cos, cos], [-sin, sin]. Each product
// and the sum are rounded to the model dtype, as `x * cos + swapped * sin` does.
template <typename T>
void rotary_rows(T* x, int64_t ldx, const T* cos_sin, int64_t rows, int64_t num_heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cos_sin + t * 2 * d;
      const T* sin = cos + d;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + t * ldx + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          const float lo = static_cast<float>(round_to<T>(x1 * static_cast<float>(cos[i]))) +
                           static_cast<float>(round_to<T>(x2 * static_cast<float>(sin[i])));
          const float hi = static_cast<float>(round_to<T>(x2 * static_cast<float>(cos[i + half]))) +
                           static_cast<float>(round_to<T>(x1 * static_cast<float>(sin[i + half])));
          v[i] = round_to<T>(lo);
          v[i + half] = round_to<T>(hi);
        }
      }
    }
  });
}

void rotary_(const at::Tensor& x, const at::Tensor& cos_sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "rotary_: x must be [T, >= heads * D] rows");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.dim() == 3 && cos_sin.size(0) == x.size(0) &&
                  cos_sin.size(1) == 2 && cos_sin.size(2) == head_dim && cos_sin.scalar_type() == x.scalar_type(),
              "rotary_: cos_sin must be [T, 2, D] in x's dtype");
  if (x.scalar_type() == at::kBFloat16 && has_kernel_set() && head_dim % 32 == 0) {
    kernels().rotary_bf16(mutable_bits(x), x.stride(0), bits(cos_sin), x.size(0), num_heads, head_dim);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotary_rows(x.data_ptr<at::BFloat16>(), x.stride(0), cos_sin.data_ptr<at::BFloat16>(), x.size(0), num_heads,
                head_dim);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary_ supports float32 and bfloat16");
    rotary_rows(x.data_ptr<float>(), x.stride(0), cos_sin.data_ptr<float>(), x.size(0), num_heads, head_dim);
  }
}

// silu(gate) * up for x = [gate | up] rows of bf16 (the gate_up_proj output), with the two
// roundings of `F.silu(gate) * up`: silu rounded to bf16, then the product.
at::Tensor silu_and_mul(const at::Tensor& x) {
  const KernelSet& set = kernels();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && x.scalar_type() == at::kBFloat16,
              "silu_and_mul: x must be [T, 2 * I] bf16 rows");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  set.silu_and_mul_bf16(bits(x), x.stride(0), mutable_bits(out), x.size(0), n);
  return out;
}

// ---- structured outputs: a token bitmask onto the logits --------------------------------
// Bit j of word w of a row's mask allows token 32w + j; every other token of that row gets
// -inf. Words wholly allowed are skipped and banned bits are visited one by one, so the cost
// follows the number of banned tokens, as xgrammar's CPU kernel's does (benchmarks/bench_structured.py).
template <typename T>
void apply_token_bitmask_rows(T* logits, int64_t ld, int64_t vocab, const uint32_t* mask, int64_t words,
                              const int64_t* rows, int64_t num_rows) {
  const T neg_inf = static_cast<T>(-INFINITY);
  at::parallel_for(0, num_rows, 8, [&](int64_t begin, int64_t end) {
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

void apply_token_bitmask_(const at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_token_bitmask_: logits must be [B, V] rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt &&
                  bitmask.size(0) == logits.size(0),
              "apply_token_bitmask_: bitmask must be a contiguous [B, W] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong,
              "apply_token_bitmask_: rows must be a 1-D int64 tensor");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "apply_token_bitmask_: row ", r[i], " out of range");
  const auto* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask_", [&] {
    apply_token_bitmask_rows<scalar_t>(logits.data_ptr<scalar_t>(), logits.stride(0), logits.size(1), mask,
                                       bitmask.size(1), r, rows.size(0));
  });
}

}  // namespace kvserve

TORCH_LIBRARY(kvserve, m) {
  m.def("load_kernel_set(str path, str name) -> str", &kvserve::load_kernel_set);
  m.def("kernel_set() -> str", &kvserve::kernel_set_name);
  m.def("unload_kernel_set() -> ()", &kvserve::unload_kernel_set);
  m.def("has_amx_bf16() -> bool", &kvserve::has_amx_op);
  m.def("set_amx_enabled(bool enabled) -> bool", &kvserve::set_amx_enabled_op);
  m.def("quant_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias, int n, int bits, int group) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, TORCH_FN(kvserve::quant_linear));
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("linear_bf16", c10::DispatchKey::CPU, TORCH_FN(kvserve::linear_bf16));
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window, Tensor? bias=None) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(kvserve::paged_decode_attention));
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, "
        "float scale, int window) -> Tensor");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(kvserve::paged_prefill_attention));
  m.def("logprobs_topk(Tensor logits, Tensor token_ids, int k) -> (Tensor, Tensor, Tensor)");
  m.impl("logprobs_topk", c10::DispatchKey::CPU, TORCH_FN(kvserve::logprobs_topk));
  m.def("argmax_bf16(Tensor logits) -> Tensor");
  m.impl("argmax_bf16", c10::DispatchKey::CPU, TORCH_FN(kvserve::argmax_bf16));
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(kvserve::silu_and_mul));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(kvserve::rms_norm));
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(kvserve::add_rms_norm_));
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, TORCH_FN(kvserve::write_kv_cache));
  m.def("rotary_(Tensor(a!) x, Tensor cos_sin, int num_heads, int head_dim) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(kvserve::rotary_));
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.impl("apply_token_bitmask_", c10::DispatchKey::CPU, TORCH_FN(kvserve::apply_token_bitmask_));
}
