"""The update math: tensors in, tensors out (no optimizer object, no plan).

Used by the rooms above it (``state/``, ``update/``, ``flat/``, ``fsdp2/``) module by module;
nothing of it is public outside ``dtypeplan.optimizers``.
"""

__all__: list[str] = []
