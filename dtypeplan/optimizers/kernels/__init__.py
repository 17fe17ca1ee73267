"""The update math: tensors in, tensors out (no optimizer object, no plan)."""

__all__: list[str] = []
