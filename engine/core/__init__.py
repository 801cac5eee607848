"""Continuous batching over a paged KV cache: the scheduler, the block pool and the per-request KV cache
manager, the request's bookkeeping and the plain-data step record the worker runs. Plain Python, no torch.
Features attach to the scheduler as optional collaborators (engine/spec_decode/, engine/seq2seq/)."""
