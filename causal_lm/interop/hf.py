"""Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / SmolLM3 checkpoints <-> this project's Decoder.

A Hugging Face folder holds `config.json`, the weights as `model.safetensors` (or shards listed in
`model.safetensors.index.json`) and usually `tokenizer.json`. Reading it needs only `safetensors`' numpy API
(plus `tokenizers` for the tokenizer): neither torch nor transformers is imported, and nothing touches the
network.

Every family is the same network as ours with config fields switched on: pre-norm blocks, RMSNorm (float32
statistics), a gated MLP, rotate-half RoPE over the whole head, GQA with query head n served by K/V head n // (N/K)
and optionally tied embeddings. Qwen2 adds biases on q/k/v (not on o); Qwen3 an RMSNorm over each head's q and k
(`qk_norm`); SmolLM3 NoPE layers (`rope_pattern`); Gemma 2 (1 + w) norms, norms after attention and the MLP, scaled
embeddings, GeGLU, `query_pre_attn_scalar` and tanh softcapping of scores and logits; Gemma 3 QK-norm instead of
the score softcap and a separate RoPE theta on its local layers. RoPE scaling (`linear`, `llama3`, `yarn`) maps
onto the `rope_*` fields. So loading is transposes and reshapes, no permutation:

    HF nn.Linear weight [out, in]                    ours
    self_attn.q_proj.weight   [N*H, D]   ->  blocks.attn.wq   [L, D, N, H]
    self_attn.k_proj.weight   [K*H, D]   ->  blocks.attn.wk   [L, D, K, H]   (v_proj likewise)
    self_attn.o_proj.weight   [D, N*H]   ->  blocks.attn.wo   [L, N, H, D]
    self_attn.q_proj.bias     [N*H]      ->  blocks.attn.bq   [L, N, H]      (k/v biases likewise; Qwen2)
    self_attn.q_norm.weight   [H]        ->  blocks.attn.q_norm.scale [L, H] (k_norm likewise; Qwen3, Gemma 3)
    mlp.gate_proj.weight      [F, D]     ->  blocks.mlp.w_gate [L, D, F]     (up_proj likewise)
    mlp.down_proj.weight      [D, F]     ->  blocks.mlp.w_down [L, F, D]
    input_layernorm.weight    [D]        ->  blocks.attn_norm.scale [L, D]
    post_attention_layernorm  [D]        ->  blocks.mlp_norm.scale  [L, D]   (Gemma: blocks.post_attn_norm.scale)
    pre_feedforward_layernorm [D]        ->  blocks.mlp_norm.scale  [L, D]   (Gemma)
    post_feedforward_layernorm [D]       ->  blocks.post_mlp_norm.scale [L, D] (Gemma)
    model.embed_tokens.weight [V, D]     ->  embed [V, D]
    model.norm.weight         [D]        ->  final_norm.scale [D]
    lm_head.weight            [V, D]     ->  lm_head [D, V]  (absent when tied)

Gemma's norm weights w are stored as they are (the model applies 1 + w). Sliding windows (Mistral's on every
layer, the others' per layer through `layer_types` and their older spellings) map onto `sliding_window` and
`layer_pattern`, which use transformers' rule (query i sees keys i - window + 1 .. i). Anything the model here
does not compute (dynamic / longrope RoPE scaling, biases on o_proj or the MLP, another activation, bidirectional
attention) is refused with an error that names the setting, never loaded approximately.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.data.tokenizer import HFTokenizer, TokenizerError
from causal_lm.interop.chat import end_of_turn_id, read_chat_template
from causal_lm.model.transformer import Decoder
from causal_lm.model.weights import check_tensor

# architecture class name -> model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "SmolLM3ForCausalLM": "smollm3",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
# Names save_hf / convert --architecture accept besides the model types.
ARCHITECTURE_ALIASES = {"gemma3": "Gemma3ForCausalLM"}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Defaults of the config classes where config.json may leave a key out and the families differ.
_DEFAULT_THETA = {"SmolLM3ForCausalLM": 2_000_000.0, "Gemma3ForCausalLM": 1_000_000.0}
_GEMMA3_LOCAL_THETA = 10_000.0
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128, "Gemma2ForCausalLM": 256, "Gemma3ForCausalLM": 256}
_TIED_BY_DEFAULT = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "SmolLM3ForCausalLM")
# transformers' activation name -> ModelConfig.mlp_activation
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATIONS = {v: k for k, v in _ACTIVATIONS.items()}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Buffers some older exports saved next to the weights; they are recomputed from the config, never parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFFormatError(ValueError):
    """A Hugging Face checkpoint that is missing something, malformed, or uses a feature not supported here."""


# ---- config -------------------------------------------------------------------------------------------------


def read_hf_config(path: str) -> dict:
    """config.json of a Hugging Face checkpoint folder as a dict."""
    if not os.path.isdir(path):
        raise HFFormatError(
            f"{path!r} is not a directory; expected a Hugging Face checkpoint folder holding "
            "config.json and model.safetensors"
        )
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFFormatError(
            f"{path!r} has no config.json; expected a Hugging Face checkpoint folder (config.json + model.safetensors)"
        )
    return read_json(cfg_path)


def read_json(file: str):
    """A JSON file of a checkpoint folder; one HFFormatError naming the file and the position if it does not parse."""
    with open(file, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise HFFormatError(
            f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (a truncated or hand-edited file?)"
        ) from None


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    known = [a for a in archs if a in ARCHITECTURES]
    if known:
        return known[0]
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    hint = ""
    if "Gemma3ForConditionalGeneration" in archs:
        hint = " (the multimodal Gemma 3; only the text-only Gemma3ForCausalLM, e.g. gemma-3-1b, loads here)"
    raise HFFormatError(
        f"unsupported architecture {archs or None} (model_type {model_type!r}){hint}; supported: "
        f"{', '.join(ARCHITECTURES)} (model_type {', '.join(MODEL_TYPES)})"
    )


_ROPE_TYPES_REFUSED = {
    "dynamic": "dynamic NTK recomputes the frequencies from the length of each call",
    "longrope": "LongRoPE switches between two sets of frequencies at the original context length",
}


def _rope_scaling(d: dict, hf: dict, theta: float, where: str, *, nested: bool = False) -> dict:
    """ModelConfig RoPE fields for one transformers rope-parameters dict, resolved as modeling_rope_utils does."""
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in _ROPE_TYPES_REFUSED:
        raise HFFormatError(
            f"config.json: {where} rope type {kind!r} is not supported ({_ROPE_TYPES_REFUSED[kind]}); supported: "
            "default, linear, llama3, yarn"
        )
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise HFFormatError(
            f"config.json: {where} rope type {kind!r} is not supported; supported: default, linear, llama3, yarn"
        )
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFFormatError(
            f"config.json: partial_rotary_factor={d['partial_rotary_factor']} is not supported "
            "for these architectures; expected 1.0"
        )
    out: dict[str, Any] = {"rope_type": kind, "rope_theta": float(d.get("rope_theta", theta))}
    if kind == "default":
        return out

    def need(key):
        if d.get(key) is None:
            raise HFFormatError(f"config.json: {where} rope type {kind!r} needs {key!r}")
        return d[key]

    context = hf.get("max_position_embeddings", 2048)
    if kind in ("llama3", "yarn"):
        # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins (flat dicts).
        original = None if nested else hf.get("original_max_position_embeddings")
        original = original or d.get("original_max_position_embeddings") or context
        out["rope_original_max_len"] = int(original)
    if kind in ("linear", "llama3"):
        out["rope_factor"] = float(need("factor"))
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(need("low_freq_factor"))
        out["rope_high_freq_factor"] = float(need("high_freq_factor"))
    if kind == "yarn":
        factor = d.get("factor")
        factor = context / out["rope_original_max_len"] if factor is None else float(factor)
        out["rope_factor"] = factor
        out["rope_beta_fast"] = float(d.get("beta_fast") or 32.0)
        out["rope_beta_slow"] = float(d.get("beta_slow") or 1.0)
        out["rope_truncate"] = bool(d.get("truncate", True))
        attention_factor = d.get("attention_factor")
        mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:  # DeepSeek's form, resolved here

            def get_mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        if attention_factor is not None:
            out["rope_attention_factor"] = float(attention_factor)
    return out


def _rope(hf: dict, arch: str) -> dict:
    """ModelConfig RoPE fields (rope_theta, rope_type and its parameters, rope_local_theta) for config.json.

    transformers >= 5 writes `rope_parameters: {rope_type, rope_theta, ...}` (Gemma 3: one dict per layer type,
    `sliding_attention` and `full_attention`); older configs write a top-level `rope_theta` and `rope_scaling`
    (Gemma 3: `rope_local_base_freq` for the local layers and `rope_scaling` for the global ones).
    """
    params, scaling = hf.get("rope_parameters"), hf.get("rope_scaling")
    for d in (params, scaling):
        if d is not None and not isinstance(d, dict):
            raise HFFormatError(f"config.json: rope settings {d!r} are not a dict")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFFormatError(
            f"config.json: partial_rotary_factor={hf['partial_rotary_factor']} is not supported "
            "for these architectures; expected 1.0"
        )
    theta = hf.get("rope_theta", _DEFAULT_THETA.get(arch, 10_000.0))
    nested = params is not None and ("full_attention" in params or "sliding_attention" in params)
    if arch != "Gemma3ForCausalLM":
        if nested:
            raise HFFormatError(
                "config.json: per-layer-type rope_parameters are not supported for "
                f"{arch}; expected one rope_parameters dict"
            )
        # transformers: rope_scaling (the older key) replaces rope_parameters when both are given.
        return _rope_scaling(scaling or params or {}, hf, theta, "the")
    # Gemma 3: plain RoPE at its own theta on the local layers, the global layers' RoPE (maybe scaled).
    glob = dict((params or {}).get("full_attention") or {}) if nested else {}
    glob.update(scaling or {})  # transformers 5 updates full_attention with rope_scaling
    local = dict((params or {}).get("sliding_attention") or {}) if nested else {}
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
    out = _rope_scaling(glob, hf, theta, "full_attention", nested=True)
    local_out = _rope_scaling(local, hf, theta, "sliding_attention", nested=True)
    if local_out["rope_type"] == "default":
        if local_out != out:
            out["rope_local_theta"] = local_out["rope_theta"]
    elif local_out != out:
        raise HFFormatError(
            "config.json: the sliding_attention layers' rope parameters are scaled differently from the "
            f"full_attention ones ({local} vs {glob}); only plain RoPE with its own theta on the local layers, or "
            "the same parameters as the global ones, is supported"
        )
    return out


def _sliding_windows(hf: dict, arch: str, num_layers: int) -> tuple:
    """Per layer: the sliding window transformers applies (0 = full causal attention)."""
    window = hf.get("sliding_window")
    if arch in GEMMA:
        window = hf.get("sliding_window", 4096)
    if window is None or arch == "LlamaForCausalLM":  # Llama has no window; transformers ignores the key too
        return (0,) * num_layers
    if not isinstance(window, int) or window <= 0:
        raise HFFormatError(f"config.json: sliding_window={window!r} is not a positive integer or null")
    layer_types = hf.get("layer_types")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not hf.get("use_sliding_window", False):
            return (0,) * num_layers
        if layer_types is None:  # transformers' rule: layers from max_window_layers on are windowed
            first = hf.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if arch == "SmolLM3ForCausalLM":
        if not hf.get("use_sliding_window", False):
            return (0,) * num_layers
        if layer_types is None:  # transformers' rule: the NoPE layers are the windowed ones
            rope = _smollm3_rope_layers(hf, num_layers)
            layer_types = ["full_attention" if r else "sliding_attention" for r in rope]
    if arch in GEMMA and layer_types is None:
        # Gemma 2 alternates local and global layers; Gemma 3 (configs before layer_types) has every
        # sliding_window_pattern-th layer global.
        every = 2 if arch == "Gemma2ForCausalLM" else hf.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        return (window,) * num_layers  # Mistral: every layer
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise HFFormatError(
            f"config.json: layer_types={layer_types!r}; expected {num_layers} entries, each "
            "'sliding_attention' or 'full_attention'"
        )
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def _smollm3_rope_layers(hf: dict, num_layers: int) -> list:
    """SmolLM3's no_rope_layers (despite the name, 1 = the layer uses RoPE, 0 = NoPE), as transformers derives it
    from no_rope_layer_interval when absent (every interval-th layer is NoPE)."""
    rope = hf.get("no_rope_layers")
    if rope is None:
        every = hf.get("no_rope_layer_interval", 4)
        rope = [int((i + 1) % every != 0) for i in range(num_layers)]
    if len(rope) != num_layers or set(rope) - {0, 1}:
        raise HFFormatError(f"config.json: no_rope_layers={rope!r}; expected {num_layers} entries, each 0 or 1")
    return list(rope)


def model_config_from_hf(
    hf: dict, *, param_dtype: str = "float32", dtype: str | None = None, max_seq_len: int | None = None
) -> ModelConfig:
    """The ModelConfig that computes what `transformers` computes for this config.json (or an HFFormatError)."""
    arch = _architecture(hf)
    gemma = arch in GEMMA
    act_key = "hidden_activation" if gemma else "hidden_act"  # transformers' Gemma configs read hidden_activation
    act = hf.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in _ACTIVATIONS:
        raise HFFormatError(
            f"config.json: {act_key}={act!r} is not supported; expected 'silu' (SwiGLU MLP) or "
            "'gelu_pytorch_tanh' (GeGLU)"
        )
    if hf.get("attention_bias", False) and arch != "Qwen2ForCausalLM":
        raise HFFormatError(
            f"config.json: attention_bias=true (biases on q/k/v and o_proj) is not supported for "
            f"{arch}; expected false (Qwen2-style q/k/v-only biases are supported as Qwen2ForCausalLM)"
        )
    if hf.get("mlp_bias", False):
        raise HFFormatError("config.json: mlp_bias=true is not supported; expected false")
    if hf.get("use_bidirectional_attention"):
        raise HFFormatError("config.json: use_bidirectional_attention=true is not supported; expected a causal model")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(hf.get(key), int):
            raise HFFormatError(f"config.json: {key} is missing or not an integer (got {hf.get(key)!r})")
    D, N, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    K = hf.get("num_key_value_heads") or N
    H = hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch) or D // N
    context = int(max_seq_len or hf.get("max_position_embeddings", 2048))
    rope = _rope(hf, arch)
    # transformers' window: query i sees keys j with i - j < window, the same rule as model.sliding_window here.
    # A window no shorter than the context never hides a key, so it is dropped, unless the local layers have their
    # own RoPE (Gemma 3): then it is cut to the context, which keeps them local and changes nothing else.
    local_rope = "rope_local_theta" in rope
    windows = [(min(w, context) if local_rope else 0) if w >= context else w for w in _sliding_windows(hf, arch, L)]
    window = max(windows)
    pattern = "" if all(windows) or not window else ",".join("local" if w else "global" for w in windows)
    if local_rope and not window:
        del rope["rope_local_theta"]  # no local layer to apply it to
    rope_pattern = ""
    if arch == "SmolLM3ForCausalLM":
        layers = _smollm3_rope_layers(hf, L)
        if not all(layers):
            rope_pattern = ",".join("rope" if r else "nope" for r in layers)
    extra: dict[str, Any] = {}
    if gemma:
        extra.update(
            norm_scale_plus_one=True,
            post_norms=True,
            scale_embeddings=True,
            attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        )
        if arch == "Gemma2ForCausalLM":
            extra["attn_softcap"] = float(hf.get("attn_logit_softcapping", 50.0) or 0.0)
        # (transformers' Gemma 3 ignores attn_logit_softcapping, and so does this mapping)
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=D,
            num_layers=L,
            num_heads=N,
            num_kv_heads=K,
            head_dim=H,
            mlp_dim=hf["intermediate_size"],
            max_seq_len=context,
            position="rope",
            rope_fraction=1.0,
            rope_pattern=rope_pattern,
            sliding_window=window,
            layer_pattern=pattern,
            qkv_bias=(arch == "Qwen2ForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            mlp_activation=_ACTIVATIONS[act],
            tie_embeddings=bool(hf.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            param_dtype=param_dtype,
            dtype=dtype or param_dtype,
            **rope,
            **extra,
        )
    except ValueError as e:
        raise HFFormatError(f"config.json describes a model this project cannot build: {e}") from None


def default_architecture(c: ModelConfig) -> str:
    """The Hugging Face architecture save_hf writes `c` as when none is named: the one family whose features it
    uses (Gemma's norms -> Gemma 3 with QK-norm, else Gemma 2; QK-norm -> Qwen3; NoPE layers -> SmolLM3; q/k/v
    biases -> Qwen2; a window -> Mistral; else Llama)."""
    if c.norm_scale_plus_one or c.post_norms or c.scale_embeddings:
        return "Gemma3ForCausalLM" if c.qk_norm else "Gemma2ForCausalLM"
    if c.qk_norm:
        return "Qwen3ForCausalLM"
    if "nope" in c.layer_ropes:
        return "SmolLM3ForCausalLM"
    if c.qkv_bias:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if any(c.layer_windows) else "LlamaForCausalLM"


def _expressible(c: ModelConfig, arch: str) -> list:
    """What in `c` the architecture `arch` cannot express (empty: it can)."""
    problems = []
    if c.position != "rope":
        problems.append(f"position={c.position!r} (needs 'rope')")
    elif c.rope_dim != c.head_dim:
        problems.append(f"rope_fraction={c.rope_fraction} (needs 1.0: RoPE on the whole head)")
    if c.attention_mask != "causal":
        problems.append(f"attention_mask={c.attention_mask!r} (needs 'causal')")
    if c.attention_type != "mha":
        problems.append(f"attention_type={c.attention_type!r} (needs 'mha'/GQA/MQA)")
    if c.attn_output_gate:
        problems.append("attn_output_gate=True")
    if c.attn_sink:
        problems.append("attn_sink=True")
    gemma = arch in GEMMA
    windows = c.layer_windows
    if any(windows):
        if arch == "LlamaForCausalLM":
            problems.append("a sliding window (Llama has none; Mistral, Qwen2/3, Gemma 2/3 and SmolLM3 do)")
        elif arch == "MistralForCausalLM" and not all(windows):
            problems.append(f"sliding windows on some layers only ({windows}); Mistral windows every layer")
    if c.qkv_bias and arch != "Qwen2ForCausalLM":
        problems.append(f"qkv_bias=True (only Qwen2 has q/k/v biases; {arch} has none)")
    if not c.qkv_bias and arch == "Qwen2ForCausalLM":
        problems.append("qkv_bias=False (Qwen2 always has q/k/v biases)")
    needs_qk_norm = arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
    if c.qk_norm != needs_qk_norm:
        problems.append(f"qk_norm={c.qk_norm} ({arch} {'always' if needs_qk_norm else 'never'} normalises q and k)")
    for name in ("norm_scale_plus_one", "post_norms", "scale_embeddings"):
        if getattr(c, name) != gemma:
            problems.append(f"{name}={getattr(c, name)} ({'Gemma always has it' if gemma else 'a Gemma feature'})")
    if gemma:
        q = round(c.score_scale**-2)
        if q < 1 or float(q) ** -0.5 != c.score_scale:
            problems.append(f"attn_scale={c.attn_scale} (Gemma's is query_pre_attn_scalar**-0.5 for an integer)")
    elif c.attn_scale is not None and c.attn_scale != c.head_dim**-0.5:
        problems.append(f"attn_scale={c.attn_scale} (a Gemma feature; {arch} scales by head_dim**-0.5)")
    if c.attn_softcap and arch != "Gemma2ForCausalLM":
        problems.append(f"attn_softcap={c.attn_softcap} (only Gemma 2 caps the attention scores)")
    if c.final_softcap and not gemma:
        problems.append(f"final_softcap={c.final_softcap} (a Gemma feature)")
    if c.rope_local_theta is not None and arch != "Gemma3ForCausalLM":
        problems.append("rope_local_theta (only Gemma 3 has a separate theta for its local layers)")
    if "nope" in c.layer_ropes and arch != "SmolLM3ForCausalLM":
        problems.append(f"rope_pattern={c.rope_pattern!r} (only SmolLM3 has NoPE layers)")
    return problems


def _rope_json(c: ModelConfig, kind: str = "rope") -> dict:
    """transformers' rope parameters dict for a layer kind of `c.layer_ropes`."""
    if kind == "local":
        return {"rope_type": "default", "rope_theta": c.rope_local_theta}
    d: dict[str, Any] = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type != "default":
        d["factor"] = c.rope_factor
    if c.rope_type in ("llama3", "yarn"):
        d["original_max_position_embeddings"] = c.rope_original_max_len
    if c.rope_type == "llama3":
        d.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor)
    if c.rope_type == "yarn":
        d.update(beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow, truncate=c.rope_truncate)
        if c.rope_attention_factor is not None:
            d["attention_factor"] = float(c.rope_attention_factor)
    return d


def hf_config_from_model(
    c: ModelConfig,
    architecture: str | None = None,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> dict:
    """config.json for `c` (refusing models that the Hugging Face architectures cannot express)."""
    if architecture is None:
        arch = default_architecture(c)
    else:
        arch = ARCHITECTURE_ALIASES.get(architecture, MODEL_TYPES.get(architecture, architecture))
    if arch not in ARCHITECTURES:
        raise HFFormatError(
            f"unknown architecture {architecture!r}; expected one of {', '.join([*MODEL_TYPES, *ARCHITECTURE_ALIASES])}"
        )
    problems = _expressible(c, arch)
    if problems:
        raise HFFormatError(f"this model cannot be written as {arch}: " + "; ".join(problems))
    windows = c.layer_windows
    window = max(windows) or None
    layer_types = ["sliding_attention" if w else "full_attention" for w in windows]
    rope = _rope_json(c)
    act = _HF_ACTIVATIONS[c.mlp_activation]
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.mlp_dim,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": act,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, 4.x reads rope_theta / rope_scaling.
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": c.param_dtype,
        "torch_dtype": c.param_dtype,
        "use_cache": True,
    }
    if c.rope_type != "default":
        out["rope_scaling"] = rope
    if arch in ("LlamaForCausalLM", "SmolLM3ForCausalLM"):
        out.update(attention_bias=False, mlp_bias=False)
    if arch == "MistralForCausalLM":
        out.update(sliding_window=window)
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # max_window_layers (the first windowed layer) is what transformers 4.x reads; 5.x reads layer_types.
        first = next((i for i, w in enumerate(windows) if w), c.num_layers)
        out.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=first,
            layer_types=layer_types,
        )
        if arch == "Qwen3ForCausalLM":
            out["attention_bias"] = False
    elif arch == "SmolLM3ForCausalLM":
        out.update(
            no_rope_layers=[int(k != "nope") for k in c.layer_ropes],
            use_sliding_window=window is not None,
            sliding_window=window,
            layer_types=layer_types,
        )
    elif arch in GEMMA:
        out.update(
            hidden_activation=act,
            attention_bias=False,
            query_pre_attn_scalar=round(c.score_scale**-2),
            sliding_window=window,
            layer_types=layer_types,
            attn_logit_softcapping=c.attn_softcap or None,
            final_logit_softcapping=c.final_softcap or None,
        )
        if arch == "Gemma3ForCausalLM":
            local = _rope_json(c, "local" if c.rope_local_theta is not None else "rope")
            out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
            out["rope_local_base_freq"] = local["rope_theta"]  # transformers 4.x
    return out


# ---- weights ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Param:
    """One of our parameters and the Hugging Face tensor(s) it comes from.

    ours: path in our state; hf: tensor name ('{i}' = layer index for per-layer tensors); shape: the HF shape
    as (sizes, names of the config fields); to_ours / to_hf convert one (per-layer) array each way.
    """

    ours: tuple
    hf: str
    shape: Callable[[ModelConfig], tuple]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _param_table(c: ModelConfig) -> list[_Param]:
    D, N, K, H, F, V = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.vocab_size
    pre = "model.layers.{i}."

    def lin_in(heads):  # [heads*H, D] <-> [D, heads, H]
        return (lambda w, c: w.T.reshape(D, heads, H), lambda a, c: a.reshape(D, heads * H).T)

    table = [
        _Param(
            ("embed",),
            "model.embed_tokens.weight",
            lambda c: ((V, "vocab_size"), (D, "hidden_size")),
            lambda w, c: w,
            lambda a, c: a,
        ),
        _Param(
            ("final_norm", "scale"),
            "model.norm.weight",
            lambda c: ((D, "hidden_size"),),
            lambda w, c: w,
            lambda a, c: a,
        ),
        _Param(
            ("blocks", "attn_norm", "scale"),
            pre + "input_layernorm.weight",
            lambda c: ((D, "hidden_size"),),
            lambda w, c: w,
            lambda a, c: a,
        ),
        _Param(
            ("blocks", "mlp_norm", "scale"),
            pre + ("pre_feedforward_layernorm.weight" if c.post_norms else "post_attention_layernorm.weight"),
            lambda c: ((D, "hidden_size"),),
            lambda w, c: w,
            lambda a, c: a,
        ),
        _Param(
            ("blocks", "attn", "wq"),
            pre + "self_attn.q_proj.weight",
            lambda c: ((N * H, "num_attention_heads*head_dim"), (D, "hidden_size")),
            *lin_in(N),
        ),
        _Param(
            ("blocks", "attn", "wk"),
            pre + "self_attn.k_proj.weight",
            lambda c: ((K * H, "num_key_value_heads*head_dim"), (D, "hidden_size")),
            *lin_in(K),
        ),
        _Param(
            ("blocks", "attn", "wv"),
            pre + "self_attn.v_proj.weight",
            lambda c: ((K * H, "num_key_value_heads*head_dim"), (D, "hidden_size")),
            *lin_in(K),
        ),
        _Param(
            ("blocks", "attn", "wo"),
            pre + "self_attn.o_proj.weight",
            lambda c: ((D, "hidden_size"), (N * H, "num_attention_heads*head_dim")),
            lambda w, c: w.T.reshape(N, H, D),
            lambda a, c: a.reshape(N * H, D).T,
        ),
        _Param(
            ("blocks", "mlp", "w_gate"),
            pre + "mlp.gate_proj.weight",
            lambda c: ((F, "intermediate_size"), (D, "hidden_size")),
            lambda w, c: w.T,
            lambda a, c: a.T,
        ),
        _Param(
            ("blocks", "mlp", "w_up"),
            pre + "mlp.up_proj.weight",
            lambda c: ((F, "intermediate_size"), (D, "hidden_size")),
            lambda w, c: w.T,
            lambda a, c: a.T,
        ),
        _Param(
            ("blocks", "mlp", "w_down"),
            pre + "mlp.down_proj.weight",
            lambda c: ((D, "hidden_size"), (F, "intermediate_size")),
            lambda w, c: w.T,
            lambda a, c: a.T,
        ),
    ]
    norms = []
    if c.post_norms:  # Gemma: the post-attention norm is on the attention output; the MLP has its own pair
        norms += [("post_attn_norm", "post_attention_layernorm", D, "hidden_size")]
        norms += [("post_mlp_norm", "post_feedforward_layernorm", D, "hidden_size")]
    if c.qk_norm:
        norms += [(f"attn.{n}_norm", f"self_attn.{n}_norm", H, "head_dim") for n in ("q", "k")]
    for ours, theirs, size, label in norms:
        table.append(
            _Param(
                ("blocks", *ours.split("."), "scale"),
                pre + theirs + ".weight",
                lambda c, size=size, label=label: ((size, label),),
                lambda w, c: w,
                lambda a, c: a,
            )
        )
    if c.qkv_bias:
        for name, heads, label in (
            ("q", N, "num_attention_heads"),
            ("k", K, "num_key_value_heads"),
            ("v", K, "num_key_value_heads"),
        ):
            table.append(
                _Param(
                    ("blocks", "attn", "b" + name),
                    pre + f"self_attn.{name}_proj.bias",
                    lambda c, heads=heads, label=label: ((heads * H, f"{label}*head_dim"),),
                    lambda w, c, heads=heads: w.reshape(heads, H),
                    lambda a, c, heads=heads: a.reshape(heads * H),
                )
            )
    if not c.tie_embeddings:
        table.append(
            _Param(
                ("lm_head",),
                "lm_head.weight",
                lambda c: ((V, "vocab_size"), (D, "hidden_size")),
                lambda w, c: w.T,
                lambda a, c: a.T,
            )
        )
    return table


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


def _shape_text(spec) -> str:
    return "[" + ", ".join(f"{n}={label}" for n, label in spec) + "]"


def load_hf_params(path: str, config: ModelConfig) -> dict:
    """Our parameters as a nested dict of numpy arrays (param_dtype), read and checked from `path`."""
    tensors = _Tensors(path)
    pd = np.dtype(_np_dtype(config.param_dtype))
    needed = set()
    params: dict = {}
    for p in _param_table(config):
        spec = p.shape(config)
        expected = tuple(n for n, _ in spec)
        names = [p.hf.format(i=i) for i in range(config.num_layers)] if p.per_layer else [p.hf]
        arrays = []
        for name in names:
            needed.add(name)
            if name not in tensors.where:
                raise HFFormatError(
                    f"{path!r}: the checkpoint has no tensor {name!r} (expected shape "
                    f"{_shape_text(spec)} from config.json)"
                )
            got = tensors.shape(name)
            if got != expected:
                raise HFFormatError(
                    f"{path!r}: tensor {name!r} in {tensors.where[name]} has shape {list(got)}, "
                    f"expected {_shape_text(spec)} from config.json"
                )
            arrays.append(np.ascontiguousarray(p.to_ours(tensors.get(name), config), dtype=pd))
        value = np.stack(arrays) if p.per_layer else arrays[0]
        d = params
        for k in p.ours[:-1]:
            d = d.setdefault(k, {})
        d[p.ours[-1]] = value
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


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def model_from_params(config: ModelConfig, params: dict):
    """A Decoder for `config` holding `params` (nested dict like nnx.to_pure_dict), shapes checked."""

    abstract = nnx.eval_shape(lambda: Decoder(config, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    want = nnx.to_pure_dict(state)
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    flat_got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    if set(flat_want) != set(flat_got):
        missing = sorted(jax.tree_util.keystr(k) for k in set(flat_want) - set(flat_got))
        unknown = sorted(jax.tree_util.keystr(k) for k in set(flat_got) - set(flat_want))
        raise HFFormatError(f"parameters do not match the model: missing {missing}, unexpected {unknown}")
    for k, w in flat_want.items():
        if tuple(flat_got[k].shape) != tuple(w.shape):
            raise HFFormatError(
                f"parameter {jax.tree_util.keystr(k)} has shape {flat_got[k].shape}, expected {w.shape}"
            )
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a, w: jnp.asarray(a, w.dtype), params, want))
    return nnx.merge(graphdef, state)


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
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {}
    for p in _param_table(c):
        a = params
        for k in p.ours:
            a = a[k]
        a = np.asarray(jax.device_get(a))
        if p.per_layer:
            for i in range(c.num_layers):
                out[p.hf.format(i=i)] = np.ascontiguousarray(p.to_hf(a[i], c))
        else:
            out[p.hf] = np.ascontiguousarray(p.to_hf(a, c))
    return out


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
        _save_tokenizer_json(tokenizer, out_dir)
    return out_dir


def _save_tokenizer_json(tokenizer, out_dir: str) -> bool:
    """Write tokenizer.json for `tokenizer`: a tokenizers-library one as it is, the byte tokenizer as an
    equivalent byte-level BPE without merges. Returns False for tokenizers with no tokenizer.json form."""
    d = tokenizer.to_dict() if hasattr(tokenizer, "to_dict") else {}
    if d.get("kind") == "hf":
        text = d["json"]
    elif d.get("kind") == "byte":
        text = byte_tokenizer_json(tokenizer)
    else:
        return False
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    # tokenizer_config.json: load it as the plain fast tokenizer it is (a model_type-specific class such as
    # LlamaTokenizerFast could add its own normalisation or BOS handling) and name the special tokens.
    from tokenizers import Tokenizer

    inner = Tokenizer.from_str(text)
    tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id"), ("pad_token", "pad_id")):
        i = getattr(tokenizer, attr, None)
        if i is not None and inner.id_to_token(int(i)) is not None:
            tc[key] = inner.id_to_token(int(i))
    for key, value in (getattr(tokenizer, "special_tokens", None) or {}).items():
        tc.setdefault(key, value)
    if getattr(tokenizer, "add_bos", False):
        tc["add_bos_token"] = True
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
    if getattr(tokenizer, "chat_template", None):
        with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(tokenizer.chat_template)
    return True


def byte_tokenizer_json(tokenizer) -> str:
    """tokenizer.json text equal to the project's ByteTokenizer: id b = byte b (a BPE over byte-level
    characters with no merges), then <s>, </s>, <pad> at its bos/eos/pad ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins GPT-2's byte-level BPE uses for bytes
    # Order them by the byte they stand for: byte b -> id b.
    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted([(tokenizer.bos_id, "<s>"), (tokenizer.eos_id, "</s>"), (tokenizer.pad_id, "<pad>")])
    if [i for i, _ in specials] != list(range(256, 256 + len(specials))):
        raise HFFormatError(f"byte tokenizer special ids {specials} are not 256, 257, 258")
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for _, name in specials])
    return tok.to_str()


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character map (what tokenizers' ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))
