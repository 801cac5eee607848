"""Model runner: turns a StepPlan into flat tensors, runs the model, samples.

It owns the model, the KV cache tensors and the sampler; it never allocates
blocks (the block manager did) and never decides who runs (the scheduler did).
`execute` makes exactly one device-to-host copy in the common path: the sampled
token ids (logprobs, when asked for, come with them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.device import kv_cache_budget_bytes, resolve_device, resolve_dtype
from engine.sampler import Sampler
from engine.sampling_inputs import build_sampling_tensors
from engine.scheduler import ScheduledRequest, StepPlan
from models import hugepages, load_model
from models.attention import Attention, AttentionMetadata, forward_context

logger = logging.getLogger(__name__)

# (token id, logprob, rank) of the chosen token, then the top-k ids and logprobs
TokenLogprobs = tuple[int, float, int, list[int], list[float]]


@dataclass(slots=True)
class RunnerOutput:
    sampled_token_ids: list[int | None]  # aligned with plan.scheduled
    logprobs: dict[str, TokenLogprobs]  # request id -> the sampled token's logprobs
    prompt_logprobs: dict[str, list[TokenLogprobs]]  # request id -> new prompt positions


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, model_path: str, hf_config, max_model_len: int) -> None:
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_path, hf_config, self.dtype, self.device)
        self.vocab_size = hf_config.vocab_size
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_blocks = self._allocate_kv_cache(cache_config, scheduler_config, max_model_len)
        self.sampler = Sampler()

    # ---- set-up ------------------------------------------------------------
    def _allocate_kv_cache(self, cache: CacheConfig, sched: SchedulerConfig, max_model_len: int) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        bytes_per_block = sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in self.attn_layers)
        if cache.num_kv_blocks is not None:
            num_blocks = cache.num_kv_blocks
        elif cache.kv_cache_memory is not None:
            num_blocks = cache.kv_cache_memory // bytes_per_block
        else:
            # no more than the largest batch could ever use
            max_useful = sched.max_num_seqs * -(-max_model_len // self.block_size) + 1
            num_blocks = min(kv_cache_budget_bytes(self.device) // bytes_per_block, max_useful)
        if num_blocks < 2:
            raise ValueError(f"KV cache too small: {num_blocks} blocks of {bytes_per_block} bytes; "
                             f"raise kv_cache_memory (got {cache.kv_cache_memory})")
        for layer in self.attn_layers:
            # [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; block 0 is the null block
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            if self.device.type == "cpu":  # scattered block reads: huge pages spare TLB misses
                layer.kv_cache = hugepages.empty(shape, self.dtype).zero_()
            else:
                layer.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)", num_blocks - 1,
                    self.block_size, (num_blocks - 1) * self.block_size,
                    num_blocks * bytes_per_block / 2**20)
        return num_blocks

    # ---- one step ----------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        items = plan.scheduled
        input_ids, positions, meta, cu = self._prepare_inputs(items)
        sampled_idx = [i for i, it in enumerate(items) if it.is_sampled]
        prompt_rows, prompt_targets, prompt_owners = self._prompt_logprob_rows(items, cu)
        rows = np.concatenate([cu[1:][sampled_idx] - 1, prompt_rows]).astype(np.int64)

        with forward_context(meta):
            hidden = self.model(input_ids, positions)  # [T, hidden]
            logits = self.model.compute_logits(hidden[self._to_device(rows)])  # [R, vocab]

        num_sampled = len(sampled_idx)
        requests = [items[i].request for i in sampled_idx]
        tensors = build_sampling_tensors(requests, self.vocab_size, self.device) if num_sampled else None
        if num_sampled:
            out = self.sampler(logits[:num_sampled], tensors)
            token_ids = out.sampled_token_ids.tolist()  # the one device->host sync
        else:  # every request is mid-way through a chunked prefill
            out, token_ids = None, []

        sampled: list[int | None] = [None] * len(items)
        for i, tok in zip(sampled_idx, token_ids):
            sampled[i] = tok
        logprobs = self._collect_logprobs(requests, token_ids, out)
        prompt_lps = self._prompt_logprobs(logits[num_sampled:], prompt_targets, prompt_owners)
        return RunnerOutput(sampled, logprobs, prompt_lps)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _prepare_inputs(self, items: list[ScheduledRequest]):
        num_reqs = len(items)
        query_lens = np.fromiter((it.num_new_tokens for it in items), np.int64, num_reqs)
        starts = np.fromiter((it.start_pos for it in items), np.int64, num_reqs)
        cu = np.zeros(num_reqs + 1, np.int64)  # cu_seqlens_q
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        input_ids = np.fromiter((t for it in items for t in it.token_ids), np.int64, num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - starts, query_lens)
        max_blocks = max(len(it.block_ids) for it in items)
        block_table = np.zeros((num_reqs, max_blocks), np.int64)  # padded with the null block
        for i, it in enumerate(items):
            block_table[i, :len(it.block_ids)] = it.block_ids
        req_idx = np.repeat(np.arange(num_reqs), query_lens)
        bs = self.block_size
        slot_mapping = block_table[req_idx, positions // bs] * bs + positions % bs
        seq_lens = starts + query_lens
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            cu_seqlens_q=self._to_device(cu),
            seq_lens=self._to_device(seq_lens),
            block_table=self._to_device(block_table),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=bs,
        )
        return self._to_device(input_ids), self._to_device(positions), meta, cu

    # ---- logprobs ----------------------------------------------------------
    @staticmethod
    def _collect_logprobs(requests, token_ids, out) -> dict[str, TokenLogprobs]:
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not wanted:
            return {}
        lps = out.sampled_logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None
        result = {}
        for i in wanted:
            k = requests[i].params.logprobs
            ids_i = top_ids[i][:k] if top_ids and k else []
            lps_i = top_lps[i][:k] if top_lps and k else []
            result[requests[i].request_id] = (token_ids[i], lps[i], ranks[i], ids_i, lps_i)
        return result

    @staticmethod
    def _prompt_logprob_rows(items: list[ScheduledRequest], cu: np.ndarray):
        """Rows whose logits score the next prompt token, for requests asking prompt_logprobs."""
        rows, targets, owners = [], [], []
        for i, it in enumerate(items):
            req = it.request
            if not req.wants_prompt_logprobs:
                continue
            # logits at position p score prompt token p+1; skip positions already scored
            first = max(it.start_pos, len(req.prompt_logprobs))
            last = min(it.start_pos + it.num_new_tokens, req.num_prompt_tokens - 1)
            if first >= last:
                continue
            rows.extend(range(cu[i] + first - it.start_pos, cu[i] + last - it.start_pos))
            targets.extend(req.prompt_token_ids[first + 1:last + 1])
            owners.append((req, last - first))
        return np.array(rows, np.int64), targets, owners

    def _prompt_logprobs(self, logits: torch.Tensor, targets: list[int], owners) -> dict[str, list]:
        if not owners:
            return {}
        k = max(req.params.prompt_logprobs for req, _ in owners)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
        target_t = torch.tensor(targets, device=logits.device)
        target_lp = logprobs.gather(1, target_t[:, None])  # [R, 1]
        ranks = (logprobs > target_lp).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], target_t[:, None][:, :0])
        target_lp, ranks, top_lp, top_ids = (t.tolist() for t in (target_lp[:, 0], ranks, top_lp, top_ids))
        result, row = {}, 0
        for req, count in owners:
            kk = req.params.prompt_logprobs
            result[req.request_id] = [
                (targets[r], target_lp[r], ranks[r], top_ids[r][:kk], top_lp[r][:kk])
                for r in range(row, row + count)]
            row += count
        return result
