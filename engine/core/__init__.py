"""Continuous batching over a paged KV cache: the scheduler, the block manager, the request's
bookkeeping and the plain-data step record the worker runs. Plain Python, no torch."""
