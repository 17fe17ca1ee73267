"""Benchmarks of dtypeplan: memory, communication, step time and numerics (benchmarks/README.md)."""
