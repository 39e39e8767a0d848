"""dsv4-fidelity: differential testing of DeepSeek-V4 decoders against FP32/FP64 oracles."""

from fidelity.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fidelity.config import ConfigError, ModelConfig
from fidelity.default_model import default_checkpoint
from fidelity.synthesize import synthesize

__all__ = [
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
__version__ = "0.1.0"


def __getattr__(name: str):
    """``fidelity.run`` (``fidelity.api.run``), imported on first use: it pulls in the models and pandas."""
    if name == "run":
        from fidelity.api import run

        return run
    raise AttributeError(f"module 'fidelity' has no attribute {name!r}")
