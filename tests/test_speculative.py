"""Speculative decoding and shared prompts: fewer target passes, the same tokens (greedy) or the same distribution
(sampling).

The greedy property is the strong one: whatever the draft proposes, the output equals plain cached decoding token
for token, because every emitted token is the target's own argmax. It is checked over a covering array of the
attention-variant grid (every pair of factors, the draft kind rotating: the target itself, a different random model,
prompt lookup), and with every draft kind on ring-buffer, MLA and quantized caches.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cache import PROMPTS
from variants import HEADS, POSITIONS, tiny_config, tiny_mla_config, tiny_model, variant_id

from causal_lm import GenerateError, build_model, generate
from causal_lm.config import ModelConfig
from causal_lm.decode.sampling import probabilities
from causal_lm.model.functional import forward

NEW, K = 40, 4
DRAFTS = ("self", "random", "ngram")


def _draft(kind, model):
    if kind == "self":
        return model
    if kind == "random":
        return build_model(model.config, seed=7)  # the same shape, other weights: mostly rejected
    return "ngram"


def _assert_same_as_plain(model, kind, prompts=PROMPTS, new=NEW, k=K, **kw):
    plain = generate(model, prompts, max_new_tokens=new, return_logits=True, **kw)
    spec = generate(
        model, prompts, max_new_tokens=new, return_logits=True, speculative=_draft(kind, model), draft_tokens=k, **kw
    )
    assert spec.tokens == plain.tokens
    for r, toks in enumerate(plain.tokens):  # the logits that chose each emitted token (none after a row's stop)
        np.testing.assert_allclose(spec.logits[r, : len(toks)], plain.logits[r, : len(toks)], atol=1e-5, rtol=0)
    assert spec.draft_accepted <= spec.draft_proposed
    if kind == "self":  # every proposal accepted: one pass per k + 1 tokens
        assert spec.draft_accepted == spec.draft_proposed > 0
        assert spec.target_passes <= -(-new // (k + 1)) + 1
        if not kw.get("stop_tokens"):  # (a stop inside a run leaves the run's later K/V computed for nothing)
            assert spec.kv_computed == plain.kv_computed  # nothing computed and thrown away
    if kind == "random":
        assert spec.draft_accepted < spec.draft_proposed / 2
    assert spec.target_passes <= plain.target_passes
    return plain, spec


def _covering_grid() -> list:
    """(variant, draft kind) pairs covering every pair of factors of the attention-variant grid: each KV layout
    with each position scheme (12 cases), the four gate/sink settings rotating so that each KV layout meets all
    four and each position scheme three, and the draft kind rotating so that each KV layout meets all three.
    Speculation reads and rolls back the cache (its layout and positions); the gate and the sink live inside
    attention, where test_cache's every-variant check (cache == recompute, all 48) is the referee."""
    cases = []
    for i, kv in enumerate(HEADS):
        for j, pos in enumerate(POSITIONS):
            gate, sink = [(False, False), (True, False), (False, True), (True, True)][(i + j) % 4]
            cases.append(((kv, pos, gate, sink), DRAFTS[(i + j) % 3]))
    return cases


@pytest.mark.parametrize("variant, kind", _covering_grid(), ids=[f"{variant_id(v)}-{k}" for v, k in _covering_grid()])
def test_greedy_speculation_equals_plain_decoding_over_the_grid(variant, kind):
    _assert_same_as_plain(tiny_model(tiny_config(*variant)), kind)


MLA = tiny_mla_config(attn_sink=True)


@pytest.mark.parametrize("kind", DRAFTS)
@pytest.mark.parametrize(
    "name, config, kw",
    [
        ("ring-mixed", tiny_config("gqa", "rope_full", sliding_window=3, layer_pattern="local,global"), {}),
        ("mla", MLA, {}),
        ("int8", tiny_config("mqa", "rope_partial", True, False), {"cache_dtype": "int8"}),
    ],
    ids=["ring-mixed", "mla", "int8"],
)
def test_every_draft_kind_on_rings_mla_and_quantized_caches(name, config, kw, kind):
    _assert_same_as_plain(tiny_model(config), kind, **kw)


def test_rows_accept_different_counts():
    """Ragged rows of one batch accept different numbers of drafts and each still equals plain decoding."""
    model = tiny_model(tiny_config("gqa", "rope_full"))
    prompts = [[5, 6, 7, 8] * 4, [40, 2, 33], [9]]
    for kind in ("ngram", "random"):
        plain, spec = _assert_same_as_plain(model, kind, prompts=prompts)
        assert len(set(spec.draft_accepted_per_row)) > 1, spec.draft_accepted_per_row
        assert sum(spec.draft_accepted_per_row) == spec.draft_accepted


def test_a_stop_token_inside_an_accepted_run():
    """The target drafting for itself keeps every run of k drafts; a stop token strictly inside one (drafts of the
    same run after it) ends the row there, and what the run holds after it is not emitted."""
    model = tiny_model(tiny_config("gqa", "rope_full", True, False))
    free = generate(model, PROMPTS, max_new_tokens=NEW).tokens
    # token 0 comes from the prefill; pass j emits tokens (j-1)(K+1)+1 .. j(K+1), the last the target's own
    inside = lambda i: (i - 1) % (K + 1) < K - 1  # noqa: E731  a draft with more drafts of its run after it
    first, stop = next((i, t) for i, t in enumerate(free[0]) if i > 0 and free[0].index(t) == i and inside(i))
    plain, spec = _assert_same_as_plain(model, "self", stop_tokens=[stop])
    assert spec.tokens[0] == free[0][: first + 1]
    assert len(spec.tokens[0]) < len(free[0])


def test_drafts_that_would_run_past_the_cache_capacity():
    """prompt + max_new_tokens == max_seq_len: proposals past the last token are never made, nothing overflows."""
    config = tiny_config("gqa", "learned")  # learned positions: a position past max_seq_len would be clamped
    model = tiny_model(config)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    _assert_same_as_plain(model, "self", prompts=[prompt], new=config.max_seq_len - len(prompt), k=8)


def test_streaming_with_speculation():
    model = tiny_model(tiny_config("gqa", "rope_full"))
    seen = collections.defaultdict(list)
    res = generate(model, PROMPTS, max_new_tokens=NEW, speculative=model, on_step=lambda s, t: seen[s].append(t))
    assert sorted(seen) == list(range(NEW)) and all(len(v) == 1 for v in seen.values())
    for r in range(2):
        assert [int(seen[s][0][r]) for s in range(NEW) if seen[s][0][r] >= 0] == res.tokens[r]


# ---- sampling: the same distribution -----------------------------------------------------------------------------

V = 8
TARGET = ModelConfig(vocab_size=V, d_model=16, num_layers=1, num_heads=2, mlp_dim=16, max_seq_len=32, init_std=0.5)
ROWS = 8000
PROMPT = [1, 2, 3, 1]
SAMPLING = {"temperature": 1.0}
FILTERED = {"temperature": 0.8, "top_k": 6, "top_p": 0.9}


def _exact_pair_probs(model, settings):
    """P(token 2, token 3) after PROMPT (the first token marginalised): [V, V], from the model's own logits."""
    t, k, p = settings["temperature"], settings.get("top_k", 0) or 0, settings.get("top_p", 1.0)
    seqs = np.array([PROMPT + [a, b] for a in range(V) for b in range(V)], np.int32)
    logits = np.asarray(forward(model, seqs)[0])  # [V*V, T, V]
    prob = lambda x: np.asarray(probabilities(jax.numpy.asarray(x), t, k, p))  # noqa: E731
    p1 = prob(logits[0, len(PROMPT) - 1])  # [V]
    p2 = prob(logits[::V, len(PROMPT)])  # [V(a), V]: after a
    p3 = prob(logits[:, len(PROMPT) + 1]).reshape(V, V, V)  # [a, b, c]: after a, b
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def _chi_square(counts, probs):
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled into one cell)."""
    expected = probs.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep])), int(keep.sum()) - 1


def _pair_counts(model, **kw):
    res = generate(model, [PROMPT], num_samples=ROWS, max_new_tokens=3, seed=11, **kw)
    counts = np.zeros((V, V))
    for row in res.tokens:
        counts[row[1], row[2]] += 1
    return counts


# With ~50 degrees of freedom the statistic of a correct sampler is ~50 +- 10; 110 is p < 1e-5 for df <= 60.
CHI2_LIMIT = 110


@pytest.fixture(scope="module")
def sampling_models():
    target = build_model(TARGET, seed=0)
    draft = build_model(TARGET, seed=1)  # disagrees with the target
    return target, draft


@pytest.mark.parametrize("settings", [SAMPLING, FILTERED], ids=["temperature", "top-k-top-p"])
@pytest.mark.parametrize("kind", ["plain", "draft", "ngram"])
def test_speculative_sampling_has_the_distribution_of_plain_sampling(sampling_models, settings, kind):
    target, draft = sampling_models
    spec = {"plain": {}, "draft": {"speculative": draft, "draft_tokens": 3}, "ngram": {"speculative": "ngram"}}[kind]
    counts = _pair_counts(target, **spec, **settings)
    chi2, df = _chi_square(counts, _exact_pair_probs(target, settings))
    print(f"{kind} {settings}: chi2 {chi2:.1f} over {df} degrees of freedom")
    assert df >= 20 and chi2 < CHI2_LIMIT


def test_the_distribution_check_catches_an_acceptance_rule_that_keeps_every_draft(sampling_models, monkeypatch):
    from causal_lm.decode import speculative

    target, draft = sampling_models
    real = speculative._accept

    def keep_all(logits, drafts, q, n_prop, key, temperature, top_k, top_p):
        a, nxt = real(logits, drafts, q, n_prop, key, temperature, top_k, top_p)
        return n_prop, nxt

    monkeypatch.setattr(speculative, "_accept", keep_all)
    counts = _pair_counts(target, speculative=draft, draft_tokens=2, **SAMPLING)  # k=2: a fresh trace
    chi2, _ = _chi_square(counts, _exact_pair_probs(target, SAMPLING))
    assert chi2 > CHI2_LIMIT


# ---- shared prompts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False])
def test_num_samples_equals_a_batch_of_copies(use_cache):
    model = tiny_model(tiny_config("gqa", "rope_full", True, True))
    prompts, n = [[3, 14, 15, 9], [27, 18]], 3
    kw = dict(max_new_tokens=12, temperature=0.9, seed=5, use_cache=use_cache, return_logits=True)
    shared = generate(model, prompts, num_samples=n, **kw)
    copies = generate(model, [p for p in prompts for _ in range(n)], **kw)
    assert shared.tokens == copies.tokens  # prompt-major rows, the same draws
    np.testing.assert_allclose(shared.logits, copies.logits, atol=1e-5, rtol=0)
    assert len(set(map(tuple, shared.tokens[:n]))) > 1  # the samples of one prompt differ
    if use_cache:  # each prompt's K/V computed once, not n times
        assert shared.kv_computed == copies.kv_computed - (n - 1) * sum(map(len, prompts))
    else:  # recomputation shares nothing
        assert shared.kv_computed == copies.kv_computed


@pytest.mark.parametrize("kind", ["ngram", "random"])
def test_num_samples_with_speculation(kind):
    """Shared prompts under speculation: greedy rows are plain decoding's; sampled rows draw what a batch of copies
    draws (the same seed policy as without speculation), and each prompt's K/V is computed once."""
    model = tiny_model(tiny_config("gqa", "rope_full"))
    n = 3
    copies = [p for p in PROMPTS for _ in range(n)]
    spec = dict(speculative=_draft(kind, model), draft_tokens=K)
    if kind == "ngram":
        a = generate(model, PROMPTS, max_new_tokens=16, num_samples=n, **spec)
        assert a.tokens == generate(model, copies, max_new_tokens=16).tokens
    kw = dict(max_new_tokens=16, temperature=0.9, seed=5, **spec)
    shared = generate(model, PROMPTS, num_samples=n, **kw)
    batch = generate(model, copies, **kw)
    assert shared.tokens == batch.tokens
    assert shared.draft_accepted_per_row == batch.draft_accepted_per_row
    assert len(set(map(tuple, shared.tokens[:n]))) > 1  # the samples of one prompt differ
    assert shared.kv_computed == batch.kv_computed - (n - 1) * sum(map(len, PROMPTS))


def test_bad_speculative_arguments():
    model = tiny_model(tiny_config("gqa", "rope_full"))
    with pytest.raises(GenerateError, match="use_cache=True"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="ngram", use_cache=False)
    with pytest.raises(GenerateError, match="'ngram' or a draft model"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="medusa")
    with pytest.raises(GenerateError, match="draft_tokens"):
        generate(model, PROMPTS, max_new_tokens=4, speculative="ngram", draft_tokens=0)
    with pytest.raises(GenerateError, match="vocabulary"):
        generate(model, PROMPTS, max_new_tokens=4, speculative=build_model(tiny_config("gqa", vocab_size=50)))
    with pytest.raises(GenerateError, match="num_samples"):
        generate(model, PROMPTS, max_new_tokens=4, num_samples=0)


def test_prompt_lookup_proposes_k_tokens_and_continues_repeats_periodically():
    """Prompt lookup's drafts: the tokens after the latest earlier occurrence of the row's last n tokens (longest n
    first); an occurrence overlapping the end (a run of one token, a repeated phrase) continues periodically, so
    it proposes k tokens too, not only the one or two left before the end; no occurrence, no proposal."""
    from causal_lm.decode.speculative import ngram_proposals

    rows = [
        [5, 5, 5, 5, 0, 0, 0, 0],  # a run of one token: period 1
        [1, 2, 3, 1, 2, 3, 1, 2],  # a repeated phrase: [3, 1, 2] seen at 2, followers from 5, period 3
        [7, 8, 9, 4, 7, 8, 0, 0],  # [7, 8] seen at 0: followers 9, 4, 7, 8 (no overlap)
        [1, 2, 3, 4, 0, 0, 0, 0],  # nothing recurs
        [6, 1, 6, 2, 6, 0, 0, 0],  # only [6] recurs, latest at 2: followers 2, 6, then periodic
    ]
    lengths = [4, 8, 6, 4, 5]
    drafts, n = ngram_proposals(jnp.asarray(rows, jnp.int32), jnp.asarray(lengths, jnp.int32), k=5)
    drafts, n = np.asarray(drafts), np.asarray(n)
    assert n.tolist() == [5, 5, 5, 0, 5]
    assert drafts[0].tolist() == [5, 5, 5, 5, 5]
    assert drafts[1].tolist() == [3, 1, 2, 3, 1]
    assert drafts[2].tolist() == [9, 4, 7, 8, 9]
    assert drafts[4].tolist() == [2, 6, 2, 6, 2]
