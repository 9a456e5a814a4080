"""Frozen configuration dataclasses and `key=value` overrides.

One `Config` object is passed whole; each section is a frozen dataclass that validates itself at
construction, so an invalid combination fails before any array is allocated. Derived sizes are properties.

Overrides come from the command line as `section.key=value` (`model.num_layers=4`, `train.steps=100`);
a bare `key=value` is looked up in the model section first, then in any section that has that key. Values are
converted to the field's type; an unknown key is an error listing the valid ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from typing import Any, Iterable, Optional

POSITIONS = ("rope", "none", "learned")
MASKS = ("causal", "none", "causal_after_softmax")
ATTENTION_IMPLS = ("xla", "dot_product_attention")
ATTENTION_TYPES = ("mha",)
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value or combination that cannot work."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and variant of the decoder.

    num_kv_heads == num_heads is MHA, 1 is MQA, anything in between (dividing num_heads) is GQA.
    """

    vocab_size: int = 259
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # None -> num_heads (MHA)
    head_dim: Optional[int] = None  # None -> d_model // num_heads
    mlp_dim: int = 704
    max_seq_len: int = 512
    position: str = "rope"  # "rope" | "none" | "learned"
    rope_theta: float = 10_000.0
    rope_fraction: float = 1.0  # share of each head's dims that are rotated
    attention_mask: str = "causal"  # "causal" | "none" | "causal_after_softmax" (the last two: research knobs)
    attention_impl: str = "xla"  # "xla" (einsum) | "dot_product_attention" (jax.nn.dot_product_attention)
    attention_type: str = "mha"  # "mha" covers MHA / GQA / MQA through num_kv_heads
    attn_output_gate: bool = False  # sigmoid gate on each head's attention output
    attn_sink: bool = False  # learnable per-head logit added to the softmax denominator
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-style)
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; softmax and loss are always float32
    remat: bool = False  # rematerialise each block in the backward pass
    scan_layers: bool = True  # scan over stacked layers (compile time flat in depth) or unroll

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"model.{name} must be a positive integer, got {v!r}")
        kv = self.num_kv_heads
        _check(kv is None or (isinstance(kv, int) and kv > 0),
               f"model.num_kv_heads must be a positive integer or None, got {kv!r}")
        _check(self.num_heads % self.kv_heads == 0,
               f"model.num_kv_heads={self.kv_heads} must divide num_heads={self.num_heads} "
               "(MHA: equal, MQA: 1, GQA: a divisor)")
        if self.head_dim is None:
            _check(self.d_model % self.num_heads == 0,
                   f"model.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                   "set head_dim explicitly")
        else:
            _check(isinstance(self.head_dim, int) and self.head_dim > 0,
                   f"model.head_dim must be a positive integer, got {self.head_dim!r}")
        _check(self.position in POSITIONS, f"model.position must be one of {POSITIONS}, got {self.position!r}")
        _check(self.attention_mask in MASKS, f"model.attention_mask must be one of {MASKS}, got {self.attention_mask!r}")
        _check(self.attention_impl in ATTENTION_IMPLS,
               f"model.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        _check(self.attention_type in ATTENTION_TYPES,
               f"model.attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}")
        _check(0.0 <= self.rope_fraction <= 1.0, f"model.rope_fraction must be in [0, 1], got {self.rope_fraction}")
        _check(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")
        if self.position == "rope":
            _check(self.rope_dim > 0 and self.rope_dim % 2 == 0,
                   f"model.rope_fraction={self.rope_fraction} of head_dim={self.head_size} rotates "
                   f"{self.head_size * self.rope_fraction:g} dims; it must be a positive even number")
            _check(abs(self.rope_dim - self.head_size * self.rope_fraction) < 1e-9,
                   f"model.rope_fraction={self.rope_fraction} of head_dim={self.head_size} is not a whole number of dims")
        if self.attention_impl == "dot_product_attention":
            _check(not self.attn_sink, "model.attn_sink needs attention_impl='xla' "
                   "(jax.nn.dot_product_attention has no sink logit)")
            _check(self.attention_mask != "causal_after_softmax",
                   "attention_mask='causal_after_softmax' needs attention_impl='xla'")
        _check(self.norm_eps > 0, f"model.norm_eps must be positive, got {self.norm_eps}")
        _check(self.param_dtype in DTYPES, f"model.param_dtype must be one of {DTYPES}, got {self.param_dtype!r}")
        _check(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_size(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads sharing one K/V head."""
        return self.num_heads // self.kv_heads

    @property
    def rope_dim(self) -> int:
        """Dims of each head that RoPE rotates (0 without RoPE)."""
        if self.position != "rope":
            return 0
        return int(round(self.head_size * self.rope_fraction))

    @property
    def is_causal(self) -> bool:
        return self.attention_mask == "causal"

    def kv_bytes_per_token(self, bytes_per_element: Optional[int] = None) -> int:
        """Bytes of K and V cached per token, all layers together."""
        if bytes_per_element is None:
            bytes_per_element = _DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * self.kv_heads * self.head_size * bytes_per_element


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    corpus: str = "builtin"  # "builtin" | local path or glob (txt/jsonl/parquet) | "hf:NAME[:CONFIG]"
    tokenizer: str = "byte"  # "byte" | "char" | path to a tokenizer.json
    text_field: str = "text"
    val_fraction: float = 0.05
    max_documents: int = 0  # 0 = all

    def __post_init__(self):
        _check(0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        _check(self.max_documents >= 0, f"data.max_documents must be >= 0, got {self.max_documents}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    microbatches: int = 1
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0
    sample_tokens: int = 48
    sample_prompt: str = "The "

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "microbatches", "eval_every", "log_every",
                     "checkpoint_every", "keep_checkpoints", "eval_batches"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"train.{name} must be a positive integer, got {v!r}")
        _check(self.batch_size % self.microbatches == 0,
               f"train.batch_size={self.batch_size} must be divisible by train.microbatches={self.microbatches}")
        _check(self.learning_rate > 0, f"train.learning_rate must be positive, got {self.learning_rate}")
        _check(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: the rest of the devices
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        _check(self.train.seq_len <= self.model.max_seq_len,
               f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")


# ---- overrides ---------------------------------------------------------------------------------------------

def _sections(config: Any) -> dict[str, Any]:
    if isinstance(config, Config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {"": config}


def valid_keys(config: Any) -> list[str]:
    keys = []
    for sec, obj in _sections(config).items():
        for f in dataclasses.fields(obj):
            keys.append(f"{sec}.{f.name}" if sec else f.name)
    return keys


def _convert(text: str, annotation: Any, key: str) -> Any:
    hints = annotation
    if isinstance(hints, str):
        hints = eval(hints, {"Optional": Optional, "typing": typing}, {})  # annotations are postponed strings
    origin = typing.get_origin(hints)
    args = typing.get_args(hints)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if text.lower() in ("none", "null", ""):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _convert(text, inner, key)
    try:
        if hints is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if hints is int:
            return int(text.replace("_", ""))
        if hints is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"cannot convert {key}={text!r} to {getattr(hints, '__name__', hints)}") from None
    return text


def apply_overrides(config: Any, overrides: Iterable[str]) -> Any:
    """Return a copy of `config` with `key=value` strings applied (validated by the dataclasses)."""
    secs = _sections(config)
    changes: dict[str, dict[str, Any]] = {s: {} for s in secs}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if "." in key and isinstance(config, Config):
            sec, name = key.split(".", 1)
            candidates = [sec] if sec in secs and name in {f.name for f in dataclasses.fields(secs[sec])} else []
        else:
            sec, name = "", key
            order = sorted(secs, key=lambda s: s != "model")
            candidates = [s for s in order if name in {f.name for f in dataclasses.fields(secs[s])}][:1]
        if not candidates:
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys(config))}")
        sec = candidates[0]
        field = {f.name: f for f in dataclasses.fields(secs[sec])}[name]
        changes[sec][name] = _convert(text.strip(), field.type, key)
    new = {s: dataclasses.replace(obj, **changes[s]) if changes[s] else obj for s, obj in secs.items()}
    if isinstance(config, Config):
        return Config(**new)
    return new[""]


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    """Load `get_config()` from a preset file (default: configs/small.py's shape) and apply overrides."""
    if path is None:
        config = Config()
    else:
        if not os.path.exists(path):
            here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
            alt = os.path.join(here, path if path.endswith(".py") else path + ".py")
            if os.path.exists(alt):
                path = alt
            else:
                raise ConfigError(f"config file {path!r} not found")
        spec = importlib.util.spec_from_file_location("_causal_lm_preset", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"config file {path!r} has no get_config()")
        config = module.get_config()
        if isinstance(config, ModelConfig):
            config = Config(model=config)
        if not isinstance(config, Config):
            raise ConfigError(f"{path}: get_config() must return causal_lm.Config or ModelConfig, got {type(config)}")
    return apply_overrides(config, overrides)
