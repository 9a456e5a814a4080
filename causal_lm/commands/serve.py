"""`causal-lm serve`: an OpenAI-compatible HTTP server (causal_lm/serve/server.py) on the engine, for a trained or
converted workdir, a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import os
import sys

from causal_lm.interop.chat import apply_chat_template
from causal_lm.interop.gguf import load_gguf
from causal_lm.interop.hf_checkpoint import load_hf
from causal_lm.serve import Engine
from causal_lm.serve.runner import EngineRunner
from causal_lm.serve.server import MAX_BODY_BYTES, bind, check_installed, create_app, serve
from causal_lm.train.checkpoint import load_for_inference


def register(sub):
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, streaming) on the serving engine",
        description="Serve a model over the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, "
        "/health, /metrics) until SIGINT or SIGTERM.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a trained or converted workdir (its latest checkpoint and tokenizer)")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint folder (config.json, safetensors)")
    src.add_argument("--gguf", metavar="FILE", help="a GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--model-name", default=None, help="the model's name in the API (default: the folder or file)")
    p.add_argument("--kv-memory", default="1GiB", help="KV-cache pool size, e.g. 1GiB, 512MiB (default 1GiB)")
    p.add_argument("--max-seqs", type=int, default=16, help="requests running at once (default 16)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    p.add_argument("--cache-dtype", default=None, help="page storage: float32, bfloat16, int8, ... (default: model's)")
    p.add_argument("--max-model-len", type=int, default=None, help="the context to allow (default: the model's)")
    p.add_argument("--max-step-tokens", type=int, default=None, help="tokens one engine step feeds (default 256)")
    p.add_argument(
        "--max-body-bytes", type=int, default=MAX_BODY_BYTES, help=f"largest request body (default {MAX_BODY_BYTES})"
    )
    p.set_defaults(func=run)


def load_served(args):
    """(model, tokenizer, name) of --workdir / --hf / --gguf, with --max-model-len applied."""
    n = args.max_model_len
    if n is not None and n < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {n}")
    if args.workdir:
        model, tok, _ = load_for_inference(args.workdir, overrides=[f"model.max_seq_len={n}"] if n else ())
        path = args.workdir
    elif args.hf:
        model, tok = load_hf(args.hf, max_seq_len=n)
        path = args.hf
        if tok is None:
            raise ValueError(f"{args.hf!r} has no tokenizer.json: the server needs one to turn text into ids")
    else:
        model, tok = load_gguf(args.gguf, max_seq_len=n)
        path = args.gguf
    name = args.model_name or os.path.basename(os.path.normpath(path)) or path
    return model, tok, name


def run(args) -> int:
    check_installed()
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    sock = bind(args.host, args.port)  # a taken port fails now, before the model is loaded
    try:
        model, tok, name = load_served(args)
    except BaseException:
        sock.close()
        raise
    engine = Engine(
        model,
        max_seqs=args.max_seqs,
        page_size=args.page_size,
        kv_memory=args.kv_memory,
        cache_dtype=args.cache_dtype,
        max_step_tokens=args.max_step_tokens,
    )
    chat = None
    if getattr(tok, "chat_template", None):
        chat = lambda messages: apply_chat_template(tok, messages, add_generation_prompt=True)
    runner = EngineRunner(engine).start()
    app = create_app(runner, tok, model_name=name, chat=chat, max_body_bytes=args.max_body_bytes)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    c = model.config
    print(
        f"causal-lm serve: {name} ({model.num_params():,} parameters, context {c.max_seq_len} tokens, "
        f"{'chat template' if chat else 'no chat template'}; {engine.num_pages} KV pages of {engine.page_size} "
        f"tokens ({engine.cache_dtype}), up to {engine.max_seqs} requests at once) on http://{shown}:{port}",
        flush=True,
    )
    serve(app, runner, sock)
    print("causal-lm serve: stopped", file=sys.stderr, flush=True)
    return 0
