"""`causal-lm bench serve`: the serving engine on a fixed workload, next to `generate` and transformers' own
continuous batching on the same weights, in one run.

The workload: `requests` requests with random prompts of prompt_range tokens and new_range new tokens each (greedy,
no stop id, so every system emits exactly the tokens asked for), arriving all at once or as a Poisson process.

    engine            `Engine` (continuous batching, paged KV cache, chunked prefill), stepped on the host; a request
                      is submitted when its arrival time has passed
    generate x1       our `generate`, one request at a time in arrival order (all at once arrival only)
    generate x8       our `generate` over fixed batches of 8 requests in arrival order, each batch decoding until its
                      longest request is done (the tokens beyond a request's own count are wasted, as in any
                      fixed-batch server); all at once arrival only
    peer              transformers' ContinuousBatchingManager (the `generate_batch` machinery) over LlamaForCausalLM
                      holding the same weights (`build_peer`, from the interop conversion), requests added at their
                      arrival times, each with its own max_new_tokens

Reported per system and arrival: output tokens/s (requested tokens / wall time from the first arrival to the last
token), time to first token p50/p99 (from a request's arrival), time per output token p50/p99 (a request's
first-to-last token time / (tokens - 1)); for the engine also pages used at peak, prefix-cache hits and programs
compiled during the timed run. Ratios: engine tokens/s over each other's. Compile time is kept out of every timed
run: the engine first serves the same workload with other token ids (the same lengths and counts, so the same
programs, and no prefix-cache hits for the timed run); generate first runs the same prompts with 1 new token (its
programs are compiled for max_new_bucket = the largest new-token count, so one program per prompt bucket); the peer
is built and started before its clock starts.

With `reps` > 1 the systems take turns on the all-at-once workload (engine, generate x1, generate x8, peer, then
again), each rep on new prompt ids of the same lengths and counts (so the engine's prefix cache never hits an
earlier rep), and each system's fastest rep counts: a ratio then compares runs that met the same state of a shared
machine as nearly as one run after another can (a 2-core VM's read speed moves within minutes).
"""

from __future__ import annotations

import time

import numpy as np

from causal_lm.bench.common import environment, peer_status
from causal_lm.bench.peer import build_peer
from causal_lm.config import Config
from causal_lm.decode import generate
from causal_lm.interop.hf_weights import model_from_params
from causal_lm.serve import Engine
from causal_lm.train.state import init_params

KEYS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "wall_s", "output_tokens")


def workload(
    n: int, prompt_range: tuple, new_range: tuple, vocab_size: int, *, arrival: str, rate: float, seed: int = 0
) -> list:
    """[{prompt, max_tokens, arrive (seconds after the start)}], prompts and counts uniform in their ranges."""
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(0, vocab_size, int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist() for _ in range(n)
    ]
    counts = [int(rng.integers(new_range[0], new_range[1] + 1)) for _ in range(n)]
    # arrivals from their own generator: the same prompts and counts whatever the arrival process
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n) if arrival == "poisson" else np.zeros(n)
    arrive = np.cumsum(gaps) - gaps[0]
    return [dict(prompt=p, max_tokens=k, arrive=float(a)) for p, k, a in zip(prompts, counts, arrive, strict=True)]


def _percentiles(values, prefix: str) -> dict:
    if not values:
        return {f"{prefix}_p50_s": None, f"{prefix}_p99_s": None}
    return {f"{prefix}_p50_s": float(np.percentile(values, 50)), f"{prefix}_p99_s": float(np.percentile(values, 99))}


def _metrics(work, first, last, wall) -> dict:
    """Per-request first/last token times (seconds after the start; None when not observed) -> the summary."""
    tokens = sum(w["max_tokens"] for w in work)
    ttft = [f - w["arrive"] for w, f in zip(work, first, strict=True) if f is not None]
    tpot = [
        (lt - f) / (w["max_tokens"] - 1)
        for w, f, lt in zip(work, first, last, strict=True)
        if f is not None and w["max_tokens"] > 1
    ]
    return dict(
        tokens_per_s=tokens / wall, wall_s=wall, output_tokens=tokens, **_percentiles(ttft, "ttft"),
        **_percentiles(tpot, "tpot"),
    )  # fmt: skip


def engine_run(engine: Engine, work) -> dict:
    """Serve `work` on `engine` (requests submitted once their arrival time has passed); metrics + engine stats."""
    before = engine.stats()
    order = sorted(range(len(work)), key=lambda i: work[i]["arrive"])
    rid_of, first, last, counts = {}, [None] * len(work), [None] * len(work), [0] * len(work)
    index = {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_work():
        now = time.perf_counter() - t0
        while nxt < len(order) and work[order[nxt]]["arrive"] <= now:
            i = order[nxt]
            rid_of[i] = engine.submit(work[i]["prompt"], max_tokens=work[i]["max_tokens"])
            index[rid_of[i]] = i
            nxt += 1
        if not engine.has_work():
            time.sleep(max(0.0, work[order[nxt]]["arrive"] - now))
            continue
        events = engine.step()
        now = time.perf_counter() - t0
        for e in events:
            if e.token is not None:
                i = index[e.request_id]
                counts[i] += 1
                first[i] = now if first[i] is None else first[i]
                last[i] = now
    wall = time.perf_counter() - t0
    if counts != [w["max_tokens"] for w in work]:
        raise RuntimeError("the engine emitted other token counts than asked for")
    s = engine.stats()
    return dict(
        _metrics(work, first, last, wall),
        pages_peak=s["pages_peak"],
        pages_total=s["pages_total"],
        prefix_hit_pages=s["prefix_hit_pages"] - before["prefix_hit_pages"],
        prefix_hit_tokens=s["prefix_hit_tokens"] - before["prefix_hit_tokens"],
        preemptions=s["preemptions"] - before["preemptions"],
        programs_compiled_while_timed=s["programs_compiled"] - before["programs_compiled"],
        bursts=s["bursts"] - before["bursts"],
        burst_tokens=s["burst_tokens"] - before["burst_tokens"],
    )


def generate_run(model, work, batch: int, new_bucket: int) -> dict:
    """`generate` over consecutive groups of `batch` requests (arrival ignored: all at once), each group until its
    longest request is done. Time to first token and per token are not observed (no streaming): None."""
    t0 = time.perf_counter()
    for s in range(0, len(work), batch):
        group = work[s : s + batch]
        generate(
            model,
            [w["prompt"] for w in group],
            max_new_tokens=max(w["max_tokens"] for w in group),
            max_new_bucket=new_bucket,
        )
    wall = time.perf_counter() - t0
    return _metrics(work, [None] * len(work), [None] * len(work), wall)


def peer_run(peer, work, new_bucket: int) -> dict:
    """transformers' continuous batching (ContinuousBatchingManager) over `work`: each request added at its arrival
    time with its own max_new_tokens; token times from its own per-token timestamps (time.perf_counter)."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=new_bucket, eos_token_id=None, pad_token_id=0)
    with peer.continuous_batching_context_manager(generation_config=gc, block=True, timeout=5) as manager:
        order = sorted(range(len(work)), key=lambda i: work[i]["arrive"])
        ids, results = {}, {}
        t0 = time.perf_counter()
        nxt = 0
        while len(results) < len(work):
            now = time.perf_counter() - t0
            while nxt < len(order) and work[order[nxt]]["arrive"] <= now:
                i = order[nxt]
                ids[
                    manager.add_request(work[i]["prompt"], max_new_tokens=work[i]["max_tokens"], record_timestamps=True)
                ] = i
                nxt += 1
            r = manager.get_result(timeout=0.05)
            if r is not None and r.is_finished():
                if r.error:
                    raise RuntimeError(f"the peer failed a request: {r.error}")
                results[ids[r.request_id]] = r
        first = [None] * len(work)
        last = [None] * len(work)
        for i, r in results.items():
            if len(r.generated_tokens) != work[i]["max_tokens"]:
                raise RuntimeError("the peer emitted other token counts than asked for")
            if r.timestamps:
                first[i], last[i] = r.timestamps[0] - t0, r.timestamps[-1] - t0
        wall = max(r.lifespan[1] for r in results.values()) - t0
    return _metrics(work, first, last, wall)


def _new_ids(work, vocab_size: int, seed: int) -> list:
    """`work` with new random prompt ids (the same lengths, counts and arrivals)."""
    rng = np.random.default_rng(seed)
    return [dict(w, prompt=rng.integers(0, vocab_size, len(w["prompt"])).tolist()) for w in work]


def _take_turns(systems: dict, base, reps: int, vocab_size: int, seed: int) -> dict:
    """{system: its fastest run's metrics, with `tokens_per_s_reps` (every rep's rate, in turn order; the engine's
    `prefix_hit_pages_reps` too)}: rep r runs every system in turn on one workload, `base` for the first and new
    prompt ids (`_new_ids`) for each later one."""
    best, history = {}, {}
    for r in range(reps):
        work = base if r == 0 else _new_ids(base, vocab_size, seed + 1000 + r)
        for name, run in systems.items():
            v = run(work)
            for key in ("tokens_per_s", "prefix_hit_pages"):
                if key in v:
                    history.setdefault(name, {}).setdefault(f"{key}_reps", []).append(v[key])
            if name not in best or v["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = v
    return {name: dict(v, **history[name]) for name, v in best.items()}


def bench_serve(
    config: Config,
    *,
    requests: int = 64,
    prompt_range: tuple = (32, 512),
    new_range: tuple = (32, 256),
    arrivals: tuple = ("all", "poisson"),
    rate: float | None = None,
    max_seqs: int = 16,
    page_size: int = 16,
    max_step_tokens: int = 256,
    burst_steps: int = 1,
    baselines: bool = True,
    peer: bool = True,
    seed: int = 0,
    reps: int = 1,
) -> dict:
    """The workload on a random-init model of `config`'s shape (see the module docstring). rate: Poisson arrivals
    per second (default: the engine's all-at-once request rate, so the queue neither idles nor grows without end).
    reps: timed runs of each system on the all-at-once workload, taking turns; the fastest counts."""
    if int(reps) != reps or reps < 1:
        raise ValueError(f"reps must be a whole number >= 1, got {reps!r}")
    m = config.model
    # positions up to the workload's longest sequence: the engine's page tables (and so what each step gathers) are
    # as wide as max_seq_len, and generate's buffers are bucketed anyway
    m = m.replace(max_seq_len=prompt_range[1] + new_range[1])
    _, params, _ = init_params(m, config.train.seed)
    model = model_from_params(m, params)
    new_bucket = int(new_range[1])
    engine = Engine(
        model,
        max_seqs=max_seqs,
        page_size=page_size,
        num_pages=max_seqs * -(-(prompt_range[1] + new_range[1]) // page_size) + 1,
        max_step_tokens=max_step_tokens,
        batch_buckets=tuple(b for b in (1, 4, max_seqs) if b <= max_seqs),
        token_buckets=tuple(t for t in (1, 16, 64, max_step_tokens) if t <= max_step_tokens),
        burst_steps=burst_steps,
    )
    status = peer_status() if peer else "skipped"
    out = {
        "benchmark": "serve",
        "environment": environment(),
        "model": {
            "d_model": m.d_model,
            "num_layers": m.num_layers,
            "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads,
            "vocab_size": m.vocab_size,
        },  # fmt: skip
        "workload": dict(
            requests=requests, prompt_range=list(prompt_range), new_range=list(new_range), seed=seed, reps=reps
        ),
        "engine_settings": dict(
            max_seqs=max_seqs,
            page_size=page_size,
            max_step_tokens=max_step_tokens,
            num_pages=engine.num_pages,
            burst_steps=engine.burst_steps,
        ),  # fmt: skip
        "peer": status,
        "runs": {},
    }
    base = workload(requests, prompt_range, new_range, m.vocab_size, arrival="all", rate=1.0, seed=seed)
    # The warm-up pass meets the timed run's program shapes (same lengths, same new-token counts, so the same row,
    # chunk and page-table-width buckets) with other token ids, so its pages give the timed run no prefix hits.
    engine_run(engine, _new_ids(base, m.vocab_size, seed + 7))  # compiles the engine's programs
    systems = {"engine": lambda work: engine_run(engine, work)}
    if baselines:
        for batch in (1, 8):
            generate_run(model, [dict(w, max_tokens=1) for w in base], batch, new_bucket)  # compiles
            systems[f"generate_x{batch}"] = lambda work, batch=batch: generate_run(model, work, batch, new_bucket)
    peer_model = None
    if status == "ok":
        peer_model = build_peer(m, params).eval()
        systems["peer"] = lambda work: peer_run(peer_model, work, new_bucket)
    results = {"all": _take_turns(systems, base, reps, m.vocab_size, seed)}
    if "poisson" in arrivals:
        r = rate or requests / results["all"]["engine"]["wall_s"]
        out["workload"]["poisson_rate_per_s"] = r
        work = workload(requests, prompt_range, new_range, m.vocab_size, arrival="poisson", rate=r, seed=seed)
        results["poisson"] = {"engine": engine_run(engine, work)}
        if peer_model is not None:
            results["poisson"]["peer"] = peer_run(peer_model, work, new_bucket)
    out["runs"] = {a: v for a, v in results.items() if a in arrivals}
    eng = results["all"]["engine"]["tokens_per_s"]
    out["ratios"] = {f"engine_vs_{k}": eng / v["tokens_per_s"] for k, v in results["all"].items() if k != "engine"}
    if "poisson" in results and "peer" in results["poisson"]:
        out["ratios"]["engine_vs_peer_poisson"] = (
            results["poisson"]["engine"]["tokens_per_s"] / results["poisson"]["peer"]["tokens_per_s"]
        )
    return out


def format_serve(r: dict) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        f"serve: {r['workload']['requests']} requests, prompts {r['workload']['prompt_range']}, new tokens "
        f"{r['workload']['new_range']}; model d_model {r['model']['d_model']} x {r['model']['num_layers']} layers; "
        f"peer: {r['peer']}",
        f"{'arrival':8} {'system':12} {'tok/s':>9} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'wall s':>8}",
    ]
    for arrival, runs in r["runs"].items():
        for name, v in runs.items():
            lines.append(
                f"{arrival:8} {name:12} {v['tokens_per_s']:9.1f} {f(v['ttft_p50_s'], '9.3f')} "
                f"{f(v['ttft_p99_s'], '8.3f')} {f(v['tpot_p50_s'], '9.4f')} {f(v['tpot_p99_s'], '8.4f')} "
                f"{v['wall_s']:8.1f}"
            )
    e = r["runs"].get("all", {}).get("engine")
    if e:
        lines.append(
            f"engine: pages at peak {e['pages_peak']}/{e['pages_total']}, prefix hits {e['prefix_hit_pages']} pages, "
            f"preemptions {e['preemptions']}, programs compiled while timed {e['programs_compiled_while_timed']}, "
            f"{e['burst_tokens']} of {e['output_tokens']} tokens in {e['bursts']} decode bursts"
        )
    reps = r["workload"].get("reps", 1)
    if reps > 1:
        lines.append(
            f"all at once: the fastest of {reps} reps per system, the systems taking turns; every rep's tok/s: "
            + "; ".join(
                f"{name} " + " / ".join(f"{x:.1f}" for x in v["tokens_per_s_reps"])
                for name, v in r["runs"].get("all", {}).items()
            )
        )
    lines.append("ratios (engine tokens/s over): " + ", ".join(f"{k[10:]} {v:.2f}x" for k, v in r["ratios"].items()))
    return "\n".join(lines)
