"""Interchange with other ecosystems' checkpoint formats (Hugging Face Llama / Mistral / Qwen2)."""

from causal_lm.interop.hf import HFFormatError, load_hf, save_hf

__all__ = ["HFFormatError", "load_hf", "save_hf"]
