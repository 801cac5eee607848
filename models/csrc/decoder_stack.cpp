// The decoder layers of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) as one call per
// step, for the CPU. It calls the same kernels, in the same order, as the model's Python
// forward with the CPU backend (models/llama.py, models/attention/cpu.py), so its output is
// bit for bit the same; what it removes is the Python between them: per layer a dozen
// module calls and op dispatches, which at batch 1 cost as much as reading a quantized
// layer's weights. models/cpu_stack.py decides when a model qualifies and builds one.

#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "binding.h"

namespace kvserve {

// One matmul's weight as models/cpu_model.py (bits 16: bf16 packed) or models/quantization.py
// (bits 8 or 4: VNNI packed, with scales) left it.
struct StackLinear {
  at::Tensor packed, scales;
  c10::optional<at::Tensor> bias;
  int64_t n, bits, group;

  at::Tensor operator()(const at::Tensor& x) const {
    if (bits == 16) return linear_bf16(x, packed, bias, n);
    return quant_linear(x, packed, scales, bias, n, bits, group);
  }
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3: per head, before the rotary embedding
  StackLinear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [blocks, block_size, KvH, D] each
  int64_t num_heads, num_kv_heads, head_dim, window;  // window 0: full attention
  double scale, eps;
};

// Which rows of a step decode and which requests prefill; derived once, shared by the layers.
struct StepRows {
  bool all_decode = true;
  at::Tensor decode_rows, decode_table, decode_seq_lens;  // only when some rows decode and some do not
  struct Prefill { int64_t req, start, len, seq_len; };
  std::vector<Prefill> prefills;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  explicit DecoderStack(double final_eps) : final_eps_(final_eps) {}

  void add_linear(at::Tensor packed, c10::optional<at::Tensor> scales, c10::optional<at::Tensor> bias, int64_t n,
                  int64_t bits, int64_t group) {
    TORCH_CHECK(bits == 16 || bits == 8 || bits == 4, "DecoderStack: bits must be 16, 8 or 4");
    linears_.push_back({packed, scales.value_or(at::Tensor()), bias, n, bits, group});
  }

  // The layer's four matmuls are the last four add_linear calls (qkv, o, gate_up, down).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t window, double scale, double eps) {
    TORCH_CHECK(linears_.size() == 4 * (layers_.size() + 1), "DecoderStack: add four linears before each layer");
    const StackLinear* l = linears_.data() + 4 * layers_.size();
    layers_.push_back({input_norm, post_norm, q_norm, k_norm, l[0], l[1], l[2], l[3], k_cache, v_cache, num_heads,
                       num_kv_heads, head_dim, window, scale, eps});
  }

  // x [T, hidden] (the embeddings; overwritten as the residual stream) -> the final norm's output.
  // cos_sin [T, 2, D]; slots [T]; block_table [B, max_blocks], seq_lens [B] (int64);
  // query_lens / seq_lens_cpu: the host copies of each request's new and total token counts.
  at::Tensor forward(at::Tensor x, at::Tensor final_norm, at::Tensor cos_sin, at::Tensor slots,
                     at::Tensor block_table, at::Tensor seq_lens, std::vector<int64_t> query_lens,
                     std::vector<int64_t> seq_lens_cpu) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack has no layers");
    const StepRows rows = step_rows(x.size(0), block_table, seq_lens, query_lens, seq_lens_cpu);
    at::Tensor residual = x, h;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      h = i == 0 ? rms_norm(x, layer.input_norm, layer.eps) : add_rms_norm_(residual, x, layer.input_norm, layer.eps);
      h = attention(layer, rows, layer.qkv(h), cos_sin, slots, block_table, seq_lens);
      h = add_rms_norm_(residual, layer.o(h), layer.post_norm, layer.eps);
      x = layer.down(silu_and_mul(layer.gate_up(h)));
    }
    return add_rms_norm_(residual, x, final_norm, final_eps_);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  static StepRows step_rows(int64_t num_tokens, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            const std::vector<int64_t>& query_lens, const std::vector<int64_t>& seq_lens_cpu) {
    TORCH_CHECK(query_lens.size() == seq_lens_cpu.size(), "DecoderStack: one query and one sequence length per request");
    StepRows r;
    std::vector<int64_t> decode_rows, decode_reqs;
    int64_t start = 0;
    for (size_t i = 0; i < query_lens.size(); ++i) {
      if (query_lens[i] == 1) {
        decode_rows.push_back(start);
        decode_reqs.push_back(static_cast<int64_t>(i));
      } else {
        r.prefills.push_back({static_cast<int64_t>(i), start, query_lens[i], seq_lens_cpu[i]});
      }
      start += query_lens[i];
    }
    TORCH_CHECK(start == num_tokens, "DecoderStack: the query lengths add up to ", start, ", not ", num_tokens, " rows");
    r.all_decode = r.prefills.empty();
    if (!r.all_decode && !decode_rows.empty()) {
      const auto opts = at::TensorOptions().dtype(at::kLong);
      at::Tensor reqs = at::empty({static_cast<int64_t>(decode_reqs.size())}, opts);
      r.decode_rows = at::empty({static_cast<int64_t>(decode_rows.size())}, opts);
      std::copy(decode_reqs.begin(), decode_reqs.end(), reqs.data_ptr<int64_t>());
      std::copy(decode_rows.begin(), decode_rows.end(), r.decode_rows.data_ptr<int64_t>());
      r.decode_table = at::index_select(block_table, 0, reqs);
      r.decode_seq_lens = at::index_select(seq_lens, 0, reqs);
    }
    return r;
  }

  // qkv [T, (H + 2 KvH) * D] -> [T, H * D]: q/k norms (Qwen3), rotary in place, K/V into the cache,
  // then decode rows together and each prefill on its own, as models/attention/torch_ref.py does.
  static at::Tensor attention(const StackLayer& l, const StepRows& rows, const at::Tensor& qkv,
                              const at::Tensor& cos_sin, const at::Tensor& slots, const at::Tensor& block_table,
                              const at::Tensor& seq_lens) {
    const int64_t t = qkv.size(0), d = l.head_dim, q_size = l.num_heads * d, kv_size = l.num_kv_heads * d;
    at::Tensor q = qkv.slice(1, 0, q_size).view({t, l.num_heads, d});
    at::Tensor k = qkv.slice(1, q_size, q_size + kv_size).view({t, l.num_kv_heads, d});
    at::Tensor v = qkv.slice(1, q_size + kv_size).view({t, l.num_kv_heads, d});
    if (l.q_norm.has_value()) {  // FusedOps.rms_norm's PyTorch numerics (the rows are strided heads)
      q.copy_(at::mul(*l.q_norm, at::rms_norm(q, {d}, c10::nullopt, l.eps)));
      k.copy_(at::mul(*l.k_norm, at::rms_norm(k, {d}, c10::nullopt, l.eps)));
    }
    rotary_(qkv, cos_sin, l.num_heads + l.num_kv_heads, d);
    write_kv_cache(k, v, l.k_cache, l.v_cache, slots);
    if (rows.all_decode) return paged_decode_attention(q, l.k_cache, l.v_cache, block_table, seq_lens, l.scale, l.window);
    at::Tensor out = at::empty({t, q_size}, qkv.options());
    if (rows.decode_rows.defined()) {
      at::Tensor q_dec = at::index_select(q, 0, rows.decode_rows);
      out.index_copy_(0, rows.decode_rows, paged_decode_attention(q_dec, l.k_cache, l.v_cache, rows.decode_table,
                                                                  rows.decode_seq_lens, l.scale, l.window));
    }
    for (const auto& p : rows.prefills) {
      out.narrow(0, p.start, p.len).copy_(paged_prefill_attention(q.narrow(0, p.start, p.len), l.k_cache, l.v_cache,
                                                                  block_table[p.req], p.seq_len, l.scale, l.window));
    }
    return out;
  }

  std::vector<StackLinear> linears_;
  std::vector<StackLayer> layers_;
  double final_eps_;
};

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.class_<kvserve::DecoderStack>("DecoderStack")
      .def(torch::init<double>())
      .def("add_linear", &kvserve::DecoderStack::add_linear)
      .def("add_layer", &kvserve::DecoderStack::add_layer)
      .def("forward", &kvserve::DecoderStack::forward)
      .def("num_layers", &kvserve::DecoderStack::num_layers);
}
