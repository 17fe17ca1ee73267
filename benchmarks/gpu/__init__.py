"""GPU benchmarks: run as ``python3 -m benchmarks.gpu.<name>`` from the repository root."""
