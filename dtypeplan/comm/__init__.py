"""Collectives with an explicit wire dtype (see :mod:`dtypeplan.comm._collectives`)."""

from dtypeplan.comm._collectives import CollectiveError, CommStats, Communicator

__all__ = ["CollectiveError", "CommStats", "Communicator"]
