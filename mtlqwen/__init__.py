"""mtlqwen: an inference engine for the Qwen3.5 family on MLX."""

from .kernels import SeqLayout
from .model import CheckpointError, ConfigError, ModelCache, Qwen35Model, load, load_drafter
from .runtime import Delta, Engine, Output, SamplingParams, Structure

__version__ = "0.1.0"


def load_tokenizer(path_or_repo):
    """The checkpoint's tokenizer and chat template (see mtlqwen.tokenizer)."""
    from .tokenizer import load_tokenizer as _load  # noqa: PLC0415

    return _load(path_or_repo)


__all__ = [
    "CheckpointError", "ConfigError", "Delta", "Engine", "ModelCache", "Output", "Qwen35Model", "SamplingParams",
    "SeqLayout", "Structure", "load", "load_drafter", "load_tokenizer",
]
