"""Decoders under test: anything that prefills, steps and reports sites under the harness's names.

``ProductionDecoder`` (the built-in decoder), ``TransformersDecoder`` (transformers' ``DeepseekV4ForCausalLM``)
and ``TraceDecoder`` (a recorded trace from any engine, ``fidelity.decoders.trace_file``) implement ``Decoder``.
``indexer_scores`` and ``indexer_topk`` are the production decoder's lightning indexer on given inputs (its scores
under a profile, its top-k tie order): what the indexer recall study scores each precision with.
"""

from fidelity.decoders.base import Decoder, mode_support, required_sites
from fidelity.decoders.production.decoder import ProductionDecoder
from fidelity.decoders.production.indexer_scoring import indexer_scores, indexer_topk
from fidelity.decoders.trace import TraceDecoder
from fidelity.decoders.transformers import TransformersDecoder

__all__ = ["Decoder", "ProductionDecoder", "TraceDecoder", "TransformersDecoder", "default_decoder", "indexer_scores",
           "indexer_topk", "mode_support", "required_sites"]


def default_decoder(checkpoint, profile: object = "reference", max_context: int = 4096,
                    device: str = "cpu") -> Decoder:
    """The decoder a run tests when it names none: the built-in production decoder with ``profile`` (a name, a
    spec string, a .toml/.json path or a ``Profile``)."""
    return ProductionDecoder(checkpoint, profile, max_context, device)
