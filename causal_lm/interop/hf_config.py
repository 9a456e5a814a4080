"""Hugging Face config.json <-> ModelConfig, for the Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / SmolLM3
families.

Every family is the same network as ours with config fields switched on: pre-norm blocks, RMSNorm (float32
statistics), a gated MLP, rotate-half RoPE over the whole head, GQA with query head n served by K/V head n // (N/K)
and optionally tied embeddings. Qwen2 adds biases on q/k/v (not on o); Qwen3 an RMSNorm over each head's q and k
(`qk_norm`); SmolLM3 NoPE layers (`rope_pattern`); Gemma 2 (1 + w) norms, norms after attention and the MLP, scaled
embeddings, GeGLU, `query_pre_attn_scalar` and tanh softcapping of scores and logits; Gemma 3 QK-norm instead of
the score softcap and a separate RoPE theta on its local layers. RoPE scaling (`linear`, `llama3`, `yarn`) maps
onto `rope_theta` and `rope_scaling`. Sliding windows (Mistral's on every layer, the others' per layer through
`layer_types` and their older spellings) map onto `sliding_window` and `layer_pattern`, which use transformers'
rule (query i sees keys i - window + 1 .. i). Anything the model here does not compute (dynamic / longrope RoPE
scaling, biases on o_proj or the MLP, another activation, bidirectional attention) is refused with an error that
names the setting, never loaded approximately.

The weights' mapping is hf_weights.py; reading and writing checkpoint folders, hf_checkpoint.py.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from causal_lm.config import ModelConfig

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


class HFFormatError(ValueError):
    """A Hugging Face checkpoint that is missing something, malformed, or uses a feature not supported here."""


# ---- config.json -> ModelConfig -------------------------------------------------------------------------------


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
    scaling: dict[str, Any] = {"type": kind}
    out: dict[str, Any] = {"rope_theta": float(d.get("rope_theta", theta)), "rope_scaling": scaling}
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
        scaling["original_max_len"] = int(original)
    if kind in ("linear", "llama3"):
        scaling["factor"] = float(need("factor"))
    if kind == "llama3":
        scaling["low_freq_factor"] = float(need("low_freq_factor"))
        scaling["high_freq_factor"] = float(need("high_freq_factor"))
    if kind == "yarn":
        factor = d.get("factor")
        factor = context / scaling["original_max_len"] if factor is None else float(factor)
        scaling["factor"] = factor
        scaling["beta_fast"] = float(d.get("beta_fast") or 32.0)
        scaling["beta_slow"] = float(d.get("beta_slow") or 1.0)
        scaling["truncate"] = bool(d.get("truncate", True))
        attention_factor = d.get("attention_factor")
        mscale, mscale_all_dim = d.get("mscale"), d.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:  # DeepSeek's form, resolved here

            def get_mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
    return out


def _rope(hf: dict, arch: str) -> dict:
    """ModelConfig RoPE fields (rope_theta, rope_scaling as a dict, rope_local_theta) for config.json.

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
    if local_out["rope_scaling"]["type"] == "default":
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
    r = c.rope_scaling
    d: dict[str, Any] = {"rope_type": r.type, "rope_theta": c.rope_theta}
    if r.type != "default":
        d["factor"] = r.factor
    if r.type in ("llama3", "yarn"):
        d["original_max_position_embeddings"] = r.original_max_len
    if r.type == "llama3":
        d.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        d.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        if r.attention_factor is not None:
            d["attention_factor"] = float(r.attention_factor)
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
    if c.rope_scaling.type != "default":
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
