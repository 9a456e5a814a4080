"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / SmolLM3 checkpoints <-> this project's Decoder.

The import path of the Hugging Face interop's public names, which live in three modules:

    hf_config.py      config.json <-> ModelConfig (the families, what each expresses, RoPE scaling, windows)
    hf_weights.py     the parameter table: our parameters <-> Hugging Face tensors (shared with the GGUF reader)
    hf_checkpoint.py  checkpoint folders: safetensors reading and writing, tokenizer files, load_hf / save_hf

and causal_lm/data/tokenizer_json.py writes tokenizer.json for the project's tokenizers.
"""

from causal_lm.data.tokenizer_json import byte_tokenizer_json, write_tokenizer_json
from causal_lm.interop.hf_checkpoint import (
    INDEX_NAME,
    WEIGHTS_NAME,
    hf_tensors_from_model,
    load_hf,
    load_hf_params,
    read_hf_tokenizer,
    read_tokenizer_settings,
    save_hf,
)
from causal_lm.interop.hf_config import (
    ARCHITECTURE_ALIASES,
    ARCHITECTURES,
    GEMMA,
    MODEL_TYPES,
    HFFormatError,
    default_architecture,
    hf_config_from_model,
    model_config_from_hf,
    read_hf_config,
    read_json,
)
from causal_lm.interop.hf_weights import model_from_params, param_table

_save_tokenizer_json = write_tokenizer_json  # the name it had here

__all__ = [
    "ARCHITECTURES",
    "ARCHITECTURE_ALIASES",
    "GEMMA",
    "INDEX_NAME",
    "MODEL_TYPES",
    "WEIGHTS_NAME",
    "HFFormatError",
    "byte_tokenizer_json",
    "default_architecture",
    "hf_config_from_model",
    "hf_tensors_from_model",
    "load_hf",
    "load_hf_params",
    "model_config_from_hf",
    "model_from_params",
    "param_table",
    "read_hf_config",
    "read_json",
    "read_hf_tokenizer",
    "read_tokenizer_settings",
    "save_hf",
    "write_tokenizer_json",
]
