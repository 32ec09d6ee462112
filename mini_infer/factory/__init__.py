"""Random-weight Qwen2.5 checkpoints in Hugging Face format, with the real Qwen2.5 tokenizer."""

from mini_infer.factory.checkpoint import (
    PRESETS,
    default_model_dir,
    ensure_default_model,
    make_model,
    parameter_count,
    write_config,
)
from mini_infer.factory.tokenizer import write_tokenizer

__all__ = [
    "PRESETS",
    "default_model_dir",
    "ensure_default_model",
    "make_model",
    "parameter_count",
    "write_config",
    "write_tokenizer",
]
