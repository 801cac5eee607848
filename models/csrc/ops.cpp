// CPU kernels for the places where PyTorch's generic CPU ops leave most of the machine
// idle (`python -m benchmarks.bench_kernels` measures each against PyTorch):
//
//  * kvserve::linear_bf16    y = x @ W.T + b for bf16, with W pre-packed once into
//    64-column blocks of input-feature pairs. One 6x64 register tile of vdpbf16ps at any
//    batch: at batch 1 it streams the weights at close to DRAM bandwidth; at 64-2048 rows
//    it runs at 85-95% of this CPU's measured bf16 peak (oneDNN: 60-95%). On CPUs with
//    AMX-BF16, from a few rows on, the same packed weights go through the tile multiply
//    instead (linear_amx.h): 32x32 blocks of tdpbf16ps, an order of magnitude more flops.
//  * kvserve::quant_linear   the same for int8 / int4 weights in groups (models/quantization.py):
//    activations quantized per row and group, int8 dot products (vpdpbusd), fp32 per group.
//  * kvserve::paged_decode_attention  one query token per request attending over its
//    keys/values *in place* in the paged cache (no gather copy), GQA-aware: the query
//    heads that share a KV head are scored together from one read of each key.
//  * kvserve::paged_prefill_attention  flash-style causal attention for a prompt chunk.
//  * kvserve::logprobs_topk  the sampler's log-softmax of the sampled token and the top k, from
//    two reads of each row of logits.
//  * kvserve::rms_norm, add_rms_norm_, rotary_, silu_and_mul, argmax_bf16  fused
//    per-layer ops with PyTorch's roundings; write_kv_cache stores a layer's new keys
//    and values.
//  * torch.classes.kvserve.DecoderStack  a Llama-family model's layers as one call per step,
//    through the kernels above (no Python between them).
//
// All accumulate in fp32. The AVX512-BF16 paths are compiled with target attributes
// and chosen at run time, so the library loads on any x86-64 CPU; the Python side
// (models/cpu_ops.py) only calls the linear and the two attention kernels (bf16 only)
// when `has_avx512_bf16()` is true. Elsewhere PyTorch's ops (oneDNN, SDPA) are faster
// than scalar C++ would be.
// Threads come from ATen's pool (at::parallel_for), the same one torch's ops use.

#include <torch/library.h>

// One translation unit: each kernel family is a header of definitions, included here only
// (parsing ATen's headers dominates the build, so one unit builds much faster than one per
// family).
#include "decode_attention.h"
#include "decoder_stack.h"
#include "linear.h"
#include "logprobs.h"
#include "prefill_attention.h"
#include "quant_linear.h"
#include "small_ops.h"

namespace {
bool has_avx512_bf16_op() { return kvserve::has_avx512_bf16(); }
bool has_avx512_vnni_op() { return kvserve::has_avx512_vnni(); }
bool has_amx_bf16_op() { return kvserve::has_amx_bf16(); }
bool set_amx_enabled_op(bool enabled) { return kvserve::amx_enabled().exchange(enabled); }
}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("has_avx512_bf16() -> bool", &has_avx512_bf16_op);
  m.def("has_avx512_vnni() -> bool", &has_avx512_vnni_op);
  m.def("has_amx_bf16() -> bool", &has_amx_bf16_op);
  m.def("set_amx_enabled(bool enabled) -> bool", &set_amx_enabled_op);
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
  m.class_<kvserve::DecoderStack>("DecoderStack")
      .def(torch::init<double>())
      .def("add_linear", &kvserve::DecoderStack::add_linear)
      .def("add_layer", &kvserve::DecoderStack::add_layer)
      .def("forward", &kvserve::DecoderStack::forward)
      .def("num_layers", &kvserve::DecoderStack::num_layers);
}
