"""Tensor parallelism, Megatron style: this rank's place in the group, its collectives, and the
parallel layers the model files build.

Each of `size` ranks holds a slice of every large matrix:

* column-parallel (`ColumnParallelLinear`, `MergedColumnParallelLinear` for gate/up,
  `QKVParallelLinear`): output features split, no communication; the attention heads of
  rank r are the ones its q/k/v rows produce. KV heads are split like the query heads, or
  replicated when there are fewer KV heads than ranks (MQA/GQA): rank r then holds KV head
  `r // (size // num_kv_heads)`, the one its query heads attend with.
* row-parallel (`RowParallelLinear`, o_proj / down_proj): input features split, one
  all-reduce of the output; rank 0 alone adds the bias.
* vocab-parallel (`VocabParallelEmbedding`, `ParallelLMHead`): vocabulary rows split
  (padded to a multiple of `size`); the embedding all-reduces, the LM head gathers the
  logits of the rows it is given (the sampled ones) onto rank 0 only.

The layers read `current()` when they are built: the loader builds the model inside
`with tensor_parallel(state):`. At size 1 they are the plain layers of `models/layers.py`
with whole-tensor loading and nothing else on the forward path.

Weight loaders take a `LazyTensor` (or a tensor) and read only their rank's slice.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.models.layers import Linear, PackedLinear, VocabEmbedding, as_lazy, check_shape


@dataclass(slots=True, eq=False)
class ParallelState:
    """This process's rank in a tensor-parallel group of `size`. `group` (a torch.distributed
    process group) is joined after the weights are loaded; it is None at size 1."""

    rank: int = 0
    size: int = 1
    device: torch.device | None = None
    group: object | None = None

    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """Reduce `x` in place over the group (sum, or min for a few host-side numbers)."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MIN
        self.group.allreduce([x], opts).wait()
        return x

    def gather(self, x: Tensor) -> list[Tensor] | None:
        """Every rank's `x` on rank 0 (in rank order); None on the other ranks."""
        import torch.distributed as dist

        opts = dist.GatherOptions()
        opts.rootRank = 0
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.group.gather(outputs, [x.contiguous()], opts).wait()
        return outputs[0] if self.rank == 0 else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit on every rank)."""
        x = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(x, "min").item())


def new_group(store, rank: int, size: int, device: torch.device, timeout_s: float) -> object:
    """The group's process group over `store` (a `torch.distributed.TCPStore`): gloo on the CPU,
    NCCL on CUDA. `timeout_s` bounds every collective, so a hung rank fails the others' steps."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # one machine
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


_current = ParallelState()


def current() -> ParallelState:
    """The state layers built now belong to (size 1 outside `tensor_parallel`)."""
    return _current


@contextmanager
def tensor_parallel(state: ParallelState) -> Iterator[ParallelState]:
    """Build layers for `state` inside this block; always restores the previous state."""
    global _current
    previous, _current = _current, state
    try:
        yield state
    finally:
        _current = previous


def split(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"tensor_parallel_size={size} must divide {what}={total}")
    return total // size


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: split, or one replicated head when there are fewer than ranks."""
    if num_kv_heads >= size:
        return split(num_kv_heads, size, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} must divide, or be a multiple of, "
            f"num_key_value_heads={num_kv_heads}"
        )
    return 1


def check_tensor_parallel(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError unless the model's heads can be split over `size` ranks."""
    split(num_heads, size, "num_attention_heads")
    kv_heads_per_rank(num_kv_heads, size)


# ---- layers ------------------------------------------------------------------------------


def check_full_shape(loaded, shape: Sequence[int], what: str = "") -> None:
    """The checkpoint tensor has the whole (unsharded) `shape`, before a rank takes its slice."""
    if tuple(loaded.shape) != tuple(shape):
        raise ValueError(
            f"shape mismatch{what}: checkpoint has {tuple(loaded.shape)}, "
            f"model expects {tuple(shape)}"
        )


class ColumnParallelLinear(Linear):
    """Output features split over ranks; each rank's output is its slice (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current()
        super().__init__(in_features, split(out_features, self.tp.size, "out_features"), bias)
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded) -> None:
        size = param.shape[0]
        check_full_shape(loaded, (size * self.tp.size, *param.shape[1:]))
        param.copy_(as_lazy(loaded).narrow(0, self.tp.rank * size, size).read())


class MergedColumnParallelLinear(PackedLinear):
    """Several column-parallel linears on one input (gate/up): each rank holds its slice of each.
    `full_sizes[i]`: rows of checkpoint tensor `shard_ids[i]` (all ranks together)."""

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], shard_ids: Sequence, bias: bool = False
    ) -> None:
        self.tp = current()
        self.full_sizes = list(output_sizes)
        super().__init__(
            in_features,
            [split(s, self.tp.size, "output size") for s in output_sizes],
            shard_ids,
            bias,
        )

    def shard_rows(self, shard_id, loaded):
        """The rows of checkpoint tensor `shard_id` that this rank holds."""
        size = self.output_sizes[self.shard_ids.index(shard_id)]
        return as_lazy(loaded).narrow(0, self.tp.rank * size, size)

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded, shard_id=None) -> None:
        loaded = as_lazy(loaded)
        if shard_id is None:  # already packed in the checkpoint (GPT-2's c_attn): shard each part
            if loaded.shape[0] != sum(self.full_sizes):
                raise ValueError(
                    f"shape mismatch (packed): checkpoint has {tuple(loaded.shape)}, "
                    f"model expects {sum(self.full_sizes)} rows"
                )
            offset = 0
            for sid, size in zip(self.shard_ids, self.full_sizes):
                super().weight_loader(
                    param, self.shard_rows(sid, loaded.narrow(0, offset, size)), sid
                )
                offset += size
            return
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard {shard_id!r} (expected one of {self.shard_ids})")
        full = self.full_sizes[self.shard_ids.index(shard_id)]
        check_full_shape(loaded, (full, *param.shape[1:]), f" in shard {shard_id!r}")
        super().weight_loader(param, self.shard_rows(shard_id, loaded), shard_id)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v of `num_heads` / `num_kv_heads` heads, packed; this rank's heads only.
    `num_heads` and `num_kv_heads` are this rank's counts (what its `Attention` gets)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = current()
        local_heads = split(num_heads, tp.size, "num_attention_heads")
        local_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        sizes = [local_heads * head_dim, local_kv_heads * head_dim, local_kv_heads * head_dim]
        super().__init__(hidden_size, [s * tp.size for s in sizes], ["q", "k", "v"], bias)
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, local_heads, local_kv_heads
        self.total_num_kv_heads = num_kv_heads

    def shard_rows(self, shard_id, loaded):
        d = self.head_dim
        if shard_id == "q":
            return as_lazy(loaded).narrow(0, self.tp.rank * self.num_heads * d, self.num_heads * d)
        if self.total_num_kv_heads >= self.tp.size:
            first = self.tp.rank * self.num_kv_heads
        else:  # replicated: the KV head this rank's query heads belong to
            first = self.tp.rank // (self.tp.size // self.total_num_kv_heads)
        return as_lazy(loaded).narrow(0, first * d, self.num_kv_heads * d)


class RowParallelLinear(Linear):
    """Input features split over ranks (the input is the column-parallel layer's slice); the
    partial outputs are summed with one all-reduce. Only rank 0 adds the bias: the other ranks
    load zeros in its place, so the packed CPU kernels need no special case."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current()
        super().__init__(split(in_features, self.tp.size, "in_features"), out_features, bias)
        self.tp_size = self.tp.size
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded) -> None:
        loaded = as_lazy(loaded)
        if len(loaded.shape) == 1:  # the bias
            check_shape(param, loaded)
            if self.tp.rank == 0:
                param.copy_(loaded.read())
            else:
                param.zero_()
            return
        size = param.shape[1]
        check_full_shape(loaded, (param.shape[0], size * self.tp.size))
        param.copy_(loaded.narrow(1, self.tp.rank * size, size).read())

    def forward(self, x: Tensor) -> Tensor:  # [T, in / size] -> [T, out]
        return self.reduce(self.forward_partial(x))

    def forward_partial(self, x: Tensor) -> Tensor:  # [T, in / size] -> [T, out], this rank's part
        """This rank's term of the sum (a LoRA wrapper adds its adapters' part before `reduce`)."""
        return super().forward(x)

    def reduce(self, y: Tensor) -> Tensor:  # [T, out] partial -> [T, out] summed over the ranks
        if self.tp_size > 1:
            self.tp.all_reduce(y)
        return y


def _load_vocab_rows(tp: ParallelState, param: Tensor, loaded, vocab_size: int) -> None:
    """Rows [rank * per, (rank + 1) * per) of a [vocab, hidden] tensor; rows past the vocabulary
    (padding) are zeros."""
    loaded = as_lazy(loaded)
    if loaded.shape[0] != vocab_size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
            f"({vocab_size}, {', '.join(map(str, param.shape[1:]))})"
        )
    per = param.shape[0]
    start = tp.rank * per
    num = max(0, min(per, vocab_size - start))
    param[:num].copy_(loaded.narrow(0, start, num).read())
    param[num:].zero_()


def _gather_vocab(tp: ParallelState, logits: Tensor, vocab_size: int) -> Tensor:
    """[N, vocab / size] per rank -> [N, vocab] on rank 0; other ranks keep their slice."""
    parts = tp.gather(logits)
    return logits if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]


class VocabParallelEmbedding(VocabEmbedding):
    """Token embedding with the vocabulary split over ranks; also the tied, vocab-parallel LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.tp = current()
        self.vocab_size = num_embeddings
        self.tp_size = self.tp.size
        self.num_rows = -(-num_embeddings // self.tp.size)  # this rank's
        super().__init__(self.num_rows, embedding_dim)
        self.weight.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded) -> None:
        _load_vocab_rows(self.tp, param, loaded, self.vocab_size)

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return self.rows(ids)
        per = self.num_rows
        local = ids - self.tp.rank * per
        outside = (local < 0) | (local >= per)  # [T] another rank's rows
        x = self.rows(local.masked_fill(outside, 0))
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def lm_head(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab] (rank 0)
        logits = super().lm_head(hidden)
        return logits if self.tp_size == 1 else _gather_vocab(self.tp, logits, self.vocab_size)


class ParallelLMHead(Linear):
    """An untied LM head [vocab, hidden] split by vocabulary rows; logits gathered onto rank 0
    (the other ranks return their own slice, which nobody reads)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp = current()
        self.vocab_size = vocab_size
        self.tp_size = self.tp.size
        super().__init__(hidden_size, -(-vocab_size // self.tp.size))
        self.weight.weight_loader = self.weight_loader

    @torch.no_grad()
    def weight_loader(self, param: Tensor, loaded) -> None:
        _load_vocab_rows(self.tp, param, loaded, self.vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:  # [N, hidden] -> [N, vocab] (rank 0)
        logits = super().forward(hidden)
        return logits if self.tp_size == 1 else _gather_vocab(self.tp, logits, self.vocab_size)
