"""The architecture settings of issue 16 as config fields of the one model, without transformers: what the config
refuses, what `causal-lm info` says, and every setting at once (which no single Hugging Face family combines)
staying exact under scan vs unrolled layers and cache vs recompute.

Their equality with the reference implementations is tests/test_architectures.py (needs torch + transformers).
"""

import numpy as np
import pytest

from causal_lm.commands.info import architecture_notes
from causal_lm.config import ConfigError, ModelConfig

SMALL = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=4, mlp_dim=32, max_seq_len=64)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rope_type="dynamic"), r"rope_scaling.type='dynamic'.*not implemented"),
        (dict(rope_type="longrope"), r"rope_scaling.type must be one of"),
        (dict(rope_type="llama3", rope_factor=8.0), r"needs model.rope_scaling.original_max_len"),
        (dict(rope_type="yarn", rope_factor=4.0, rope_original_max_len=16, rope_low_freq_factor=2.0), r"llama3"),
        (dict(rope_factor=2.0), r"model.rope_scaling.factor only applies to rope_scaling.type"),
        (dict(rope_local_theta=1e4), r"rope_local_theta.*local \(sliding-window\) layers, but this model has none"),
        (dict(rope_pattern="nope"), r"no 'rope' layer.*position='none'"),
        (dict(rope_pattern="rope,none"), r"rope_pattern entries"),
        (dict(position="none", rope_pattern="rope,nope"), r"rope_pattern=.*needs position='rope'"),
        (dict(attn_softcap=30.0, attention_impl="dot_product_attention"), r"attn_softcap needs attention_impl='xla'"),
        (dict(attn_softcap=-1.0), r"attn_softcap must be >= 0"),
        (dict(mlp_activation="relu"), r"mlp_activation must be one of"),
        (dict(attn_scale=0.0), r"attn_scale must be positive"),
        (dict(attention_type="mla", kv_lora_rank=8, num_kv_heads=None, qk_norm=True), r"qk_norm is not supported"),
    ],
)
def test_config_refuses_what_it_does_not_compute(fields, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**SMALL, "num_kv_heads": 2, **fields})


def test_config_keeps_defaults_for_models_without_these_settings():
    """A plain model's per-layer RoPE is one table and it has no notes (no extra ops on the default path)."""
    c = ModelConfig(**SMALL)
    assert c.layer_ropes == ("rope", "rope") and c.score_scale == c.head_dim**-0.5
    assert architecture_notes(c) == []
    assert ModelConfig(**SMALL, position="none").layer_ropes == ()


ALL = dict(
    SMALL,
    num_layers=4,
    num_kv_heads=2,
    init_std=0.2,
    sliding_window=6,
    layer_pattern="local,local,global",
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_type="yarn",
    rope_factor=4.0,
    rope_original_max_len=16,
    rope_pattern="rope,rope,rope,nope",
    qk_norm=True,
    norm_scale_plus_one=True,
    post_norms=True,
    scale_embeddings=True,
    mlp_activation="gelu_tanh",
    attn_scale=0.3,
    attn_softcap=3.0,
    final_softcap=5.0,
)


def test_info_describes_each_setting():
    c = ModelConfig(**ALL)
    assert c.layer_ropes == ("local", "local", "rope", "nope")
    notes = "; ".join(architecture_notes(c))
    for phrase in (
        "RoPE scaling yarn (factor 4, original context 16, beta fast/slow 32/1, attention factor 1.139) on the "
        "global layers",
        "local layers' RoPE theta 10000 (global 1e+06)",
        "NoPE layers [3]",
        "sliding window 6 on 3 of 4 layers",
        "QK-norm",
        "(1 + w)",
        "post-norms",
        "embeddings x sqrt(32)",
        "GeGLU",
        "score scale 0.3",
        "attention scores softcapped at 3",
        "final logits softcapped at 5",
    ):
        assert phrase in notes, phrase
    llama3 = ModelConfig(**SMALL, rope_type="llama3", rope_factor=8.0, rope_original_max_len=32)
    assert architecture_notes(llama3) == [
        "RoPE scaling llama3 (factor 8, original context 32, low/high freq factors 1/4)"
    ]


@pytest.mark.slow
def test_every_setting_at_once_scan_equals_unrolled_and_cache_equals_recompute():
    """Scanned layers select their RoPE tables and masks by a traced index (NoPE as the identity rotation),
    unrolled ones statically; the cache runs the local layers in rings. All must agree."""
    import causal_lm
    from causal_lm.model import init_cache
    from causal_lm.model.functional import forward

    c = ModelConfig(**ALL)
    model = causal_lm.build_model(c, seed=0)
    unrolled = causal_lm.build_model(c.replace(scan_layers=False), seed=0)
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, (2, 24))
    scanned = np.asarray(forward(model, tokens)[0])
    np.testing.assert_allclose(np.asarray(forward(unrolled, tokens)[0]), scanned, atol=1e-5, rtol=0)
    cache = init_cache(c, batch_size=2, max_len=32)
    first, cache = forward(model, tokens[:, :12], cache=cache)  # chunks of 12 > the 6-token window
    second, _ = forward(model, tokens[:, 12:], cache=cache)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), scanned, atol=1e-5, rtol=0)
    prompts = [tokens[0, :5].tolist(), tokens[1, :3].tolist()]
    cached = causal_lm.generate(model, prompts, max_new_tokens=16)
    assert cached.tokens == causal_lm.generate(model, prompts, max_new_tokens=16, use_cache=False).tokens
