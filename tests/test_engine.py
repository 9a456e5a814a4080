"""The serving engine (causal_lm/serve) over the paged KV cache (causal_lm/model/paged_cache.py).

The bug classes these tests exist to catch: a request's tokens that depend on who else is in the batch (a page
another request wrote, a stale slot of a reused page, a row's key), a page freed while still referenced, a page
boundary off by one, a prefix shared one token too far, a preempted sequence sampled again instead of replayed,
pages that leak, programs retraced after warm-up.

Compile time dominates on a CPU: every engine here has one or two (rows, tokens) buckets, and the reference
`generate` calls use prompts of one length bucket (17..32 tokens) and one max-new-tokens bucket.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from variants import tiled_weights, tiny_config, tiny_mla_config, tiny_model

from causal_lm import generate
from causal_lm.decode.loop import STREAM_EVERY, DecodeLoop, drive
from causal_lm.decode.sampling import SamplingParams, sample
from causal_lm.serve import Engine, EngineError, EngineLoop

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


def held(engine, rid) -> list:
    """Pages a request holds now, per layer group (its table's columns with a page)."""
    pages = engine._requests[rid].pages
    return [sum(p is not None for p in group) for group in pages] if pages else [0] * len(engine.windows)


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


def test_window_model_returns_pages_outside_the_window():
    """When every layer is local (window 6), pages wholly before a row's window go back as it grows: sequences of
    up to 44 tokens (15 pages of 3) run in a pool of 8 pages, a request never holds more than
    floor((window + chunk - 2) / page_size) + 2 = 6 pages, and the tokens are still those of generate (whose
    local layers keep ring buffers)."""
    model = tiny_model(CONFIGS["window"])
    engine = small_engine(model, num_pages=8)
    rng = np.random.default_rng(9)
    requests = [dict(prompt=rng.integers(0, V, 32).tolist(), max_tokens=12, stop=[]) for _ in range(4)]
    ids = [engine.submit(r["prompt"], max_tokens=12) for r in requests]
    while engine.has_work():
        engine.step()
        assert all(held(engine, i)[0] <= 6 for i in ids)
    for r, rid in zip(requests, ids, strict=True):
        assert engine.result(rid).tokens == expected(model, r)[0]
    assert engine.stats()["pages_out_of_window"] > 0
    assert_no_leak(engine)


def test_mixed_model_pages_its_local_and_global_layers_independently():
    """Mixed local (window 6) / global layers: each layer group has its own pages. Two sequences of 44 tokens
    (15 pages of 3 each in the global group) run together in a pool of (12 local, 30 global) pages without
    preemption, since the local group gives back its pages wholly before the window (at most 6 per sequence) while
    the global group keeps all 15; the tokens are generate's. kv_memory splits the bytes so that both groups hold
    equally many max_seq_len sequences: the local group gets fewer pages."""
    model = tiny_model(CONFIGS["mixed"])
    engine = small_engine(model, num_pages=(12, 30))
    assert engine.windows == (6, 0) and engine.group_pages == (12, 30)
    rng = np.random.default_rng(10)
    requests = [dict(prompt=rng.integers(0, V, 32).tolist(), max_tokens=12, stop=[]) for _ in range(2)]
    ids = [engine.submit(r["prompt"], max_tokens=12) for r in requests]
    most = [0, 0]
    while engine.has_work():
        engine.step()
        for i in ids:
            most = [max(m, h) for m, h in zip(most, held(engine, i), strict=True)]
    # seen between steps (a sequence's last step, which needs its 15th page, also finishes it): the local group
    # holds the window's pages, the global group all of them
    assert most[0] <= 6 and most[1] == 14
    stats = engine.stats()
    assert stats["preemptions"] == 0 and stats["pages_out_of_window"] > 0
    local_peak, global_peak = (g["pages_peak"] for g in stats["groups"])
    assert local_peak <= 12 and global_peak == 30
    assert engine.fits([44, 44]) and not engine.fits([44, 44, 44]) and engine.pages_needed(44) == 6 + 15
    for r, rid in zip(requests, ids, strict=True):
        assert engine.result(rid).tokens == expected(model, r)[0]
    assert_no_leak(engine)
    with pytest.raises(EngineError, match="could never run"):
        small_engine(model, num_pages=(5, 30)).submit([1] * 32, max_tokens=12)  # 6 local pages needed
    local, glob = Engine(model, max_seqs=2, page_size=3, kv_memory="64KiB", max_step_tokens=8).group_pages
    assert local < glob / 2


def test_exact_under_churn_int8():
    """int8 pages with per-token scales: the engine equals generate(..., cache_dtype="int8")."""
    model = tiny_model(CONFIGS["gqa"])
    engine = small_engine(model, num_pages=40, cache_dtype="int8")
    assert_exact_under_churn(model, engine, seed=3, cache_dtype="int8")


# ---- decode bursts -------------------------------------------------------------------------------------------------
def tokens_by_request(events) -> dict:
    out = {}
    for e in events:
        if e.token is not None:
            out.setdefault(e.request_id, []).append(e.token)
    return out


def assert_pages_cover_the_cache(engine):
    """Every running sequence holds a page for each token whose K/V it has computed (a window model aside)."""
    for seq in engine._running:
        assert len(seq.pages[0]) * engine.page_size >= seq.computed, f"request {seq.rid}: K/V outside its pages"


def test_decode_bursts_change_no_token_and_end_on_time():
    """A step whose rows all decode runs several decode steps in one dispatch (a burst). Bursts change no token:
    a row that emits its stop id mid-burst keeps nothing after it and gives its pages back at once while the others
    go on; a row reaching max_tokens mid-burst stops there; a request cancelled between bursts gets nothing more; a
    sampled request draws what it draws one step at a time (burst_steps=1); every greedy request ends with
    generate's tokens. Bursts end on time: a new arrival's prompt is fed by the next step (no burst while a prompt
    chunk runs), and while a request waits for a row every running row emits the same count of tokens in a burst
    (none ends by max_tokens before the burst's end, holding its place). Bug classes: a token after a stop kept,
    a burst's pages one slot short (K/V dropped), a burst's key index off, bursts that starve waiting requests."""
    model = tiny_model(CONFIGS["gqa"])
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, V, int(rng.integers(17, 33))).tolist() for _ in range(12)]
    engine = small_engine(model, burst_steps=8)

    # requests waiting for a row: each burst stops where the first running row reaches its max_tokens
    ids = [engine.submit(p, max_tokens=MAX_NEW - i % 3) for i, p in enumerate(prompts[:8])]  # 6 rows: two wait
    waiting_bursts = 0
    while engine.has_work():
        waiting, bursts = engine.stats()["waiting"], engine.stats()["bursts"]
        counts = {len(t) for t in tokens_by_request(engine.step()).values()}
        assert_pages_cover_the_cache(engine)
        if waiting and engine.stats()["bursts"] > bursts:
            waiting_bursts += 1
            assert len(counts) == 1 and counts.pop() > 1
    assert waiting_bursts > 0 and engine.stats()["bursts"] > waiting_bursts  # and longer bursts once none waits
    for i, rid in enumerate(ids):
        r = engine.result(rid)
        assert r.tokens == reference(model, prompts[i])[: MAX_NEW - i % 3] and r.finish_reason == "length"

    # a stop mid-burst, max_tokens mid-burst, a cancellation between bursts, a new arrival ending them
    want = [reference(model, p) for p in prompts]
    stop_at = next(j for j in range(3, MAX_NEW) if want[8][j] not in want[8][:j])  # request 8's stop: its first
    stop = want[8][stop_at]
    bursts = engine.stats()["bursts"]
    stopping, short, sampled, cancelled = ids = [
        engine.submit(prompts[8], max_tokens=MAX_NEW, stop=[stop]),
        engine.submit(prompts[9], max_tokens=8),
        engine.submit(prompts[10], max_tokens=MAX_NEW, **SAMPLED),
        engine.submit(prompts[11], max_tokens=MAX_NEW),
    ]
    while any(not engine.result(i).tokens for i in ids):
        engine.step(max_burst=1)  # one token per step: no burst yet
    before = {i: len(engine.result(i).tokens) for i in ids}
    assert before[stopping] <= stop_at and before[short] < 7 and before[cancelled] <= 3
    assert engine.stats()["bursts"] == bursts
    got = tokens_by_request(engine.step())
    assert_pages_cover_the_cache(engine)
    assert engine.stats()["bursts"] == bursts + 1
    assert engine.result(stopping).finish_reason == "stop" and engine.result(stopping).tokens[-1] == stop
    assert engine.result(short).finish_reason == "length" and len(engine.result(short).tokens) == 8
    assert held(engine, stopping) == held(engine, short) == [0]  # their pages went back in the burst
    assert len(got[cancelled]) == 8 > max(len(got[stopping]), len(got[short]))  # the others went on
    engine.cancel(cancelled)
    n_cancelled = len(engine.result(cancelled).tokens)
    ids.append(engine.submit(prompts[0], max_tokens=4))  # a new arrival: the next step feeds its prompt
    got = tokens_by_request(engine.step())
    assert engine.stats()["bursts"] == bursts + 1 and engine._requests[ids[4]].computed > 0
    assert cancelled not in got and len(got[sampled]) == 1
    while engine.has_work():
        engine.step()
    results = [engine.result(i) for i in ids]
    assert results[0].tokens == want[8][: stop_at + 1]
    assert results[1].tokens == want[9][:8] and results[4].tokens == want[0][:4]
    assert results[3].tokens == want[11][:n_cancelled] and results[3].finish_reason == "cancelled"
    one_step = small_engine(model, burst_steps=1)
    alone = one_step.run([dict(prompt_ids=prompts[10], max_tokens=MAX_NEW, **SAMPLED)], progress=False)[0]
    assert results[2].tokens == alone.tokens
    np.testing.assert_allclose(results[2].logprobs, alone.logprobs, atol=1e-5, rtol=0)
    assert one_step.stats()["bursts"] == 0
    assert_no_leak(engine)


# ---- the decode loop protocol ------------------------------------------------------------------------------------
def test_drive_over_the_engine_streams_generates_greedy_tokens():
    """EngineLoop implements DecodeLoop: drive over it (to the end, or streaming every STREAM_EVERY tokens through
    on_step) gives each prompt's greedy tokens of generate alone; the stream hands over every column once, in
    order, -1 for a request that had already stopped, and pauses more than once. Bug class: an engine loop whose
    clock or state skips, repeats or reorders streamed tokens, or stops before every request is done."""
    model = tiny_model(CONFIGS["gqa"])
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, V, int(rng.integers(17, 33))).tolist() for _ in range(5)]
    want = [reference(model, p) for p in prompts]
    stop = want[2][3]  # request 2 (and any other that emits it) stops early
    want = [w[: w.index(stop) + 1] if stop in w else w for w in want]
    engine = small_engine(model)
    loop: DecodeLoop = EngineLoop(engine, prompts, MAX_NEW, stop=[stop])
    assert all(callable(getattr(loop, f)) for f in ("start", "step", "resume", "progress"))
    end = drive(loop)
    assert [r.tokens for r in loop.results(end)] == want
    assert loop.progress(end).done.all() and loop.progress(end).clock == MAX_NEW
    columns, pauses = [], []
    loop = EngineLoop(engine, prompts, MAX_NEW, stop=[stop])
    resume = loop.resume
    loop.resume = lambda s, until: (pauses.append(until), resume(s, until))[1]
    end = drive(loop, on_step=lambda col, toks: columns.append((col, toks.tolist())))
    assert [c for c, _ in columns] == list(range(MAX_NEW)) and pauses == [1, 1 + STREAM_EVERY, MAX_NEW]
    streamed = [[toks[b] for _, toks in columns if toks[b] >= 0] for b in range(len(prompts))]
    assert streamed == want == [r.tokens for r in loop.results(end)]
    assert_no_leak(engine)


# ---- sampling ---------------------------------------------------------------------------------------------------
SAMPLED = dict(temperature=0.9, top_k=30, top_p=0.95, seed=1234)


def test_sampling_params_apply_each_rows_own_settings():
    """SamplingParams draws row b with row b's settings and key fold_in(key(seed[b]), index[b]): each row equals
    the scalar `sample` of that row alone; greedy, top-k 1 and a tiny top-p rows give the argmax."""
    logits = jax.random.normal(jax.random.key(0), (4, V)) * 3.0
    params = SamplingParams.make(
        [0.0, 2.0, 3.0, 2.0], [None, 1, None, None], [None, None, 0.9, 1e-6], [5, 6, 7, 8], [[1], [], [2, 3], []]
    )
    index = np.array([0, 3, 1, 9], np.int32)
    got = np.asarray(jax.jit(lambda p, x, i: p.sample(x, i))(params, logits, index))
    for b in range(4):
        key = jax.random.fold_in(jax.random.key(int(params.seed[b])), int(index[b]))
        args = (params.temperature[b], params.top_k[b], params.top_p[b])
        assert got[b] == int(sample(logits[b : b + 1], key, *args)[0])
    argmax = np.asarray(logits.argmax(-1))
    assert got[0] == argmax[0] and got[1] == argmax[1] and got[3] == argmax[3]
    draws = [int(params.sample(logits, np.full(4, n, np.int32))[2]) for n in range(20)]
    assert len(set(draws)) > 1  # the hot row really samples
    assert np.asarray(params.stopped(np.array([1, 1, 3, 0]))).tolist() == [True, False, True, False]


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch():
    """A request's n-th token is drawn with its own seed's key: the same tokens alone and among other sampled and
    greedy requests arriving around it (and a different seed draws other tokens, so the test can fail)."""
    model = tiny_model(CONFIGS["gqa"])
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, V, 20).tolist()
    alone = small_engine(model).run([dict(prompt_ids=prompt, max_tokens=12, **SAMPLED)], progress=False)[0]
    engine = small_engine(model)
    others = [
        dict(prompt_ids=rng.integers(0, V, int(rng.integers(17, 33))).tolist(), max_tokens=8, temperature=t, seed=s)
        for s, t in enumerate([1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 0.5])
    ]
    busy = engine.run(others[:3] + [dict(prompt_ids=prompt, max_tokens=12, **SAMPLED)] + others[3:], progress=False)
    assert busy[3].tokens == alone.tokens
    other_seed = small_engine(model).run(
        [dict(prompt_ids=prompt, max_tokens=12, **dict(SAMPLED, seed=99))], progress=False
    )[0]
    assert other_seed.tokens != alone.tokens


# ---- logprobs ---------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef",))
def _padded_logits(state, tokens, segment, *, graphdef):
    return nnx.merge(graphdef, state)(tokens, segment_ids=segment)[0]


def recomputed_logprobs(model, seq, with_tolerance=False):
    """log_softmax of one full forward pass over seq (right-padded to 48 tokens: one compile): [len(seq), V].
    with_tolerance: also the tolerance two float32 computations of these logprobs can be held to, `logprob_atol`."""
    tokens = np.zeros((1, 48), np.int32)
    tokens[0, : len(seq)] = seq
    segment = (np.arange(48) < len(seq)).astype(np.int32)[None]
    graphdef, state = nnx.split(model)
    logits = np.asarray(_padded_logits(state, tokens, segment, graphdef=graphdef))[0, : len(seq)]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return (lp, logprob_atol(logits)) if with_tolerance else lp


def logprob_atol(logits) -> float:
    """1e-5 (the issue's tolerance), or 32 float32 ulps of the largest |logit| where that is more. Two orders of
    float32 sums (the engine's decode step, a full forward pass) differ by a few ulps of the values they sum, and
    log_softmax subtracts logits: its error scales with the logits, not with the logprob. These random models have
    init_std 0.5 and logits of magnitude 8-16 (ulp 9.5e-7, so 3.1e-5): on a Zen 4 (AVX-512) the engine's logprobs
    were off a full forward's by a median 1.7e-6 and at most 1.4e-5 (1.7e-5 with XLA's own decode products) over
    647 values, so a flat 1e-5 held only on CPUs whose kernels happen to round closer."""
    return max(1e-5, 32 * float(np.spacing(np.float32(np.abs(logits).max()))))


def test_logprobs_equal_full_recomputation():
    """Each generated token's logprob and its top-20 alternatives, and each prompt token's logprob given its
    prefix, equal log_softmax of a full forward pass's float32 logits (atol `logprob_atol`); the alternatives are
    sorted, the greedy token is the first of them; the first prompt token's entry is None (it has no context)."""
    model = tiny_model(CONFIGS["gqa"])
    rng = np.random.default_rng(6)
    prompts = [[7], rng.integers(0, V, 19).tolist(), rng.integers(0, V, 30).tolist()]
    requests = [dict(prompt_ids=p, max_tokens=10, logprobs=20, prompt_logprobs=True) for p in prompts]
    requests.append(dict(prompt_ids=prompts[1], max_tokens=10, logprobs=3, temperature=1.0, seed=3))
    results = small_engine(model).run(requests, progress=False)
    for req, res in zip(requests, results, strict=True):
        prompt, k = req["prompt_ids"], req["logprobs"]
        ref, atol = recomputed_logprobs(model, prompt + res.tokens, with_tolerance=True)
        for i, tok in enumerate(res.tokens):
            row = ref[len(prompt) - 1 + i]
            np.testing.assert_allclose(res.logprobs[i], row[tok], atol=atol, rtol=0)
            ids, lps = zip(*res.top_logprobs[i], strict=True)
            assert len(ids) == k and list(lps) == sorted(lps, reverse=True)
            np.testing.assert_allclose(lps, np.sort(row)[::-1][:k], atol=atol, rtol=0)
            np.testing.assert_allclose(row[list(ids)], lps, atol=atol, rtol=0)
            if req.get("temperature", 0.0) == 0.0:
                assert ids[0] == tok
        if req.get("prompt_logprobs"):
            assert len(res.prompt_logprobs) == len(prompt) and res.prompt_logprobs[0] is None
            want = [ref[t - 1, prompt[t]] for t in range(1, len(prompt))]
            np.testing.assert_allclose(res.prompt_logprobs[1:], want, atol=atol, rtol=0)
        else:
            assert res.prompt_logprobs is None


# ---- the prefix cache -------------------------------------------------------------------------------------------
def run_in_two_waves(engine, first, rest):
    """The first request's prompt is computed (and its full pages registered) before the rest arrive; returns the
    results and the most pages held at once."""
    rid = engine.submit(**first)
    peak = 0
    while engine.result(rid).tokens == []:
        engine.step()
        peak = max(peak, engine.stats()["pages_used"])
    ids = [rid] + [engine.submit(**r) for r in rest]
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.stats()["pages_used"])
    return [engine.result(i).tokens for i in ids], peak


def test_prefix_sharing_computes_less_and_changes_nothing():
    """Prompts sharing a 24-token prefix (pages of 4): with the prefix cache the later requests hold the first
    request's full pages instead of computing them: identical tokens, fewer K/V vectors computed, fewer pages.
    One prompt repeats the first exactly (24 tokens, a whole number of pages): the page of its last token is still
    computed, since its logits give the first new token."""
    model = tiny_model(CONFIGS["gqa"])
    rng = np.random.default_rng(7)
    shared = rng.integers(0, V, 24).tolist()
    first = dict(prompt_ids=shared, max_tokens=6)
    rest = [dict(prompt_ids=shared + rng.integers(0, V, n).tolist(), max_tokens=6) for n in (1, 3, 5, 8)]
    rest.append(dict(prompt_ids=list(shared), max_tokens=6))
    runs = {}
    for on in (True, False):
        engine = small_engine(model, page_size=4, num_pages=90, prefix_cache=on)
        runs[on] = run_in_two_waves(engine, first, rest), engine.stats()
    ((tokens_on, peak_on), stats_on), ((tokens_off, peak_off), stats_off) = runs[True], runs[False]
    assert tokens_on == tokens_off
    for r, toks in zip([first] + rest, tokens_on, strict=True):
        assert toks == generate(model, [r["prompt_ids"]], max_new_tokens=6).tokens[0]
    # four requests share 6 pages (24 tokens), the exact repeat 5: 4 * 24 + 20 tokens not computed
    assert stats_on["prefix_hit_tokens"] == 4 * 24 + 20
    assert stats_off["kv_computed"] - stats_on["kv_computed"] == 4 * 24 + 20
    assert stats_off["prefix_hit_pages"] == 0
    assert peak_on < peak_off


def test_num_samples_share_the_prompts_pages_and_draw_what_separate_requests_draw():
    """num_samples=4 is four requests with seeds s .. s+3 that share the prompt's pages: the same tokens as four
    separate requests (no prefix cache), but the prompt's full pages computed and held once (the samples wait for
    the first to compute it). Bug class: samples that each recompute and hold the prompt, or that share a key."""
    model = tiny_model(CONFIGS["gqa"])
    prompt = np.random.default_rng(9).integers(0, V, 26).tolist()
    settings = dict(max_tokens=6, temperature=1.0)
    grouped = small_engine(model, page_size=4, num_pages=90, prefix_cache=False)
    (samples,) = grouped.run([dict(prompt_ids=prompt, num_samples=4, seed=11, **settings)], progress=False)
    separate = small_engine(model, page_size=4, num_pages=90, prefix_cache=False)
    alone = separate.run([dict(prompt_ids=prompt, seed=11 + i, **settings) for i in range(4)], progress=False)
    assert [r.tokens for r in samples] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in samples}) > 1  # the samples really differ
    g, s = grouped.stats(), separate.stats()
    assert g["prefix_hit_pages"] == 3 * 6  # samples 1..3 hold the 6 full pages of the 26-token prompt
    assert s["kv_computed"] - g["kv_computed"] == 3 * 24
    assert g["pages_peak"] < s["pages_peak"]
    assert_no_leak(grouped)


def test_prompt_chunks_run_with_little_padding_and_change_no_token():
    """Eight prompts of 17..32 tokens arriving at once, a 16-token step budget, token buckets 1/4/16 and row buckets
    1/2/4: the prompt chunks run in calls grouped by token bucket and cut to a bucket they fill (no chunk is then
    padded beyond 1.5x), so the slots the calls compute are 1.19x the prompt tokens fed here; asserted <= 1.3x
    (uncut chunks give 1.46x, one call padded to [rows, longest chunk] 1.52x), and every request's greedy tokens are
    those of `generate` alone. Bug class: a short chunk padded to a long one's length (a CPU pays for every padded
    token)."""
    model = tiny_model(CONFIGS["gqa"])
    requests = [dict(prompt_ids=r["prompt"], max_tokens=r["max_tokens"]) for r in churn_requests(3, n=8)]
    engine = Engine(
        model, max_seqs=4, page_size=4, num_pages=90, max_step_tokens=16, batch_buckets=(1, 2, 4),
        token_buckets=(1, 4, 16), prefix_cache=False,
    )  # fmt: skip
    results = engine.run(requests, progress=False)
    for r, res in zip(requests, results, strict=True):
        assert res.tokens == reference(model, r["prompt_ids"])[: r["max_tokens"]]
    stats = engine.stats()
    assert stats["chunk_tokens"] >= sum(len(r["prompt_ids"]) - 1 for r in requests)
    assert stats["chunk_slots"] <= 1.3 * stats["chunk_tokens"], stats
    assert_no_leak(engine)


def test_decode_calls_run_on_the_kernels_tiles_and_long_chunks_on_the_stacked_weights(monkeypatch):
    """Which weights each call of the engine runs on: a call of at most matvec.MAX_ROWS token slots (decoding rows,
    bursts, short chunks) the decode form in the C++ kernels' tiles (every product goes to the kernels, which read
    tiles faster); a longer chunk the model's stacked weights (layers=None: XLA's product, slower over tiles). The
    batch-invariant mode runs its XLA decode form for every call. Greedy tokens stay those of `generate`. Bug
    class: a prompt chunk multiplied over tiles (1.2-5x slower), or decode steps left off the tiles."""
    from causal_lm.model import matvec
    from causal_lm.serve import engine as engine_module

    seen = []
    for name in ("_step_program", "_burst_program"):
        real = getattr(engine_module, name)

        def spy(state, layers, pool, batch, *, _real=real, **kw):
            seen.append((batch.tokens.shape if hasattr(batch, "tokens") else (batch.token.shape[0], 1), layers))
            return _real(state, layers, pool, batch, **kw)

        monkeypatch.setattr(engine_module, name, spy)
    model = tiny_model(CONFIGS["gqa"])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, V, n).tolist() for n in (30, 20)]
    for invariant in (False, True):
        seen.clear()
        burst = 1 if invariant else 4
        engine = Engine(model, max_seqs=2, page_size=4, num_pages=40, max_step_tokens=32, prefix_cache=False,
                        token_buckets=(1, 4, 32), burst_steps=burst, batch_invariant=invariant)  # fmt: skip
        results = engine.run([dict(prompt_ids=p, max_tokens=MAX_NEW) for p in prompts], progress=False)
        if not invariant:
            for p, res in zip(prompts, results, strict=True):
                assert res.tokens == reference(model, p)
        small = [layers for (b, t), layers in seen if b * t <= matvec.MAX_ROWS]
        large = [layers for (b, t), layers in seen if b * t > matvec.MAX_ROWS]
        assert small and large, seen
        if invariant:
            assert all(layers is engine._layers and not layers.native for layers in small + large)
            continue
        assert engine.stats()["bursts"] > 0  # the burst program ran too
        assert all(layers is None for layers in large)
        assert all(layers is engine._layers for layers in small)
        if matvec.usable():
            assert engine._layers.native and all(tiled_weights(engine._layers)) and tiled_weights(engine._layers)


# ---- no leaks, bounded programs ---------------------------------------------------------------------------------
def test_no_leak_after_a_thousand_requests_and_no_retrace_after_warmup():
    """1,000 short requests with cancellations, repeated prompts and pages scarce enough to preempt: afterwards every
    page is free or cached, every reference count is zero, and no program was traced after the first 100
    requests (the step shapes stay within the buckets)."""
    model = tiny_model(CONFIGS["gqa"])
    engine = small_engine(model, num_pages=14, token_buckets=(1, 8))
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, V, int(rng.integers(1, 17))).tolist() for _ in range(60)]
    traces_after_warmup, live = None, []
    for i in range(1000):
        live.append(engine.submit(prompts[int(rng.integers(0, 60))], max_tokens=int(rng.integers(1, 4))))
        if rng.random() < 0.1:
            engine.cancel(live[int(rng.integers(0, len(live)))])
        if i % 3 == 2:
            engine.step()
        if i == 100:
            traces_after_warmup = engine.stats()["programs_compiled"]
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert_no_leak(engine)
    assert stats["preemptions"] > 0 and stats["prefix_hit_pages"] > 0
    assert sum(engine.result(r).finish_reason == "cancelled" for r in live) > 10
    assert stats["programs_compiled"] == traces_after_warmup
    assert set(stats["program_shapes"]) <= {(6, 1), (6, 8)}


# ---- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_ids=[]), "empty"),
        (dict(prompt_ids=[1, V]), "outside the vocabulary"),
        (dict(prompt_ids=[1, -1]), "outside the vocabulary"),
        (dict(prompt_ids="abc"), "list of token ids"),
        (dict(prompt_ids=[1] * 90, max_tokens=7), "max_seq_len"),
        (dict(prompt_ids=[1] * 30, max_tokens=40), "could never run"),
        (dict(prompt_ids=[1], max_tokens=0), "max_tokens"),
        (dict(prompt_ids=[1], temperature=float("nan")), "temperature"),
        (dict(prompt_ids=[1], top_k=0), "top_k"),
        (dict(prompt_ids=[1], top_p=0.0), "top_p"),
        (dict(prompt_ids=[1], seed=-1), "seed"),
        (dict(prompt_ids=[1], stop=[V]), "stop"),
        (dict(prompt_ids=[1], logprobs=21), "logprobs"),
    ],
)
def test_bad_requests_are_refused_at_submit(kwargs, match):
    """Each bad argument is a clear EngineError at submit, before any compute (JAX would clamp a bad id)."""
    engine = Engine(tiny_model(CONFIGS["gqa"]), max_seqs=2, page_size=4, num_pages=16, max_step_tokens=8)
    with pytest.raises(EngineError, match=match):
        engine.submit(**kwargs)
    assert engine.stats()["waiting"] == 0 and engine.stats()["steps"] == 0
    with pytest.raises(EngineError, match="no request"):
        engine.cancel(7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_seqs=8, max_step_tokens=4), "max_step_tokens"),
        (dict(kv_memory="1GiB", num_pages=8), "not both"),
        (dict(kv_memory="lots", num_pages=None), "must be a size"),
        (dict(kv_memory="10B", num_pages=None), "holds no page"),
        (dict(page_size=0), "page_size"),
        (dict(token_buckets=(1, 512)), "token_buckets"),
        (dict(cache_dtype="int4"), "cache dtype"),
    ],
)
def test_bad_engine_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model(CONFIGS["gqa"]), **{**dict(max_seqs=2, max_step_tokens=8, num_pages=8), **kwargs})


def test_kv_memory_sizes_the_pool():
    """kv_memory in bytes units gives as many pages as fit (each page: every layer's K/V plus slot positions)."""
    engine = Engine(tiny_model(CONFIGS["gqa"]), max_seqs=2, page_size=4, kv_memory="64KiB", max_step_tokens=8)
    # 2 layers x (K + V: 2 heads x 8 dims) float32 = 256 bytes per token, + 4 for its position: 1040 per page
    assert engine.num_pages == 65536 // 1040


def test_page_tables_are_as_wide_as_the_rows_need():
    """A step reads the pages its rows hold, not the max_seq_len-wide table: short requests run the narrowest
    width bucket that covers their pages, a longer one the next, and the tokens stay generate's."""
    model = tiny_model(CONFIGS["gqa"])
    engine = small_engine(model, page_size=4, num_pages=64, width_buckets=(2, 8))
    assert engine.width_buckets == (2, 8, 24)  # the whole table (max_seq_len 96 / page_size 4) is always one
    short = dict(prompt=[5, 6, 7], max_tokens=4, stop=())  # at most 6 cached tokens: 2 pages
    (res,) = engine.run([dict(prompt_ids=short["prompt"], max_tokens=4)], progress=False)
    assert engine.stats()["table_widths"] == [2]
    assert res.tokens == expected(model, short)[0]
    prompt = list(range(1, 27))  # 26 + 12 tokens: up to 9 pages
    (res,) = engine.run([dict(prompt_ids=prompt, max_tokens=MAX_NEW)], progress=False)
    assert engine.stats()["table_widths"] == [2, 8, 24]
    assert res.tokens == reference(model, prompt)
