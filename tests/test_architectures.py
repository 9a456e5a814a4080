"""Llama 3.x RoPE scaling, Qwen3, Gemma 2, Gemma 3 and SmolLM3 equal to `transformers`' own implementations.

Each family is a tiny random model built by `transformers` (its config and modeling classes), saved with
save_pretrained and loaded with `causal_lm.load_hf`; one model per family serves all its checks:

    logits within 1e-4 (float32) at every real position of a ragged (right-padded) batch;
    greedy 32 tokens identical to transformers' `generate`, from prompts of two lengths;
    cache == recompute in our model: generate with and without the cache, and the ragged batch fed through the
      cache in two chunks longer than the local window gives the one-shot logits;
    save_hf -> transformers' from_pretrained gives the original logits, and load_hf gives back the same model.

What each case pins down (and the bug it catches): llama3 scaling with its three frequency bands all present
(head_dim 16, original context 32); Qwen3's QK-norm with head_dim 24 != hidden/heads and YaRN (its ramp and its
attention factor on cos/sin); Gemma 2's (1 + w) norms, post-norms, sqrt(d_model) embeddings, GeGLU, a
query_pre_attn_scalar that is not head_dim, a score softcap that bites and a final-logit softcap, alternating
8-token windows; Gemma 3's 5 local : 1 global layers with a local theta of 1e4 and a linearly scaled global theta
of 1e6; SmolLM3's NoPE layers (every 2nd) run both scanned (RoPE tables selected by a traced layer index) and
unrolled (decode). Every sequence is longer than the windows. Weights are drawn large (std 0.2, norms randomised)
so every tensor matters and greedy decoding has no near-ties.
"""

import numpy as np  # noqa: E402
import pytest  # noqa: E402

REASON = "the interop extra is not installed: pip install -e '.[interop]' torch"
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)
pytest.importorskip("safetensors", reason=REASON)
transformers.utils.logging.disable_progress_bar()

from causal_lm import HFFormatError, load_hf, save_hf  # noqa: E402
from causal_lm.config import ModelConfig  # noqa: E402
from causal_lm.decode import generate  # noqa: E402
from causal_lm.interop.hf import model_config_from_hf  # noqa: E402
from causal_lm.model import init_cache  # noqa: E402
from causal_lm.model.functional import forward  # noqa: E402

VOCAB, HIDDEN, CONTEXT = 300, 64, 128
TOL = 1e-4  # float32 logits
NEW = 32

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32}
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
}

# name -> (config class, model class, config overrides, what our config must say)
CASES = {
    "llama3-scaled": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
        dict(rope_type="llama3", rope_factor=8.0, rope_original_max_len=32, layer_ropes=("rope", "rope")),
    ),
    "qwen3-yarn-headdim": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_parameters=YARN_ROPE),
        dict(rope_type="yarn", qk_norm=True, head_dim=24, tie_embeddings=False, layer_windows=(0, 0)),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
        ),
        dict(
            norm_scale_plus_one=True,
            post_norms=True,
            scale_embeddings=True,
            mlp_activation="gelu_tanh",
            attn_scale=24**-0.5,
            attn_softcap=5.0,
            final_softcap=8.0,
            layer_windows=(8, 0),
            qk_norm=False,
            tie_embeddings=True,
        ),
    ),
    "gemma3-5local-1global": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=32,
            sliding_window=8,
            rope_parameters=GEMMA3_ROPE,
        ),
        dict(
            qk_norm=True,
            attn_softcap=0.0,
            rope_theta=1e6,
            rope_local_theta=1e4,
            rope_type="linear",
            layer_windows=(8, 8, 8, 8, 8, 0),
            layer_ropes=("local",) * 5 + ("rope",),
        ),
    ),
    "smollm3-nope": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2),
        dict(rope_theta=2e6, layer_ropes=("rope", "nope", "rope", "nope"), qk_norm=False, tie_embeddings=True),
    ),
}


def make_hf_model(config_cls, model_cls, seed=0, **overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    config = getattr(transformers, config_cls)(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gemma = model_cls.startswith("Gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if "norm" in name:  # gains near 1: Gemma's (1 + w) norms store w near 0
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None  # generate exactly NEW tokens, like ours without stop tokens
    model.generation_config.pad_token_id = 0
    return model


def hf_logits(model, tokens, attention_mask=None):
    with torch.no_grad():
        mask = None if attention_mask is None else torch.as_tensor(attention_mask, dtype=torch.long)
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long), attention_mask=mask).logits.numpy()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, our model): built, saved and converted once per family."""
    name = request.param
    config_cls, model_cls, overrides, _ = CASES[name]
    hf_model = make_hf_model(config_cls, model_cls, **overrides)
    path = str(tmp_path_factory.mktemp(name))
    hf_model.save_pretrained(path)
    model, _ = load_hf(path)
    return name, hf_model, model


# A ragged batch: row 0 has 48 real tokens, row 1 has 29 and then padding (segment id 0, attention_mask 0).
TOKENS = np.random.default_rng(0).integers(3, VOCAB, (2, 48)).astype(np.int32)
LENGTHS = (48, 29)
SEGMENTS = (np.arange(48)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.int32)
PROMPTS = [TOKENS[0, :11].tolist(), TOKENS[1, :6].tolist()]


MAX_DIFFS = {}  # family -> max |logit difference| vs transformers, printed at the end of the module


def _ragged_close(ours, ref, name, what):
    for row, n in enumerate(LENGTHS):
        diff = float(np.abs(ours[row, :n] - ref[row, :n]).max())
        MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), diff)
        assert diff < TOL, f"{name} {what}, row {row}: max |logit diff| {diff:.2e}"


@pytest.fixture(scope="module")
def ragged(case):
    """Our logits on the ragged batch (one compile per family), shared by the checks that compare with them."""
    return np.asarray(forward(case[2], TOKENS, segment_ids=SEGMENTS)[0])


def test_config_mapping(case):
    name, _, model = case
    c = model.config
    for field, value in CASES[name][3].items():
        assert getattr(c, field) == value, f"{name}: {field}={getattr(c, field)!r}, expected {value!r}"


def test_logits_match_transformers_on_a_ragged_batch(case, ragged):
    name, hf_model, _ = case
    ref = hf_logits(hf_model, TOKENS, SEGMENTS)
    assert np.abs(ref).max() > 1.0  # not a comparison of near-zero logits
    _ragged_close(ragged, ref, name, "ragged batch vs transformers")


@pytest.fixture(scope="module")
def generations():
    return {}


def _ours(generations, name, model, use_cache):
    key = (name, use_cache)
    if key not in generations:
        generations[key] = generate(model, PROMPTS, max_new_tokens=NEW, use_cache=use_cache).tokens
    return generations[key]


@pytest.mark.slow
def test_greedy_tokens_match_transformers(case, generations):
    name, hf_model, model = case
    ours = _ours(generations, name, model, use_cache=True)
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
        ref = out[0, len(prompt) :].tolist()
        assert len(ref) == NEW and len(prompt) + NEW > 8  # past the 8-token windows
        assert ours[row] == ref, (
            f"{name} row {row}: first difference at step "
            f"{next(i for i, (a, b) in enumerate(zip(ours[row], ref, strict=True)) if a != b)}"
        )


@pytest.mark.slow
def test_cache_equals_recompute(case, generations, ragged):
    name, _, model = case
    assert _ours(generations, name, model, use_cache=True) == _ours(generations, name, model, use_cache=False)
    # The ragged batch through the cache in two chunks of 24 (longer than the windows and their rings): the same
    # logits as one pass without a cache, at every real position (to float32 rounding: other kernels, other
    # summation orders, on logits of magnitude ~10).
    cache = init_cache(model.config, batch_size=2, max_len=64)
    first, cache = forward(model, TOKENS[:, :24], segment_ids=SEGMENTS[:, :24], cache=cache)
    second, cache = forward(model, TOKENS[:, 24:], segment_ids=SEGMENTS[:, 24:], cache=cache)
    chunked = np.concatenate([np.asarray(first), np.asarray(second)], axis=1)
    assert np.asarray(cache.lengths).tolist() == list(LENGTHS)
    for row, n in enumerate(LENGTHS):
        np.testing.assert_allclose(chunked[row, :n], ragged[row, :n], atol=TOL, rtol=0, err_msg=f"{name} row {row}")


def test_round_trip_through_save_hf(case, tmp_path):
    import jax
    from flax import nnx

    name, hf_model, model = case
    out = str(tmp_path / "out")
    save_hf(model, None, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(back).__name__ == CASES[name][1]
    np.testing.assert_array_equal(hf_logits(back, TOKENS), hf_logits(hf_model, TOKENS))
    again, _ = load_hf(out)
    assert again.config == model.config
    a, b = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(again))
    jax.tree.map(np.testing.assert_array_equal, a, b)


# ---- RoPE frequencies, config mapping and refusals: no compilation ----------------------------------------------


@pytest.mark.parametrize(
    "rope, top",
    [
        (LLAMA3_ROPE, {}),
        ({**LLAMA3_ROPE, "rope_theta": 500_000.0, "factor": 32.0, "original_max_position_embeddings": 8}, {}),
        (LLAMA3_ROPE, {"original_max_position_embeddings": 100}),  # a top-level value wins, as in transformers
        ({"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}, {}),
        (YARN_ROPE, {}),
        ({**YARN_ROPE, "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, {}),
        ({**YARN_ROPE, "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707}, {}),  # DeepSeek's form
        ({**YARN_ROPE, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5}, {}),
    ],
    ids=["llama3", "llama3-wide", "llama3-top-level", "linear", "yarn", "yarn-explicit", "yarn-mscale", "yarn-mscale2"],
)
def test_inverse_frequencies_equal_transformers(rope, top):
    """transformers' own rope init function against the config it maps to here and our frequencies from it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from causal_lm.model.rope import inverse_frequencies

    hf = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=CONTEXT, rope_parameters=dict(rope)
    )
    for k, v in top.items():
        setattr(hf, k, v)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    d = {**hf.to_dict(), "architectures": ["LlamaForCausalLM"], **top}
    inv, factor = inverse_frequencies(model_config_from_hf(d))
    np.testing.assert_allclose(inv, ref_inv.numpy(), rtol=2e-7, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    plain = 1.0 / (10_000.0 ** (np.arange(0, 16, 2) / 16))
    assert np.abs(inv / plain - 1).max() > 0.1  # the scaling changes the frequencies


def _hf_dict(config_cls, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4)
    base.update(num_hidden_layers=kw.pop("num_hidden_layers", 6), max_position_embeddings=CONTEXT, **kw)
    d = getattr(transformers, config_cls)(**base).to_dict()
    d["architectures"] = [config_cls.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    return d


def test_older_config_spellings_map_the_same():
    """Configs written by transformers 4.x: Gemma 3's rope_theta / rope_local_base_freq / rope_scaling and
    sliding_window_pattern, Gemma 2 without layer_types, SmolLM3 with only no_rope_layer_interval."""
    new = model_config_from_hf(_hf_dict("Gemma3TextConfig", sliding_window=8, rope_parameters=dict(GEMMA3_ROPE)))
    old = _hf_dict("Gemma3TextConfig", sliding_window=8)
    for k in ("rope_parameters", "layer_types"):
        old.pop(k)
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    assert model_config_from_hf(old) == new
    assert new.layer_ropes == ("local",) * 5 + ("rope",)

    g2 = _hf_dict("Gemma2Config", num_hidden_layers=4, sliding_window=8)
    g2.pop("layer_types")
    assert model_config_from_hf(g2).layer_windows == (8, 0, 8, 0)

    s3 = _hf_dict("SmolLM3Config", num_hidden_layers=8, no_rope_layer_interval=4)
    s3.pop("no_rope_layers")
    assert model_config_from_hf(s3).layer_ropes == ("rope", "rope", "rope", "nope") * 2


def test_gemma3_local_layers_keep_their_theta_when_the_window_covers_the_context():
    """A window no shorter than the context hides nothing; the local layers are still local for their RoPE."""
    d = _hf_dict("Gemma3TextConfig", sliding_window=512, rope_parameters=dict(GEMMA3_ROPE))
    c = model_config_from_hf(d)
    assert c.layer_windows == (CONTEXT,) * 5 + (0,) and c.layer_ropes == ("local",) * 5 + ("rope",)
    same = {"sliding_attention": dict(GEMMA3_ROPE["full_attention"]), "full_attention": GEMMA3_ROPE["full_attention"]}
    c = model_config_from_hf(_hf_dict("Gemma3TextConfig", sliding_window=512, rope_parameters=same))
    assert c.layer_windows == (0,) * 6 and c.rope_local_theta is None and c.rope_type == "linear"


@pytest.mark.parametrize(
    "config_cls, changes, match",
    [
        ("LlamaConfig", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), r"rope type 'dynamic'.*NTK"),
        (
            "LlamaConfig",
            dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
            r"rope type 'longrope'",
        ),
        ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), r"needs 'low_freq_factor'"),
        ("Qwen3Config", dict(attention_bias=True), r"attention_bias=true.*Qwen3ForCausalLM"),
        ("SmolLM3Config", dict(mlp_bias=True), r"mlp_bias=true"),
        ("Gemma2Config", dict(hidden_activation="gelu"), r"hidden_activation='gelu'.*gelu_pytorch_tanh"),
        ("Gemma3TextConfig", dict(use_bidirectional_attention=True), r"use_bidirectional_attention"),
        (
            "Gemma3TextConfig",
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                }
            ),
            r"sliding_attention layers' rope parameters are scaled differently",
        ),
        (
            "Qwen3Config",
            dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"),
            r"multimodal Gemma 3",
        ),
    ],
)
def test_unsupported_settings_are_refused(config_cls, changes, match):
    d = {**_hf_dict(config_cls), **changes}  # config.json as transformers wrote it, then edited
    with pytest.raises(HFFormatError, match=match):
        model_config_from_hf(d)


SMALL = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=4, mlp_dim=32, max_seq_len=64)


def test_save_refuses_what_the_architecture_cannot_express(tmp_path):
    from flax import nnx

    from causal_lm.model import build_model

    gemma = ModelConfig(
        **SMALL,
        norm_scale_plus_one=True,
        post_norms=True,
        scale_embeddings=True,
        qk_norm=True,
        attn_softcap=20.0,
        sliding_window=8,
        layer_pattern="local,global",
        rope_local_theta=1e4,
    )
    model = nnx.eval_shape(lambda: build_model(gemma))
    for arch, match in (
        ("llama", r"qk_norm=True.*norm_scale_plus_one=True.*rope_local_theta"),
        ("gemma3", r"attn_softcap=20.0 \(only Gemma 2"),
        ("gemma2", r"qk_norm=True.*rope_local_theta"),
    ):
        with pytest.raises(HFFormatError, match=match):
            save_hf(model, None, str(tmp_path / arch), architecture=arch)
    nope = nnx.eval_shape(lambda: build_model(ModelConfig(**SMALL, rope_pattern="rope,nope")))
    with pytest.raises(HFFormatError, match=r"rope_pattern='rope,nope' \(only SmolLM3"):
        save_hf(nope, None, str(tmp_path / "q"), architecture="qwen3")


def test_report_max_logit_differences():
    """Runs last in this module: prints the measured differences (pytest -s shows them)."""
    for name, d in MAX_DIFFS.items():
        print(f"max |logit diff| vs transformers on the ragged batch, {name}: {d:.2e}")
