"""Where the flat engine's tensors live (Megatron's "param and grad buffers"): the flat buffers,
buckets and shard map, one param group's buffer, accumulator and master chunks, and the host
slots of optimizer offload.

Used by ``grads/``, ``update/`` and ``flat/`` module by module; nothing of it is public
outside ``dtypeplan.optimizers``.
"""

__all__: list[str] = []
