"""Decoders under test: anything that prefills, steps and reports sites under the harness's names.

``ProductionDecoder`` (the built-in decoder), ``TransformersDecoder`` (transformers' ``DeepseekV4ForCausalLM``)
and ``TraceDecoder`` (a recorded trace from any engine, ``fidelity.decoders.trace_file``) implement ``Decoder``.
"""

from fidelity.decoders.base import Decoder, mode_support, required_sites
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.transformers import TransformersDecoder

__all__ = ["Decoder", "ProductionDecoder", "TraceDecoder", "TransformersDecoder", "mode_support", "required_sites"]
