"""FP32/FP64 oracle implementations of every DSv4 op, and ``OracleModel`` wiring them (spec §4)."""

from oracles.model import OracleModel, OracleSession

__all__ = ["OracleModel", "OracleSession"]
