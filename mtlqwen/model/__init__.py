"""Config, checkpoint loading and quantization, and the Qwen3.5 graph."""

from .cache import ModelCache
from .config import ConfigError, Qwen35Config, QuantSpec, load_config, parse_config
from .loading import load, resolve_model_path
from .qwen35 import Qwen35Model
from .weights import CheckpointError

__all__ = [
    "CheckpointError", "ConfigError", "ModelCache", "QuantSpec", "Qwen35Config", "Qwen35Model",
    "load", "load_config", "parse_config", "resolve_model_path",
]
