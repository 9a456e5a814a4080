"""The attention-variant grid every property test runs over, and tiny shared configs."""

import functools
import itertools

from causal_lm.config import MLAConfig, ModelConfig

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}  # num_kv_heads with 4 query heads
POSITIONS = {
    "rope_full": dict(position="rope", rope_fraction=1.0),
    "rope_partial": dict(position="rope", rope_fraction=0.25),  # 2 of 8 dims rotated
    "nope": dict(position="none"),
    "learned": dict(position="learned"),
}

VARIANTS = [
    (kv, pos, gate, sink) for kv, pos, gate, sink in itertools.product(HEADS, POSITIONS, (False, True), (False, True))
]


def variant_id(v):
    kv, pos, gate, sink = v
    return f"{kv}-{pos}{'-gate' if gate else ''}{'-sink' if sink else ''}"


VARIANT_IDS = [variant_id(v) for v in VARIANTS]


@functools.cache
def tiny_config(kv="gqa", pos="rope_full", gate=False, sink=False, **overrides) -> ModelConfig:
    base = dict(
        vocab_size=61,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=HEADS[kv],
        mlp_dim=48,
        max_seq_len=96,
        init_std=0.2,
        attn_output_gate=gate,
        attn_sink=sink,
        **POSITIONS[pos],
    )
    base.update(overrides)
    return ModelConfig(**base)


@functools.cache
def tiny_mla_config(**overrides) -> ModelConfig:
    """The tiny shape with multi-head latent attention: a 12-rank latent, a 4-dim shared rope key, absorbed."""
    mla = MLAConfig(kv_lora_rank=12, qk_rope_head_dim=4, absorb=True)
    return tiny_config("mha", attention_type="mla", num_kv_heads=None, mla=mla, **overrides)


@functools.cache
def tiny_model(config: ModelConfig, seed: int = 0):
    """Built once per config. Sink logits are set away from 0 so the sink really takes a share."""
    import jax.numpy as jnp

    from causal_lm.model import build_model

    model = build_model(config, seed=seed)
    if config.attn_sink:
        L, N = config.num_layers, config.num_heads
        model.blocks.attn.sink[...] = jnp.linspace(-1.0, 1.5, L * N).reshape(L, N)
    return model


def tiled_weights(layers) -> list:
    """Whether each float32 / int8 weight of a decode form (`split_layers`, and its head) is stored in the C++
    kernels' tiles (rank 4, model/matvec.py)."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path((layers.states, layers.head))[0]
    weights = [a for p, a in leaves if any(getattr(k, "name", getattr(k, "key", None)) in ("t", "data") for k in p)]
    return [a.ndim == 4 for a in weights]
