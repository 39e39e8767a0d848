"""dsv4-fidelity: differential testing of DeepSeek-V4 decoders against FP32/FP64 oracles.

Subpackages, in the order data flows: ``model`` (config, formats, weights, checkpoints, sites, sampler), the
decoders under test (``decoders``: the built-in ``decoders.production`` and foreign ones), the ``harness`` (runs,
modes, comparison, judgement), ``outputs`` (run directory, report, plots, comparisons), and the ``testing`` kit for
your own kernels; ``job``, ``mutants``, ``api`` and ``cli`` sit on top. Each imports only from those before it."""

from fidelity._version import __version__
from fidelity.model.checkpoint import Checkpoint, CheckpointError
from fidelity.model.config import ConfigError, ModelConfig
from fidelity.model.default import default_checkpoint
from fidelity.model.load import load_checkpoint
from fidelity.model.save import save_checkpoint
from fidelity.model.synthesize import synthesize

__all__ = [
    "__version__",
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "default_checkpoint",
    "load_checkpoint",
    "run",
    "save_checkpoint",
    "synthesize",
]


def __getattr__(name: str):
    """``fidelity.run`` (``fidelity.api.run``), imported on first use: it pulls in the models and pandas."""
    if name == "run":
        from fidelity.api import run

        return run
    raise AttributeError(f"module 'fidelity' has no attribute {name!r}")
