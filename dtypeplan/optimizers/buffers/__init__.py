"""Where the flat engine's tensors live (Megatron's "param and grad buffers"): the flat buffers,
buckets and shard map, one param group's buffer, accumulator and master chunks, and the host
slots of optimizer offload."""

__all__: list[str] = []
