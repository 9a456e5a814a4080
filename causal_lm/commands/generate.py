"""`causal-lm generate`: stream text from a trained workdir (or a random-init model, for timing).

`--speculative ngram|WORKDIR` checks up to `--draft-tokens K` proposals per forward pass of the model (prompt
lookup, or a draft model loaded from another workdir with the same vocabulary): greedy text is the same as without
it, and the stats line adds the target passes and the share of proposals accepted. `--num-samples N` draws N
continuations of the one prompt, its K/V computed once and shared (it needs --temperature > 0: greedy samples
would be N copies of one text).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from causal_lm.commands.common import add_quantize_args, check_quantize_args
from causal_lm.config import load_config
from causal_lm.data.tokenizer import ByteTokenizer
from causal_lm.decode import generate
from causal_lm.interop.chat import apply_chat_template
from causal_lm.interop.gguf import load_gguf
from causal_lm.model import backends, build_model
from causal_lm.model.quant import quantize
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
    p.add_argument(
        "--speculative",
        metavar="ngram|WORKDIR",
        default=None,
        help="speculative decoding: 'ngram' (prompt lookup) or a draft model's workdir (same vocabulary); "
        "greedy output is unchanged, fewer forward passes of the model",
    )
    p.add_argument(
        "--draft-tokens",
        metavar="K",
        type=int,
        default=None,
        help="draft tokens checked per forward pass with --speculative (1..16, default 4)",
    )
    p.add_argument(
        "--num-samples",
        metavar="N",
        type=int,
        default=1,
        help="N samples of the prompt, its K/V computed once (needs --temperature > 0); printed at the end",
    )
    p.add_argument(
        "--weights",
        metavar="float32|int8|int4",
        default=None,
        help="weight storage for decoding: int8 (per output channel) or int4 (groups of --group-size inputs) "
        "quantizes a float model (causal_lm.quantize); default: as loaded",
    )
    p.add_argument("--group-size", type=int, default=None, help="with --weights int8/int4: inputs per scale")
    add_quantize_args(p)
    p.add_argument(
        "--gguf",
        metavar="FILE",
        default=None,
        help="run a llama.cpp GGUF file directly, its Q8_0/Q4_0/Q4_1 weights kept quantized (instead of --workdir)",
    )
    p.set_defaults(func=run)


def apply_weights(model, weights, group_size=None, minimums: bool = False, embed=None):
    """The model with `--weights` applied: quantized from float, or unchanged when it already is that format."""
    if weights is not None and weights not in ("float32", "int8", "int4"):
        raise ValueError(f"--weights must be one of float32, int8, int4, got {weights!r}")
    check_quantize_args(weights, minimums, embed)
    have = model.config.weights
    if weights is None or weights == have:
        if group_size is not None and weights is None:
            raise ValueError("--group-size applies with --weights int8|int4")
        if minimums and not model.config.weights_minimums:
            raise ValueError("the model's int4 weights have no minimums: --minimums cannot add them (load a float one)")
        if embed is not None and embed != (model.config.weights_embed or have):
            raise ValueError(
                f"the model's embedding is not {embed}: --embed-weights cannot convert it (load a float one)"
            )
        return model
    if have != "float32":
        raise ValueError(f"the model's weights are {have}: --weights {weights} cannot convert them (load a float one)")
    if weights == "float32":
        return model
    return quantize(model, weights, group_size=group_size, minimums=minimums, embed=embed)


def _finite(text: str) -> float:
    """argparse type: a finite float (float() accepts 'nan' and 'inf', which mean nothing as sampling settings)."""

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def load_model_and_tokenizer(workdir=None, config_path=None, overrides=(), gguf=None):
    """(model, tokenizer) from a workdir's latest checkpoint, a GGUF file (quants kept), or a random-init model
    from a config."""
    if gguf:
        return load_gguf(gguf, dequantize=False)
    if workdir:
        model, tokenizer, _ = load_for_inference(workdir)
        return model, tokenizer

    config = load_config(config_path or "small", overrides)
    return build_model(config.model), ByteTokenizer()


def _check_args(args) -> None:
    """The errors a user can make on the command line, before any model is loaded."""
    if args.gguf and (args.workdir or args.overrides or args.config):
        raise ValueError("--gguf FILE replaces --workdir / --config: give one model")
    if args.workdir and args.overrides:
        raise ValueError("key=value overrides apply to --config models; a workdir's model is fixed by its checkpoint")
    if args.chat is not None and args.prompt is not None:
        raise ValueError("--chat MESSAGE and --prompt TEXT exclude each other (--chat builds the prompt)")
    if args.chat is not None and not args.workdir:
        raise ValueError("--chat needs --workdir: a converted instruct model whose tokenizer has a chat template")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.num_samples > 1 and args.temperature == 0:
        # Allowed in Python (generate(num_samples=) is exact either way), refused here: N identical texts are
        # never what was meant, and the cost is N rows of decoding.
        raise ValueError(
            f"--num-samples {args.num_samples} with --temperature 0 (greedy) would print {args.num_samples} "
            "identical texts: set --temperature > 0"
        )
    if args.draft_tokens is not None:
        if args.speculative is None:
            raise ValueError("--draft-tokens applies to speculative decoding: add --speculative ngram|WORKDIR")
        if not 1 <= args.draft_tokens <= 16:
            raise ValueError(f"--draft-tokens must be in 1..16, got {args.draft_tokens}")
    if args.speculative is not None:
        if args.no_cache:
            raise ValueError("--speculative checks drafts through the KV cache: it cannot run with --no-cache")
        if args.speculative != "ngram" and not os.path.isdir(args.speculative):
            raise ValueError(f"--speculative takes 'ngram' or a draft model's workdir; {args.speculative!r} is neither")


def _vocabulary(tok) -> tuple:
    """What the token ids mean: two tokenizers with the same value here give each id the same text."""
    d = tok.to_dict()
    if "json" in d:  # a Hugging Face tokenizer: its vocabulary and added tokens (not its chat template or settings)
        spec = json.loads(d["json"])
        added = sorted((t["id"], t["content"]) for t in spec.get("added_tokens", []))
        return d["kind"], json.dumps(spec.get("model", {}).get("vocab"), sort_keys=True), tuple(added)
    return d["kind"], d.get("chars")


def load_draft(workdir: str, target, target_tok):
    """The draft model of `--speculative WORKDIR`, after checking that its ids mean the target's tokens."""
    try:
        draft, draft_tok, _ = load_for_inference(workdir)
    except ValueError as e:  # CheckpointError: not a workdir, or nothing intact in it
        raise ValueError(f"--speculative {workdir}: {e}") from None
    if draft.config.vocab_size != target.config.vocab_size or _vocabulary(draft_tok) != _vocabulary(target_tok):
        raise ValueError(
            f"--speculative {workdir}: the draft's vocabulary ({draft.config.vocab_size} ids, {draft_tok.kind} "
            f"tokenizer) differs from the model's ({target.config.vocab_size} ids, {target_tok.kind} tokenizer): "
            "its proposals would mean other tokens"
        )
    return draft


def run(args) -> int:
    _check_args(args)
    if args.weights is not None and args.weights not in ("float32", "int8", "int4"):  # before loading anything
        raise ValueError(f"--weights must be one of float32, int8, int4, got {args.weights!r}")
    check_quantize_args(args.weights, args.minimums, args.embed_weights)
    model, tok = load_model_and_tokenizer(args.workdir, args.config, args.overrides, args.gguf)
    model = apply_weights(model, args.weights, args.group_size, args.minimums, args.embed_weights)
    speculative = args.speculative
    if speculative is not None and speculative != "ngram":
        speculative = load_draft(speculative, model, tok)  # refused before anything is printed
    # A backend that cannot run here fails now; the line itself is printed with the stats, so that an error
    # raised while generate checks its arguments is the only thing a failed run prints.
    backend_line = backends.describe(model.config)
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
    samples = args.num_samples
    decode = tok.stream_decoder() if hasattr(tok, "stream_decoder") else None
    # N samples are printed one after another at the end; one streams as it comes
    streaming = not args.no_stream and decode is not None and samples == 1

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
        num_samples=samples,
    )
    if speculative is not None:
        kw.update(speculative=speculative, draft_tokens=args.draft_tokens or 4)
    # The first call streams the text as it comes (compiling, or loading the compiled programs from the persistent
    # compilation cache, on the way); a second, quiet call is timed, so tokens/s measures decoding, not XLA.
    t0 = time.perf_counter()
    res = generate(model, [prompt], on_step=on_step if streaming else None, **kw)
    first_call_s = time.perf_counter() - t0
    if samples > 1:
        for i, row in enumerate(res.tokens):
            out.write(f"--- sample {i + 1} of {samples} ---\n{shown}{tok.decode(row)}\n")
    elif not streaming or not first_token_at:  # not streamed (or no token came back): the prompt, then the text
        out.write(shown)
        out.write(tok.decode(res.tokens[0]))
    first_s = f"first token after {first_token_at[0] - t0:.2f}s, " if first_token_at else ""
    t0 = time.perf_counter()
    res = generate(model, [prompt], **kw)
    dt = time.perf_counter() - t0
    if samples == 1:
        print()
    print(backend_line, file=sys.stderr)
    print(_stats(args, res, dt, first_s, first_call_s), file=sys.stderr)
    return 0


def _stats(args, res, seconds: float, first_s: str, first_call_s: float) -> str:
    """The stats line: tokens/s, target passes and acceptance (speculative), the first call's time, K/V computed."""
    n = sum(len(t) for t in res.tokens)
    mode = "recompute" if args.no_cache else "kv cache"
    if args.speculative is not None:
        draft = "ngram" if args.speculative == "ngram" else "draft model"
        mode += f", speculative {draft}, {args.draft_tokens or 4} draft tokens"
    rows = f" over {len(res.tokens)} samples" if len(res.tokens) > 1 else ""
    line = f"[{mode}] {n} tokens{rows} in {seconds:.3f}s = {n / seconds:.1f} tokens/s"
    # passes serve every sample at once: per token of the longest one
    per = (
        "per token"
        if len(res.tokens) == 1
        else f"per token of the longest sample, each pass serving all {len(res.tokens)}"
    )
    line += f"; target passes: {res.target_passes} ({res.target_passes / max(res.steps, 1):.2f} {per})"
    if args.speculative is not None:
        share = res.draft_accepted / res.draft_proposed if res.draft_proposed else 0.0
        line += f"; drafts accepted: {res.draft_accepted}/{res.draft_proposed} ({100 * share:.0f}%)"
    return (
        f"{line} (first call: {first_s}all in {first_call_s:.2f}s, compile included); "
        f"K/V vectors computed: {res.kv_computed}"
    )
