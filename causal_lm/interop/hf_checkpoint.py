"""Hugging Face checkpoint folders: read and write them (config.json, safetensors weights, tokenizer files).

A Hugging Face folder holds `config.json`, the weights as `model.safetensors` (or shards listed in
`model.safetensors.index.json`) and usually `tokenizer.json`. Reading it needs only `safetensors`' numpy API
(plus `tokenizers` for the tokenizer): neither torch nor transformers is imported, and nothing touches the
network. The config mapping is hf_config.py, the weights' mapping hf_weights.py, and the tokenizer.json writer
causal_lm/data/tokenizer_json.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.data.tokenizer import HFTokenizer, TokenizerError
from causal_lm.data.tokenizer_json import write_tokenizer_json
from causal_lm.interop.chat import end_of_turn_id, read_chat_template
from causal_lm.interop.hf_config import (
    HFFormatError,
    hf_config_from_model,
    model_config_from_hf,
    read_hf_config,
    read_json,
)
from causal_lm.interop.hf_weights import model_from_params, read_params, shape_text, tensors_from_params
from causal_lm.model.weights import check_tensor

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Buffers some older exports saved next to the weights; they are recomputed from the config, never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class _Tensors:
    """Lazy access to the tensors of a checkpoint folder, single file or sharded."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, INDEX_NAME)
        single = os.path.join(path, WEIGHTS_NAME)
        if os.path.isfile(index):
            weight_map = read_json(index)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise HFFormatError(f"{index} has no weight_map")
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not os.path.isfile(os.path.join(path, fname)):
                    raise HFFormatError(f"{INDEX_NAME} lists shard {fname!r}, which is missing from {path!r}")
        elif os.path.isfile(single):
            files = [WEIGHTS_NAME]
        else:
            others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5")))
            hint = (
                (
                    f" (found {', '.join(others)}: only safetensors are read here; re-save it with transformers' "
                    "save_pretrained, which writes safetensors)"
                )
                if others
                else ""
            )
            raise HFFormatError(f"{path!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")
        self.files = {}
        self.where: dict[str, str] = {}
        for fname in files:
            handle = self._guard(fname, lambda fname=fname: safe_open(os.path.join(path, fname), framework="numpy"))
            self.files[fname] = handle
            for name in handle.keys():
                self.where[name] = fname

    def names(self) -> set:
        return set(self.where)

    def _guard(self, fname: str, read):
        """read(), with the safetensors library's errors (a truncated or malformed file) as one HFFormatError
        naming the file: safetensors carries no checksum, so damage shows up as a parse error or not at all."""
        try:
            return read()
        except OSError:
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise HFFormatError(
                f"{os.path.join(self.path, fname)} cannot be read as safetensors (truncated or damaged?): {first}"
            ) from None

    def shape(self, name: str) -> tuple:
        fname = self.where[name]
        return tuple(self._guard(fname, lambda: self.files[fname].get_slice(name).get_shape()))

    def get(self, name: str) -> np.ndarray:
        """The tensor, checked finite and within a sane magnitude (WeightError naming it and its file)."""
        fname = self.where[name]
        w = self._guard(fname, lambda: self.files[fname].get_tensor(name))
        check_tensor(w, name, os.path.join(self.path, fname))
        return w

    def name(self, hf_name: str) -> str:  # (hf_weights.TensorSource)
        return hf_name

    def read(self, name: str, spec: tuple) -> np.ndarray:
        """The tensor `name`, its shape checked (from the file's header, before reading) against `spec`."""
        if name not in self.where:
            raise HFFormatError(
                f"{self.path!r}: the checkpoint has no tensor {name!r} (expected shape {shape_text(spec)} from "
                "config.json)"
            )
        got = self.shape(name)
        if got != tuple(n for n, _ in spec):
            raise HFFormatError(
                f"{self.path!r}: tensor {name!r} in {self.where[name]} has shape {list(got)}, "
                f"expected {shape_text(spec)} from config.json"
            )
        return self.get(name)


def load_hf_params(path: str, config: ModelConfig) -> dict:
    """Our parameters as a nested dict of numpy arrays (param_dtype), read and checked from `path`."""
    tensors = _Tensors(path)
    params, needed = read_params(config, tensors)
    if config.tie_embeddings:
        needed.add("lm_head.weight")  # tied: transformers uses the embedding, so do we
    extra = sorted(n for n in tensors.names() - needed if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise HFFormatError(
            f"{path!r}: tensors {shown} have no place in this architecture (a feature not "
            "supported here, or a config.json that does not match the weights); refusing to "
            "drop weights silently"
        )
    return params


def load_hf(
    path: str,
    *,
    param_dtype: str = "float32",
    dtype: str | None = None,
    max_seq_len: int | None = None,
    load_tokenizer: bool = True,
):
    """Read a local Hugging Face checkpoint folder of a supported family (`ARCHITECTURES`): (model, tokenizer or
    None).

    param_dtype: the dtype weights are stored in here (default float32 whatever the file holds, so logits match
    transformers' float32 ones; "bfloat16" halves memory); dtype: compute dtype (default: param_dtype).
    max_seq_len: the context to allow (default: the checkpoint's max_position_embeddings).
    The tokenizer is read from tokenizer.json when the folder has one, else None. No network access.
    """
    path = os.fspath(path)
    hf = read_hf_config(path)
    config = model_config_from_hf(hf, param_dtype=param_dtype, dtype=dtype, max_seq_len=max_seq_len)
    model = model_from_params(config, load_hf_params(path, config))
    tokenizer = read_hf_tokenizer(path, hf) if load_tokenizer else None
    return model, tokenizer


def _special_ids(path: str, hf: dict) -> dict:
    """bos/eos/pad ids the checkpoint declares (generation_config.json over config.json); a list of EOS ids
    (Llama 3 instruct) gives its first."""
    ids = {k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = read_json(gen_path)
        ids.update({k: gen[k] for k in ids if gen.get(k) is not None})
    out = {}
    for k, v in ids.items():
        if isinstance(v, list):
            v = v[0] if v else None
        out[k.replace("_token", "")] = int(v) if isinstance(v, int) else None
    return out  # {"bos_id": ..., "eos_id": ..., "pad_id": ...}


def _eos_ids(path: str, hf: dict) -> list[int]:
    """Every EOS id the checkpoint declares: generation_config.json's eos_token_id (a list for Llama 3 instruct,
    which ends turns with <|eot_id|>) and config.json's."""
    out = []
    gen_path = os.path.join(path, "generation_config.json")
    sources = [hf]
    if os.path.isfile(gen_path):
        sources.insert(0, read_json(gen_path))
    for src in sources:
        v = src.get("eos_token_id")
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in out:
                out.append(i)
    return out


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_settings(path: str, hf: dict, inner) -> dict:
    """HFTokenizer keyword arguments from the folder's configs (besides the special ids): add_bos, stop_ids,
    chat_template, special_tokens. `inner`: the tokenizers.Tokenizer, to look tokens up."""

    tc_path = os.path.join(path, "tokenizer_config.json")
    tc: dict = {}
    if os.path.isfile(tc_path):
        tc = read_json(tc_path)
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    special = {k: _token_text(tc.get(k)) for k in names}
    special = {k: v for k, v in special.items() if v is not None}
    template = read_chat_template(path, tc)
    stops = _eos_ids(path, hf)
    eos_text = special.get("eos_token")
    if eos_text is not None and inner.token_to_id(eos_text) is not None:
        stops.append(inner.token_to_id(eos_text))
    if template is not None:
        eot = end_of_turn_id(inner, template, special)
        if eot is not None:
            stops.append(eot)
    add_bos = tc.get("add_bos_token")
    return {
        "add_bos": bool(add_bos) if isinstance(add_bos, bool) else None,
        "stop_ids": stops,
        "chat_template": template,
        "special_tokens": special or None,
    }


def read_hf_tokenizer(path: str, hf: dict | None = None):
    """The folder's tokenizer.json as the project's HFTokenizer, or None when the folder has no tokenizer.json.

    Special ids come from generation_config.json / config.json; BOS handling, the chat template and the stop
    ids (every EOS id, plus the template's end-of-turn token) from tokenizer_config.json, chat_template.jinja and
    generation_config.json.
    """
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer

    with open(file, encoding="utf-8") as f:
        text = f.read()
    hf = hf if hf is not None else read_hf_config(path)
    try:
        inner = Tokenizer.from_str(text)
    except Exception as e:
        raise TokenizerError(f"{file} is not a valid tokenizers tokenizer.json: {e}") from None
    return HFTokenizer(text, source=file, **_special_ids(path, hf), **read_tokenizer_settings(path, hf, inner))


def hf_tensors_from_model(model) -> dict:
    """{Hugging Face tensor name: numpy array} for a Decoder (weights in the model's param dtype)."""

    c = model.config
    hf_config_from_model(c)  # raises if the model cannot be expressed
    return tensors_from_params(c, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def save_hf(model, tokenizer, out_dir: str, *, architecture: str | None = None) -> str:
    """Write `model` (and the tokenizer's tokenizer.json, when it has one) as a Hugging Face checkpoint.

    architecture: a model type of `ARCHITECTURES` ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
    "smollm3") or its class name; default: the family whose features the model uses (`default_architecture`).
    Writes config.json, generation_config.json and model.safetensors; `transformers`' from_pretrained loads the
    folder. Returns out_dir.
    """
    from safetensors.numpy import save_file

    c = model.config
    ids = {k: getattr(tokenizer, k, None) for k in ("bos_id", "eos_id", "pad_id")} if tokenizer is not None else {}
    ids = {k: (int(v) if v is not None and 0 <= int(v) < c.vocab_size else None) for k, v in ids.items()}
    cfg = hf_config_from_model(c, architecture, **ids)
    tensors = hf_tensors_from_model(model)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors creates the file 0600: make it as readable as the other files here
    os.umask(umask)
    os.chmod(os.path.join(out_dir, WEIGHTS_NAME), 0o666 & ~umask)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    gen = {
        k: v
        for k, v in (
            ("bos_token_id", cfg["bos_token_id"]),
            ("eos_token_id", cfg["eos_token_id"]),
            ("pad_token_id", cfg["pad_token_id"]),
        )
        if v is not None
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        write_tokenizer_json(tokenizer, out_dir)
    return out_dir
