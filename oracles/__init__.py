"""FP32/FP64 oracle implementations of every DSv4 op, ``OracleModel`` wiring them (spec §4), and ``Reference``: the
oracle side of the free, layer and op comparison modes."""

from oracles.model import OracleModel, OracleSession
from oracles.reference import MODES, Reference

__all__ = ["MODES", "OracleModel", "OracleSession", "Reference"]
