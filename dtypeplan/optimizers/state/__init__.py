"""What the optimizer state holds, how it is named, stored and counted, apart from any layout:
the ``param.{i}.{name}`` / ``scalar.{name}`` keys, per-element and scalar values, one moment
stored as fp32, bf16, int8 or fp8 blocks, bf16 masters and low-precision moments, and the
tensors a rank holds by ``plan.memory()`` component."""

__all__: list[str] = []
