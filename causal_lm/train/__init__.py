"""Training: the loop, its jitted step, orbax checkpoints, evaluation and metrics.

train_and_evaluate(config, workdir)        train (resuming from workdir's checkpoints), evaluate, sample
Hook(fn, every=N)                          fn(info: StepInfo) every N steps of training (hooks=[...] above)
evaluate(model, batches, token_bytes)      validation loss / perplexity / bits per byte
load_for_inference(workdir)                (model, tokenizer, config) from a workdir's checkpoint
save_for_inference(workdir, model, config, tokenizer)
restore_params(workdir, model)             a workdir's weights into a model built elsewhere
"""

from causal_lm.notes import Note
from causal_lm.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    IntegrityError,
    load_for_inference,
    restore_params,
    save_for_inference,
)
from causal_lm.train.divergence import DivergenceError, NonFiniteLossError
from causal_lm.train.evaluate import evaluate, sample_text
from causal_lm.train.hooks import Hook, StepInfo
from causal_lm.train.lock import WorkdirLockedError
from causal_lm.train.loop import resolve_config, train_and_evaluate
from causal_lm.train.metrics import plot_metrics, read_metrics

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "IntegrityError",
    "DivergenceError",
    "WorkdirLockedError",
    "Note",
    "load_for_inference",
    "restore_params",
    "save_for_inference",
    "evaluate",
    "Hook",
    "StepInfo",
    "sample_text",
    "NonFiniteLossError",
    "resolve_config",
    "train_and_evaluate",
    "plot_metrics",
    "read_metrics",
]
