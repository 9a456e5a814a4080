"""`causal-lm generate`: stream text from a trained workdir (or a random-init model, for timing)."""

from __future__ import annotations

import argparse
import math
import sys
import time

from causal_lm.config import load_config
from causal_lm.data.tokenizer import ByteTokenizer
from causal_lm.decode import generate
from causal_lm.interop.chat import apply_chat_template
from causal_lm.model import build_model
from causal_lm.train.checkpoint import load_for_inference


def register(sub):
    p = sub.add_parser(
        "generate",
        help="generate text with or without the KV cache, streaming, with tokens/s",
        description="Generate from a trained (or converted) workdir, or from a random-init model "
        "built from --config (useful for timing).",
    )
    p.add_argument("--workdir", help="training workdir to load the latest checkpoint and tokenizer from")
    p.add_argument(
        "--config", default=None, help="preset for a random-init model when no --workdir is given (default: small)"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="model overrides for --config")
    p.add_argument("--prompt", default=None, help="prompt text (default 'The ')")
    p.add_argument(
        "--chat",
        metavar="MESSAGE",
        default=None,
        help="a user message, rendered with the checkpoint's chat template (generation stops at its end of turn)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--temperature", type=_finite, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=_finite, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=None, help="prefill the prompt in chunks of this size")
    p.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    p.set_defaults(func=run)


def _finite(text: str) -> float:
    """argparse type: a finite float (float() accepts 'nan' and 'inf', which mean nothing as sampling settings)."""

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def load_model_and_tokenizer(workdir=None, config_path=None, overrides=()):
    """(model, tokenizer) from a workdir's latest checkpoint, or a random-init model from a config."""
    if workdir:
        model, tokenizer, _ = load_for_inference(workdir)
        return model, tokenizer

    config = load_config(config_path or "small", overrides)
    return build_model(config.model), ByteTokenizer()


def run(args) -> int:
    if args.workdir and args.overrides:
        raise ValueError("key=value overrides apply to --config models; a workdir's model is fixed by its checkpoint")
    if args.chat is not None and args.prompt is not None:
        raise ValueError("--chat MESSAGE and --prompt TEXT exclude each other (--chat builds the prompt)")
    if args.chat is not None and not args.workdir:
        raise ValueError("--chat needs --workdir: a converted instruct model whose tokenizer has a chat template")
    model, tok = load_model_and_tokenizer(args.workdir, args.config, args.overrides)
    if args.chat is not None:
        text = apply_chat_template(tok, [{"role": "user", "content": args.chat}], add_generation_prompt=True)
        shown = ""  # the reply alone, not the template's markup
    else:
        text = shown = args.prompt if args.prompt is not None else "The "
    # BOS in front where the checkpoint's tokenizer asks for it (never twice); other tokenizers encode as is.
    prompt = tok.encode_prompt(text) if hasattr(tok, "encode_prompt") else tok.encode(text)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    out = sys.stdout
    decode = tok.stream_decoder() if hasattr(tok, "stream_decoder") else None

    first_token_at = []

    # The prompt is echoed once the first token exists, not before: an error raised while generate checks its
    # arguments (a cache on a model without the causal mask, a prompt too long) must be the first thing printed,
    # not glued to the prompt ("The causal-lm generate: error: ...").
    def on_step(step, toks):
        if not first_token_at:
            first_token_at.append(time.perf_counter())
            out.write(shown)
        if toks[0] >= 0 and decode is not None:
            out.write(decode([int(toks[0])]))
            out.flush()

    # EOS, the checkpoint's other EOS ids and the chat template's end-of-turn token (HFTokenizer.stop_ids).
    stops = list(getattr(tok, "stop_ids", None) or ([tok.eos_id] if getattr(tok, "eos_id", None) is not None else []))
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        use_cache=not args.no_cache,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chunk_size=args.chunk_size,
        stop_tokens=stops,
    )
    # The first call streams the text as it comes (compiling, or loading the compiled programs from the persistent
    # compilation cache, on the way); a second, quiet call is timed, so tokens/s measures decoding, not XLA.
    streaming = not args.no_stream and decode is not None
    t0 = time.perf_counter()
    res = generate(model, [prompt], on_step=on_step if streaming else None, **kw)
    first_call_s = time.perf_counter() - t0
    if not first_token_at:  # not streamed (or no token came back): the prompt, then the whole text
        out.write(shown)
    if not streaming:
        out.write(tok.decode(res.tokens[0]))
    first_s = f"first token after {first_token_at[0] - t0:.2f}s, " if first_token_at else ""
    t0 = time.perf_counter()
    res = generate(model, [prompt], **kw)
    dt = time.perf_counter() - t0
    n = len(res.tokens[0])
    print()
    print(
        f"[{'recompute' if args.no_cache else 'kv cache'}] {n} tokens in {dt:.3f}s = {n / dt:.1f} tokens/s "
        f"(first call: {first_s}all in {first_call_s:.2f}s, compile included); K/V vectors computed: {res.kv_computed}",
        file=sys.stderr,
    )
    return 0
