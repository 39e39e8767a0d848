"""Probes: small functions from site tensors to metric rows."""
