"""`causal-lm convert`: Hugging Face Llama / Mistral / Qwen2 checkpoints and GGUF files to a workdir, and back.

causal-lm convert --from-hf DIR --workdir OUT     then: causal-lm generate/eval --workdir OUT
causal-lm convert --from-gguf FILE --workdir OUT  (llama / qwen2 GGUF files, any quantization, dequantized)
causal-lm convert --to-hf WORKDIR --out DIR       then: transformers' from_pretrained(DIR)
causal-lm convert --merge-lora WORKDIR --workdir OUT  a LoRA run's base + adapters as one model's weights

The workdir keeps the tokenizer with its settings (BOS handling, stop ids, chat template), so `generate --chat`
works on it.
"""

from __future__ import annotations

import dataclasses
import json
import os

from causal_lm.commands.common import add_quantize_args, check_quantize_args, parse_step
from causal_lm.config import Config, DataConfig, TrainConfig
from causal_lm.data.tokenizer import HFTokenizer
from causal_lm.interop.gguf import ARCHITECTURES, load_gguf
from causal_lm.interop.hf_checkpoint import load_hf, save_hf
from causal_lm.interop.hf_config import HFFormatError, read_hf_config
from causal_lm.model.quant import quantize as quantize_model
from causal_lm.train.checkpoint import (
    CHECKPOINT_DIR,
    REFUSED_DIR,
    Checkpointer,
    CheckpointError,
    load_for_inference,
    save_for_inference,
)


def register(sub):
    p = sub.add_parser(
        "convert",
        help="convert Hugging Face Llama/Mistral/Qwen2 checkpoints and GGUF files to a workdir and back",
        description="--from-hf DIR --workdir OUT reads a local Hugging Face checkpoint folder "
        "(config.json, *.safetensors, tokenizer.json) into a workdir that generate, "
        "eval and train use; --from-gguf FILE --workdir OUT does the same for a llama.cpp GGUF file "
        "(llama / qwen2 architectures, dequantized to float32); --to-hf WORKDIR --out DIR writes a "
        "workdir's model as a folder transformers loads. Nothing is downloaded.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="Hugging Face checkpoint folder to read")
    src.add_argument("--from-gguf", metavar="FILE", help="GGUF file to read (llama or qwen2 architecture)")
    src.add_argument("--to-hf", metavar="WORKDIR", help="workdir whose checkpoint to write as a Hugging Face folder")
    src.add_argument(
        "--merge-lora",
        metavar="WORKDIR",
        help="a LoRA run's workdir (train.lora_rank > 0): write its base with the adapters merged in "
        "(W + alpha/rank * A @ B) as a plain model in --workdir OUT",
    )
    p.add_argument("--workdir", help="with --from-hf / --from-gguf: the workdir to create")
    p.add_argument("--out", help="with --to-hf: the folder to write")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="with --from-hf: a tokenizer.json to use when DIR has none (generate and eval need one); with "
        "--from-gguf: instead of the tokenizer rebuilt from the file's vocabulary",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="with --from-hf / --from-gguf: parameter and compute dtype of the converted model (default float32)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="with --from-hf / --from-gguf: context length (default: the checkpoint's max_position_embeddings "
        "or the GGUF file's context_length)",
    )
    p.add_argument(
        "--architecture",
        choices=("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "smollm3"),
        default=None,
        help="with --to-hf: the architecture to write (default: the family whose features the model uses, "
        "see causal_lm.interop.hf_config.default_architecture; plain models as llama)",
    )
    p.add_argument(
        "--step", default=None, help="with --to-hf / --merge-lora: checkpoint step, 'latest' (default) or 'best'"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --from-hf / --from-gguf: convert into a workdir that already holds checkpoints, moving them to "
        "WORKDIR/checkpoints_refused/ (without it such a workdir is refused)",
    )
    p.add_argument(
        "--quantize",
        metavar="int8|int4",
        default=None,
        help="with --from-hf / --from-gguf: store the weights as int8 (per output channel) or int4 (groups of 32) "
        "for decoding (causal_lm.quantize)",
    )
    add_quantize_args(p, "--quantize")
    p.set_defaults(func=run)


def existing_steps(workdir: str) -> list[int]:
    """The checkpoint steps a workdir already holds (read from the directory names: no checkpoint library)."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def check_target_workdir(workdir: str, force: bool) -> list[int]:
    """Refuse, before anything is read, a workdir that already holds checkpoints (a training run's): the converted
    model would be written as step 0 beside them, and every command would go on using the newest of them.
    With force, they are moved to checkpoints_refused/ when the converted model is saved. Returns their steps."""
    steps = existing_steps(workdir)
    if steps and not force:
        raise CheckpointError(
            f"{workdir} already holds checkpoints (steps {', '.join(map(str, steps))}): converting into it would "
            "leave them the ones every command uses; use a new --workdir, or --force to move them to "
            f"{os.path.join(workdir, REFUSED_DIR)}"
        )
    return steps


def _save_converted(
    workdir: str, model, tokenizer, replace: list[int] = (), quantize=None, minimums=False, embed_weights=None
) -> tuple:
    """Write a converted model and its tokenizer as a checkpoint of `workdir` (generate, eval, train read it);
    quantize: "int8" | "int4" stores the weights that way (causal_lm.quantize, default group sizes; int4 groups
    with minimums, the embedding table and head in `embed_weights`). Returns (checkpoint path, the saved model's
    config)."""
    if quantize:
        model = quantize_model(model, quantize, minimums=minimums, embed=embed_weights)

    mc = model.config
    # Training-side settings only matter if the workdir is fine-tuned later: a context that fits the model, and
    # the workdir's own copy of the tokenizer (written by save_for_inference) as data.tokenizer.
    train = TrainConfig(seq_len=min(TrainConfig().seq_len, mc.max_seq_len))
    data = DataConfig(tokenizer=os.path.join(os.path.abspath(workdir), "tokenizer", "tokenizer.json"))
    config = Config(model=mc, data=data, train=train)
    if replace:
        ckpt = Checkpointer(workdir)
        try:
            ckpt.move_aside([s for s in replace if s in ckpt.all_steps()])
        finally:
            ckpt.close()
    return save_for_inference(workdir, model, config, tokenizer), mc


def convert_from_hf(
    hf_dir: str,
    workdir: str,
    *,
    tokenizer_path=None,
    dtype: str = "float32",
    max_seq_len=None,
    force: bool = False,
    quantize=None,
    minimums: bool = False,
    embed_weights=None,
) -> dict:
    """Read `hf_dir` with load_hf and write it as a checkpoint of `workdir`. Returns a summary dict. A workdir
    that already holds checkpoints is refused unless force (see check_target_workdir)."""

    replaced = check_target_workdir(workdir, force)
    model, tokenizer = load_hf(hf_dir, param_dtype=dtype, max_seq_len=max_seq_len)
    if tokenizer_path is not None:
        tokenizer = HFTokenizer.from_file(tokenizer_path)
    if tokenizer is None:
        raise HFFormatError(
            f"{hf_dir!r} has no tokenizer.json, which generate and eval need to turn text into "
            "ids; pass --tokenizer PATH/tokenizer.json"
        )
    path, saved = _save_converted(workdir, model, tokenizer, replaced, quantize, minimums, embed_weights)
    arch = read_hf_config(hf_dir).get("architectures", ["?"])[0]
    return {
        "architecture": arch,
        "params": model.num_params(),
        "config": saved,
        "checkpoint": path,
        "tokenizer_vocab": tokenizer.vocab_size,
        "chat_template": getattr(tokenizer, "chat_template", None) is not None,
        "replaced": replaced,
    }


def convert_from_gguf(
    gguf_file: str,
    workdir: str,
    *,
    tokenizer_path=None,
    dtype: str = "float32",
    max_seq_len=None,
    force: bool = False,
    quantize=None,
    minimums: bool = False,
    embed_weights=None,
) -> dict:
    """Read a GGUF file with load_gguf and write it as a checkpoint of `workdir`. Returns a summary dict. A workdir
    that already holds checkpoints is refused unless force (see check_target_workdir)."""

    replaced = check_target_workdir(workdir, force)
    model, tokenizer = load_gguf(
        gguf_file, param_dtype=dtype, max_seq_len=max_seq_len, load_tokenizer=tokenizer_path is None
    )
    if tokenizer_path is not None:
        tokenizer = HFTokenizer.from_file(tokenizer_path)
    path, saved = _save_converted(workdir, model, tokenizer, replaced, quantize, minimums, embed_weights)
    arch = ARCHITECTURES["qwen2" if model.config.qkv_bias else "llama"]
    return {
        "architecture": f"GGUF {arch}",
        "params": model.num_params(),
        "config": saved,
        "checkpoint": path,
        "tokenizer_vocab": tokenizer.vocab_size,
        "chat_template": getattr(tokenizer, "chat_template", None) is not None,
        "replaced": replaced,
    }


def convert_to_hf(workdir: str, out_dir: str, *, architecture=None, step=None) -> dict:
    """Write `workdir`'s checkpoint as a Hugging Face folder with save_hf. Returns a summary dict."""

    model, tokenizer, _ = load_for_inference(workdir, step)
    save_hf(model, tokenizer, out_dir, architecture=architecture)
    with open(os.path.join(out_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    return {
        "architecture": arch,
        "params": model.num_params(),
        "out": out_dir,
        "tokenizer_json": os.path.isfile(os.path.join(out_dir, "tokenizer.json")),
    }


def merge_lora(lora_workdir: str, workdir: str, *, step=None, force: bool = False) -> dict:
    """Write the merged weights of a LoRA run's checkpoint as an inference checkpoint of a new workdir."""
    reader = Checkpointer(lora_workdir, read_only=True)
    try:
        steps = reader.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoints in {lora_workdir!r}")
        saved = reader.read_meta(steps[-1])["config"].get("train", {})
    finally:
        reader.close()
    if not saved.get("lora_rank"):
        raise CheckpointError(f"{lora_workdir!r} is not a LoRA run (its train.lora_rank is 0): nothing to merge")
    replace = check_target_workdir(workdir, force)
    model, tokenizer, config = load_for_inference(lora_workdir, step)  # base + adapters, merged
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, lora_rank=0))
    if replace:
        ckpt = Checkpointer(workdir)
        try:
            ckpt.move_aside([s for s in replace if s in ckpt.all_steps()])
        finally:
            ckpt.close()
    path = save_for_inference(workdir, model, config, tokenizer)
    return {"checkpoint": path, "params": model.num_params(), "rank": saved["lora_rank"]}


def _stored(m) -> str:
    """How a quantized model's weights are stored, in words: "int4 (groups of 32 with minimums; int8 embedding)"."""
    group = f"groups of {m.weights_group_size}" if m.weights_group_size else "per output channel"
    extra = [group + (" with minimums" if m.weights_minimums else "")]
    if m.weights_embed:
        extra.append(f"{m.weights_embed} embedding")
    return f"{m.weights} ({'; '.join(extra)})"


def run(args) -> int:
    if args.merge_lora:
        if not args.workdir or args.out:
            raise ValueError("--merge-lora WORKDIR needs --workdir OUT (and no --out)")
        r = merge_lora(args.merge_lora, args.workdir, step=parse_step(args.step), force=args.force)
        print(f"merged the rank-{r['rank']} adapters of {args.merge_lora}: {r['params']:,} parameters")
        print(f"wrote {r['checkpoint']}")
        return 0
    source = args.from_hf or args.from_gguf
    if args.quantize is not None and args.quantize not in ("int8", "int4"):
        raise ValueError(f"--quantize must be int8 or int4, got {args.quantize!r}")
    check_quantize_args(args.quantize, args.minimums, args.embed_weights, "--quantize")
    if source:
        flag = "--from-hf DIR" if args.from_hf else "--from-gguf FILE"
        if not args.workdir or args.out:
            raise ValueError(f"{flag} needs --workdir OUT (and no --out)")
        if args.architecture is not None or args.step is not None:
            raise ValueError("--architecture and --step apply to --to-hf only")
        convert = convert_from_hf if args.from_hf else convert_from_gguf
        r = convert(
            source,
            args.workdir,
            tokenizer_path=args.tokenizer,
            dtype=args.dtype,
            max_seq_len=args.max_seq_len,
            force=args.force,
            quantize=args.quantize,
            minimums=args.minimums,
            embed_weights=args.embed_weights,
        )
        m = r["config"]
        window = f", sliding window {m.sliding_window}" if m.sliding_window else ""
        print(
            f"{r['architecture']}: {r['params']:,} parameters, {m.num_layers} layers, d_model {m.d_model}, "
            f"{m.num_heads} heads / {m.num_kv_heads} kv heads, head dim {m.head_dim}, vocab {m.vocab_size}, "
            f"context {m.max_seq_len}, rope theta {m.rope_theta:g}{window}, "
            f"{'tied' if m.tie_embeddings else 'untied'} embeddings, {m.param_dtype}"
            + (f", weights stored {_stored(m)}" if args.quantize else "")
        )
        if r["replaced"]:
            print(
                f"--force: moved the checkpoints it held (steps {', '.join(map(str, r['replaced']))}) to "
                f"{os.path.join(args.workdir, REFUSED_DIR)}"
            )
        print(f"wrote {r['checkpoint']}")
        print(f"next: causal-lm generate --workdir {args.workdir} --prompt '...'")
        if r.get("chat_template"):
            print(f"  or: causal-lm generate --workdir {args.workdir} --chat '...'")
        return 0
    if not args.out or args.workdir:
        raise ValueError("--to-hf WORKDIR needs --out DIR (and no --workdir)")
    if args.force:
        raise ValueError("--force applies to --from-hf / --from-gguf only")
    if args.quantize:
        raise ValueError("--quantize applies to --from-hf / --from-gguf only")
    for name in ("tokenizer", "max_seq_len"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} applies to --from-hf / --from-gguf only")
    step = parse_step(args.step)
    r = convert_to_hf(args.to_hf, args.out, architecture=args.architecture, step=step)
    tok = "with tokenizer.json" if r["tokenizer_json"] else "no tokenizer.json (this tokenizer kind has none)"
    print(f"wrote {r['out']} as {r['architecture']} ({r['params']:,} parameters, {tok})")
    return 0
