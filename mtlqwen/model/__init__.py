"""Config, checkpoint loading and quantization, and the Qwen3.5 graph."""

from .cache import ModelCache
from .dflash import Drafter, DrafterCache, DrafterFitError, load_drafter
from .dflash_config import DFlashConfig, default_target_layer_ids, parse_dflash_config
from .config import ConfigError, Qwen35Config, QuantSpec, load_config, parse_config
from .loading import load, resolve_model_path
from .qwen35 import Qwen35Model
from .weights import CheckpointError

__all__ = [
    "CheckpointError", "ConfigError", "DFlashConfig", "Drafter", "DrafterCache", "DrafterFitError",
    "default_target_layer_ids", "load_drafter", "parse_dflash_config", "ModelCache", "QuantSpec", "Qwen35Config", "Qwen35Model",
    "load", "load_config", "parse_config", "resolve_model_path",
]
