"""plait-vs-PyTorch benchmarks, run with `plait bench NAME` (never in CI)."""
