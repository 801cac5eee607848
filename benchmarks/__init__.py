"""Development benchmarks and probes: not part of the installed package (see docs/performance.md).

Run from the repository root, for example `python -m benchmarks.bench_engine`.
"""
