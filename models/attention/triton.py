"""The Triton backend (CUDA; on the CPU only under TRITON_INTERPRET=1, for tests).

Per layer and step, two launches plus one: the rotary embedding and the K/V cache
write in one kernel (padding rows, slot -1, are skipped), then either the paged
decode kernel (every row a decode row: split-K over the context, as flash-decoding)
or the varlen prefill kernel (a ragged batch of any query lengths in one launch,
cached prefixes read in place). The metadata is int32 and the decode path reads no
host value that changes between steps except `max_seq_len`, which CUDA-graph
capture fixes at max_model_len, so decode steps can be captured and replayed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvserve.models.attention.layer import Attention, AttentionBackend
from kvserve.models.attention.metadata import current_context
from kvserve.models.kernels import triton_attention, triton_ops


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    index_dtype = torch.int32
    supports_cuda_graphs = True

    def forward(self, layer: Attention, qkv: Tensor) -> Tensor:
        meta = current_context().meta
        q, k, v = layer.split_qkv(qkv)
        k_cache, v_cache = layer.kv
        if layer.rotary is not None:
            triton_ops.rotary_and_cache_write(
                q,
                k,
                v,
                layer.rotary.cos_sin_cache,
                meta.positions,
                k_cache,
                v_cache,
                meta.slot_mapping,
            )
        else:
            # no rotary (GPT-2): padding rows (slot -1) write into the null block, which no one reads
            slots = meta.slot_mapping.clamp_min(0).long()
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)
        if meta.is_all_decode:
            out = triton_attention.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_table,
                meta.seq_lens,
                layer.scale,
                layer.sliding_window,
                meta.max_seq_len,
                softcap=layer.logit_softcap,
            )
        else:
            out = triton_attention.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_table,
                meta.cu_seqlens_q,
                meta.seq_lens,
                layer.scale,
                layer.sliding_window,
                meta.max_query_len,
                softcap=layer.logit_softcap,
            )
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)
