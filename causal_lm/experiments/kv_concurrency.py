"""Users served at a fixed KV budget: the KV-cache lesson's bytes-per-token table turned into concurrent sequences.

For each attention layout (MHA, GQA, MQA, MLA, all layers local with a window, 5 local : 1 global) and for int8
storage (of the GQA layout), at each KV budget (default 64 MiB and 256 MiB) and sequence length (512, 2048 tokens):

    bytes_per_token   one page's bytes (every layer's K/V or latent, scales, slot positions) / page size, from the
                      engine's own page accounting (`page_bytes`)
    fit               how many sequences of that length the pool holds at once: each layer group's pages (the
                      budget split for sequences of that length, `Engine.pages_for_budget(budget, length)`, what
                      `num_pages=` of an engine serving them is; one group: budget // page bytes, as
                      `Engine(kv_memory=...)` sizes it) // the pages one sequence holds at most in that group
                      (`Engine.group_pages_needed`: every page up to its last token, or, for local layers, the pages
                      of the window and a chunk), the least over the groups. Each group pages independently, so a
                      5:1 local/global model's local layers hold only the window's pages and it fits more sequences
                      than GQA
    engine_admitted   the check that this arithmetic is the engine's: a pool sized for `check_seqs` such sequences
                      (plus a page less than one more) gets check_seqs + 2 of them at once, and the most that decode
                      at the same time is counted; for global layouts it equals check_seqs, for all-local ones it is at
                      least check_seqs (the bound is conservative: pages leave the window as a sequence advances)
    tokens_per_s      the engine's measured output tokens/s with min(fit, max_seqs) sequences of a short prompt
                      decoding together (random weights: speed does not depend on what the model learned)

    run(config, out_dir) -> results; writes report.md, kv_concurrency.png and results.json. The models are random
    (nothing to train: bytes and admission are properties of the shapes), so the default run takes minutes on a CPU.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from causal_lm.config import Config, config_to_dict, load_config
from causal_lm.experiments.common import pyplot, write_json, write_text
from causal_lm.experiments.kv_memory import layouts
from causal_lm.model import build_model
from causal_lm.model.paged_cache import page_bytes, pages_for
from causal_lm.serve.engine import Engine, parse_bytes

NAME = "kv-concurrency"
HELP = "concurrent sequences that fit a KV budget, and engine throughput, for MHA/GQA/MQA/MLA/windows/int8"


def variants(window: int) -> dict:
    """name -> (model overrides, cache storage): kv-memory's layouts in float32, and GQA-2 in int8."""
    out = {name: (changes, "float32") for name, changes in layouts(window).items()}
    out["GQA-2 int8"] = (layouts(window)["GQA-2"], "int8")
    return out


def default_config() -> Config:
    """The tiny preset's heads at width 128 with 6 layers (room for a 5:1 pattern), positions up to 2048."""
    return load_config("tiny", ["model.num_layers=6", "model.d_model=128", "model.max_seq_len=2048"])


def _engine(model, storage, *, kv_memory=None, num_pages=None, max_seqs, page_size, chunk, step_tokens=None):
    return Engine(
        model,
        max_seqs=max_seqs,
        page_size=page_size,
        kv_memory=kv_memory,
        num_pages=num_pages,
        max_step_tokens=step_tokens or max(chunk, max_seqs),
        cache_dtype=storage,
        batch_buckets=(max_seqs,),
        token_buckets=(1, chunk) if chunk > 1 else (1,),
        prefix_cache=False,
    )


def _admitted(model, storage, length, check_seqs, *, page_size, chunk) -> tuple:
    """(decoding at once, pages in the pool): check_seqs + 2 sequences of `length` tokens offered at once to an
    engine whose pool holds check_seqs of them by `pages_needed` (and a page less than one more). Each prompt ends
    on the first slot of its last page, so a sequence that has read its prompt holds every page it will need, and
    the prompts are read side by side (a chunk each per step), so the sequences the pool holds decode together."""
    rows = check_seqs + 2
    kw = dict(max_seqs=rows, page_size=page_size, chunk=chunk, step_tokens=rows * chunk)
    need = _engine(model, storage, num_pages=1, **kw).group_pages_needed(length)
    engine = _engine(model, storage, num_pages=tuple(check_seqs * n + n - 1 for n in need), **kw)
    prompt_len = min(length - 1, page_size * (pages_for(length - 1, page_size) - 1) + 1)
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, prompt_len).tolist() for _ in range(rows)]
    engine.run([dict(prompt_ids=p, max_tokens=length - prompt_len) for p in prompts], progress=False)
    return engine.stats()["decoding_peak"], engine.num_pages


def _throughput(model, storage, rows, *, page_size, prompt_len, new_tokens, reps) -> float:
    """Output tokens/s of `rows` sequences (random prompts of prompt_len) decoding new_tokens each together, best of
    reps after an untimed run that compiles."""
    engine = _engine(model, storage, num_pages=rows * (-(-(prompt_len + new_tokens) // page_size)) + 1,
                     max_seqs=rows, page_size=page_size, chunk=prompt_len)  # fmt: skip
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    requests = [dict(prompt_ids=rng.integers(0, V, prompt_len).tolist(), max_tokens=new_tokens) for _ in range(rows)]
    best = float("inf")
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        engine.run(requests, progress=False)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return rows * new_tokens / best


def run(
    config: Config | None = None,
    out_dir: str = "runs/kv_concurrency",
    *,
    budgets: tuple = ("64MiB", "256MiB"),
    lengths: tuple = (512, 2048),
    window: int = 128,
    page_size: int = 16,
    chunk: int = 64,
    check_seqs: int = 2,
    max_seqs: int = 32,
    prompt_len: int = 32,
    new_tokens: int = 32,
    reps: int = 1,
    names: tuple | None = None,
) -> dict:
    """Every variant of `variants(window)` (or those in `names`) at every budget and length; reps=0 skips the
    throughput timing."""
    config = config or default_config()
    if max(lengths) > config.model.max_seq_len:
        config = dataclasses.replace(config, model=config.model.replace(max_seq_len=max(lengths)))
    chosen = variants(window)
    unknown = [n for n in names or () if n not in chosen]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}; choose from {list(chosen)}")
    os.makedirs(out_dir, exist_ok=True)
    results = {
        "experiment": NAME,
        "budgets": list(budgets),
        "lengths": list(lengths),
        "window": window,
        "page_size": page_size,
        "config": config_to_dict(config),
        "layouts": {},
    }
    for name, (changes, storage) in chosen.items():
        if names is not None and name not in names:
            continue
        model = build_model(config.model.replace(**changes))
        per_page = page_bytes(model.config, page_size, storage)
        probe = _engine(model, storage, num_pages=1, max_seqs=1, page_size=page_size, chunk=chunk)
        cells = {}
        for budget in budgets:
            for length in lengths:
                pages = probe.pages_for_budget(parse_bytes(budget), length)  # split for sequences of `length`
                need = probe.group_pages_needed(length)
                fit = min(p // n for p, n in zip(pages, need, strict=True))
                cells[f"{budget}/{length}"] = {"pages": int(sum(pages)), "group_pages": list(pages), "fit": int(fit)}
        checks = {}
        for length in lengths:
            admitted, pool = _admitted(model, storage, length, check_seqs, page_size=page_size, chunk=chunk)
            checks[str(length)] = {"pool_pages": pool, "expected": check_seqs, "engine_admitted": int(admitted)}
        fits = [c["fit"] for c in cells.values()]
        rows = max(1, min(max(fits), max_seqs))
        speed = None
        if reps:
            # positions up to the throughput run's sequences: each step gathers every row's page table, which is
            # max_seq_len wide (the same weights: a model's parameters do not depend on max_seq_len)
            short = build_model(config.model.replace(**changes, max_seq_len=prompt_len + new_tokens))
            speed = _throughput(
                short, storage, rows, page_size=page_size, prompt_len=prompt_len, new_tokens=new_tokens, reps=reps
            )
        results["layouts"][name] = {
            "overrides": {k: str(v) for k, v in changes.items()},
            "storage": storage,
            "bytes_per_token": per_page / page_size,
            "pages_needed": {str(n): probe.pages_needed(n) for n in lengths},
            "group_pages_needed": {str(n): list(probe.group_pages_needed(n)) for n in lengths},
            "groups": [
                dict(window=w, page_bytes=b) for w, b in zip(probe.windows, probe.group_page_bytes, strict=True)
            ],
            "cells": cells,
            "checks": checks,
            "throughput_rows": rows,
            "tokens_per_s": speed,
        }
    write_json(os.path.join(out_dir, "results.json"), results)
    plot(results, os.path.join(out_dir, "kv_concurrency.png"))
    write_text(os.path.join(out_dir, "report.md"), report(results))
    return results


def check_ok(layout: dict, all_local: bool) -> bool:
    """The engine admits what the arithmetic says (at least, for all-local layouts)."""
    return all(
        (c["engine_admitted"] >= c["expected"]) if all_local else (c["engine_admitted"] == c["expected"])
        for c in layout["checks"].values()
    )


def _all_local(name: str) -> bool:
    return name.startswith("local")


def summary(results: dict) -> str:
    budget, length = results["budgets"][0], results["lengths"][-1]
    lay = results["layouts"]
    fits = ", ".join(f"{n} {v['cells'][f'{budget}/{length}']['fit']}" for n, v in lay.items())
    ok = all(check_ok(v, _all_local(n)) for n, v in lay.items())
    return f"sequences of {length} tokens in {budget}: {fits}; engine admits what the arithmetic says: {ok}"


def plot(results: dict, path: str) -> str:
    plt = pyplot()
    names = list(results["layouts"])
    cells = list(results["layouts"][names[0]]["cells"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.8), constrained_layout=True)
    x = np.arange(len(names))
    w = 0.8 / len(cells)
    for i, cell in enumerate(cells):
        vals = [max(results["layouts"][n]["cells"][cell]["fit"], 0.5) for n in names]
        ax.bar(x + (i - (len(cells) - 1) / 2) * w, vals, w, label=cell.replace("/", ", ") + " tokens")
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("concurrent sequences that fit")
    ax.set_title(f"Users served at a fixed KV budget (page size {results['page_size']}, window {results['window']})")
    ax.legend(fontsize=8)
    speeds = [results["layouts"][n]["tokens_per_s"] or 0.0 for n in names]
    bx.bar(x, speeds)
    for xi, n in zip(x, names, strict=True):
        bx.annotate(f"{results['layouts'][n]['throughput_rows']} rows", (xi, speeds[list(x).index(xi)]), ha="center")
    bx.set_xticks(x, names, rotation=20)
    bx.set_ylabel("engine output tokens / s")
    bx.set_title("Measured engine throughput, min(fit, max_seqs) sequences decoding")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results: dict) -> str:
    cells = list(next(iter(results["layouts"].values()))["cells"])
    lines = [
        "# KV concurrency: users served at a fixed KV budget",
        "",
        "Each layout's bytes per token come from the engine's page accounting (`page_bytes` / page size); a budget "
        "holds budget // page bytes pages, and a sequence of L tokens holds at most `Engine.pages_needed(L)` of "
        "them. `fit` = pages // pages per sequence. A model with local and global layers pages each layer group "
        "independently: the budget is split between the groups for sequences of that length "
        "(`Engine.pages_for_budget(budget, L)`) and a local group "
        "holds only the window's pages, so `fit` is the least over the groups of group pages // group pages per "
        "sequence. The check column runs the engine on a pool sized for "
        "`expected` sequences (and a page short of one more), offers it two more, and counts the most that decode "
        "at once. Throughput: the engine's output tokens/s with min(fit, max_seqs) sequences decoding together "
        "(random weights, this machine).",
        "",
        "![fit and throughput](kv_concurrency.png)",
        "",
        "| layout | storage | bytes / token | "
        + " | ".join(f"fit {c.replace('/', ', ')}" for c in cells)
        + " | engine check (admitted / expected) | tokens/s (rows) |",
        "|---|---|---|" + "---|" * len(cells) + "---|---|",
    ]
    for name, v in results["layouts"].items():
        fits = " | ".join(f"{v['cells'][c]['fit']:,}" for c in cells)
        check = ", ".join(f"L={n}: {c['engine_admitted']}/{c['expected']}" for n, c in v["checks"].items())
        speed = "-" if v["tokens_per_s"] is None else f"{v['tokens_per_s']:,.0f} ({v['throughput_rows']})"
        lines.append(f"| {name} | {v['storage']} | {v['bytes_per_token']:,.0f} | {fits} | {check} | {speed} |")
    lay = results["layouts"]
    lines += ["", "## What it shows", ""]
    if "MHA" in lay:
        base = lay["MHA"]["bytes_per_token"]
        lines.append(
            "Bytes per token relative to MHA: "
            + ", ".join(f"{n} {v['bytes_per_token'] / base:.2f}x" for n, v in lay.items() if n != "MHA")
            + ". Fewer bytes per token is more users at the same memory, in proportion for global layouts; "
            "all-local layouts hold a bounded number of pages however long the sequence, so their count stops "
            "depending on the length."
        )
    if "5:1 mixed" in lay and "GQA-2" in lay:
        mixed, gqa = lay["5:1 mixed"]["cells"], lay["GQA-2"]["cells"]
        lines.append(
            "5:1 local/global (GQA-2 heads) against GQA-2: "
            + ", ".join(f"{c.replace('/', ', ')} tokens {mixed[c]['fit']:,} vs {gqa[c]['fit']:,}" for c in cells)
            + " sequences: its local layers keep only the window's pages."
        )
    ok = all(check_ok(v, _all_local(n)) for n, v in lay.items())
    lines.append(f"The engine admits exactly what the arithmetic says (at least, for all-local layouts): {ok}.")
    return "\n".join(lines) + "\n"
