"""`causal-lm train`: train a config in a workdir (rerunning the same command resumes)."""

from __future__ import annotations

from causal_lm.commands.common import add_config_args, config_from_args
from causal_lm.config import TASKS
from causal_lm.parallel import initialize_distributed, is_main_process
from causal_lm.train import train_and_evaluate


def register(sub):
    p = sub.add_parser(
        "train",
        help="train a model (resumes when the workdir has checkpoints)",
        description="Train --config (with key=value overrides) in --workdir: progress bar, "
        "metrics.jsonl, TensorBoard events in workdir/tb, orbax checkpoints. Rerunning "
        "the same command on the same workdir resumes from its latest checkpoint.",
    )
    add_config_args(p)
    p.add_argument(
        "--workdir",
        required=True,
        help="directory for checkpoints, metrics and the tokenizer "
        "(multi-host: one every host sees, e.g. NFS or a gcsfuse mount)",
    )
    g = p.add_argument_group(
        "multi-host",
        "Run the same command on every host. Under SLURM srun (several tasks), "
        "mpirun or TPU pod workers JAX's distributed runtime is started "
        "automatically; otherwise give all three of the flags below.",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (jax.distributed coordinator)")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes (hosts) in the run")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() and let JAX detect the cluster (TPU VM slices)",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="what to train: the same as train.task=TASK (lm: next tokens, sft: chat replies, dpo: preference "
        "pairs, grpo: rewards); see docs/post-training.md",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    if args.task is not None:
        args.overrides = [*args.overrides, f"train.task={args.task}"]
    config = config_from_args(args)
    # Before anything touches a device: connect to the other processes, if there are any.
    initialize_distributed(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)

    # Divergence, a workdir in use or a damaged checkpoint: causal_lm.cli.main turns them into one error line.
    record = train_and_evaluate(config, args.workdir)
    if record.get("val_loss") is not None and is_main_process():
        print(
            f"done: step {record['step']}, val_loss {record['val_loss']:.4f}, val_ppl {record['val_ppl']:.2f}"
            + (f", {record['val_bpb']:.3f} bits/byte" if record.get("val_bpb") is not None else "")
            + f"; workdir {args.workdir}"
        )
    return 0
