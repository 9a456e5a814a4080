"""Post-training (causal_lm/train/post.py, docs/post-training.md): chat SFT's assistant-only loss.

The bug classes: a loss that trains on the user's tokens (the mask lost or shifted by one on its way from the
rendered conversation to the targets), packed conversations that see each other.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from causal_lm.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from causal_lm.data import ByteTokenizer, DataError
from causal_lm.data.pipeline import pack, rows_to_batch
from causal_lm.train.grpo import GRPOSettings, GRPOTrainer, group_advantages, grpo_loss, token_logprobs
from causal_lm.train.post import build_sft_data, encode_conversation, synthetic_conversations
from causal_lm.train.state import init_params
from causal_lm.train.step import loss_and_grads

TINY = ModelConfig(vocab_size=259, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=48, max_seq_len=128)
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And 4 - 1?"},
    {"role": "assistant", "content": "3."},
]


@pytest.fixture(scope="module")
def tiny():
    graphdef, params, rest = init_params(TINY, 0)
    return graphdef, params, rest


# ---- SFT -----------------------------------------------------------------------------------------------------
def test_mask_covers_exactly_the_assistant_replies_and_their_end():
    tok = ByteTokenizer()
    ids, mask = encode_conversation(tok, CONV)
    assert len(ids) == len(mask)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert trained == tok.encode("5.") + [tok.eos_id] + tok.encode("3.") + [tok.eos_id]
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if not m]).startswith("System: Be brief.\nUser:")
    batch, _ = _batch([CONV])  # packed: the weighted targets are exactly the replies and their ends
    assert batch["targets"][batch["weights"] > 0].tolist() == trained


def _batch(convs, seq_len=64):
    tok = ByteTokenizer()
    enc = [encode_conversation(tok, c) for c in convs]
    flat = np.asarray([x for ids, _ in enc for x in ids], np.int32)
    mask = np.asarray([x for _, m in enc for x in m], bool)
    rows = pack(flat, np.asarray([len(ids) for ids, _ in enc]), seq_len, tok.pad_id, mask=mask)
    return rows_to_batch(rows.tokens, rows.segments, rows.mask), rows


@pytest.fixture(scope="module")
def grads_of(tiny):
    graphdef, params, rest = tiny
    fn = jax.jit(lambda p, b: loss_and_grads(graphdef, p, rest, b)[:2])
    return lambda batch: jax.device_get(fn(params, batch))


def test_loss_ignores_non_assistant_targets(grads_of):
    """Changing a user token's target leaves the loss and every gradient unchanged; an assistant token's changes
    them."""
    batch, _ = _batch([CONV])
    w = batch["weights"][0]
    user_pos = int(np.flatnonzero(w == 0)[3])  # a target inside the system/user text
    asst_pos = int(np.flatnonzero(w == 1)[0])
    loss0, g0 = grads_of(batch)

    def changed(pos):
        b = {k: v.copy() for k, v in batch.items()}
        b["targets"][0, pos] = (b["targets"][0, pos] + 1) % 256
        return grads_of(b)

    loss1, g1 = changed(user_pos)
    assert loss1 == loss0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True))
    loss2, g2 = changed(asst_pos)
    assert loss2 != loss0
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g2), strict=True))


def test_packing_keeps_conversations_apart(tiny):
    """Two conversations packed in one row: separate segments, and the second one's logits equal its logits alone."""
    graphdef, params, rest = tiny
    other = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    batch, rows = _batch([other, CONV], seq_len=96)
    seg = batch["segment_ids"][0]
    assert set(seg.tolist()) >= {1, 2}
    start = int(np.argmax(seg == 2))
    assert batch["weights"][0, start - 1] == 0  # the boundary is never a target
    alone, _ = _batch([CONV], seq_len=96)
    model = nnx.merge(graphdef, params, rest)
    packed = model(jnp.asarray(batch["tokens"]), segment_ids=jnp.asarray(batch["segment_ids"]))[0]
    single = model(jnp.asarray(alone["tokens"]), segment_ids=jnp.asarray(alone["segment_ids"]))[0]
    n = int((seg == 2).sum())
    np.testing.assert_allclose(packed[0, start : start + n], single[0, :n], atol=1e-5)
    np.testing.assert_array_equal(batch["weights"][0, start : start + n - 1], alone["weights"][0, : n - 1])


def _sft_config(**train):
    return Config(
        model=TINY,
        data=DataConfig(corpus="synthetic-chat", max_documents=200),
        train=TrainConfig(task="sft", batch_size=4, seq_len=64, **train),
    )


def test_sft_data_weights_only_assistant_tokens():
    data = build_sft_data(_sft_config())
    batch = next(data.train)
    tok = data.tokenizer
    trained = batch["targets"][batch["weights"] > 0]
    untrained = batch["targets"][(batch["weights"] == 0) & (batch["segment_ids"] > 0)]
    assert tok.decode(trained).count("The answer is") >= 1
    assert "What is" not in tok.decode(trained) and "User:" not in tok.decode(trained)
    assert "User:" in tok.decode(untrained)
    assert data.info["val_tokens"] > 0 and data.val[0]["weights"].sum() > 0  # eval reports assistant-token loss


def test_synthetic_set_is_fixed_by_its_seed():
    assert synthetic_conversations(5, 1) == synthetic_conversations(5, 1) != synthetic_conversations(5, 2)


def test_synthetic_replies_restate_each_question_form_once():
    from causal_lm.train.post import arithmetic_reply

    for q in ("What is 12 + 3?", "Compute 12 + 3.", "12 + 3 = ?"):
        assert arithmetic_reply(q, 15) == "12 + 3 = 15. The answer is 15.", q


def test_bad_sft_input_fails_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="train.task must be one of"):
        TrainConfig(task="rlhf")
    with pytest.raises(ConfigError, match="needs conversations"):
        build_sft_data(dataclasses.replace(_sft_config(), data=DataConfig(corpus="builtin")))
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": []}\n')
    with pytest.raises(DataError, match="c.jsonl:1: the conversation has no assistant message"):
        build_sft_data(dataclasses.replace(_sft_config(), data=DataConfig(corpus=str(bad))))
    bad.write_text('{"text": "hi"}\n')
    with pytest.raises(DataError, match="c.jsonl:1: the record has no 'messages'"):
        build_sft_data(dataclasses.replace(_sft_config(), data=DataConfig(corpus=str(bad))))


# ---- logprob parity and GRPO ---------------------------------------------------------------------------------
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.6),
}
RL_MODEL = dataclasses.replace(TINY, init_std=0.5, max_seq_len=48)


@pytest.fixture(scope="module")
def rl_model():
    graphdef, params, rest = init_params(RL_MODEL, 0)
    return nnx.merge(graphdef, params, rest)


@pytest.fixture(scope="module")
def rollouts(rl_model):
    from causal_lm.serve import Engine

    engine = Engine(rl_model, max_seqs=8, page_size=8, num_pages=64, max_step_tokens=16, batch_invariant=True)
    prompt = ByteTokenizer().encode("User: What is 2 + 3?\nAssistant: ")
    reqs = [dict(prompt_ids=prompt, max_tokens=10, seed=i, **kw) for i, kw in enumerate(SETTINGS.values())]
    return dict(zip(SETTINGS, engine.run(reqs, progress=False), strict=True))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampler_logprobs_equal_the_trainers(rl_model, rollouts, name):
    """The engine's sample_logprobs (the distribution each token was drawn from) equal the trainer's recomputation
    from one forward pass, with the same settings, bitwise (CPU, float32, the batch-invariant mode on both sides),
    for greedy, temperature, top-k and top-p."""
    from causal_lm.train.grpo import rollout_batch

    res, kw = rollouts[name], SETTINGS[name]
    batch, _ = rollout_batch([[res]], [0.0], RL_MODEL.max_seq_len - 1)
    new = np.asarray(
        token_logprobs(
            rl_model,
            jnp.asarray(batch["tokens"]),
            jnp.asarray(batch["targets"]),
            jnp.asarray(batch["segment_ids"]),
            kw.get("temperature", 1.0),
            kw.get("top_k", 0),
            kw.get("top_p", 1.0),
        )
    )[0]
    on = batch["weights"][0] > 0
    assert on.sum() == len(res.tokens)
    np.testing.assert_array_equal(new[on], np.asarray(res.sample_logprobs, np.float32))
    if name == "greedy":  # greedy: the model's own distribution, what `logprobs` reports
        np.testing.assert_allclose(res.sample_logprobs, res.logprobs, atol=1e-6, rtol=0)
    if name in ("top_k", "top_p"):  # the truncated distribution is renormalized: every drawn token gains
        assert all(s > lp for s, lp in zip(res.sample_logprobs, res.logprobs, strict=True))


def test_invariant_attention_is_the_reference_and_ignores_the_calls_shapes():
    """The batch-invariant kernel computes attention (the reference's result, with sink logits and softcapping too),
    and a query's output has the same bits alone over a wider, zero-padded key view (a decode step over a paged
    cache) as among all queries of the sequence (the trainer's pass): the property the parity rests on."""
    from causal_lm.model.kernels import invariant_attention, reference_attention
    from causal_lm.model.mask import AttentionMask

    rng = np.random.default_rng(0)
    T, S = 20, 150  # 150 slots, chunks of 8: the last 16 chunks are empty for every query
    q, k, v = (jnp.asarray(rng.normal(size=(2, T, 4, 8)), jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # GQA: 2 KV heads
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (2, T, T))
    sink = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)

    def attend(q, k, v, vis, sink=None, cap=None, chunk=8):  # chunks of 8 keys: the recurrence spans several
        return invariant_attention(q, k, v, AttentionMask(vis), scale=0.3, sink=sink, softcap=cap, chunk=chunk)

    run = jax.jit(attend, static_argnums=(5, 6))
    for s, cap in ((None, None), (sink, 1.5)):
        want = reference_attention(q, k, v, AttentionMask(causal), scale=0.3, sink=s, softcap=cap)[0]
        np.testing.assert_allclose(run(q, k, v, causal, s, cap), want, atol=2e-6, rtol=0)
    full = np.asarray(run(q, k, v, causal))
    pad = [(0, 0), (0, S - T), (0, 0), (0, 0)]
    kp, vp = jnp.pad(k, pad, constant_values=3.0), jnp.pad(v, pad, constant_values=7.0)  # empty slots: any values
    for p in (0, 7, T - 1):
        vis = jnp.broadcast_to(jnp.arange(S) <= p, (2, 1, S))
        one = np.asarray(run(q[:, p : p + 1], kp, vp, vis))
        np.testing.assert_array_equal(one[:, 0], full[:, p])


BF16_BOUND = 1e-5  # bfloat16, batch-invariant mode on both sides: measured max 1.2e-7 (docs/post-training.md)


@pytest.mark.slow
def test_bfloat16_sampler_logprobs_within_the_stated_bound():
    from causal_lm.serve import Engine
    from causal_lm.train.grpo import rollout_batch

    graphdef, params, rest = init_params(dataclasses.replace(RL_MODEL, dtype="bfloat16"), 0)
    model = nnx.merge(graphdef, params, rest)
    # One compiled step program (a single rows/tokens bucket): the cost here is compiling, not running.
    engine = Engine(
        model, max_seqs=4, page_size=8, num_pages=32, batch_buckets=[4], token_buckets=[16], batch_invariant=True
    )
    prompt = ByteTokenizer().encode("User: What is 2 + 3?\nAssistant: ")
    reqs = [dict(prompt_ids=prompt, max_tokens=8, seed=i, **kw) for i, kw in enumerate(SETTINGS.values())]
    results = engine.run(reqs, progress=False)
    batch, _ = rollout_batch([results], [0.0] * len(results), RL_MODEL.max_seq_len - 1)
    col = lambda key, default: jnp.asarray([kw.get(key, default) for kw in SETTINGS.values()])[:, None]  # noqa: E731
    new = jax.jit(lambda *a: token_logprobs(model, *a))(
        batch["tokens"],
        batch["targets"],
        batch["segment_ids"],
        col("temperature", 1.0),
        col("top_k", 0),
        col("top_p", 1.0),
    )
    on = batch["weights"] > 0
    diff = np.abs(np.asarray(new)[on] - batch["old_logp"][on])
    assert on.sum() == sum(len(r.tokens) for r in results) and diff.max() <= BF16_BOUND, diff.max()


def test_group_advantages_are_normalized_per_group():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [5.0, 5.0, 5.0, 5.0], [0.0, 3.0, 6.0, 9.0]])
    a = group_advantages(r)
    np.testing.assert_allclose(a.mean(axis=1), 0.0, atol=1e-6)
    np.testing.assert_allclose(a[0], [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_array_equal(a[1], 0.0)  # a group that agrees teaches nothing
    np.testing.assert_allclose(a[2].std(), 1.0, atol=1e-5)


def test_grpo_loss_clips_the_ratio():
    """A hand computation: ratio 1.5, eps 0.2: advantage +1 gains only up to 1.2, advantage -1 pays the full 1.5."""
    new = jnp.log(jnp.array([[1.5, 1.0]]))
    old = jnp.zeros((1, 2))
    w = jnp.array([[1.0, 0.0]])
    loss_pos, stats = grpo_loss(new, old, jnp.array([1.0]), w, 0.2)
    loss_neg, _ = grpo_loss(new, old, jnp.array([-1.0]), w, 0.2)
    np.testing.assert_allclose([loss_pos, loss_neg], [-1.2, 1.5], rtol=1e-6)
    np.testing.assert_allclose(stats["ratio_max"], 1.5, rtol=1e-6)
    assert float(stats["ratio_max_dev"]) == pytest.approx(0.5)


def ascii_share(completion: str, answer) -> float:
    """A toy reward a random byte model can climb: the share of ASCII characters in its reply (about half at the
    start: bytes >= 128 decode to U+FFFD)."""
    return sum(c.isascii() for c in completion) / max(len(completion), 1)


def test_grpo_first_ratio_is_one_and_later_inner_steps_move_it(rl_model):
    """The first inner update of a rollout batch is on-policy with bitwise parity: every ratio exactly 1 (and KL 0:
    the reference is the start); the second inner update scores the same tokens with the weights the first moved,
    so its ratios are off 1 (what the clip bounds)."""
    trainer = GRPOTrainer(
        rl_model,
        ByteTokenizer(),
        GRPOSettings(
            group_size=4,
            prompts_per_step=2,
            max_new_tokens=8,
            learning_rate=3e-2,
            reward="test_post_training:ascii_share",
            kl_coef=0.01,
            inner_steps=2,
        ),
    )
    first = trainer.step()
    assert first["ratio_max_dev"] == 0.0  # on-policy and bitwise parity: every ratio is exactly 1
    assert first["ratio_min"] == first["ratio_max"] == 1.0
    assert first["kl"] == 0.0  # the reference is the starting weights
    assert first["last_ratio_max_dev"] > 1e-3, first  # the second inner update sees the moved policy


def test_rollout_engine_pool_is_sized_to_the_rollout():
    """group_size * prompts_per_step rows, each with the pages of prompt + max_new_tokens (rounded up to a power of
    two >= 64, at most max_seq_len): 32 x 64 tokens of pages of 8 here, not the engine's default 1 GiB pool."""
    from causal_lm.train.grpo import rollout_engine_kwargs

    s = GRPOSettings(group_size=8, prompts_per_step=4, max_new_tokens=24)
    assert rollout_engine_kwargs(s, 128, 36) == dict(max_seqs=32, page_size=8, num_pages=32 * 8)
    assert rollout_engine_kwargs(s, 128, 41)["num_pages"] == 32 * 16  # 65 tokens: 128
    assert rollout_engine_kwargs(s, 96, 80)["num_pages"] == 32 * 12  # capped at max_seq_len
    with pytest.raises(ConfigError, match="inner_steps"):
        GRPOSettings(inner_steps=0)


# A short GRPO run on the easy arithmetic task (operands below 3) from a model SFT'd briefly on it: the expected
# reward on 16 held-out questions (mean exact-match reward over 16 samples each) rises. GRPO seeds 0, 1, 2 (this
# SFT'd model, 24 steps, on an Intel Xeon model 207): 0.273 -> 0.457, 0.453 and 0.410; at 12 steps the rise was
# 0.12, 0.15, 0.12, too near the 0.1 asserted to hold on every CPU. The run is in the default (not batch-invariant)
# mode: its update is ten times cheaper under the suite's unoptimized XLA flags (0.45 s a step against 5 s), and
# what it checks is that the policy learns; the invariant mode's parity is checked by the tests above and, end to
# end through `causal-lm train --task grpo`, by tests/test_post_loop.py.
EASY = 3


@pytest.fixture(scope="module")
def sft_model():
    """The tiny preset's shape (2 layers, d_model 64), SFT'd for 300 steps on synthetic chat with operands below 3."""
    import optax

    from causal_lm.data.pipeline import TrainIterator

    cfg = dataclasses.replace(TINY, d_model=64, mlp_dim=128)
    tok = ByteTokenizer()
    enc = [encode_conversation(tok, c) for c in synthetic_conversations(4000, 0, max_operand=EASY)]
    flat = np.asarray([x for ids, _ in enc for x in ids], np.int32)
    mask = np.asarray([x for _, m in enc for x in m], bool)
    rows = pack(flat, np.asarray([len(ids) for ids, _ in enc]), 128, tok.pad_id, mask=mask)
    data = TrainIterator(rows, 16, 0)
    graphdef, params, rest = init_params(cfg, 0)
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 20, 300, 1e-3))
    opt_state = opt.init(params)

    @jax.jit
    def step(p, o, batch):
        grads = loss_and_grads(graphdef, p, rest, batch)[1]
        updates, o = opt.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    for _ in range(300):
        params, opt_state = step(params, opt_state, next(data))
    return nnx.merge(graphdef, params, rest), tok


_INVARIANT_LOGITS_CHILD = """
import dataclasses, sys
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from causal_lm.config import ModelConfig
from causal_lm.model.kv_cache import init_cache
from causal_lm.train.state import init_params
cfg = ModelConfig(vocab_size=259, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
                  max_seq_len=48, init_std=0.5)
g, p, r = init_params(cfg, 0)
m = nnx.merge(g, p, r)
tokens = jnp.asarray(np.random.default_rng(5).integers(0, 259, (1, 12)), jnp.int32)
full = np.asarray(jax.jit(lambda m, t: m.forward(t, batch_invariant=True).logits)(m, tokens))[0]
step = jax.jit(lambda m, t, c: (lambda o: (o.logits, o.cache))(m.forward(t, cache=c, batch_invariant=True)))
logits, cache = step(m, tokens[:, :5], init_cache(cfg, 1, 16))
got = [np.asarray(logits)[0, i] for i in range(5)]
for i in range(5, 12):
    logits, cache = step(m, tokens[:, i : i + 1], cache)
    got.append(np.asarray(logits)[0, 0])
print("positions differing:", int((np.stack(got) != full).any(axis=1).sum()))
"""


def test_invariant_decode_steps_give_the_forward_pass_logits_bitwise():
    """The mechanism under the parity, at the logits (which a random model's near-uniform logprobs would hide),
    compiled as users run it (a child process without this suite's fast-compile XLA flags: the mismatch below did
    not show at --xla_backend_optimization_level=0): in the batch-invariant mode, a prefill then one-token steps
    over a cache give every position the same logit bits as one forward pass over the whole sequence. Unpadded,
    the row-wise head over the odd vocabulary (259) rounded differently in every one-token step at d_model 64."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CAUSAL_LM_COMPILATION_CACHE")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _INVARIANT_LOGITS_CHILD], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "positions differing: 0", out.stdout


@pytest.mark.slow
def test_a_short_grpo_run_raises_the_arithmetic_reward(sft_model):
    from causal_lm.train.grpo import evaluate_reward
    from causal_lm.train.post import arithmetic_problem, arithmetic_questions

    model, tok = sft_model
    s = GRPOSettings(
        group_size=16,
        prompts_per_step=4,
        max_new_tokens=12,
        learning_rate=1e-3,
        inner_steps=2,
        reward="causal_lm.train.grpo:arithmetic_reward",
        seed=0,
        batch_invariant=False,
    )
    held_out = arithmetic_questions(16, seed=1, max_operand=EASY)
    before = evaluate_reward(model, tok, held_out, s)["expected_reward"]
    trainer = GRPOTrainer(model, tok, s, problem_fn=functools.partial(arithmetic_problem, max_operand=EASY))
    for _ in range(24):
        trainer.step()
    after = evaluate_reward(trainer.model(), tok, held_out, s)["expected_reward"]
    print(f"expected reward {before:.3f} -> {after:.3f}")
    assert 0.1 < before < 0.8, before
    assert after > before + 0.1, (before, after)


# ---- DPO -----------------------------------------------------------------------------------------------------
def test_dpo_loss_equals_a_hand_computation():
    from causal_lm.train.dpo import dpo_loss

    pc, pr, rc, rr = (jnp.array(x) for x in ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0], [-3.0, -3.0]))
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.5)
    m = 0.5 * ((np.array([-3.0, -5.0]) - [-3.5, -4.0]) - (np.array([-4.0, -2.0]) - [-3.0, -3.0]))  # [0.75, 0.0]
    want = np.mean(np.log1p(np.exp(-m)))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(stats["reward_margin"], m.mean(), rtol=1e-6)
    assert float(stats["reward_accuracy"]) == 0.5


def test_dpo_at_the_reference_is_ln2_then_learns_the_preference(tmp_path):
    from causal_lm.train.dpo import DPOTrainer, encode_pairs, read_preferences

    path = tmp_path / "prefs.jsonl"
    recs = [
        {
            "prompt": f"What is {a} + {b}?",
            "chosen": f"The answer is {a + b}.",
            "rejected": f"The answer is {a + b + 1}.",
        }
        for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    graphdef, params, rest = init_params(TINY, 0)
    trainer = DPOTrainer(nnx.merge(graphdef, params, rest), beta=0.1, learning_rate=1e-2)
    batch = encode_pairs(ByteTokenizer(), read_preferences(str(path)), 48)
    first = trainer.step(batch)
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert first["reward_margin"] == 0.0
    for _ in range(5):
        last = trainer.step(batch)
    assert last["loss"] < first["loss"] and last["reward_accuracy"] == 1.0
