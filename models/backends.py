"""The attention backends' names, in a module without torch so that configuration (EngineArgs,
the CLI) can offer and check them before anything loads. `models/attention/backend.py` picks one."""

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")  # auto: cpu on CPU, triton on CUDA
