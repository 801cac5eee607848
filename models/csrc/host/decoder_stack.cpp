// The decoder layers of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) as one call per
// step, for the CPU. It calls the same kernels, in the same order, as the model's Python
// forward with the CPU backend (models/llama.py, models/qwen.py, models/attention/cpu.py), so
// its output is bit for bit the same; what it removes is the Python between them: per layer a
// dozen module calls and op dispatches, which at batch 1 cost as much as reading a quantized
// layer's weights. models/cpu_stack.py decides when a model qualifies and builds one.
//
// The stack keeps pointers to the weights and KV caches (Python keeps those tensors alive) and
// its own scratch buffers, grown to the largest step seen and reused after that.
//
// LoRA (lora.cpp): a linear may carry adapter slots; each step then names the rows of each slot,
// and every LoRA'd linear adds their adapters' outputs right after its own, as models/lora.py's
// wrappers do in the Python forward.

#include <string>
#include <vector>

#include "host.h"

namespace kvserve::host_lib {
namespace {

// One matmul's weight as models/cpu_model.py (bits 16: bf16 packed) or models/quantization.py
// (bits 8 or 4: VNNI packed, with fp16 scales) left it; y [m, n] from x [m, k].
struct StackLinear {
  const void* packed;
  const uint16_t* scales;
  const float* bias;
  int64_t n, k, col_blocks, bits, group;
  int64_t lora = -1;  // index of its adapter slots in the stack's loras_, or -1

  void operator()(const uint16_t* x, int64_t ldx, int64_t m, uint16_t* y) const {
    if (bits == 16)
      kernel_set()->linear_bf16(x, ldx, m, static_cast<const uint16_t*>(packed), k / 2, col_blocks, bias, y, n);
    else
      kernel_set()->quant_linear(x, true, ldx, m, k, static_cast<const uint8_t*>(packed), scales, bits, group, bias,
                                 y, n, col_blocks);
  }
};

struct StackLayer {
  const uint16_t *input_norm, *post_norm;
  const uint16_t *q_norm, *k_norm;  // Qwen3: per head, before the rotary embedding; else null
  StackLinear qkv, o, gate_up, down;
  uint16_t *k_cache, *v_cache;  // [blocks, block_size, KvH, D] each
  int64_t num_slots, block_size, num_heads, num_kv_heads, head_dim, window;  // window 0: full attention
  float scale, eps;
};

// Which rows of a step decode and which requests prefill; derived once a step, shared by the layers.
struct StepRows {
  bool all_decode = true;
  std::vector<int64_t> decode_rows, decode_table, decode_seq_lens;  // only when some rows decode and some do not
  struct Prefill { int64_t req, start, len, seq_len; };
  std::vector<Prefill> prefills;
};

// Grows v to at least n elements, never shrinks it: no allocation once the largest step was seen.
template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

}  // namespace

class DecoderStack {
 public:
  explicit DecoderStack(float final_eps) : final_eps_(final_eps) {}

  const char* add_linear(const StackLinear& linear) {
    if (linear.bits != 16 && linear.bits != 8 && linear.bits != 4)
      return fail("DecoderStack: bits must be 16, 8 or 4");
    linears_.push_back(linear);
    return nullptr;
  }

  // Adapter slots on the last linear added (before its layer).
  const char* add_lora(const uint16_t* a, const uint16_t* b, int64_t num_shards, int64_t rank_pad,
                       const int64_t* shard_n, int64_t num_slots) {
    if (linears_.size() <= 4 * layers_.size()) return fail("DecoderStack: add_lora follows its linear");
    StackLinear& linear = linears_.back();
    if (linear.lora >= 0) return fail("DecoderStack: the linear has adapter slots already");
    if (!loras_.empty() && num_slots != loras_[0].num_slots) return fail("DecoderStack: the linears' slots differ");
    LoraLinear l;
    if (const char* err = lora_linear(l, a, b, linear.k, linear.n, num_shards, rank_pad, shard_n, num_slots))
      return err;
    linear.lora = static_cast<int64_t>(loras_.size());
    loras_.push_back(l);
    return nullptr;
  }

  // The layer's four matmuls are the last four add_linear calls (qkv, o, gate_up, down).
  const char* add_layer(StackLayer layer, int64_t hidden) {
    if (linears_.size() != 4 * (layers_.size() + 1)) return fail("DecoderStack: add four linears before each layer");
    if (!layers_.empty() && hidden != hidden_) return fail("DecoderStack: the layers' hidden sizes differ");
    const StackLinear* l = linears_.data() + 4 * layers_.size();
    layer.qkv = l[0], layer.o = l[1], layer.gate_up = l[2], layer.down = l[3];
    const int64_t q_size = layer.num_heads * layer.head_dim, kv_size = layer.num_kv_heads * layer.head_dim;
    if (layer.qkv.n != q_size + 2 * kv_size || layer.o.k != q_size || layer.gate_up.n != 2 * layer.down.k ||
        layer.o.n != hidden || layer.down.n != hidden || layer.qkv.k != hidden || layer.gate_up.k != hidden)
      return fail("DecoderStack: the layer's matmul shapes do not match its heads and hidden size");
    hidden_ = hidden;
    max_qkv_ = std::max(max_qkv_, layer.qkv.n), max_q_ = std::max(max_q_, q_size);
    max_inter_ = std::max(max_inter_, layer.down.k);
    layers_.push_back(layer);
    return nullptr;
  }

  // x [T, hidden] bf16 contiguous (the embeddings; overwritten as the residual stream) -> out
  // [T, hidden], the final norm's output. cos_sin [T, 2, D]; slots [T]; block_table [B, table_stride],
  // seq_lens [B] (int64); query_lens / seq_lens_cpu: each request's new and total token counts.
  const char* forward(uint16_t* x, uint16_t* out, const uint16_t* final_norm, const uint16_t* cos_sin,
                      const int64_t* slots, const int64_t* block_table, int64_t table_stride, const int64_t* seq_lens,
                      const int64_t* query_lens, const int64_t* seq_lens_cpu, int64_t num_reqs, int64_t num_tokens,
                      const LoraSegments& lora) {
    if (layers_.empty()) return fail("DecoderStack has no layers");
    if (!kernel_set()) return fail("DecoderStack needs a CPU kernel set");
    if (lora.num_rows > 0) {
      if (loras_.empty()) return fail("DecoderStack: LoRA rows for a stack without adapter slots");
      if (const char* err = check_segments(lora, num_tokens, loras_[0].num_slots)) return err;
    }
    lora_ = lora;
    const char* err = step_rows(num_tokens, block_table, table_stride, seq_lens, query_lens, seq_lens_cpu, num_reqs);
    if (err) return err;
    const int64_t t = num_tokens, hidden = hidden_;
    if (t == 0) return nullptr;
    uint16_t* h = at_least(h_, t * hidden);
    uint16_t* proj = at_least(proj_, t * hidden);  // o_proj's and down_proj's outputs
    uint16_t* qkv = at_least(qkv_, t * max_qkv_);
    uint16_t* attn = at_least(attn_, t * max_q_);
    uint16_t* gate_up = at_least(gate_up_, t * 2 * max_inter_);
    uint16_t* act = at_least(act_, t * max_inter_);
    const KernelSet& set = *kernel_set();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      if (i == 0)
        set.rms_norm_bf16(x, hidden, l.input_norm, h, t, hidden, l.eps);
      else
        set.add_rms_norm_bf16(x, proj, hidden, l.input_norm, h, t, hidden, l.eps);
      l.qkv(h, hidden, t, qkv);
      add_lora_outputs(l.qkv, h, hidden, qkv);
      if (const char* err = attention(l, qkv, t, cos_sin, slots, block_table, table_stride, seq_lens, attn)) return err;
      l.o(attn, l.o.k, t, proj);
      add_lora_outputs(l.o, attn, l.o.k, proj);
      set.add_rms_norm_bf16(x, proj, hidden, l.post_norm, h, t, hidden, l.eps);
      l.gate_up(h, hidden, t, gate_up);
      add_lora_outputs(l.gate_up, h, hidden, gate_up);
      set.silu_and_mul_bf16(gate_up, l.gate_up.n, act, t, l.down.k);
      l.down(act, l.down.k, t, proj);
      add_lora_outputs(l.down, act, l.down.k, proj);
    }
    set.add_rms_norm_bf16(x, proj, hidden, final_norm, out, t, hidden, final_eps_);
    return nullptr;
  }

 private:
  // y [T, linear.n] += the step's adapters' outputs for x's rows (ldx apart), if the linear has slots.
  void add_lora_outputs(const StackLinear& linear, const uint16_t* x, int64_t ldx, uint16_t* y) {
    if (linear.lora >= 0 && lora_.num_rows > 0) lora_apply(loras_[linear.lora], lora_, x, ldx, y, linear.n, lora_scratch_);
  }

  const char* step_rows(int64_t num_tokens, const int64_t* block_table, int64_t table_stride, const int64_t* seq_lens,
                        const int64_t* query_lens, const int64_t* seq_lens_cpu, int64_t num_reqs) {
    StepRows& r = rows_;
    r.decode_rows.clear(), r.decode_table.clear(), r.decode_seq_lens.clear(), r.prefills.clear();
    int64_t start = 0;
    for (int64_t i = 0; i < num_reqs; ++i) {
      if (query_lens[i] == 1) {
        r.decode_rows.push_back(start);
      } else {
        const int64_t max_len = table_stride * layers_[0].block_size;
        if (query_lens[i] < 1 || seq_lens_cpu[i] < query_lens[i] || seq_lens_cpu[i] > max_len)
          return fail("DecoderStack: request " + std::to_string(i) +
                      "'s lengths do not fit its queries and block table");
        r.prefills.push_back({i, start, query_lens[i], seq_lens_cpu[i]});
      }
      start += query_lens[i];
    }
    if (start != num_tokens)
      return fail("DecoderStack: the query lengths add up to " + std::to_string(start) + ", not " +
                  std::to_string(num_tokens) + " rows");
    r.all_decode = r.prefills.empty();
    if (!r.all_decode) {  // the decode rows' requests, gathered once for every layer
      for (int64_t i = 0; i < num_reqs; ++i) {
        if (query_lens[i] != 1) continue;
        const int64_t* row = block_table + i * table_stride;
        r.decode_table.insert(r.decode_table.end(), row, row + table_stride);
        r.decode_seq_lens.push_back(seq_lens[i]);
      }
    }
    return nullptr;
  }

  // qkv [T, (H + 2 KvH) * D] -> out [T, H * D]: q/k norms (Qwen3), rotary in place, K/V into the
  // cache, then the decode rows together and each prefill on its own, as models/attention/cpu.py does.
  const char* attention(const StackLayer& l, uint16_t* qkv, int64_t t, const uint16_t* cos_sin, const int64_t* slots,
                        const int64_t* block_table, int64_t table_stride, const int64_t* seq_lens, uint16_t* out) {
    const KernelSet& set = *kernel_set();
    const int64_t d = l.head_dim, q_size = l.num_heads * d, kv_size = l.num_kv_heads * d, ld = l.qkv.n;
    if (l.q_norm) {
      rms_norm_heads(qkv, ld, t, l.num_heads, d, l.q_norm, l.eps);
      rms_norm_heads(qkv + q_size, ld, t, l.num_kv_heads, d, l.k_norm, l.eps);
    }
    rotary(qkv, ld, cos_sin, t, l.num_heads + l.num_kv_heads, d, kBF16);
    if (const char* err = write_kv_cache(qkv + q_size, ld * 2, qkv + q_size + kv_size, ld * 2, t, kv_size * 2,
                                         l.k_cache, l.v_cache, l.num_slots, slots))
      return err;
    const int64_t stride_block = l.block_size * kv_size;
    DecodeArgs a{l.num_kv_heads, l.num_heads / l.num_kv_heads, d, l.block_size, ld, d, stride_block, kv_size,
                 table_stride, l.window, l.scale};
    if (rows_.all_decode) {
      set.decode_attention(a, qkv, l.k_cache, l.v_cache, block_table, seq_lens, t, out);
      return nullptr;
    }
    const int64_t num_dec = static_cast<int64_t>(rows_.decode_rows.size());
    if (num_dec > 0) {  // gathered into scratch: q rows in, results back to their rows
      uint16_t* q_dec = at_least(q_dec_, num_dec * q_size);
      uint16_t* out_dec = at_least(out_dec_, num_dec * q_size);
      for (int64_t i = 0; i < num_dec; ++i)
        std::memcpy(q_dec + i * q_size, qkv + rows_.decode_rows[i] * ld, q_size * 2);
      a.q_stride_req = q_size;
      set.decode_attention(a, q_dec, l.k_cache, l.v_cache, rows_.decode_table.data(), rows_.decode_seq_lens.data(),
                           num_dec, out_dec);
      for (int64_t i = 0; i < num_dec; ++i)
        std::memcpy(out + rows_.decode_rows[i] * q_size, out_dec + i * q_size, q_size * 2);
    }
    for (const auto& p : rows_.prefills) {
      PrefillArgs pa{l.num_heads / l.num_kv_heads, d, l.block_size, ld, d, stride_block, kv_size,
                     p.seq_len - p.len, p.seq_len, l.window, l.scale};
      set.prefill_attention(pa, qkv + p.start * ld, l.k_cache, l.v_cache, block_table + p.req * table_stride,
                            l.num_kv_heads, p.len, out + p.start * q_size, q_size);
    }
    return nullptr;
  }

  std::vector<StackLinear> linears_;
  std::vector<StackLayer> layers_;
  float final_eps_;
  int64_t hidden_ = 0, max_qkv_ = 0, max_q_ = 0, max_inter_ = 0;
  StepRows rows_;
  std::vector<uint16_t> h_, proj_, qkv_, attn_, gate_up_, act_, q_dec_, out_dec_;
  std::vector<LoraLinear> loras_;
  LoraSegments lora_;  // this step's (valid during forward)
  LoraScratch lora_scratch_;
};

}  // namespace kvserve::host_lib

using kvserve::host_lib::DecoderStack;

KV_EXPORT DecoderStack* kv_stack_new(float final_eps) { return new DecoderStack(final_eps); }

KV_EXPORT void kv_stack_free(DecoderStack* stack) { delete stack; }

// packed: bf16 [N/64, K/2, 64, 2] (bits 16) or uint8 [N/64, K/4, 256 or 128] with fp16 scales
// [N/64, K/group, 64]; bias float32 [N] or null.
KV_EXPORT const char* kv_stack_add_linear(DecoderStack* stack, const void* packed, const uint16_t* scales,
                                          const float* bias, int64_t n, int64_t k, int64_t col_blocks, int64_t bits,
                                          int64_t group) {
  return stack->add_linear({packed, scales, bias, n, k, col_blocks, bits, group});
}

// Adapter slots of the last linear added, packed by models/lora_cpu.py (host.h's LoraLinear).
KV_EXPORT const char* kv_stack_add_lora(DecoderStack* stack, const uint16_t* a, const uint16_t* b, int64_t num_shards,
                                        int64_t rank_pad, const int64_t* shard_n, int64_t num_slots) {
  return stack->add_lora(a, b, num_shards, rank_pad, shard_n, num_slots);
}

// Norm weights bf16 [hidden] (q_norm, k_norm: [D] or null); caches [num_blocks, block_size, KvH, D] bf16.
KV_EXPORT const char* kv_stack_add_layer(DecoderStack* stack, const uint16_t* input_norm, const uint16_t* post_norm,
                                         const uint16_t* q_norm, const uint16_t* k_norm, uint16_t* k_cache,
                                         uint16_t* v_cache, int64_t num_blocks, int64_t block_size, int64_t hidden,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t window,
                                         float scale, float eps) {
  if ((q_norm == nullptr) != (k_norm == nullptr)) return kvserve::host_lib::fail("DecoderStack: q_norm without k_norm");
  return stack->add_layer({input_norm, post_norm, q_norm, k_norm, {}, {}, {}, {}, k_cache, v_cache,
                           num_blocks * block_size, block_size, num_heads, num_kv_heads, head_dim, window, scale, eps},
                          hidden);
}

KV_EXPORT const char* kv_stack_forward(DecoderStack* stack, uint16_t* x, uint16_t* out, const uint16_t* final_norm,
                                       const uint16_t* cos_sin, const int64_t* slots, const int64_t* block_table,
                                       int64_t table_stride, const int64_t* seq_lens, const int64_t* query_lens,
                                       const int64_t* seq_lens_cpu, int64_t num_reqs, int64_t num_tokens,
                                       const int64_t* lora_rows, const int32_t* lora_starts, const int32_t* lora_lens,
                                       const int32_t* lora_slots, int64_t lora_segments, int64_t lora_num_rows) {
  // lora_*: the rows that use an adapter, grouped by slot (lora_num_rows 0: none this step)
  const kvserve::host_lib::LoraSegments lora{lora_rows, lora_starts, lora_lens, lora_slots, lora_segments,
                                             lora_num_rows};
  return stack->forward(x, out, final_norm, cos_sin, slots, block_table, table_stride, seq_lens, query_lens,
                        seq_lens_cpu, num_reqs, num_tokens, lora);
}
