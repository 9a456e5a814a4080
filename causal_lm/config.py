"""Frozen configuration dataclasses and `key=value` overrides.

One `Config` object is passed whole; each section is a frozen dataclass that validates itself at
construction, so an invalid combination fails before any array is allocated. Derived sizes are properties.

Overrides come from the command line as `section.key=value` (`model.num_layers=4`, `train.steps=100`), a model
sub-structure's keys by their path (`model.rope_scaling.factor=8`, `model.mla.kv_lora_rank=64`); a bare
`key=value` is looked up in the model section first, then in any section that has that key. The model's old flat
names (`model.rope_factor=8`) still work, mapped to their new path. Values are converted to the field's type; an
unknown key is an error listing the valid ones.

What each attention backend can compute is one table, ATTENTION_BACKENDS, read by the validation here and by the
backend choice at run time (causal_lm/model/backends.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import typing
from collections.abc import Iterable
from typing import Any, Optional

POSITIONS = ("rope", "none", "learned")
MASKS = ("causal", "none", "causal_after_softmax")
REMATS = ("none", "minimal", "full")
ATTENTION_TYPES = ("mha", "mla")
LAYER_KINDS = ("global", "local")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_KINDS = ("rope", "nope")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
WEIGHTS = ("float32", "int8", "int4")  # model.weights (model/quant.py)
DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "muon", "lion", "adafactor")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # train.lora_targets (causal_lm/train/lora.py)
TASKS = ("lm", "sft", "dpo", "grpo")  # train.task: what the loss trains on (causal_lm/train/post.py)
OPT_STATE_DTYPES = ("auto", "float32", "bfloat16")


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


class ConfigError(ValueError):
    """A configuration value or combination that cannot work."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`model.rope_scaling.*`), computed as transformers computes it (modeling_rope_utils).

    "default": plain RoPE; "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) divides the low
    frequencies by `factor` and blends the middle band between `low_freq_factor` and `high_freq_factor` of the
    `original_max_len` context; "yarn" (Qwen, DeepSeek) ramps between interpolated and original frequencies from
    `beta_fast` to `beta_slow` rotations and multiplies cos and sin by `attention_factor`. Every other field belongs
    to the types named in `APPLIES`; setting one for another type is an error (it would silently do nothing).
    """

    type: str = "default"  # "default" | "linear" | "llama3" | "yarn"
    factor: float = 1.0  # linear / llama3 / yarn: the context extension factor
    original_max_len: int = 0  # llama3 / yarn: the pretraining context (original_max_position_embeddings)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None -> 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: round the correction range to whole dims

    APPLIES: typing.ClassVar[dict] = {
        "factor": ("linear", "llama3", "yarn"),
        "original_max_len": ("llama3", "yarn"),
        "low_freq_factor": ("llama3",),
        "high_freq_factor": ("llama3",),
        "beta_fast": ("yarn",),
        "beta_slow": ("yarn",),
        "attention_factor": ("yarn",),
        "truncate": ("yarn",),
    }

    def __post_init__(self):
        t = self.type
        _check(
            t != "dynamic",
            "model.rope_scaling.type='dynamic' (dynamic NTK) is not implemented: transformers recomputes its "
            "frequencies from the length of each call, so one model's RoPE would depend on how it is called",
        )
        _check(t in ROPE_TYPES, f"model.rope_scaling.type must be one of {ROPE_TYPES}, got {t!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, types in self.APPLIES.items():
            _check(
                getattr(self, name) == defaults[name] or t in types,
                f"model.rope_scaling.{name} only applies to rope_scaling.type {' / '.join(map(repr, types))} "
                f"(this model uses {t!r})",
            )
        if t != "default":
            _check(self.factor > 0, f"model.rope_scaling.factor must be positive, got {self.factor}")
        if t == "yarn":  # transformers only warns; below 1 the attention factor 0.1 ln(s) + 1 drops under 1
            _check(
                self.factor >= 1,
                f"rope_scaling.type='yarn' needs model.rope_scaling.factor >= 1 (the context extension factor), "
                f"got {self.factor}",
            )
        if t in ("llama3", "yarn"):
            m = self.original_max_len
            _check(
                isinstance(m, int) and m > 0,
                f"rope_scaling.type={t!r} needs model.rope_scaling.original_max_len, the pretraining context "
                f"(a positive integer), got {m!r}",
            )
        if t == "llama3":
            _check(
                self.high_freq_factor > self.low_freq_factor > 0,
                "rope_scaling.type='llama3' needs 0 < model.rope_scaling.low_freq_factor < "
                f"model.rope_scaling.high_freq_factor, got {self.low_freq_factor} and {self.high_freq_factor}",
            )
        a = self.attention_factor
        _check(a is None or a > 0, f"model.rope_scaling.attention_factor must be positive or None, got {a}")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (`model.mla.*`, DeepSeek-V2), used when model.attention_type="mla".

    K/V come from a kv_lora_rank latent; RoPE acts only on a separate qk_rope_head_dim part (one rope key shared
    by all heads). The cache holds latent + rope key per token. Sizes left at None are derived by ModelConfig."""

    kv_lora_rank: int | None = None  # required for "mla"
    q_lora_rank: int | None = None  # None: queries projected directly from the model dim
    qk_nope_head_dim: int | None = None  # None -> head_dim
    qk_rope_head_dim: int | None = None  # None -> head_dim // 2 with RoPE, 0 without
    v_head_dim: int | None = None  # None -> head_dim
    absorb: bool = False  # decode path over a cache: False expands the latent to K/V, True attends over it

    def __post_init__(self):
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            _check(
                v is None or (isinstance(v, int) and v > 0),
                f"model.mla.{name} must be a positive integer or None, got {v!r}",
            )
        r = self.qk_rope_head_dim
        _check(r is None or (isinstance(r, int) and r >= 0), f"model.mla.qk_rope_head_dim must be >= 0, got {r!r}")


# The model's sub-structures, by field name, and the flat keys they replaced (still accepted everywhere a key is:
# ModelConfig(...), .replace(...), key=value overrides, and config.json files written before the change).
SUBSECTIONS = {"rope_scaling": RopeScaling, "mla": MLAConfig}
LEGACY_MODEL_KEYS = {
    "rope_type": "rope_scaling.type",
    "rope_factor": "rope_scaling.factor",
    "rope_original_max_len": "rope_scaling.original_max_len",
    "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_beta_fast": "rope_scaling.beta_fast",
    "rope_beta_slow": "rope_scaling.beta_slow",
    "rope_attention_factor": "rope_scaling.attention_factor",
    "rope_truncate": "rope_scaling.truncate",
    "kv_lora_rank": "mla.kv_lora_rank",
    "q_lora_rank": "mla.q_lora_rank",
    "qk_nope_head_dim": "mla.qk_nope_head_dim",
    "qk_rope_head_dim": "mla.qk_rope_head_dim",
    "v_head_dim": "mla.v_head_dim",
    "mla_absorb": "mla.absorb",
}


def _subsection(name: str, value: Any):
    """A sub-structure from its object or its dict (config.json), unknown keys an error naming the valid ones."""
    cls = SUBSECTIONS[name]
    if isinstance(value, cls):
        return value
    _check(isinstance(value, dict), f"model.{name} must be a {cls.__name__} or a dict, got {value!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    bad = sorted(set(value) - set(names))
    _check(
        not bad,
        f"unknown config key(s) {', '.join(f'model.{name}.{k}' for k in bad)}; valid keys: "
        f"{', '.join(f'model.{name}.{k}' for k in names)}",
    )
    return cls(**value)


def nest_model_keys(values: dict) -> dict:
    """ModelConfig keyword arguments with the flat legacy names (`rope_factor`) and dotted paths
    (`rope_scaling.factor`) folded into their sub-structures, on top of any sub-structure also given."""
    out, subs = {}, {}
    for key, v in values.items():
        path = LEGACY_MODEL_KEYS.get(key, key)
        if "." in path:
            sub, field = path.split(".", 1)
            _check(sub in SUBSECTIONS, f"unknown config key 'model.{key}'; model sections: {sorted(SUBSECTIONS)}")
            subs.setdefault(sub, {})[field] = v
        else:
            out[key] = _subsection(key, v) if key in SUBSECTIONS else v
    for sub, fields in subs.items():
        base = _subsection(sub, out.get(sub, {}))
        out[sub] = _subsection(sub, {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **fields})
    return out


# ---- attention backends: what each one computes -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one `model.attention_impl` can compute: read by config validation (a named backend is refused for a
    model it cannot run) and by the backend choice at run time (causal_lm/model/backends.py: `auto` skips it)."""

    label: str  # how messages name it
    masks: tuple  # the attention_mask values it takes
    mla: bool  # runs MLA's own kernels
    sink: bool  # per-head sink logits
    softcap: bool  # score softcapping
    fused: bool = False  # takes the mask as structure and serves a call's own tokens only (backends.py)
    platforms: tuple = ("cpu", "gpu", "tpu")  # where JAX can run it
    platform_note: str = ""  # the message's words for where it runs, when run elsewhere
    compute_dtypes: tuple = DTYPES
    head_dim_multiple: int = 1
    max_head_dim: int = 0  # 0: any
    multi_device: bool = True  # runs where the process sees several devices (partitioned over a mesh)


ATTENTION_BACKENDS = {
    "xla": Backend("the XLA kernels", MASKS, mla=True, sink=True, softcap=True),
    "dot_product_attention": Backend(
        "jax.nn.dot_product_attention", ("causal", "none"), mla=False, sink=False, softcap=False
    ),
    "cudnn": Backend(
        "cuDNN's fused attention",
        ("causal",),
        mla=False,
        sink=False,
        softcap=False,
        fused=True,
        platforms=("gpu",),
        platform_note="needs an NVIDIA GPU",
        compute_dtypes=("bfloat16", "float16"),
        head_dim_multiple=8,
        max_head_dim=128,
    ),
    # On a CPU splash runs in Pallas interpret mode (exact, slow): what the tests run.
    "splash": Backend(
        "Pallas splash attention",
        ("causal",),
        mla=False,
        sink=True,
        softcap=True,
        fused=True,
        platforms=("cpu", "tpu"),
        platform_note="is a TPU kernel (on a CPU it runs in interpret mode, for tests)",
        multi_device=False,
    ),
}
ATTENTION_IMPLS = ("auto", *ATTENTION_BACKENDS)


def _backend_gap(m: ModelConfig, backend: str):
    """(the model setting, why `backend` cannot compute it, the Backend field that says which can) or None."""
    b = ATTENTION_BACKENDS[backend]
    if m.attention_type == "mla" and not b.mla:
        return "attention_type='mla'", f"{b.label} has no MLA kernels; MLA keeps its own", lambda x: x.mla
    if m.attention_mask not in b.masks:
        return (
            f"attention_mask={m.attention_mask!r}",
            f"{b.label} takes only {' / '.join(map(repr, b.masks))}",
            lambda x: m.attention_mask in x.masks,
        )
    if m.attn_sink and not b.sink:
        return "model.attn_sink", f"{b.label} has no sink logit", lambda x: x.sink
    if m.attn_softcap and not b.softcap:
        return "model.attn_softcap", f"{b.label} has no score softcapping", lambda x: x.softcap
    return None


def backend_unsupported(m: ModelConfig, backend: str) -> str | None:
    """Why `backend` cannot compute this model's attention (a model setting, from ATTENTION_BACKENDS), or None."""
    gap = _backend_gap(m, backend)
    return None if gap is None else f"{gap[0]} ({gap[1]})"


fused_backend_unsupported = backend_unsupported  # the name backends.py and older scripts import


def check_backend(m: ModelConfig) -> None:
    """A named attention_impl that cannot compute this model is refused, naming the ones that can ("auto" always
    can: it falls back to the XLA kernels)."""
    if m.attention_impl == "auto":
        return
    gap = _backend_gap(m, m.attention_impl)
    if gap is None:
        return
    setting, why, supports = gap
    able = [repr(n) for n in ("xla", "auto", *ATTENTION_BACKENDS) if n == "auto" or supports(ATTENTION_BACKENDS[n])]
    able = list(dict.fromkeys(able))
    raise ConfigError(
        f"model.attention_impl={m.attention_impl!r} cannot run {setting} ({why}); {setting} needs attention_impl="
        + ", ".join(able[:-1])
        + " or "
        + able[-1]
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and variant of the decoder.

    num_kv_heads == num_heads is MHA, 1 is MQA, anything in between (dividing num_heads) is GQA.

    Settings that belong to one variant live in a sub-structure of their own: `rope_scaling` (RopeScaling: its type
    and that type's parameters) and `mla` (MLAConfig). Their old flat names (rope_factor, kv_lora_rank, ...; see
    LEGACY_MODEL_KEYS) are still accepted as keyword arguments, overrides and config.json keys, and still read.

    Sizes left at None are derived at construction (num_kv_heads, head_dim, and MLA's mla.qk_nope_head_dim,
    mla.qk_rope_head_dim, mla.v_head_dim), so code reads one name per size. `config.replace(**changes)` derives
    them again from the changed fields; `dataclasses.replace` would carry the old derived values over. Serialised
    configs (`config_to_dict`) keep a derived size as None, so it is derived again when loaded.
    """

    vocab_size: int = 259
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None  # None -> num_heads (MHA)
    head_dim: int | None = None  # None -> d_model // num_heads
    mlp_dim: int = 704
    max_seq_len: int = 512
    position: str = "rope"  # "rope" | "none" | "learned"
    rope_theta: float = 10_000.0
    rope_fraction: float = 1.0  # share of each head's dims that are rotated
    attention_mask: str = "causal"  # "causal" | "none" | "causal_after_softmax" (the last two: research knobs)
    # "auto": splash on TPU, cudnn on a GPU (bf16/fp16), else "xla" (einsum kernels) | "dot_product_attention"
    # (jax.nn.dot_product_attention, XLA's choice) | "cudnn" (NVIDIA GPUs) | "splash" (Pallas TPU kernel). The
    # fused ones (cudnn, splash) run attention over a call's own tokens; a cache's prefill and decode keep the
    # XLA kernels. See causal_lm/model/backends.py.
    attention_impl: str = "auto"
    attention_type: str = "mha"  # "mha" covers MHA / GQA / MQA through num_kv_heads; "mla": latent attention
    # MLA (DeepSeek-V2) settings, used when attention_type="mla" (see MLAConfig); left at their defaults otherwise.
    mla: MLAConfig = dataclasses.field(default_factory=lambda: MLAConfig())
    # Sliding window: a "local" layer's query at position p sees keys at positions p - sliding_window + 1 .. p.
    sliding_window: int = 0  # 0 = no window
    layer_pattern: str = ""  # comma-separated "local"/"global", cycled over layers; "" = all local if windowed
    # RoPE frequency scaling (linear, llama3, yarn) and its type's own settings, see RopeScaling.
    rope_scaling: RopeScaling = dataclasses.field(default_factory=lambda: RopeScaling())
    rope_local_theta: float | None = None  # local (sliding-window) layers' own plain-RoPE theta (Gemma 3)
    rope_pattern: str = ""  # comma-separated "rope"/"nope", cycled over layers: NoPE layers in a RoPE model
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    norm_scale_plus_one: bool = False  # every RMSNorm multiplies by (1 + w), w initialised to 0 (Gemma)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add (Gemma 2/3)
    scale_embeddings: bool = False  # embeddings times sqrt(d_model), cast to the compute dtype first (Gemma)
    mlp_activation: str = "silu"  # gated MLP: "silu" (SwiGLU) | "gelu_tanh" (GeGLU, tanh-approximate GELU)
    attn_scale: float | None = None  # score multiplier; None -> head_dim ** -0.5 (Gemma: query_pre_attn_scalar**-0.5)
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the mask (Gemma 2); 0 = off
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (Gemma 2); 0 = off
    attn_output_gate: bool = False  # sigmoid gate on each head's attention output
    attn_sink: bool = False  # learnable per-head logit added to the softmax denominator
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-style)
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; softmax and loss are always float32
    # Weight-only quantization (causal_lm.quantize, model/quant.py): "float32" = the float parameters (param_dtype),
    # "int8" (per output channel, or groups of weights_group_size inputs), "int4" (groups of weights_group_size
    # inputs, symmetric or with per-group minimums). Set by quantize(); a checkpoint's config rebuilds the structure.
    weights: str = "float32"
    weights_group_size: int = 0  # 0: one group spanning the input (int8 per output channel)
    weights_minimums: bool = False
    weights_embed: str = ""  # the embedding table / output head's format when not `weights` ("int8"); "": as weights
    # What the backward pass recomputes: "none" (keep every matmul output), "minimal" (keep only the named
    # projection outputs q/k/v/o and the MLP's, recompute the rest), "full" (keep each block's input only).
    # Old configs' true/false mean full/none.
    remat: str = "none"
    scan_layers: bool = True  # scan over stacked layers (compile time flat in depth) or unroll
    # Which of the derivable sizes were left at None (filled in by __post_init__); not a config key.
    _derived: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        r = self.remat
        if isinstance(r, bool) or str(r).lower() in _BOOL_WORDS:  # the old bool field (config.json, key=value)
            object.__setattr__(self, "remat", "full" if _BOOL_WORDS.get(str(r).lower(), r) is True else "none")
        _check(self.remat in REMATS, f"model.remat must be one of {REMATS} (or true/false), got {self.remat!r}")
        for name in ("layer_pattern", "rope_pattern"):  # accept ("local", "global") as well as "local,global"
            if isinstance(getattr(self, name), (tuple, list)):
                object.__setattr__(self, name, ",".join(getattr(self, name)))
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_seq_len"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"model.{name} must be a positive integer, got {v!r}")
        kv = self.num_kv_heads
        _check(
            kv is None or (isinstance(kv, int) and kv > 0),
            f"model.num_kv_heads must be a positive integer or None, got {kv!r}",
        )
        if self.head_dim is None:
            _check(
                self.d_model % self.num_heads == 0,
                f"model.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; set head_dim explicitly",
            )
        else:
            _check(
                isinstance(self.head_dim, int) and self.head_dim > 0,
                f"model.head_dim must be a positive integer, got {self.head_dim!r}",
            )
        self._derive_sizes()
        _check(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
            "(MHA: equal, MQA: 1, GQA: a divisor)",
        )
        _check(self.position in POSITIONS, f"model.position must be one of {POSITIONS}, got {self.position!r}")
        _check(
            self.attention_mask in MASKS, f"model.attention_mask must be one of {MASKS}, got {self.attention_mask!r}"
        )
        _check(
            self.attention_impl in ATTENTION_IMPLS,
            f"model.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}",
        )
        _check(
            self.attention_type in ATTENTION_TYPES,
            f"model.attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}",
        )
        _check(0.0 <= self.rope_fraction <= 1.0, f"model.rope_fraction must be in [0, 1], got {self.rope_fraction}")
        _check(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")
        self._check_mla()
        self._check_window()
        self._check_rope_variants()
        self._check_block_variants()
        if self.position == "rope" and self.attention_type != "mla":
            _check(
                self.rope_dim > 0 and self.rope_dim % 2 == 0,
                f"model.rope_fraction={self.rope_fraction} of head_dim={self.head_dim} rotates "
                f"{self.head_dim * self.rope_fraction:g} dims; it must be a positive even number",
            )
            _check(
                abs(self.rope_dim - self.head_dim * self.rope_fraction) < 1e-9,
                f"model.rope_fraction={self.rope_fraction} of head_dim={self.head_dim} is not a whole number of dims",
            )
        check_backend(self)
        _check(self.norm_eps > 0, f"model.norm_eps must be positive, got {self.norm_eps}")
        _check(self.param_dtype in DTYPES, f"model.param_dtype must be one of {DTYPES}, got {self.param_dtype!r}")
        _check(self.dtype in DTYPES, f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.weights in WEIGHTS, f"model.weights must be one of {WEIGHTS}, got {self.weights!r}")
        _check(
            isinstance(self.weights_group_size, int) and self.weights_group_size >= 0,
            f"model.weights_group_size must be a non-negative integer, got {self.weights_group_size!r}",
        )
        _check(
            self.weights_embed in ("",) + WEIGHTS[1:] and (not self.weights_embed or self.weights != "float32"),
            f"model.weights_embed must be '' (as model.weights) or one of {WEIGHTS[1:]} with quantized weights, "
            f"got {self.weights_embed!r}",
        )

    def _derive_sizes(self):
        """Fill in the sizes left at None (recording which, see the class docstring)."""
        derived = []

        def fill(name, value):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
                derived.append(name)

        fill("num_kv_heads", self.num_heads)
        fill("head_dim", self.d_model // self.num_heads)
        if self.attention_type == "mla":
            mla = {
                "qk_nope_head_dim": self.head_dim,
                "qk_rope_head_dim": self.head_dim // 2 if self.position == "rope" else 0,
                "v_head_dim": self.head_dim,
            }
            fills = {k: v for k, v in mla.items() if getattr(self.mla, k) is None}
            derived += [f"mla.{k}" for k in fills]
            object.__setattr__(self, "mla", dataclasses.replace(self.mla, **fills))
        object.__setattr__(self, "_derived", tuple(derived))

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes` applied, deriving again every size that was derived here and is not changed.

        A change may name a sub-structure's field by its path (`**{"mla.kv_lora_rank": 64}`) or by its old flat
        name (`kv_lora_rank=64`): it is applied on top of the sub-structure, whose other fields are kept."""
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in self._derived:
            if "." in name:
                sub, field = name.split(".", 1)
                kept[sub] = dataclasses.replace(kept[sub], **{field: None})
            else:
                kept[name] = None
        return ModelConfig(**nest_model_keys({**kept, **changes}))

    def to_dict(self) -> dict:
        """Every config key and its value, with derived sizes as None (they are derived again when loaded); the
        sub-structures (rope_scaling, mla) as dicts of their own."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for sub in SUBSECTIONS:
            out[sub] = dataclasses.asdict(out[sub])
        for name in self._derived:
            if "." in name:
                sub, field = name.split(".", 1)
                out[sub][field] = None
            else:
                out[name] = None
        return out

    def __getattr__(self, name):
        """The old flat names of the sub-structures' fields still read (`config.kv_lora_rank`)."""
        path = LEGACY_MODEL_KEYS.get(name)
        if path is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        sub, field = path.split(".", 1)
        return getattr(getattr(self, sub), field)

    def _check_mla(self):
        m = self.mla
        # (for other attention types nothing is derived, so a value here was set by the user)
        if self.attention_type != "mla":
            set_ = [f"model.mla.{f.name}" for f in dataclasses.fields(m) if getattr(m, f.name) != f.default]
            _check(
                not set_,
                f"{', '.join(set_)} only apply to attention_type='mla' (this model uses {self.attention_type!r})",
            )
            return
        r = m.kv_lora_rank
        _check(
            isinstance(r, int) and r > 0,
            f"attention_type='mla' needs model.mla.kv_lora_rank, a positive integer (the cached latent size), "
            f"got {r!r}",
        )
        rr = m.qk_rope_head_dim
        if self.position == "rope":
            _check(rr > 0, f"model.mla.qk_rope_head_dim must be positive with RoPE, got {rr!r}")
            _check(
                self.rope_dim % 2 == 0,
                f"MLA's rope part must be a positive even number of dims, got {self.rope_dim} "
                "(set model.mla.qk_rope_head_dim)",
            )
        else:
            _check(
                rr == 0,
                f"model.mla.qk_rope_head_dim={rr} needs position='rope' (this model uses {self.position!r})",
            )
        _check(
            self.num_kv_heads == self.num_heads,
            "MLA has no separate KV heads (every head expands its own K/V from the shared latent); "
            "leave model.num_kv_heads unset",
        )
        _check(
            self.rope_fraction == 1.0,
            "MLA rotates exactly its mla.qk_rope_head_dim dims; leave model.rope_fraction at 1.0",
        )
        _check(not self.qkv_bias, "model.qkv_bias is not supported with attention_type='mla'")

    def _check_window(self):
        w = self.sliding_window
        _check(isinstance(w, int) and w >= 0, f"model.sliding_window must be an integer >= 0 (0 = off), got {w!r}")
        kinds = self.layer_kinds
        bad = [k for k in kinds if k not in LAYER_KINDS]
        _check(
            not bad,
            f"model.layer_pattern entries must be in {LAYER_KINDS}, got {bad} "
            "(write it as e.g. layer_pattern=local,local,global)",
        )
        if "local" in kinds:
            _check(w > 0, "model.layer_pattern has local layers but model.sliding_window is 0")
        if w > 0:
            _check(
                not kinds or "local" in kinds,
                f"model.sliding_window={w} but model.layer_pattern={self.layer_pattern!r} has no local layer",
            )
            _check(self.attention_mask == "causal", "model.sliding_window needs attention_mask='causal'")

    def _check_rope_variants(self):
        """RoPE settings against the rest of the model (RopeScaling checks its own fields)."""
        t = self.rope_scaling.type
        per_layer = {"rope_local_theta": None, "rope_pattern": ""}
        if self.position != "rope":
            _check(
                t == "default",
                f"model.rope_scaling.type={t!r} needs position='rope' (this model uses {self.position!r})",
            )
            for name, off in per_layer.items():
                _check(
                    getattr(self, name) == off,
                    f"model.{name}={getattr(self, name)!r} needs position='rope' (this model uses {self.position!r})",
                )
            return
        if self.attention_type == "mla":
            _check(t == "default", "model.rope_scaling is not supported with attention_type='mla'")
            for name, off in per_layer.items():
                _check(getattr(self, name) == off, f"model.{name} is not supported with attention_type='mla'")
        lt = self.rope_local_theta
        if lt is not None:
            _check(lt > 0, f"model.rope_local_theta must be positive or None, got {lt}")
            _check(
                any(self.layer_windows),
                "model.rope_local_theta is the RoPE theta of local (sliding-window) layers, but this model has none "
                "(set sliding_window and layer_pattern)",
            )
        kinds = self.rope_kinds
        bad = [k for k in kinds if k not in ROPE_KINDS]
        _check(
            not bad,
            f"model.rope_pattern entries must be in {ROPE_KINDS}, got {bad} (write it as e.g. rope_pattern=rope,nope)",
        )
        _check(
            not kinds or "rope" in kinds,
            "model.rope_pattern has no 'rope' layer; for a model without RoPE use position='none'",
        )

    def _check_block_variants(self):
        _check(
            self.mlp_activation in MLP_ACTIVATIONS,
            f"model.mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}",
        )
        s = self.attn_scale
        _check(s is None or s > 0, f"model.attn_scale must be positive or None, got {s!r}")
        for name in ("attn_softcap", "final_softcap"):
            v = getattr(self, name)
            _check(v >= 0, f"model.{name} must be >= 0 (0 = off), got {v}")
        if self.attention_type == "mla":
            for name in ("qk_norm", "attn_scale", "attn_softcap", "norm_scale_plus_one"):
                _check(
                    not getattr(self, name),
                    f"model.{name} is not supported with attention_type='mla' (MLA has its own norms and scale)",
                )

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        """Dims of each head that RoPE rotates (0 without RoPE). MLA: its decoupled rope part."""
        if self.position != "rope":
            return 0
        if self.attention_type == "mla":
            return self.mla.qk_rope_head_dim
        return int(round(self.head_dim * self.rope_fraction))

    @property
    def layer_kinds(self) -> tuple:
        """The parsed layer_pattern, e.g. ("local", "local", "global") (empty when unset)."""
        return tuple(k.strip() for k in self.layer_pattern.split(",") if k.strip())

    @property
    def layer_windows(self) -> tuple:
        """Per layer: its sliding window (0 = a global layer that sees every earlier key)."""
        if self.sliding_window == 0:
            return (0,) * self.num_layers
        kinds = self.layer_kinds or ("local",)
        return tuple(self.sliding_window if kinds[i % len(kinds)] == "local" else 0 for i in range(self.num_layers))

    @property
    def rope_kinds(self) -> tuple:
        """The parsed rope_pattern, e.g. ("rope", "rope", "rope", "nope") (empty when unset)."""
        return tuple(k.strip() for k in self.rope_pattern.split(",") if k.strip())

    @property
    def layer_ropes(self) -> tuple:
        """Per layer, the rotary embedding it applies (empty without RoPE):
        "rope" (rope_theta, scaled by rope_scaling), "local" (rope_local_theta, plain: the local layers when it is
        set) or "nope" (none: the NoPE layers of rope_pattern)."""
        if self.position != "rope":
            return ()
        kinds = self.rope_kinds or ("rope",)
        out = []
        for i, w in enumerate(self.layer_windows):
            if kinds[i % len(kinds)] == "nope":
                out.append("nope")
            else:
                out.append("local" if w and self.rope_local_theta is not None else "rope")
        return tuple(out)

    @property
    def score_scale(self) -> float:
        """The multiplier of q.k before the softmax (MHA / GQA / MQA)."""
        return self.head_dim**-0.5 if self.attn_scale is None else float(self.attn_scale)

    @property
    def attention_label(self) -> str:
        """ "MHA", "GQA-4" (4 KV heads), "MQA" or "MLA"."""
        if self.attention_type == "mla":
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA-{self.num_kv_heads}"

    def kv_layer_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """Bytes one token occupies in one layer's cache: K and V at the KV-head count, or MLA's latent + rope key."""
        if bytes_per_element is None:
            bytes_per_element = _DTYPE_BYTES[self.dtype]
        if self.attention_type == "mla":
            return (self.mla.kv_lora_rank + self.rope_dim) * bytes_per_element
        return self.num_kv_heads * 2 * self.head_dim * bytes_per_element

    def kv_bytes_per_token(self, bytes_per_element: int | None = None) -> int:
        """Bytes cached per token, all layers together (what `init_cache` allocates per token and row)."""
        return self.num_layers * self.kv_layer_bytes_per_token(bytes_per_element)


_dataclass_init = ModelConfig.__init__


@functools.wraps(_dataclass_init)
def _model_config_init(self, *args, **kwargs):
    # Old flat names (rope_factor=8, kv_lora_rank=32) and dicts of a sub-structure (config.json) are accepted.
    _dataclass_init(self, *args, **nest_model_keys(kwargs))


ModelConfig.__init__ = _model_config_init


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    corpus: str = "builtin"  # "builtin" | local path or glob (txt/jsonl/parquet) | "hf:NAME[:CONFIG]"
    tokenizer: str = "byte"  # "byte" | "char" | path to a tokenizer.json
    text_field: str = "text"
    val_fraction: float = 0.05
    max_documents: int = 0  # 0 = all
    streaming: bool = False  # stream local files instead of loading them (hub datasets always stream)

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
    sample_tokens: int = 48  # tokens sampled through the KV cache at each eval (0 = no sample)
    sample_prompt: str = "The "
    sample_temperature: float = 0.8
    compute_dtype: str = "auto"  # "auto": bfloat16 on GPU/TPU, model.dtype on CPU; or a dtype overriding model.dtype
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = known accelerator table, else a measured matmul
    progress: bool = True  # tqdm progress bar on an interactive terminal (log lines otherwise)
    # ---- post-training (causal_lm/train/post.py, docs/post-training.md) ------------------------------------------
    # "lm": next-token training on every token; "sft": chat conversations (JSONL `messages`, or the built-in
    # "synthetic-chat" set), loss on the assistant's tokens only.
    task: str = "lm"
    # LoRA (causal_lm/train/lora.py): lora_rank > 0 trains low-rank adapters W + (lora_alpha / lora_rank) * A @ B on
    # the weights lora_targets names (q, k, v, o, gate, up, down), the base frozen; 0 = full training.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "q,k,v,o,gate,up,down"
    # DPO (train.task=dpo, causal_lm/train/dpo.py): data.corpus = JSONL {prompt, chosen, rejected}; beta.
    beta: float = 0.1
    # GRPO (train.task=grpo, causal_lm/train/grpo.py): per step prompts_per_step prompts x group_size samples of up
    # to max_new_tokens through the engine at rollout_temperature/top_k/top_p, rewarded by `reward`
    # (module:function), clipped ratio clip_eps, k3 KL to the reference weighted kl_coef (0 = off); inner_steps
    # clipped updates per rollout batch (GRPO's inner epochs: the optimizer, and so its learning-rate schedule, counts
    # inner_steps updates per step). max_operand: the arithmetic operands are below it, in GRPO's questions and in
    # data.corpus=synthetic-chat (sft, and grpo's validation set); a small one (3, 5) is an easy task.
    group_size: int = 8
    prompts_per_step: int = 4
    max_new_tokens: int = 24
    rollout_temperature: float = 1.0
    rollout_top_k: int = 0
    rollout_top_p: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    reward: str = "causal_lm.train.grpo:arithmetic_and_format_reward"
    inner_steps: int = 1
    max_operand: int = 50
    # ---- optimizer choice, auxiliary loss, profiling (causal_lm/train/state.py, step.py, profile.py) ----------
    optimizer: str = "adamw"  # "adamw" | "muon" (matrices; AdamW for the rest) | "lion" | "adafactor"
    muon_momentum: float = 0.95  # Muon's Nesterov momentum (its AdamW part uses beta1/beta2)
    z_loss: float = 0.0  # coefficient of the auxiliary mean log(Z)^2 term (0 = off), logged as z_loss
    opt_state_dtype: str = "auto"  # optimizer moments' dtype: "auto" = the parameters' dtype, or float32/bfloat16
    profile_steps: str = ""  # "START,END": a jax.profiler trace of steps START..END into workdir/profile ("" = off)
    # Divergence stops training, and nothing from that step on is saved: a non-finite loss or gradient norm; a
    # step's loss more than spike_threshold nats AND spike_zscore standard deviations above the mean of the previous
    # spike_window steps' (once 5 are known); or more than spike_threshold nats above ln(vocab_size) (worse than a
    # uniform guess; or above the run's first loss, if higher). spike_threshold=0 turns both loss tests off.
    spike_threshold: float = 1.0
    spike_zscore: float = 6.0
    spike_window: int = 50
    # Resume from this checkpoint step instead of the latest; the later checkpoints are deleted (after saying so).
    resume_step: int | None = None

    def __post_init__(self):
        if isinstance(self.profile_steps, (tuple, list)):  # accept (10, 12) as well as "10,12"
            object.__setattr__(self, "profile_steps", ",".join(str(s) for s in self.profile_steps))
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "microbatches",
            "eval_every",
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
            "eval_batches",
            "spike_window",
        ):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"train.{name} must be a positive integer, got {v!r}")
        _check(
            self.batch_size % self.microbatches == 0,
            f"train.batch_size={self.batch_size} must be divisible by train.microbatches={self.microbatches}",
        )
        _check(self.learning_rate > 0, f"train.learning_rate must be positive, got {self.learning_rate}")
        _check(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _check(self.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = no clipping), got {self.grad_clip}")
        _check(self.sample_tokens >= 0, f"train.sample_tokens must be >= 0, got {self.sample_tokens}")
        _check(self.sample_temperature >= 0, f"train.sample_temperature must be >= 0, got {self.sample_temperature}")
        _check(
            self.compute_dtype == "auto" or self.compute_dtype in DTYPES,
            f"train.compute_dtype must be 'auto' or one of {DTYPES}, got {self.compute_dtype!r}",
        )
        _check(self.peak_flops >= 0, f"train.peak_flops must be >= 0, got {self.peak_flops}")
        _check(self.task in TASKS, f"train.task must be one of {TASKS}, got {self.task!r}")
        _check(
            isinstance(self.lora_rank, int) and self.lora_rank >= 0,
            f"train.lora_rank must be an integer >= 0 (0 = no LoRA), got {self.lora_rank!r}",
        )
        _check(self.beta > 0, f"train.beta must be positive, got {self.beta}")
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "inner_steps", "max_operand"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"train.{name} must be a positive integer, got {v!r}")
        _check(self.group_size >= 2 or self.task != "grpo", "train.group_size must be >= 2 (advantages are per group)")
        _check(self.rollout_temperature >= 0, f"train.rollout_temperature must be >= 0, got {self.rollout_temperature}")
        _check(self.rollout_top_k >= 0, f"train.rollout_top_k must be >= 0 (0 = off), got {self.rollout_top_k}")
        _check(0 < self.rollout_top_p <= 1, f"train.rollout_top_p must be in (0, 1], got {self.rollout_top_p}")
        _check(0 < self.clip_eps < 1, f"train.clip_eps must be in (0, 1), got {self.clip_eps}")
        _check(self.kl_coef >= 0, f"train.kl_coef must be >= 0 (0 = off), got {self.kl_coef}")
        _check(":" in self.reward, f"train.reward must be 'module:function', got {self.reward!r}")
        _check(self.lora_alpha > 0, f"train.lora_alpha must be positive, got {self.lora_alpha}")
        if self.lora_rank:
            names = [n.strip() for n in str(self.lora_targets).split(",") if n.strip()]
            _check(
                bool(names) and all(n in LORA_TARGETS for n in names),
                f"train.lora_targets={self.lora_targets!r}: expected a comma-separated subset of "
                + ",".join(LORA_TARGETS),
            )
        _check(self.optimizer in OPTIMIZERS, f"train.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        _check(0.0 <= self.muon_momentum < 1.0, f"train.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        _check(self.z_loss >= 0, f"train.z_loss must be >= 0 (0 = off), got {self.z_loss}")
        _check(
            self.opt_state_dtype in OPT_STATE_DTYPES,
            f"train.opt_state_dtype must be one of {OPT_STATE_DTYPES}, got {self.opt_state_dtype!r}",
        )
        span = self.profile_range  # parses and checks profile_steps
        if span is not None:
            _check(
                span[1] <= self.steps,
                f"train.profile_steps={self.profile_steps} ends after the last step (train.steps={self.steps})",
            )
        for name in ("learning_rate", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip", "spike_threshold"):
            v = getattr(self, name)
            _check(v == v and abs(v) != float("inf"), f"train.{name} must be a finite number, got {v}")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        _check(self.spike_threshold >= 0, f"train.spike_threshold must be >= 0 (0 = off), got {self.spike_threshold}")
        _check(self.spike_zscore >= 0, f"train.spike_zscore must be >= 0, got {self.spike_zscore}")
        _check(
            self.resume_step is None or (isinstance(self.resume_step, int) and self.resume_step >= 0),
            f"train.resume_step must be a checkpoint step (>= 0) or none, got {self.resume_step!r}",
        )

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(START, END) of train.profile_steps, both 1-based and inclusive; None when profiling is off."""
        if not str(self.profile_steps).strip():
            return None
        parts = str(self.profile_steps).split(",")
        try:
            start, end = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(
                f"train.profile_steps must be 'START,END' (two step numbers, e.g. 10,12), got {self.profile_steps!r}"
            ) from None
        _check(
            1 <= start <= end,
            f"train.profile_steps={self.profile_steps}: need 1 <= START <= END (steps count from 1)",
        )
        return start, end


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
        _check(
            self.train.seq_len <= self.model.max_seq_len,
            f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )


# ---- overrides ---------------------------------------------------------------------------------------------


def _sections(config: Any) -> dict[str, Any]:
    if isinstance(config, Config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {"": config}


def _leaves(obj) -> dict[str, dataclasses.Field]:
    """A section's keys and their fields, a sub-structure's as paths ("rope_scaling.factor")."""
    out = {}
    for f in _keys(obj):
        if f.name in SUBSECTIONS and isinstance(obj, ModelConfig):
            out.update({f"{f.name}.{g.name}": g for g in dataclasses.fields(SUBSECTIONS[f.name])})
        else:
            out[f.name] = f
    return out


def _resolve_key(obj, name: str) -> str | None:
    """The key `name` names in a section (an old flat name gives its new path), or None."""
    if name in _leaves(obj):
        return name
    if isinstance(obj, ModelConfig) and name in LEGACY_MODEL_KEYS:
        return LEGACY_MODEL_KEYS[name]
    return None


def valid_keys(config: Any) -> list[str]:
    keys = []
    for sec, obj in _sections(config).items():
        for name in _leaves(obj):
            keys.append(f"{sec}.{name}" if sec else name)
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
        if "." in key and isinstance(config, Config) and key.split(".", 1)[0] in secs:
            sec, name = key.split(".", 1)
            candidates = [sec] if _resolve_key(secs[sec], name) else []
        else:  # a bare key (or sub-structure path): the model section first
            sec, name = "", key
            order = sorted(secs, key=lambda s: s != "model")
            candidates = [s for s in order if _resolve_key(secs[s], name)][:1]
        if not candidates:
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys(config))}")
        sec = candidates[0]
        path = _resolve_key(secs[sec], name)
        changes[sec][path] = _convert(text.strip(), _leaves(secs[sec])[path].type, key)
    new = {s: _replace(obj, **changes[s]) if changes[s] else obj for s, obj in secs.items()}
    if isinstance(config, Config):
        return Config(**new)
    return new[""]


def load_config(path: str | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load `get_config()` from a preset file (default: configs/small.py's shape), or a workdir's config.json, and
    apply overrides."""
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
        if path.endswith(".json"):  # a workdir's config.json (e.g. a converted model's), to fine-tune it
            try:
                with open(path) as f:
                    return apply_overrides(config_from_dict(json.load(f)), overrides)
            except (json.JSONDecodeError, TypeError, KeyError) as e:
                raise ConfigError(f"config file {path!r} is not a causal-lm config.json ({e})") from None
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


# ---- serialisation (checkpoints, config.json) --------------------------------------------------------------


def _replace(obj, **changes):
    """dataclasses.replace, through ModelConfig.replace where derived sizes must be derived again (and keys may be
    sub-structure paths, "mla.kv_lora_rank")."""
    return obj.replace(**changes) if isinstance(obj, ModelConfig) else dataclasses.replace(obj, **changes)


def _keys(obj) -> list:
    """The config keys of a section: its init fields (ModelConfig's bookkeeping field is not one)."""
    return [f for f in dataclasses.fields(obj) if f.init]


def config_to_dict(config: Config) -> dict:
    """A JSON-able dict of every section and field (derived model sizes as None, see ModelConfig)."""
    out = dataclasses.asdict(config)
    out["model"] = config.model.to_dict()
    return out


def config_from_dict(d: dict) -> Config:
    """The inverse of `config_to_dict`; fields missing from `d` take their defaults, unknown ones are an error."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]
    unknown = set(d) - set(sections)
    if unknown:
        raise ConfigError(f"unknown config section(s) {sorted(unknown)}; valid: {sorted(sections)}")
    built = {}
    for name, factory in sections.items():
        cls = type(factory())
        values = dict(d.get(name, {}))
        names = {f.name for f in _keys(cls)}
        legacy = set(LEGACY_MODEL_KEYS) if cls is ModelConfig else set()  # configs written before the sub-structures
        bad = sorted(set(values) - names - legacy)
        if bad:
            raise ConfigError(
                f"unknown config key(s) {', '.join(f'{name}.{k}' for k in bad)}; valid keys: "
                f"{', '.join(f'{name}.{k}' for k in sorted(names))}"
            )
        built[name] = cls(**values)
    return Config(**built)
