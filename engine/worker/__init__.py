"""Runs the steps the core plans: the model runner (tensors, forward, sampling), the tensor-parallel
executor and its worker processes, the KV pool tensors, CUDA graphs."""
