"""`causal-lm bench train|decode`: throughput next to transformers/PyTorch and the machine's own ceilings.

Thin front over `causal_lm.bench.bench_train` / `bench_decode`: a text table, or one JSON object with --json.
"""

from __future__ import annotations

import json

from causal_lm.bench import bench_decode, bench_serve, bench_train, format_decode, format_serve, format_train
from causal_lm.bench.llamacpp import bench_llamacpp, format_llamacpp
from causal_lm.bench.load import bench_server, format_server
from causal_lm.commands.common import add_config_args, config_from_args
from causal_lm.config import REMATS


def register(sub):
    p = sub.add_parser(
        "bench",
        help="training / decoding throughput vs transformers (PyTorch) and the machine",
        description="Benchmarks run in one process: the machine's matmul FLOP/s and memory "
        "bandwidth, then ours and the peer (transformers' LlamaForCausalLM with the "
        "same weights, when torch and transformers are installed).",
    )
    which = p.add_subparsers(dest="bench", metavar="{train,decode,serve,llama-cpp}")
    t = which.add_parser("train", help="tokens/s, step time, MFU, compile time of the training step")
    _common(t)
    t.add_argument("--steps", type=int, default=None, help="timed steps after warm-up (default 5; quick 2)")
    t.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; quick 1)")
    t.add_argument(
        "--compile-layers",
        default="2,12",
        help="depths whose first-step compile time is measured, comma-separated ('' = none)",
    )
    t.add_argument(
        "--remat",
        default="",
        help="also time each model.remat policy, comma-separated (none,minimal,full) or 'all': step time and "
        "peak memory (compiled.memory_analysis()) per policy",
    )
    t.set_defaults(func=run_train)
    d = which.add_parser("decode", help="generate tokens/s with the KV cache and with recompute")
    _common(d)
    d.add_argument("--contexts", default="128,512,1024,2048", help="prompt lengths, comma-separated")
    d.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    d.add_argument("--new-tokens", type=int, default=None, help="decode steps timed with the cache (default 128)")
    d.add_argument(
        "--recompute-new-tokens", type=int, default=None, help="decode steps timed without the cache (default 4)"
    )
    d.add_argument("--reps", type=int, default=None, help="timed calls per length; the best counts (default 3)")
    d.add_argument(
        "--cache-dtypes", default="", help="more rows with the cache stored as these, e.g. bfloat16,int8 (ours only)"
    )
    d.add_argument("--workdir", default=None, help="time this trained workdir's model instead of a random-init one")
    d.add_argument(
        "--speculative",
        default=None,
        metavar="ngram|WORKDIR",
        help="add rows comparing plain and speculative decoding (prompt lookup, or a draft model's workdir)",
    )
    d.add_argument("--draft-tokens", type=int, default=4, help="draft tokens checked per target pass (default 4)")
    d.add_argument(
        "--no-first-call",
        action="store_true",
        help="skip timing the first token of two fresh processes (compiling, then from the compilation cache)",
    )
    d.add_argument(
        "--weights",
        default="float32",
        metavar="float32,int8,int4",
        help="rows for the weights stored as each of these (causal_lm.quantize), comma-separated; their timings "
        "alternate, so the 'x f32' ratio compares steps of the same minutes",
    )
    d.add_argument(
        "--gguf", default=None, metavar="FILE", help="time a GGUF file's model, its Q8_0/Q4_0/Q4_1 weights kept"
    )
    d.set_defaults(func=run_decode)
    s = which.add_parser(
        "serve", help="the serving engine on a fixed workload vs generate (x1, batches of 8) and transformers' CB"
    )
    add_config_args(s, default_config="bench_small")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    s.add_argument("--no-peer", action="store_true", help="skip transformers' continuous batching")
    s.add_argument("--no-baselines", action="store_true", help="skip our generate one at a time and in batches of 8")
    s.add_argument("--requests", type=int, default=None, help="requests in the workload (default 64)")
    s.add_argument("--prompt-range", default=None, help="prompt lengths, min,max (default 32,512; 16,64 with --server)")
    s.add_argument(
        "--new-range", default=None, help="new tokens per request, min,max (default 32,256; 16,64 with --server)"
    )
    s.add_argument(
        "--server",
        metavar="URL",
        default=None,
        help="load-test a running `causal-lm serve` at URL instead (--clients, --requests and/or --duration)",
    )
    s.add_argument("--clients", type=int, default=8, help="--server: concurrent clients (default 8)")
    s.add_argument("--duration", type=float, default=None, help="--server: stop sending after T seconds")
    s.add_argument("--stream", default="both", help="--server: streaming requests: both (every other one), yes or no")
    s.add_argument("--arrivals", default="all,poisson", help="all and/or poisson, comma-separated")
    s.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: the engine's)")
    s.add_argument("--max-seqs", type=int, default=16, help="engine rows (default 16)")
    s.add_argument("--page-size", type=int, default=16, help="engine page size (default 16)")
    s.add_argument("--max-step-tokens", type=int, default=256, help="engine tokens per step (default 256)")
    s.add_argument(
        "--burst-steps", type=int, default=1, help="engine decode steps per dispatch when all rows decode (default 1)"
    )
    s.add_argument(
        "--reps",
        type=int,
        default=1,
        help="timed runs of each system on the all-at-once workload, the systems taking turns (new prompt ids each "
        "rep); each system's fastest counts (default 1)",
    )
    s.set_defaults(func=run_serve)
    lc = which.add_parser(
        "llama-cpp",
        help="decode tokens/s of llama.cpp and ours on the same GGUF files (F32, Q8_0, Q4_1), side by side",
        description="Writes the model (random weights of --config's shape, or --workdir's) as GGUF files of the "
        "--types, or takes --gguf FILE, and times greedy decoding of the same token ids by llama.cpp's CPU library "
        "and by us (load_gguf(dequantize=False)) in one process. Needs the optional peer: "
        "pip install llama-cpp-cffi cffi attrs.",
    )
    add_config_args(lc, default_config="llama_135m")
    lc.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    lc.add_argument("--quick", action="store_true", help="a shorter measurement of the machine's ceilings")
    lc.add_argument("--types", default="F32,Q8_0,Q4_1", help="GGUF types to write and time: F32,Q8_0,Q4_0,Q4_1")
    lc.add_argument("--gguf", default=None, metavar="FILE", help="time this file instead of writing files")
    lc.add_argument("--workdir", default=None, help="write this trained workdir's model instead of random weights")
    lc.add_argument("--context", type=int, default=512, help="prompt tokens (default 512)")
    lc.add_argument("--new-tokens", type=int, default=64, help="greedy tokens timed (default 64)")
    lc.add_argument("--reps", type=int, default=3, help="timed calls per length; the best counts (default 3)")
    lc.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: every core)")
    lc.add_argument("--out", default=None, metavar="DIR", help="keep the written GGUF files here")
    lc.set_defaults(func=run_llamacpp)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _range(text: str, name: str) -> tuple:
    r = _ints(text)
    if len(r) != 2 or not 1 <= r[0] <= r[1]:
        raise ValueError(f"{name} takes min,max with 1 <= min <= max, got {text!r}")
    return r


def _common(p):
    add_config_args(p, default_config="bench_small")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="a fast smoke run: fewer steps, smaller sweeps")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers/PyTorch peer")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a jax.profiler trace of the timed work here")


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _remat_policies(text: str) -> tuple:
    if text.strip() == "all":
        return REMATS
    policies = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [p for p in policies if p not in REMATS]
    if bad:
        raise ValueError(f"--remat takes {', '.join(REMATS)} or 'all', comma-separated; got {', '.join(bad)}")
    return policies


def run_train(args) -> int:
    r = bench_train(
        config_from_args(args),
        steps=args.steps,
        warmup=args.warmup,
        peer=not args.no_peer,
        quick=args.quick,
        compile_layers=_ints(args.compile_layers),
        profile=args.profile,
        remat=_remat_policies(args.remat),
    )
    print(json.dumps(r) if args.json else format_train(r))
    return 0


def run_decode(args) -> int:
    r = bench_decode(
        config_from_args(args),
        contexts=_ints(args.contexts),
        batches=_ints(args.batches),
        new_tokens=args.new_tokens,
        recompute_new_tokens=args.recompute_new_tokens,
        reps=args.reps,
        peer=not args.no_peer,
        quick=args.quick,
        cache_dtypes=tuple(x.strip() for x in args.cache_dtypes.split(",") if x.strip()),
        workdir=args.workdir,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        profile=args.profile,
        first_call=not args.no_first_call,
        weights=tuple(x.strip() for x in args.weights.split(",") if x.strip()),
        gguf=args.gguf,
    )
    print(json.dumps(r) if args.json else format_decode(r))
    return 0


def run_llamacpp(args) -> int:
    r = bench_llamacpp(
        config_from_args(args),
        types=tuple(x.strip() for x in args.types.split(",") if x.strip()),
        gguf=args.gguf,
        workdir=args.workdir,
        context=args.context,
        new_tokens=args.new_tokens,
        reps=args.reps,
        threads=args.threads,
        out_dir=args.out,
        quick=args.quick,
    )
    print(json.dumps(r) if args.json else format_llamacpp(r))
    return 0


def run_serve(args) -> int:
    if args.server:
        return run_load(args)
    arrivals = tuple(x.strip() for x in args.arrivals.split(",") if x.strip())
    if not arrivals or any(a not in ("all", "poisson") for a in arrivals):
        raise ValueError(f"--arrivals takes all and/or poisson, got {args.arrivals!r}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    r = bench_serve(
        config_from_args(args),
        requests=args.requests or 64,
        prompt_range=_range(args.prompt_range or "32,512", "--prompt-range"),
        new_range=_range(args.new_range or "32,256", "--new-range"),
        arrivals=arrivals,
        rate=args.rate,
        max_seqs=args.max_seqs,
        page_size=args.page_size,
        max_step_tokens=args.max_step_tokens,
        burst_steps=args.burst_steps,
        baselines=not args.no_baselines,
        peer=not args.no_peer,
        reps=args.reps,
    )
    print(json.dumps(r) if args.json else format_serve(r))
    return 0


def run_load(args) -> int:
    """`bench serve --server URL`: the load test; exit 1 when a request failed or the server kept pages."""
    r = bench_server(
        args.server,
        clients=args.clients,
        requests=args.requests if args.requests is not None or args.duration is not None else 64,
        duration=args.duration,
        prompt_range=_range(args.prompt_range or "16,64", "--prompt-range"),
        new_range=_range(args.new_range or "16,64", "--new-range"),
        stream=args.stream,
    )
    print(json.dumps(r) if args.json else format_server(r))
    return 1 if r["errors"] or r["pages_used_after"] else 0
