"""Collectives with an explicit wire dtype (see :mod:`dtypeplan.comm._collectives`)."""

from dtypeplan.comm._collectives import CommStats, Communicator

__all__ = ["CommStats", "Communicator"]
