"""Hooks: what the training loop does besides stepping, as pieces a user can add to without editing the loop.

    from causal_lm.train import Hook, train_and_evaluate

    def grad_to_loss(info):  # a custom metric: into metrics.jsonl and TensorBoard with the step's record
        info.metrics["grad_to_loss"] = info.metrics["grad_norm"] / info.metrics["loss"]

    train_and_evaluate(config, workdir, hooks=[Hook(grad_to_loss, every=50)])

Cadence. A hook with `every=N` runs at steps N, 2N, 3N, ... of the run (counted from step 0, so a resumed run
keeps it); `every=None` runs it at every log step. The host reads the step's metrics from the device only at log
steps: every `train.log_every` steps, the last step, and every step some hook is due (so a hook always sees its
step's metrics, and that step's record is written to metrics.jsonl). Without user hooks the log steps are those of
`train.log_every`, `train.eval_every`, `train.checkpoint_every` and the last step.

At a log step the loop builds the step's record (`info.metrics`: the mean loss since the previous log step, the
step's grad_norm and lr, tokens, throughput and MFU) and runs the hooks due, in this order:

    ProfileSteps        train.profile_steps=START,END: traces those steps (wraps the step itself; see around_step)
    CheckDivergence     every log step: a loss spike or a non-finite loss or gradient stops the run, before anything
                        of that step is written or saved
    EvaluateAndSample   every train.eval_every and at the last step: val_* metrics and a sample into the record
    your hooks          in the order given; keys a hook adds to info.metrics are written with the record
    WriteMetrics        every log step: metrics.jsonl, TensorBoard, the console
    SaveCheckpoint      every train.checkpoint_every and at the last step

A hook runs on every process of a multi-host run (`info.run.main` is True on process 0, the one that writes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from causal_lm.config import Config, config_to_dict
from causal_lm.train.divergence import DivergenceError, NonFiniteLossError, SpikeMonitor
from causal_lm.train.evaluate import evaluate_split, sample_text
from causal_lm.train.lora import merge_model
from causal_lm.train.profile import StepProfiler

# What a checkpoint holds besides the parameters.
STATE_KEYS = ("opt_state", "step", "rng", "bad_step")


@dataclasses.dataclass
class Run:
    """What stays the same for the whole run, for hooks to read."""

    config: Config  # as resolved for training (dtype, vocab size)
    workdir: str
    graphdef: Any  # the model is nnx.merge(graphdef, state.params, rest)
    rest: Any
    data: Any  # causal_lm.data.pipeline's Data: .train (resumable iterator), .val, .tokenizer, .token_bytes
    checkpointer: Any  # causal_lm.train.checkpoint.Checkpointer
    console: Any  # .print(text): a line on stderr (above a progress bar); nothing when train.progress is off
    main: bool  # process 0, the one that writes logs, metrics and checkpoints' workdir files
    place_batch: Callable | None = None  # puts a host batch onto the mesh (None on one device)
    callback: Callable[[str, int, dict], None] | None = None  # train_and_evaluate's callback

    def emit(self, event: str, step: int, info: dict) -> None:
        if self.callback:
            self.callback(event, step, info)


@dataclasses.dataclass
class StepInfo:
    """What a hook sees at a log step."""

    step: int
    metrics: dict  # the step's record, written to metrics.jsonl after the hooks before WriteMetrics ran
    state: Any  # the TrainState after this step (params, opt_state, step, rng, bad_step), on the device
    run: Run
    per_step: list[dict]  # each step's own metrics since the previous log step, oldest first (numpy scalars)

    def model(self) -> nnx.Module:
        """The model with this step's parameters."""
        return merge_model(self.run.graphdef, self.state.params, self.run.rest)

    def print(self, text: str) -> None:
        """A line on the run's console (stderr; nothing when train.progress is off or on processes other than 0)."""
        self.run.console.print(text)


class Hook:
    """Something the loop does at some steps: `Hook(fn, every=N)` calls fn(info) with a `StepInfo` at steps N, 2N,
    ... (every=None: at every log step); or subclass and override `__call__` (and `due`, `around_step`, `close`)."""

    def __init__(self, fn: Callable[[StepInfo], None] | None = None, *, every: int | None = None):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"Hook every={every!r}: a number of steps >= 1, or None for every log step")
        self.fn = fn
        self.every = every

    def due(self, step: int) -> bool:
        """Whether this hook's cadence names `step` (a step it is due at is a log step)."""
        return self.every is not None and step % self.every == 0

    def __call__(self, info: StepInfo) -> None:
        if self.fn is not None:
            self.fn(info)

    def around_step(self, step: int, fn: Callable, *args):
        """Runs the jitted step `fn(*args)` of every step; a hook that needs to wrap the step overrides it."""
        return fn(*args)

    def close(self) -> None:
        """Called once when training ends, normally or not."""

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", None) if self.fn is not None else type(self).__name__
        return f"Hook({name}, every={self.every})"


class _AlsoLast(Hook):
    """A built-in cadence: every N steps and at the run's last step."""

    def __init__(self, every: int, last: int):
        super().__init__(every=every)
        self.last = last

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last


class ProfileSteps(Hook):
    """train.profile_steps=START,END: a jax.profiler trace of those steps (`causal_lm.train.profile`)."""

    def __init__(self, steps: tuple[int, int] | None, directory: str):
        super().__init__()
        self.profiler = StepProfiler(steps, directory)

    def __call__(self, info: StepInfo) -> None:
        pass

    def around_step(self, step: int, fn: Callable, *args):
        return self.profiler.run(step, fn, *args)

    def close(self) -> None:
        self.profiler.close()


class CheckDivergence(Hook):
    """Every log step: each step's loss since the previous log step against the recent running statistics, and the
    non-finite flag the step keeps on the device, so the halt names the exact step. It runs before any hook that
    writes, so nothing from the bad step on is written or saved."""

    def __init__(self, t, vocab_size: int):
        super().__init__()
        self.monitor = SpikeMonitor(t.spike_threshold, t.spike_zscore, t.spike_window, vocab_size)

    def __call__(self, info: StepInfo) -> None:
        host, run = info.per_step, info.run
        bad_step = int(jax.device_get(info.state.bad_step))
        first = info.step - len(host) + 1  # the step of host[0]
        for i, h in enumerate(host):
            if bad_step and first + i >= bad_step:
                break
            spike = self.monitor.check(first + i, float(h["loss"]))
            if spike:
                diverged(run.checkpointer, run.workdir, run.config.train, first + i, spike, DivergenceError)
        if bad_step:
            bad = host[bad_step - first]
            diverged(
                run.checkpointer,
                run.workdir,
                run.config.train,
                bad_step,
                f"non-finite loss or gradient at step {bad_step} (loss={float(bad['loss'])}, "
                f"grad_norm={float(bad['grad_norm'])})",
                NonFiniteLossError,
            )


class EvaluateAndSample(_AlsoLast):
    """Every train.eval_every and at the last step: validation loss, perplexity and bits per byte, and a sample
    (train.sample_tokens) into the record; one console line."""

    def __call__(self, info: StepInfo) -> None:
        run, record = info.run, info.metrics
        t, m = run.config.train, run.config.model
        val = evaluate_split(
            run.graphdef, info.state.params, run.rest, run.data.val, run.data.token_bytes, run.place_batch
        )
        record.update(
            val_loss=val["loss"],
            val_ppl=val["perplexity"],
            val_bpb=val.get("bits_per_byte"),
            val_tokens=val["tokens"],
        )
        if t.sample_tokens:
            seed = int(jax.device_get(info.state.rng)[-1])
            record["sample"] = sample_text(
                info.model(),
                run.data.tokenizer,
                t.sample_prompt,
                t.sample_tokens,
                temperature=t.sample_temperature,
                seed=seed,
                use_cache=m.attention_mask == "causal",
            )
        run.console.print(eval_line(record))
        run.emit("eval", info.step, record)


class WriteMetrics(Hook):
    """Every log step: the record to metrics.jsonl and TensorBoard (`writer`), a console status line."""

    def __init__(self, writer):
        super().__init__()
        self.writer = writer
        self.last: dict = {}  # the last record written

    def __call__(self, info: StepInfo) -> None:
        self.writer.write(info.metrics)
        info.run.console.status(info.metrics)
        self.last = info.metrics
        info.run.emit("log", info.step, info.metrics)

    def close(self) -> None:
        self.writer.close()


class SaveCheckpoint(_AlsoLast):
    """Every train.checkpoint_every and at the last step: parameters, optimizer state, RNG and the data iterator's
    position, asynchronously (the run's end, or the next save, waits for it)."""

    def __call__(self, info: StepInfo) -> None:
        run, state = info.run, info.state
        meta_out = {
            "config": config_to_dict(run.config),
            "tokenizer": run.data.tokenizer.to_dict(),
            "data_state": run.data.train.state(),
        }
        run.checkpointer.save(
            info.step,
            state.params,
            meta_out,
            train_state={k: getattr(state, k) for k in STATE_KEYS},
            val_loss=info.metrics.get("val_loss"),
        )
        run.emit("checkpoint", info.step, {"wait": run.checkpointer.wait})


def diverged(ckpt, workdir: str, t, step: int, what: str, error: type) -> None:
    """Raise `error` for divergence at `step`: nothing from `step` on was written or saved (the check runs before
    the record and the checkpoint of a log step), so the newest checkpoint, once pending saves are on disk, is the
    last healthy one."""
    ckpt.wait()
    healthy = [s for s in ckpt.all_steps() if s < step]
    last = max(healthy) if healthy else None
    lower = f"{t.learning_rate / 10:g}"
    if last is None:
        where = "no checkpoint had been written yet"
        hint = (
            f"start again in a new --workdir with a lower train.learning_rate (e.g. {lower}) or more train.warmup_steps"
        )
    else:
        where = f"the last healthy checkpoint is step {last}"
        hint = (
            f"resume from step {last} with a lower learning rate: rerun with train.resume_step={last} "
            f"train.learning_rate={lower} (or raise train.warmup_steps)"
        )
    raise error(
        f"training diverged: {what}; training stopped and nothing from step {step} on was saved; {where}",
        step,
        last,
        hint,
    )


def eval_line(r: dict) -> str:
    s = f"step {r['step']}: val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.2f}"
    if r.get("val_bpb") is not None:
        s += f", {r['val_bpb']:.3f} bits/byte"
    s += ")"
    if "tokens_per_s" in r:
        s += f" | train loss {r['loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%"
    if r.get("sample") is not None:
        s += f"\n  sample: {r['sample']!r}"
    return s
