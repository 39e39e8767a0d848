"""dsv4-fidelity: differential testing of DeepSeek-V4 decoders against FP32/FP64 oracles."""

from fidelity.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fidelity.config import ConfigError, ModelConfig
from fidelity.synthesize import synthesize

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "load_checkpoint",
    "save_checkpoint",
    "synthesize",
]
__version__ = "0.1.0"
