"""Interchange with other ecosystems' formats: Hugging Face Llama / Mistral / Qwen2 folders, GGUF files, chat
templates."""

from causal_lm.interop.chat import ChatTemplateError, apply_chat_template
from causal_lm.interop.gguf import GGUFFormatError, load_gguf
from causal_lm.interop.hf_checkpoint import load_hf, save_hf
from causal_lm.interop.hf_config import HFFormatError

__all__ = [
    "ChatTemplateError",
    "GGUFFormatError",
    "HFFormatError",
    "apply_chat_template",
    "load_gguf",
    "load_hf",
    "save_hf",
]
