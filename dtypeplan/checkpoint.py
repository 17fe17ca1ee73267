"""Distributed checkpoints of a dtypeplan optimizer (see ``save`` and ``load``)."""
