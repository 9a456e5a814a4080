"""Tests written to kill the mutants that survived or were caught only narrowly (issue 21), none needing torch.

RoPE against a rotation written out here (a unit vector turned by a known angle; q.k depends only on the distance);
a query attends to its own key (a one-token sequence's attention output is its own value path, exactly); the
recompute path's cost grows with the sequence (the shapes the model is traced with, which the cached path cannot
fake). The decay mask, the schedule's values and orbax's own shape check are in test_optimizers.py and
test_reliability.py."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from variants import tiny_config, tiny_model

from causal_lm.config import TrainConfig, load_config
from causal_lm.decode import generate
from causal_lm.model.kernels import attention
from causal_lm.model.kv_cache import init_cache
from causal_lm.model.mask import AttentionMask, make_mask
from causal_lm.model.rope import apply_rope, layer_rope_tables, rope_tables
from causal_lm.model.transformer import Decoder
from causal_lm.train import Checkpointer, read_metrics, train_and_evaluate
from causal_lm.train.state import init_params, init_train_state, make_optimizer

THETA = 10000.0


def _rotate_by_hand(x: np.ndarray, pos: int, rope_dim: int, theta: float = THETA) -> np.ndarray:
    """RoPE in float64, pair by pair: dims (i, i + rope_dim/2) turned by pos * theta**(-2i/rope_dim); the rest of
    the vector untouched. Written from the definition, not from the package's code."""
    y = np.array(x, np.float64)
    half = rope_dim // 2
    for i in range(half):
        a = pos * theta ** (-2.0 * i / rope_dim)
        x1, x2 = x[..., i], x[..., i + half]
        y[..., i] = x1 * math.cos(a) - x2 * math.sin(a)
        y[..., i + half] = x1 * math.sin(a) + x2 * math.cos(a)
    return y


def _rope(x, positions, rope_dim):
    cos, sin = rope_tables(jnp.asarray(positions)[None], rope_dim, THETA)
    return np.asarray(apply_rope(jnp.asarray(x), cos, sin), np.float64)


def test_rope_turns_a_unit_vector_by_the_known_angle():
    """e_0 at position p becomes (cos p, 0.., sin p, 0..) (the first pair turns at frequency 1); e_1 turns at
    theta**(-2/rope_dim) into dim 1 + rope_dim/2; with rope_dim < H the tail dims never move. Kills a flipped sign
    of rotate-half, a wrong pairing, a slice of the wrong dims, positions off by one."""
    H, rope_dim, T = 8, 4, 6
    x = np.zeros((1, T, 2, H), np.float32)
    x[:, :, 0, 0] = 1.0  # head 0: e_0
    x[:, :, 1, 1] = 1.0  # head 1: e_1
    y = _rope(x, np.arange(T), rope_dim)
    for p in range(T):
        e0 = np.zeros(H)
        e0[0], e0[2] = math.cos(p), math.sin(p)
        np.testing.assert_allclose(y[0, p, 0], e0, atol=1e-6)
        a = p * THETA ** (-2.0 / rope_dim)
        e1 = np.zeros(H)
        e1[1], e1[3] = math.cos(a), math.sin(a)
        np.testing.assert_allclose(y[0, p, 1], e1, atol=1e-6)
    # A random vector against the hand-written rotation, partial (4 of 8 dims) and full.
    r = np.random.default_rng(0).standard_normal((1, T, 2, H)).astype(np.float32)
    for d in (4, 8):
        for p in range(T):
            np.testing.assert_allclose(_rope(r, np.arange(T), d)[0, p], _rotate_by_hand(r[0, p], p, d), atol=1e-5)


def test_rope_scores_depend_only_on_the_distance():
    """q.k after rotation at positions (m, n) equals that at (m + s, n + s), and changes with m - n."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, 1, 8)).astype(np.float32)
    score = lambda m, n: float(np.sum(_rope(q, [m], 8) * _rope(k, [n], 8)))  # noqa: E731
    for m, n in [(5, 2), (9, 9), (3, 7)]:
        for s in (1, 13, 40):
            assert score(m + s, n + s) == pytest.approx(score(m, n), abs=1e-4)
    assert abs(score(5, 2) - score(6, 2)) > 1e-3
    # By hand: the score is sum over pairs of |q_i||k_i| cos(angle difference), a function of m - n only.
    expected = float(np.sum(_rotate_by_hand(q[0, 0, 0], 5, 8) * _rotate_by_hand(k[0, 0, 0], 2, 8)))
    assert score(5, 2) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("kv", ["mha", "gqa", "mqa"])
def test_a_lone_query_attends_to_its_own_key(kv):
    """One token: its only visible key is its own, so every kernel returns exactly its value. Then at the layer:
    a one-token sequence's attention output is its value projection through wo (the gate applied). Kills a mask
    that hides a token from itself (`<` for `<=`) and a wrong query-head -> KV-head mapping on the value path."""
    rng = np.random.default_rng(2)
    K = {"mha": 4, "gqa": 2, "mqa": 1}[kv]
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 1, K, 8)).astype(np.float32)
    v = rng.standard_normal((2, 1, K, 8)).astype(np.float32)
    pos = jnp.zeros((2, 1), jnp.int32)
    mask = AttentionMask(make_mask(pos, pos, jnp.ones((2, 1), bool)), index_causal=True)
    assert bool(jnp.all(mask.visible))
    expected = np.repeat(v, 4 // K, axis=2)  # query head n reads KV head n // G
    for impl in ("xla", "dot_product_attention"):
        out, _ = attention(q, k, v, mask, impl=impl)
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-6)

    config = tiny_config(kv, "rope_full", gate=True)
    model = tiny_model(config)
    graphdef, state = nnx.split(model.blocks)
    layer0 = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    x = rng.standard_normal((2, 1, config.d_model)).astype(np.float32)
    valid = jnp.ones((2, 1), bool)
    positions, ctx = model._self_attention_context(None, None, valid)
    ropes, rope_of_layer = layer_rope_tables(config, positions)
    ctx = dataclasses.replace(ctx, ropes=ropes, rope_of_layer=rope_of_layer)
    out, _, _ = layer0.attn(jnp.asarray(x), ctx)
    _, v_own = layer0.attn.project_kv(jnp.asarray(x), *ctx.rope_for(0))
    v_heads = np.repeat(np.asarray(v_own, np.float64), 4 // K, axis=2)  # [B, 1, N, H]
    gate = 1 / (1 + np.exp(-np.einsum("btd,dnh->btnh", x, np.asarray(layer0.attn.wg[...], np.float64))))
    by_hand = np.einsum("btnh,nhd->btd", v_heads * gate, np.asarray(layer0.attn.wo[...], np.float64))
    np.testing.assert_allclose(np.asarray(out), by_hand, atol=1e-5)


def test_each_query_sees_its_own_position_in_the_mask():
    """The mask's diagonal is visible (key_pos <= query_pos includes equality) in every mode's positions."""
    pos = jnp.asarray([[0, 1, 2, 3], [5, 6, 7, 8]], jnp.int32)
    vis = np.asarray(make_mask(pos, pos, jnp.ones((2, 4), bool)))
    np.testing.assert_array_equal(vis, np.broadcast_to(np.tril(np.ones((4, 4), bool)), (2, 4, 4)))
    # One decode query at position 3 over a cache holding positions 0..3 and two empty slots.
    kp = jnp.asarray([[0, 1, 2, 3, -1, -1]], jnp.int32)
    vis = np.asarray(make_mask(jnp.asarray([[3]], jnp.int32), kp, kp >= 0))
    np.testing.assert_array_equal(vis[0, 0], [True, True, True, True, False, False])


def test_the_recompute_path_runs_the_model_over_the_whole_sequence(monkeypatch):
    """What the model is traced with inside generate(): without a cache, every call covers the whole buffer
    (prompt bucket + new tokens) and none takes a cache, so the work grows with the length; with the cache the
    loop's step takes one token. Kills use_cache=False silently decoding through the cache (whose kv_computed
    alone could be made to look right)."""
    seen = []
    original = Decoder.forward

    def recording(self, tokens, **kw):
        seen.append((tuple(tokens.shape), kw.get("cache") is not None))
        return original(self, tokens, **kw)

    monkeypatch.setattr(Decoder, "forward", recording)
    config = tiny_config("gqa", "rope_full", max_seq_len=72)  # a config of its own: nothing compiled yet
    model = tiny_model(config)
    for new in (5, 9):
        seen.clear()
        res = generate(model, [[1, 2, 3]], max_new_tokens=new, use_cache=False)
        assert len(res.tokens[0]) == new
        assert seen and all(not cached for _, cached in seen), seen
        assert {shape for shape, _ in seen} == {(1, 8 + new)}, seen  # prompt bucket 8 + the new tokens
        assert res.kv_computed == sum(3 + i for i in range(new))
    seen.clear()
    generate(model, [[1, 2, 3]], max_new_tokens=5, use_cache=True)
    assert (((1, 1), True)) in seen and all(cached for _, cached in seen), seen


MLA_CONFIG = tiny_config(
    "mha", "rope_full", attention_type="mla", num_kv_heads=None, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4
)


@pytest.mark.parametrize(
    "config",
    [tiny_config("gqa", "rope_full"), tiny_config("mqa", "rope_partial"), MLA_CONFIG],
    ids=["gqa-rope", "mqa-rope-partial", "mla"],
)
def test_logits_depend_on_relative_positions_only(config):
    """With RoPE the only position signal is the rotation of q against k: shifting every position by the same
    amount leaves the logits unchanged, while spreading them apart changes them. Kills V rotated too, a key (MLA's
    shared rope key) left unrotated while its query turns, tables built for other positions than the tokens'."""
    model = tiny_model(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (1, 9)).astype(np.int32)
    pos = np.arange(9, dtype=np.int32)[None]
    run = jax.jit(lambda t, p: model(t, positions=p)[0])
    base = np.asarray(run(tokens, pos))
    np.testing.assert_allclose(np.asarray(run(tokens, pos + 29)), base, atol=2e-5)
    assert np.abs(np.asarray(run(tokens, pos * 3)) - base).max() > 1e-3


def test_int8_cache_reads_back_what_was_written():
    """The int8 cache's dequantized K/V (stored ints times their per-token scales) equal the float32 cache's to
    within half a quantization step of each vector. Kills a scale dropped, applied twice or taken over the wrong
    axis: decoding with such a cache stays self-consistent (cached == speculative), so nothing else notices."""
    config = tiny_config("gqa", "rope_full")
    model = tiny_model(config)
    tokens = np.arange(1, 8, dtype=np.int32)[None].repeat(2, 0)
    caches = {}
    for dtype in ("float32", "int8"):
        _, caches[dtype] = model(tokens, cache=init_cache(config, 2, 12, dtype))
    f32, i8 = caches["float32"], caches["int8"]
    for name in ("k", "v"):
        # Layer 0 only: its K/V come from the embeddings alone (later layers see layer 0's quantized attention).
        exact = np.asarray(f32._read(f32.groups[0], name, 0))[:, :7]  # [B, 7, K, H]
        back = np.asarray(i8._read(i8.groups[0], name, 0))[:, :7]
        step = np.abs(exact).max(-1, keepdims=True) / 127.0
        assert np.all(np.abs(back - exact) <= 0.5 * step + 1e-6), name
        assert np.abs(exact).max() > 0.1


def test_first_layer_attention_weights_by_hand():
    """Layer 0's attention weights from the parameters, in float64 numpy: RMSNorm with the config's eps (a large
    one, so it shows), q and k projections, RoPE by hand, scores times head_dim**-0.5, query head n reading KV head
    n // G, the causal mask including the diagonal, softmax. Kills a wrong score scale, a hard-coded norm eps, a
    wrong GQA mapping, a flipped rotation, a mask that hides the diagonal or shows the future."""
    config = tiny_config("gqa", "rope_full", norm_eps=0.1)
    model = tiny_model(config)
    T, N, K, H = 7, config.num_heads, config.num_kv_heads, config.head_dim
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, (1, T)).astype(np.int32)
    got = np.asarray(jax.jit(lambda t: model.attention_weights(t))(tokens))[0, 0]  # [N, T, T]

    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    x = f64(model.embed[...])[tokens[0]]  # [T, D]
    gain = f64(model.blocks.attn_norm.scale[...])[0]
    h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 0.1) * gain
    q = np.einsum("td,dnh->tnh", h, f64(model.blocks.attn.wq[...])[0])
    k = np.einsum("td,dkh->tkh", h, f64(model.blocks.attn.wk[...])[0])
    q = np.stack([_rotate_by_hand(q[t], t, H, config.rope_theta) for t in range(T)])
    k = np.stack([_rotate_by_hand(k[t], t, H, config.rope_theta) for t in range(T)])
    G = N // K
    for n in range(N):
        s = q[:, n] @ k[:, n // G].T / math.sqrt(H)  # [T, T]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(got[n], p / p.sum(-1, keepdims=True), atol=1e-5, err_msg=f"head {n}")


@pytest.mark.parametrize("scale", [1e3, 1e-2], ids=["clipped", "under-the-limit"])
def test_gradient_clipping_scales_the_whole_gradient_by_its_global_norm(scale):
    """train.grad_clip=c: the optimizer sees g * min(1, c / ||g||) with ||g|| over every parameter together, as
    AdamW's first momentum shows ((1 - beta1) times what it was given). Kills per-element or per-parameter
    clipping, clipping after the optimizer, and none at all (AdamW's first update alone cannot tell: it is the
    gradient's sign)."""
    _, params, _ = init_params(tiny_config(), 0)
    keys = iter(jax.random.split(jax.random.key(5), len(jax.tree.leaves(params))))
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype) * scale, params)
    t = TrainConfig(grad_clip=1.0, beta1=0.9)
    opt = make_optimizer(t)
    _, state = jax.jit(opt.update)(grads, opt.init(params), params)
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in jax.tree.leaves(grads)))
    factor = min(1.0, 1.0 / norm)
    mu = state[1][0].mu  # chain(clip, adamw): AdamW's scale_by_adam state
    for g, m in zip(jax.tree.leaves(grads), jax.tree.leaves(mu), strict=True):
        np.testing.assert_allclose(np.asarray(m), 0.1 * np.asarray(g) * factor, rtol=1e-4, atol=1e-12)


def test_a_cache_filled_to_its_last_slot_equals_recompute():
    """A cache of exactly T slots filled in two chunks (5 + 3 tokens): the logits equal one pass without a cache,
    and the slots hold every position 0..T-1. Kills a write one slot late (harmless until the last slot, whose
    token JAX's scatter would then drop silently) and a length that does not reach max_len."""
    config = tiny_config("gqa", "rope_full")
    model = tiny_model(config)
    T = 8
    tokens = np.random.default_rng(6).integers(0, config.vocab_size, (2, T)).astype(np.int32)
    full = np.asarray(model(tokens)[0])
    cache = init_cache(config, 2, T)
    first, cache = model(tokens[:, :5], cache=cache)
    second, cache = model(tokens[:, 5:], cache=cache)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), full, atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [T, T]
    for row in np.asarray(cache.groups[0].positions):
        assert sorted(row.tolist()) == list(range(T))


def _checkpoint_state(workdir, step, config):
    _, params, _ = init_params(config.model, 0)
    state = init_train_state(params, make_optimizer(config.train), 0)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        keys = ("opt_state", "step", "rng", "bad_step")
        p, s, _ = ckpt.restore(step, state.params, {k: getattr(state, k) for k in keys})
    finally:
        ckpt.close()
    return jax.tree.leaves((p, s))


def test_a_resumed_run_ends_bitwise_where_the_straight_run_did(tmp_path):
    """3 steps straight against 2 steps, then train.steps=3 in the same workdir (resuming from step 2): the
    logged losses and the final checkpoint (parameters, optimizer state, step, RNG) are identical. A fast
    counterpart of test_train's SIGKILL resume; kills a resume that restarts the RNG or the data position."""
    run = ["train.checkpoint_every=1", "train.eval_every=3", "train.log_every=1", "train.progress=false"]
    run += ["train.sample_tokens=0", "train.warmup_steps=1", "train.min_lr_ratio=1.0"]  # lr independent of steps
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    config = load_config("tiny", [*run, "train.steps=3"])
    train_and_evaluate(config, straight)
    train_and_evaluate(load_config("tiny", [*run, "train.steps=2"]), resumed)
    train_and_evaluate(config, resumed)
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    rows = lambda w: [{k: r.get(k) for k in keys} for r in read_metrics(w) if "loss" in r]  # noqa: E731
    assert rows(resumed) == rows(straight) and len(rows(straight)) == 3
    for a, b in zip(_checkpoint_state(straight, 3, config), _checkpoint_state(resumed, 3, config), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_layout_written_by_hand_loads_to_the_same_model(tmp_path):
    """A Qwen2-style model (GQA, q/k/v biases, untied head) written out in Hugging Face's layout by hand (each
    Linear weight [out, in], each bias [heads * head_dim]), read back with load_hf_params: the logits are the
    original's. Needs only safetensors, not torch: kills transposes and bias layouts gone wrong on load."""
    save_file = pytest.importorskip("safetensors.numpy").save_file
    from causal_lm.interop.hf import WEIGHTS_NAME, load_hf_params, model_from_params
    from causal_lm.model import build_model

    config = tiny_config("gqa", "rope_full", qkv_bias=True, tie_embeddings=False)
    model = build_model(config, seed=1)
    rng = np.random.default_rng(7)
    for name in ("bq", "bk", "bv"):  # biases away from 0, each head and dim its own value
        b = getattr(model.blocks.attn, name)
        b[...] = jnp.asarray(rng.standard_normal(b[...].shape).astype(np.float32))
    p = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    D, N, K, H = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    a, mlp = p["blocks"]["attn"], p["blocks"]["mlp"]
    hf = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]["scale"]}
    hf["lm_head.weight"] = p["lm_head"].T
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        hf[pre + "input_layernorm.weight"] = p["blocks"]["attn_norm"]["scale"][i]
        hf[pre + "post_attention_layernorm.weight"] = p["blocks"]["mlp_norm"]["scale"][i]
        for proj, heads in (("q", N), ("k", K), ("v", K)):
            hf[pre + f"self_attn.{proj}_proj.weight"] = a["w" + proj][i].reshape(D, heads * H).T
            hf[pre + f"self_attn.{proj}_proj.bias"] = a["b" + proj][i].reshape(heads * H)
        hf[pre + "self_attn.o_proj.weight"] = a["wo"][i].reshape(N * H, D).T
        for proj in ("gate", "up", "down"):
            hf[pre + f"mlp.{proj}_proj.weight"] = mlp["w_" + proj][i].T
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in hf.items()}, str(tmp_path / WEIGHTS_NAME))
    loaded = model_from_params(config, load_hf_params(str(tmp_path), config))
    tokens = rng.integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(loaded(tokens)[0]), np.asarray(model(tokens)[0]), atol=1e-5)
