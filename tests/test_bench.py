"""Smoke test of the benchmarks at tiny shapes: JSON keys the issue specifies, sane values. Never wall-clock targets."""

import json

import pytest

from causal_lm import bench
from causal_lm.cli import main
from causal_lm.config import REMATS, Config, ModelConfig, TrainConfig

TINY = Config(
    model=ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, mlp_dim=64, max_seq_len=64),
    train=TrainConfig(batch_size=2, seq_len=16),
)
CEILINGS = {"matmul_flops": 1e10, "mem_bw_bytes_per_s": 1e10, "matmul_n": 0}  # no time spent measuring the machine


@pytest.fixture(autouse=True)
def no_pauses(monkeypatch):
    monkeypatch.setattr(bench.common, "SETTLE_SECONDS", 0.0)


def _positive(x):
    return isinstance(x, float) and x > 0


def test_bench_train_keys_and_sanity():
    r = bench.bench_train(TINY, steps=1, warmup=1, compile_layers=(1, 2), ceilings=CEILINGS)
    json.dumps(r)  # JSON-serialisable as printed by --json
    assert set(r) >= {"machine", "jax_version", "ours", "peer", "ratio_vs_peer"}
    assert set(r["machine"]) >= {"matmul_flops", "mem_bw_bytes_per_s"}
    ours = r["ours"]
    assert set(ours) >= {"tokens_per_s", "step_s", "mfu", "compile_s"}
    assert all(_positive(ours[k]) for k in ("tokens_per_s", "step_s", "mfu", "compile_s"))
    assert ours["tokens_per_s"] == pytest.approx(2 * 16 / ours["step_s"])
    assert set(r["compile_layers"]) == {"1", "2", "ratio"} and _positive(r["compile_layers"]["ratio"])
    if r["peer_status"] == "ok":  # torch + transformers installed: same weights, same batch -> same first loss
        assert _positive(r["peer"]["tokens_per_s"]) and _positive(r["ratio_vs_peer"])
        assert r["peer"]["first_loss"] == pytest.approx(ours["first_loss"], rel=1e-4)
    else:
        assert r["peer"] is None and r["ratio_vs_peer"] is None and r["peer_status"] == bench.NOT_INSTALLED
    assert "tokens/s" in bench.format_train(r)


def test_bench_decode_keys_and_sanity(latency):
    r = bench.bench_decode(
        TINY,
        contexts=(8,),
        batches=(2,),
        new_tokens=2,
        recompute_new_tokens=1,
        reps=1,
        ceilings=CEILINGS,
        cache_dtypes=("int8",),
        speculative="ngram",
        compare_loops=False,
        first_call=False,  # the `latency` fixture times it once for the module
    )
    json.dumps(r)
    assert set(r) >= {"machine", "jax_version", "rows"}
    assert [(w["context"], w["batch"], w["cache_dtype"]) for w in r["rows"]] == [(8, 2, "float32"), (8, 2, "int8")]
    int8 = r["rows"][1]  # ours only: the peer has no int8 cache; recompute does not depend on the cache's storage
    assert _positive(int8["cached_tokens_per_s"]) and _positive(int8["prefill_tokens_per_s"])
    assert int8["recompute_tokens_per_s"] is None and int8["peer_cached_tokens_per_s"] is None
    assert int8["bytes_per_token"] < r["rows"][0]["bytes_per_token"]  # a quarter of the K/V bytes, plus scales
    spec = r["speculative"]
    assert spec["draft"] == "ngram" and [w["prompt"] for w in spec["rows"]] == ["code", "prose"]
    for w in spec["rows"]:
        assert w["same_tokens_as_plain"] and 0 < w["target_passes_per_token"] <= 1 and 0 <= w["acceptance"] <= 1
    for w in r["rows"][:1]:
        assert set(w) >= {
            "context",
            "batch",
            "cached_tokens_per_s",
            "recompute_tokens_per_s",
            "bandwidth_floor_fraction",
            "peer_cached_tokens_per_s",
            "peer_recompute_tokens_per_s",
        }
        assert all(
            _positive(w[k])
            for k in ("cached_tokens_per_s", "recompute_tokens_per_s", "bandwidth_floor_fraction", "bytes_per_token")
        )
        assert _positive(w["prefill_tokens_per_s"])
        if r["peer_status"] == "ok":
            assert _positive(w["peer_cached_tokens_per_s"]) and _positive(w["cached_ratio_vs_peer"])
            assert _positive(w["peer_prefill_tokens_per_s"]) and _positive(w["prefill_ratio_vs_peer"])
        else:
            assert w["peer_cached_tokens_per_s"] is None
    # bytes per generated token: all weights once per step, shared by the batch, plus each row's K/V
    w = r["rows"][0]
    assert w["bytes_per_token"] == pytest.approx(r["weight_bytes"] / 2 + r["kv_bytes_per_token"] * (8 + 1 + 2 / 2))
    text = bench.format_decode(r)
    assert "cached" in text and "speculative decoding (ngram drafts" in text and "fresh process" not in text
    text = bench.format_decode({**r, "first_call": latency})
    assert "first token of a fresh process (context 8, batch 1)" in text and "compilation cache (0 added)" in text


def test_bench_decode_without_recompute_skips_the_peers_recompute_too():
    """--recompute-new-tokens 0 times no recompute row on either side (it divided by zero on the peer's)."""
    if bench.peer_status() != "ok":
        pytest.skip("needs torch and transformers (the interop extra)")
    r = bench.bench_decode(
        TINY, contexts=(8,), batches=(1,), new_tokens=2, recompute_new_tokens=0, reps=1, ceilings=CEILINGS,
        compare_loops=False, first_call=False,
    )  # fmt: skip
    (w,) = r["rows"]
    assert w["recompute_tokens_per_s"] is None and w["peer_recompute_tokens_per_s"] is None
    assert _positive(w["cached_tokens_per_s"]) and _positive(w["peer_cached_tokens_per_s"])
    assert "cached" in bench.format_decode(r)


def test_weights_rows_time_their_decode_steps_alternated(monkeypatch):
    """--weights float32,int8,int4: a row per storage, each with its own weight bytes and its rate over float32's.
    On a VM whose speed moves within minutes, that ratio compares like with like only if the rows' timed calls
    alternate (float32, int8, int4, float32, ...) rather than run one storage's reps after the other's."""
    calls = []
    real_runner = bench.decode._ours_runner

    def logged(model, prompts, use_cache, **kw):
        run = real_runner(model, prompts, use_cache, **kw)
        if use_cache and "max_new_bucket" in kw:  # the cached timings (prefill's runner has the smallest room)
            return lambda k: (calls.append((model.config.weights, k)), run(k))[1]
        return run

    monkeypatch.setattr(bench.decode, "_ours_runner", logged)
    r = bench.bench_decode(
        TINY, contexts=(8,), batches=(1,), new_tokens=2, recompute_new_tokens=0, reps=2, ceilings=CEILINGS,
        compare_loops=False, first_call=False, peer=False, weights=("float32", "int8", "int4"),
    )  # fmt: skip
    f32, i8, i4 = r["rows"]
    assert [w["weights"] for w in r["rows"]] == ["float32", "int8", "int4"]
    assert f32["weight_bytes"] == r["weight_bytes"] > i8["weight_bytes"] > i4["weight_bytes"]
    assert f32["ratio_vs_float32"] == 1.0
    assert i8["ratio_vs_float32"] == pytest.approx(i8["cached_tokens_per_s"] / f32["cached_tokens_per_s"])
    # after one warm-up call of each length per runner, the reps alternate: each runner's turn is an untimed t(1)
    # (its program's memory back after the others'), then the timed t(1) and t(1 + n)
    turn = [[(w, 1), (w, 1), (w, 3)] for w in ("float32", "int8", "int4")]
    assert calls[6:24] == (turn[0] + turn[1] + turn[2]) * 2, calls
    assert "int8" in bench.format_decode(r)


def test_each_decode_rows_floor_is_at_the_bandwidth_read_beside_it():
    """On a shared VM the read speed moves within minutes: a row's floor is at the read bandwidth measured just
    before and after its own timing (the faster), not at the figure from the run's start (here CEILINGS' 10 GB/s,
    which no 64 MiB read on a CPU matches exactly)."""
    r = bench.bench_decode(
        TINY, contexts=(8,), batches=(1,), new_tokens=2, recompute_new_tokens=0, reps=1, ceilings=CEILINGS,
        compare_loops=False, first_call=False, peer=False, quick=True, bandwidth_beside=True,
    )  # fmt: skip
    (w,) = r["rows"]
    assert _positive(w["mem_bw_bytes_per_s"]) and w["mem_bw_bytes_per_s"] != CEILINGS["mem_bw_bytes_per_s"]
    assert w["bandwidth_floor_fraction"] == pytest.approx(
        w["cached_tokens_per_s"] * w["bytes_per_token"] / w["mem_bw_bytes_per_s"]
    )
    assert f"{w['mem_bw_bytes_per_s'] / 1e9:>8.1f} " in bench.format_decode(r)
    # given ceilings and no bandwidth_beside: the given figure, and no time spent reading
    r = bench.bench_decode(
        TINY, contexts=(8,), batches=(1,), new_tokens=2, recompute_new_tokens=0, reps=1, ceilings=CEILINGS,
        compare_loops=False, first_call=False, peer=False,
    )  # fmt: skip
    assert r["rows"][0]["mem_bw_bytes_per_s"] == CEILINGS["mem_bw_bytes_per_s"]


def test_a_model_the_peer_cannot_mirror_is_benchmarked_on_our_side_and_marked():
    """small has rope_fraction=0.5, which LlamaForCausalLM cannot express: our row runs, the peer's says why."""
    if bench.peer_status() != "ok":
        pytest.skip("needs torch and transformers (the interop extra)")
    config = Config(model=TINY.model.replace(rope_fraction=0.5), train=TINY.train)
    r = bench.bench_train(config, steps=1, warmup=1, compile_layers=(), ceilings=CEILINGS)
    assert r["peer"] is None and r["peer_status"].startswith("not comparable") and "rope_fraction" in r["peer_status"]
    assert _positive(r["ours"]["tokens_per_s"])
    assert "peer: not comparable" in bench.format_train(r)


def test_decode_bytes_per_token():
    m = TINY.model
    kv = m.kv_bytes_per_token(4)
    assert kv == 2 * 2 * 32 * 4  # layers x (K and V) x d_model x float32
    assert bench.decode_bytes_per_token(m, 1000, 10, 1) == 1000 + 10 * kv
    assert bench.decode_bytes_per_token(m, 1000, 10, 4) == 1000 / 4 + 10 * kv
    # a local layer reads only its ring of `window` slots, however long the context
    local = m.replace(sliding_window=4)
    assert bench.decode_bytes_per_token(local, 1000, 64, 1) == bench.decode_bytes_per_token(local, 1000, 4, 1)


def test_cli_bench_json_without_peer(capsys, monkeypatch):
    monkeypatch.setattr(bench, "machine_ceilings", lambda quick=False: CEILINGS)
    assert (
        main(
            [
                "bench",
                "train",
                "--json",
                "--no-peer",
                "--steps",
                "1",
                "--warmup",
                "1",
                "--compile-layers",
                "",
                "--config",
                "tiny",
                "model.num_layers=1",
                "train.batch_size=2",
                "train.seq_len=8",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["peer"] is None and r["ratio_vs_peer"] is None and r["peer_status"] == "skipped"
    assert r["ours"]["tokens_per_s"] > 0


def test_bench_train_rows_per_remat_policy():
    """`bench train --remat all`: one row per policy with step time and the compiled program's memory; keeping less
    for the backward pass needs fewer temporary bytes (none > minimal > full at this shape)."""
    r = bench.bench_train(TINY, steps=1, warmup=1, compile_layers=(), ceilings=CEILINGS, peer=False, remat=REMATS)
    json.dumps(r)
    assert [row["remat"] for row in r["remat"]] == list(REMATS)
    assert all(_positive(row["step_s"]) and row["memory"]["peak_bytes"] > 0 for row in r["remat"])
    temp = [row["memory"]["temp_bytes"] for row in r["remat"]]
    assert temp[0] > temp[1] > temp[2], temp
    assert r["ours"]["memory"]["temp_bytes"] == temp[0]  # TINY's own policy is none
    text = bench.format_train(r)
    assert "model.remat" in text and "peak memory (MiB)" in text and text.count("\nminimal ") == 1


def test_cli_bench_refuses_an_unknown_remat_policy(capsys):
    assert main(["bench", "train", "--no-peer", "--remat", "some", "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--remat takes none, minimal, full or 'all'" in err


@pytest.mark.slow
def test_bench_train_on_the_small_preset_completes_and_marks_the_peer_row(capsys):
    """The `causal-lm bench train --config small ...` (batch shrunk): the command succeeds with the peer
    installed (docs/performance.md), our row is measured and the peer's row says why it cannot run the same model."""
    if bench.peer_status() != "ok":
        pytest.skip("needs torch and transformers (the interop extra)")
    argv = ["bench", "train", "--config", "small", "--quick", "--compile-layers", "", "train.batch_size=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "peer: not comparable" in out and "rope_fraction" in out, out
    row = next(line for line in out.splitlines() if line.startswith("tokens/s"))
    assert "n/a" in row and any(ch.isdigit() for ch in row), row


@pytest.fixture(scope="module")
def latency():
    return bench.first_call_latency(TINY, context=8, batch=1, new_tokens=2)


def test_first_call_latency_compiles_in_the_first_process_and_reads_the_cache_in_the_second(latency):
    r = latency
    json.dumps(r)
    keys = ("first_call_first_token_s", "first_call_s", "cached_compile_first_token_s", "cached_compile_s")
    assert all(_positive(r[k]) for k in keys), r
    assert r["first_call_first_token_s"] <= r["first_call_s"]
    assert r["cached_compile_first_token_s"] <= r["cached_compile_s"]
    # The first process wrote its compiled programs to the empty folder; the second found every one of them there.
    assert r["first_call_cache_entries_added"] > 0 and r["cached_compile_cache_entries_added"] == 0, r


def test_decode_steps_lost_in_timing_noise_give_a_lower_bound_and_a_note():
    """n decode steps are timed as t(1 + n) - t(1); when the difference is within the call's noise (a tiny run), the
    rate falls back to the whole call's share of n steps, a lower bound, and says so, instead of dividing by ~0."""
    from causal_lm.bench.decode import NOISE_FRACTION, _steps_seconds
    from causal_lm.train import Note

    assert _steps_seconds(1.0, 3.0, 4) == 2.0
    for t_all in (1.0, 0.999, 1.0 + NOISE_FRACTION / 2):  # equal, shorter (noise), barely longer
        with pytest.warns(Note, match="lower bound"):
            assert _steps_seconds(1.0, t_all, 4) == pytest.approx(t_all * 4 / 5)


def test_bench_serve_keys_and_token_counts(capsys):
    """A tiny workload through `causal-lm bench serve --json` (no peer: its start-up alone takes longer than the
    rest): every system's metrics, the engine's pages and prefix hits, and the ratios."""
    code = main(
        ["bench", "serve", "--config", "tiny", "--json", "--no-peer", "--requests", "4", "--prompt-range", "3,8",
         "--new-range", "2,4", "--max-seqs", "4", "--page-size", "4", "--max-step-tokens", "16", "--rate", "50",
         "--reps", "2", "model.num_layers=1", "model.d_model=32"]
    )  # fmt: skip
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["peer"] == "skipped" and r["benchmark"] == "serve" and r["workload"]["reps"] == 2
    for v in r["runs"]["all"].values():  # two turns each, the fastest kept
        assert len(v["tokens_per_s_reps"]) == 2 and v["tokens_per_s"] == max(v["tokens_per_s_reps"])
    # each rep on new prompt ids: the engine's cache never serves a later rep from an earlier one's pages
    assert r["runs"]["all"]["engine"]["prefix_hit_pages_reps"] == [0, 0]
    assert set(r["runs"]) == {"all", "poisson"}
    assert set(r["runs"]["all"]) == {"engine", "generate_x1", "generate_x8"} and set(r["runs"]["poisson"]) == {"engine"}
    for runs in r["runs"].values():
        for v in runs.values():
            assert set(v) >= set(bench.serve.KEYS)
            assert _positive(v["tokens_per_s"]) and v["output_tokens"] == r["runs"]["all"]["engine"]["output_tokens"]
    e = r["runs"]["all"]["engine"]
    assert _positive(e["ttft_p50_s"]) and e["ttft_p99_s"] >= e["ttft_p50_s"] and _positive(e["tpot_p50_s"])
    assert 0 < e["pages_peak"] <= e["pages_total"] and e["prefix_hit_pages"] >= 0
    assert set(r["ratios"]) == {"engine_vs_generate_x1", "engine_vs_generate_x8"}
    assert r["workload"]["poisson_rate_per_s"] == 50


def test_bench_serve_refuses_a_bad_reps_count_in_one_line(capsys):
    capsys.readouterr()
    assert main(["bench", "serve", "--config", "tiny", "--no-peer", "--reps", "0"]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.strip().splitlines() == ["causal-lm bench: error: --reps must be >= 1, got 0"]


def test_bench_serve_turns_keep_each_systems_fastest_rep():
    """`bench serve --reps`: every system runs once per rep in turn, rep 0 on the workload itself and each later rep
    on new prompt ids of the same lengths and counts; each system's fastest rep counts, its rates all recorded."""
    from causal_lm.bench.serve import _take_turns, workload

    base = workload(3, (4, 9), (2, 5), 1000, arrival="all", rate=1.0)
    seen, order = [], []

    def system(name, rates):
        def run(work):
            order.append(name)
            seen.append(work)
            return {"tokens_per_s": rates[len([n for n in order if n == name]) - 1], "wall_s": 1.0}

        return run

    best = _take_turns({"a": system("a", [3.0, 5.0, 4.0]), "b": system("b", [7.0, 2.0, 6.0])}, base, 3, 1000, 0)
    assert order == ["a", "b"] * 3
    assert best["a"]["tokens_per_s"] == 5.0 and best["a"]["tokens_per_s_reps"] == [3.0, 5.0, 4.0]
    assert best["b"]["tokens_per_s"] == 7.0 and best["b"]["tokens_per_s_reps"] == [7.0, 2.0, 6.0]
    assert seen[0] is base and seen[1] is base  # rep 0: both systems on the workload itself
    assert seen[2] is seen[3] and seen[4] is seen[5]  # one workload per rep, shared by the systems
    for a, b in ((base, seen[2]), (base, seen[4]), (seen[2], seen[4])):
        assert [len(w["prompt"]) for w in a] == [len(w["prompt"]) for w in b]
        assert [w["max_tokens"] for w in a] == [w["max_tokens"] for w in b]
        assert all(x["prompt"] != y["prompt"] for x, y in zip(a, b, strict=True))


def test_a_decode_rate_above_the_floor_is_timed_again_and_marked():
    """t(1 + n) - t(1) with a t(1) slowed by a burst of load comes out too small: a rate above the bandwidth floor
    (impossible) is timed again with twice the reps, the slower of the two counts, and one still above is marked."""
    from causal_lm.bench.decode import above_the_floor
    from causal_lm.train import Note

    asked = []

    def again(k, took=2.0):
        asked.append(k)
        return took

    assert above_the_floor(1.0, again, 3, floor_seconds=1.0, what="x") == (1.0, False, False)  # at the floor
    assert asked == []
    assert above_the_floor(0.5, again, 3, floor_seconds=1.0, what="x") == (2.0, True, False)  # the slower counts
    assert asked == [6]
    with pytest.warns(Note, match="timing artifact"):
        assert above_the_floor(0.5, lambda k: 0.4, 3, floor_seconds=1.0, what="x") == (0.5, True, True)
    # through bench decode: a floor far above any rate (1 KB/s) marks the row, and the table says so
    with pytest.warns(Note, match="timing artifact"):
        r = bench.bench_decode(
            TINY, contexts=(8,), batches=(1,), new_tokens=2, recompute_new_tokens=0, reps=1,
            ceilings={**CEILINGS, "mem_bw_bytes_per_s": 1e3}, compare_loops=False, first_call=False, peer=False,
        )  # fmt: skip
    (w,) = r["rows"]
    assert w["retimed"] and w["implausible"] and w["bandwidth_floor_fraction"] > 1.1
    table = bench.format_decode(r)
    assert "%!" in table and "timing artifact" in table
    r = bench.bench_decode(
        TINY, contexts=(8,), batches=(1,), new_tokens=2, recompute_new_tokens=0, reps=1, ceilings=CEILINGS,
        compare_loops=False, first_call=False, peer=False,
    )  # fmt: skip
    assert not r["rows"][0]["retimed"] and not r["rows"][0]["implausible"]
    assert "%!" not in bench.format_decode(r)
