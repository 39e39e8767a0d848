"""dsv4-fidelity: differential testing of DeepSeek-V4 decoders against FP32/FP64 oracles.

Subpackages, in the order data flows: ``model`` (config, formats, weights, checkpoints, sites, sampler), the
decoders under test (``decoders``: the built-in ``decoders.production`` and foreign ones), the ``harness`` (runs,
modes, comparison, judgement), ``outputs`` (run directory, report, plots, comparisons), and the ``testing`` kit for
your own kernels; ``job``, ``studies`` (scenarios, mutants, recall), ``api`` and ``cli`` sit on top, one layer whose
modules import one another. Each imports only from its own layer and those before it (``tests/test_layout.py``)."""

from importlib import import_module

from fidelity._version import __version__

_LAZY = {  # name -> module: imported on first use, so that ``import fidelity`` (and ``fidelity --help``) needs no torch
    "Checkpoint": "fidelity.model.checkpoint",
    "CheckpointError": "fidelity.model.checkpoint",
    "ConfigError": "fidelity.model.config",
    "ModelConfig": "fidelity.model.config",
    "default_checkpoint": "fidelity.model.default",
    "load_checkpoint": "fidelity.model.load",
    "run": "fidelity.api",
    "save_checkpoint": "fidelity.model.save",
    "synthesize": "fidelity.model.synthesize",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    """The public names (``fidelity.run`` is ``fidelity.api.run``), each imported on first use."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fidelity' has no attribute {name!r}")
