"""The serving engine (causal_lm/serve) over the paged KV cache (causal_lm/model/paged_cache.py).

The bug classes these tests exist to catch: a request's tokens that depend on who else is in the batch (a page
another request wrote, a stale slot of a reused page, a row's key), a page freed while still referenced, a page
boundary off by one, a prefix shared one token too far, a preempted sequence sampled again instead of replayed,
pages that leak, programs retraced after warm-up.

Compile time dominates on a CPU: every engine here has one or two (rows, tokens) buckets, and the reference
`generate` calls use prompts of one length bucket (17..32 tokens) and one max-new-tokens bucket.
"""

import numpy as np
import pytest
from variants import tiny_config, tiny_mla_config, tiny_model

from causal_lm import generate
from causal_lm.serve import Engine

STD = 0.5  # a random model whose greedy tokens vary (at 0.2 the tiny model repeats one token)
MAX_NEW = 12  # every reference generation: max_tokens of a request is at most this
CONFIGS = {
    "gqa": tiny_config("gqa", init_std=STD),
    "mqa": tiny_config("mqa", init_std=STD),
    "mla": tiny_mla_config(init_std=STD),
    "window": tiny_config("gqa", init_std=STD, sliding_window=6),
    "mixed": tiny_config("gqa", init_std=STD, sliding_window=6, layer_pattern="local,global"),
}
V = CONFIGS["gqa"].vocab_size

_reference = {}


def reference(model, prompt, cache_dtype=None):
    """generate of this prompt alone, MAX_NEW greedy tokens (cached across tests)."""
    key = (id(model), tuple(prompt), cache_dtype)
    if key not in _reference:
        _reference[key] = generate(model, [prompt], max_new_tokens=MAX_NEW, cache_dtype=cache_dtype).tokens[0]
    return _reference[key]


def expected(model, request, cache_dtype=None):
    """(tokens, finish reason) generate gives for a request: cut at max_tokens or after its first stop id."""
    toks = reference(model, request["prompt"], cache_dtype)[: request["max_tokens"]]
    for i, t in enumerate(toks):
        if t in request["stop"]:
            return toks[: i + 1], "stop"
    return toks, "length"


def churn_requests(seed, n=50):
    """n requests: random prompts of 17..32 tokens (a fifth repeat or extend an earlier prompt, so prefixes are
    shared), max_tokens 1..12, arrival steps 0..29, a stop id for some, a cancellation for some."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i and rng.random() < 0.2:
            base = out[int(rng.integers(0, i))]["prompt"]
            prompt = (base + rng.integers(0, V, 8).tolist())[: int(rng.integers(17, 33))]
            prompt = prompt + rng.integers(0, V, max(0, 17 - len(prompt))).tolist()
        else:
            prompt = rng.integers(0, V, int(rng.integers(17, 33))).tolist()
        out.append(
            dict(
                prompt=prompt,
                max_tokens=int(rng.integers(1, MAX_NEW + 1)),
                arrive=int(rng.integers(0, 30)),
                stop=[int(rng.integers(0, V))] if rng.random() < 0.3 else [],
                cancel_after=int(rng.integers(0, 8)) if rng.random() < 0.15 else None,
            )
        )
    return out


def run_churn(engine, requests):
    """Submit each request at its arrival step and cancel some a few steps later, stepping until all are done.
    Returns {request index: result}."""
    ids, step = {}, 0
    last = max(r["arrive"] for r in requests)
    while step <= last or engine.has_work():
        for i, r in enumerate(requests):
            if r["arrive"] == step:
                ids[i] = engine.submit(r["prompt"], max_tokens=r["max_tokens"], stop=r["stop"])
            if r["cancel_after"] is not None and r["arrive"] + r["cancel_after"] == step:
                engine.cancel(ids[i])
        engine.step()
        step += 1
    return {i: engine.result(rid) for i, rid in ids.items()}


def assert_exact_under_churn(model, engine, seed=0, cache_dtype=None):
    requests = churn_requests(seed)
    results = run_churn(engine, requests)
    finished = cancelled = 0
    for i, r in enumerate(requests):
        res = results[i]
        want, reason = expected(model, r, cache_dtype)
        if res.finish_reason == "cancelled":
            cancelled += 1
            assert res.tokens == want[: len(res.tokens)], f"request {i} (cancelled) diverged from generate"
        else:
            finished += 1
            assert res.tokens == want, f"request {i}: engine {res.tokens} != generate {want}"
            assert res.finish_reason == reason
    assert finished >= 35 and cancelled >= 1
    assert_no_leak(engine)
    return engine.stats()


def assert_no_leak(engine):
    s = engine.stats()
    assert s["running"] == s["waiting"] == 0
    assert s["pages_used"] == 0 and not engine.refcounts().any()
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"]


def small_engine(model, **kw):
    args = dict(max_seqs=6, page_size=3, num_pages=120, max_step_tokens=16, batch_buckets=(6,), token_buckets=(8,))
    args.update(kw)
    return Engine(model, **args)


# ---- exact under churn ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_exact_under_churn_page_sizes(page_size):
    """Every finished request's greedy tokens equal generate of its prompt alone, whatever the page size; page
    size 3 also runs decode-only steps in a one-token program."""
    model = tiny_model(CONFIGS["gqa"])
    buckets = (1, 8) if page_size == 3 else (8,)
    engine = small_engine(model, page_size=page_size, num_pages=360 // page_size, token_buckets=buckets)
    stats = assert_exact_under_churn(model, engine)
    assert stats["prefix_hit_pages"] > 0 or page_size == 16  # repeated prompts shared pages
    if page_size == 3:
        assert stats["program_shapes"] == [(6, 1), (6, 8)]


def test_exact_under_churn_with_preemption():
    """Pages so scarce that running sequences are preempted (their pages freed, recomputed later): tokens unchanged."""
    model = tiny_model(CONFIGS["gqa"])
    engine = small_engine(model, num_pages=20)
    stats = assert_exact_under_churn(model, engine, seed=1)
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("arch", ["mqa", "mla", "window", "mixed"])
def test_exact_under_churn_layouts(arch):
    """MQA's single KV head, MLA's latent + rope key, a sliding-window model and mixed local/global layers."""
    model = tiny_model(CONFIGS[arch])
    assert_exact_under_churn(model, small_engine(model, num_pages=40), seed=2)


def test_exact_under_churn_int8():
    """int8 pages with per-token scales: the engine equals generate(..., cache_dtype="int8")."""
    model = tiny_model(CONFIGS["gqa"])
    engine = small_engine(model, num_pages=40, cache_dtype="int8")
    assert_exact_under_churn(model, engine, seed=3, cache_dtype="int8")
