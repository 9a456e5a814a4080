"""First-token latency of a fresh process, with and without the persistent compilation cache.

What a user waits for when they type `causal-lm generate`: the first call of `generate` in a new process traces,
compiles and runs the prefill and the decode loop before the first token appears. The command line keeps the
compiled programs in JAX's persistent compilation cache (`causal_lm.compile_cache`), so a second run loads them
from disk instead. In-process timing cannot show either (a process compiles a program once, and keeps it), so
`first_call_latency` starts two fresh Python processes in turn, `python -m causal_lm.bench.first_call REQUEST`,
sharing one empty cache folder: the first compiles and fills the folder, the second should only read it. Each
reports the seconds from calling `generate` (streaming, as the command line does) to its first token and to its
end, and how many entries it added to the folder (the second should add none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from causal_lm import compile_cache
from causal_lm.config import Config, config_from_dict, config_to_dict
from causal_lm.decode import generate
from causal_lm.interop.hf_weights import model_from_params
from causal_lm.train.state import init_params


def _entries(folder: str) -> set:
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def first_call_latency(config: Config, *, context: int, batch: int, new_tokens: int, timeout: float = 900) -> dict:
    """Two fresh processes generate `new_tokens` after a random `context`-token prompt (batch rows) from a
    random-init model of `config`'s shape, with one new persistent compilation cache folder between them.

    Returns {context, batch, new_tokens, first_call_first_token_s, first_call_s (the whole call),
    first_call_cache_entries_added, cached_compile_first_token_s, cached_compile_s,
    cached_compile_cache_entries_added}: "first call" compiles everything, "cached compile" is the second process,
    whose programs come from the cache folder."""
    with tempfile.TemporaryDirectory(prefix="causal_lm_first_call_") as tmp:
        cache = os.path.join(tmp, "jax")
        request = os.path.join(tmp, "request.json")
        with open(request, "w") as f:
            json.dump(
                {
                    "config": config_to_dict(config),
                    "context": context,
                    "batch": batch,
                    "new_tokens": new_tokens,
                    "cache_dir": cache,
                },
                f,
            )
        runs = [_child(request, timeout) for _ in range(2)]
    out = {"context": context, "batch": batch, "new_tokens": new_tokens}
    for name, run in zip(("first_call", "cached_compile"), runs, strict=True):
        out[f"{name}_first_token_s"] = run["first_token_s"]
        out[f"{name}_s"] = run["call_s"]
        out[f"{name}_cache_entries_added"] = run["entries_added"]
    return out


def _child(request: str, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("CAUSAL_LM_COMPILATION_CACHE", None)  # the child turns the cache on in the request's folder itself
    proc = subprocess.run(
        [sys.executable, "-m", "causal_lm.bench.first_call", request],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"the first-call latency process failed (status {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    """The child: build the model, then time one streaming `generate` call; print one JSON line."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        req = json.load(f)
    if compile_cache.enable(req["cache_dir"]) is None:
        raise SystemExit(f"cannot use {req['cache_dir']} as the compilation cache")
    config = config_from_dict(req["config"])
    m = config.model
    _, params, _ = init_params(m, config.train.seed)
    model = model_from_params(m, params)
    prompts = np.random.default_rng(0).integers(0, m.vocab_size, (req["batch"], req["context"]), dtype=np.int32)
    before = _entries(req["cache_dir"])
    first = []

    def on_step(step, tokens):
        if not first:
            first.append(time.perf_counter())

    t0 = time.perf_counter()
    generate(model, prompts.tolist(), max_new_tokens=req["new_tokens"], on_step=on_step)
    t1 = time.perf_counter()
    added = len(_entries(req["cache_dir"]) - before)
    print(json.dumps({"first_token_s": first[0] - t0, "call_s": t1 - t0, "entries_added": added}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
