"""The parameter table: each of our parameters, the Hugging Face tensor it comes from, and the conversion each way.

One table serves every format that stores Hugging Face-layout tensors: safetensors folders (hf_checkpoint.py, both
ways) and GGUF files (gguf.py names llama.cpp's tensors by these names first, and reads through the same
`read_params`). Loading is transposes and reshapes, no permutation:

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

Gemma's norm weights w are stored as they are (the model applies 1 + w).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.interop.hf_config import HFFormatError
from causal_lm.model.transformer import Decoder


@dataclasses.dataclass(frozen=True)
class Param:
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


def param_table(c: ModelConfig) -> list[Param]:
    D, N, K, H, F, V = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.vocab_size
    pre = "model.layers.{i}."

    def lin_in(heads):  # [heads*H, D] <-> [D, heads, H]
        return (lambda w, c: w.T.reshape(D, heads, H), lambda a, c: a.reshape(D, heads * H).T)

    table = [
        Param(
            ("embed",),
            "model.embed_tokens.weight",
            lambda c: ((V, "vocab_size"), (D, "hidden_size")),
            lambda w, c: w,
            lambda a, c: a,
        ),
        Param(
            ("final_norm", "scale"),
            "model.norm.weight",
            lambda c: ((D, "hidden_size"),),
            lambda w, c: w,
            lambda a, c: a,
        ),
        Param(
            ("blocks", "attn_norm", "scale"),
            pre + "input_layernorm.weight",
            lambda c: ((D, "hidden_size"),),
            lambda w, c: w,
            lambda a, c: a,
        ),
        Param(
            ("blocks", "mlp_norm", "scale"),
            pre + ("pre_feedforward_layernorm.weight" if c.post_norms else "post_attention_layernorm.weight"),
            lambda c: ((D, "hidden_size"),),
            lambda w, c: w,
            lambda a, c: a,
        ),
        Param(
            ("blocks", "attn", "wq"),
            pre + "self_attn.q_proj.weight",
            lambda c: ((N * H, "num_attention_heads*head_dim"), (D, "hidden_size")),
            *lin_in(N),
        ),
        Param(
            ("blocks", "attn", "wk"),
            pre + "self_attn.k_proj.weight",
            lambda c: ((K * H, "num_key_value_heads*head_dim"), (D, "hidden_size")),
            *lin_in(K),
        ),
        Param(
            ("blocks", "attn", "wv"),
            pre + "self_attn.v_proj.weight",
            lambda c: ((K * H, "num_key_value_heads*head_dim"), (D, "hidden_size")),
            *lin_in(K),
        ),
        Param(
            ("blocks", "attn", "wo"),
            pre + "self_attn.o_proj.weight",
            lambda c: ((D, "hidden_size"), (N * H, "num_attention_heads*head_dim")),
            lambda w, c: w.T.reshape(N, H, D),
            lambda a, c: a.reshape(N * H, D).T,
        ),
        Param(
            ("blocks", "mlp", "w_gate"),
            pre + "mlp.gate_proj.weight",
            lambda c: ((F, "intermediate_size"), (D, "hidden_size")),
            lambda w, c: w.T,
            lambda a, c: a.T,
        ),
        Param(
            ("blocks", "mlp", "w_up"),
            pre + "mlp.up_proj.weight",
            lambda c: ((F, "intermediate_size"), (D, "hidden_size")),
            lambda w, c: w.T,
            lambda a, c: a.T,
        ),
        Param(
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
            Param(
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
                Param(
                    ("blocks", "attn", "b" + name),
                    pre + f"self_attn.{name}_proj.bias",
                    lambda c, heads=heads, label=label: ((heads * H, f"{label}*head_dim"),),
                    lambda w, c, heads=heads: w.reshape(heads, H),
                    lambda a, c, heads=heads: a.reshape(heads * H),
                )
            )
    if not c.tie_embeddings:
        table.append(
            Param(
                ("lm_head",),
                "lm_head.weight",
                lambda c: ((V, "vocab_size"), (D, "hidden_size")),
                lambda w, c: w.T,
                lambda a, c: a.T,
            )
        )
    return table


class TensorSource(Protocol):
    """Where `read_params` reads tensors by Hugging Face name: a safetensors folder or a GGUF file."""

    def name(self, hf_name: str) -> str:
        """The source's own name of a Hugging Face tensor name ('{i}' kept for the layer index)."""

    def read(self, name: str, spec: tuple) -> np.ndarray:
        """The tensor `name` as a numpy array of the Hugging Face layout, checked to have the shape of `spec`
        ((size, label) pairs); raises the format's own error naming the tensor otherwise."""


def read_params(config: ModelConfig, source: TensorSource) -> tuple[dict, set]:
    """Our parameters (a nested dict of numpy arrays in config.param_dtype) read through the parameter table, and
    the names of the tensors read (so the caller can refuse tensors left over)."""
    pd = np.dtype(np_dtype(config.param_dtype))
    used: set = set()
    params: dict = {}
    for p in param_table(config):
        spec = p.shape(config)
        base = source.name(p.hf)
        names = [base.format(i=i) for i in range(config.num_layers)] if p.per_layer else [base]
        arrays = []
        for name in names:
            used.add(name)
            arrays.append(np.ascontiguousarray(p.to_ours(source.read(name, spec), config), dtype=pd))
        value = np.stack(arrays) if p.per_layer else arrays[0]
        d = params
        for k in p.ours[:-1]:
            d = d.setdefault(k, {})
        d[p.ours[-1]] = value
    return params, used


def tensors_from_params(config: ModelConfig, params: dict) -> dict:
    """{Hugging Face tensor name: numpy array} from our parameters (nested dict, as nnx.to_pure_dict)."""
    out = {}
    for p in param_table(config):
        a = params
        for k in p.ours:
            a = a[k]
        a = np.asarray(jax.device_get(a))
        if p.per_layer:
            for i in range(config.num_layers):
                out[p.hf.format(i=i)] = np.ascontiguousarray(p.to_hf(a[i], config))
        else:
            out[p.hf] = np.ascontiguousarray(p.to_hf(a, config))
    return out


def shape_text(spec) -> str:
    return "[" + ", ".join(f"{n}={label}" for n, label in spec) + "]"


def np_dtype(name: str):
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
