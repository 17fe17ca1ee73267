"""Benchmarks of dtypeplan: memory, communication, step time and numerics (see README.md)."""
