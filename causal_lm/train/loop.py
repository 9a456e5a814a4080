"""`train_and_evaluate(config, workdir)`: the training loop, resumable from its own checkpoints.

One jitted step with the train state donated; the host does not wait for the device inside the loop except at
log steps (every `train.log_every`, and at eval and checkpoint steps). There it reads the interval's losses,
checks the non-finite flag the step keeps on the device (so the halt names the exact step, and a non-finite
state is never saved), evaluates and samples every `train.eval_every`, and saves every `train.checkpoint_every`
and at the end.

Rerunning on a workdir that has checkpoints resumes from the latest: parameters, optimizer state, RNG and the
data iterator's position are restored, metrics.jsonl is cut back to that step, and the run continues exactly as
if it had never stopped (bitwise on CPU).

On several devices (`config.mesh`, see `causal_lm.parallel`) the same loop runs sharded: the state is initialised
in its shardings, each process feeds the batch rows its devices hold, checkpoints are written and restored shard
by shard (onto whatever mesh the resuming run has), and only process 0 writes logs, metrics and workdir files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from causal_lm import parallel
from causal_lm.config import Config, ConfigError, config_to_dict
from causal_lm.data.pipeline import build_data
from causal_lm.data.tokenizer import tokenizer_from_dict
from causal_lm.train.checkpoint import CHECKPOINT_DIR, Checkpointer, check_model_config, write_workdir_files
from causal_lm.train.evaluate import evaluate_split, sample_text
from causal_lm.train.metrics import MetricsWriter, peak_flops, train_flops_per_token
from causal_lm.train.profile import PROFILE_DIR, StepProfiler
from causal_lm.train.state import (
    check_optimizer_resume,
    init_params,
    init_sharded_train_state,
    init_train_state,
    make_optimizer,
    train_state_shardings,
)
from causal_lm.train.step import compiled_train_step


class NonFiniteLossError(RuntimeError):
    """Training produced a non-finite loss, gradient or parameter; nothing from that step on was saved."""


def resolve_config(config: Config, tokenizer=None) -> Config:
    """The config training actually runs: compute dtype resolved for the backend, vocab size from the tokenizer."""
    m = config.model
    dtype = config.train.compute_dtype
    if dtype == "auto":
        dtype = m.dtype if jax.default_backend() == "cpu" else "bfloat16"
    changes = {"dtype": dtype} if dtype != m.dtype else {}
    if tokenizer is not None and tokenizer.vocab_size != m.vocab_size:
        changes["vocab_size"] = tokenizer.vocab_size
    if changes:
        config = dataclasses.replace(config, model=dataclasses.replace(m, **changes))
    return config


def _log_steps(t) -> Callable[[int], bool]:
    # Checkpoint steps are log steps too, so a resumed run's logging intervals line up with an uninterrupted run's.
    return lambda s: s % t.log_every == 0 or s % t.eval_every == 0 or s % t.checkpoint_every == 0 or s == t.steps


class _NoWriter:
    """The metrics writer of processes other than 0."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _Console:
    """A tqdm bar on an interactive terminal, plain lines otherwise, nothing when `train.progress` is off."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            # A terminal that reports no width (some ptys) would get an empty bar: use 100 columns there.
            sized = shutil.get_terminal_size((0, 0)).columns > 0
            self.bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 20,
                file=sys.stderr,
            )

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def status(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{record.get('tokens_per_s', 0):,.0f}", refresh=False
            )
        elif "val_loss" not in record:  # an eval step already printed its line
            self.print(
                f"step {record['step']}: loss {record['loss']:.4f}, {record.get('tokens_per_s', 0):,.0f} tokens/s"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_and_evaluate(
    config: Config, workdir: str, *, callback: Callable[[str, int, dict], None] | None = None
) -> dict:
    """Train `config` in `workdir` (resuming from its latest checkpoint, if any) and return the last record
    written to metrics.jsonl, with the last validation metrics.

    callback(event, step, info), if given, is called after each "log", "eval" and "checkpoint" event; for a
    checkpoint, info["wait"]() blocks until that save is on disk.
    Raises ConfigError / DataError / CheckpointError before any compute for bad input, and NonFiniteLossError
    naming the step when the loss or gradient stops being finite.
    """
    # ---- everything that can be wrong with the input fails here, before any compute or any write ----------
    latest, meta = None, None
    if os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
        reader = Checkpointer(workdir, read_only=True)
        try:
            latest = reader.latest_step()
            meta = reader.read_meta(latest) if latest is not None else None
        finally:
            reader.close()
    tokenizer = tokenizer_from_dict(meta["tokenizer"]) if meta else None
    data = build_data(config, tokenizer)
    requested_vocab = config.model.vocab_size
    config = resolve_config(config, data.tokenizer)
    notes = check_model_config(meta, config, latest, workdir) if meta is not None else []
    if meta is not None and meta.get("has_train_state"):  # the saved optimizer state must fit this optimizer
        check_optimizer_resume(meta["config"].get("train", {}), config.train, f"checkpoint {latest} in {workdir}")
    if meta is not None and meta.get("has_train_state") and meta.get("data_state") is not None:
        data.train.restore(meta["data_state"])  # the data position: the next batch is the one step latest+1 saw
    t, m = config.train, config.model
    prompt_ids = data.tokenizer.encode(t.sample_prompt)
    if t.sample_tokens and len(prompt_ids) >= m.max_seq_len:
        raise ConfigError(
            f"train.sample_prompt encodes to {len(prompt_ids)} tokens, which leaves no room in "
            f"model.max_seq_len={m.max_seq_len}"
        )

    os.makedirs(workdir, exist_ok=True)
    ckpt = Checkpointer(workdir, keep=t.keep_checkpoints)
    try:
        return _train(config, workdir, ckpt, data, latest, meta, notes, requested_vocab, callback)
    finally:
        ckpt.close()  # waits for pending asynchronous saves, surfacing their errors


def _train(
    config: Config, workdir: str, ckpt: Checkpointer, data, latest, meta, notes, requested_vocab, callback
) -> dict:
    t, m = config.train, config.model
    main = parallel.is_main_process()
    # ---- model, optimizer, state ------------------------------------------------------------------------------
    mesh = parallel.training_mesh(config.mesh)  # None on one device: the unsharded path
    optimizer = make_optimizer(t)
    if mesh is None:
        graphdef, params, rest = init_params(m, t.seed)
        state = init_train_state(params, optimizer, t.seed)
    else:
        graphdef, state, rest = init_sharded_train_state(m, t, t.seed, mesh)
        params = state.params
        if jax.process_count() > 1:  # each process reads only the rows its devices hold
            data.train.local_rows = parallel.process_rows(mesh, t.batch_size)
    start = 0
    if meta is not None:
        params, train_state, meta = ckpt.restore(
            latest, state.params, {k: getattr(state, k) for k in ("opt_state", "step", "rng", "bad_step")}
        )
        if train_state is None:  # an inference-only checkpoint (e.g. a converted model): fine-tune from it
            state = init_train_state(params, optimizer, t.seed)
        else:
            state = dataclasses.replace(state, params=params, **train_state)
            start = int(state.step)
    place_batch = None
    if mesh is not None:
        state = parallel.shard_tree(state, train_state_shardings(m, t, mesh)[0])
        place_batch = lambda b: parallel.shard_global_batch(b, mesh)  # noqa: E731
    if main:
        write_workdir_files(workdir, config, data.tokenizer)
    console = _Console(t.progress and main, t.steps, start)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    flops_per_token = train_flops_per_token(m, params, t.seq_len)
    if requested_vocab != m.vocab_size:
        console.print(
            f"model.vocab_size set to {m.vocab_size} to match the {data.tokenizer.kind} tokenizer "
            f"(config had {requested_vocab})"
        )
    if start:
        console.print(
            f"resuming {workdir} from step {start}" + (f" (model config changed: {'; '.join(notes)})" if notes else "")
        )
    console.print(
        f"model: {n_params:,} parameters, {m.num_layers} layers, d_model {m.d_model}, "
        f"{m.attention_label if hasattr(m, 'attention_label') else m.attention_type}, vocab {m.vocab_size} "
        f"({data.tokenizer.kind} tokenizer), {m.dtype} compute on {jax.default_backend()}"
    )
    if mesh is not None:
        split = parallel.batch_split(mesh, t.batch_size)
        console.print(
            f"devices: {parallel.describe(mesh)}; batch split {split} ways"
            + (
                ""
                if split == mesh.shape["data"] * mesh.shape["fsdp"]
                else f" (train.batch_size={t.batch_size} is not divisible by mesh data x fsdp = "
                f"{mesh.shape['data'] * mesh.shape['fsdp']})"
            )
        )
    console.print(
        f"data: {config.data.corpus}: " + ", ".join(f"{k} {v:,}" for k, v in data.info.items() if isinstance(v, int))
    )
    console.print(
        f"training: {t.steps} steps of {t.batch_size}x{t.seq_len} tokens"
        + (f" in {t.microbatches} microbatches" if t.microbatches > 1 else "")
        + f", {flops_per_token / 1e6:.1f} MFLOP/token (causal attention counted at half)"
    )

    writer = MetricsWriter(workdir, start) if main else _NoWriter()
    step_fn = compiled_train_step(m, t, graphdef, mesh)
    profiler = StepProfiler(t.profile_range, os.path.join(workdir, PROFILE_DIR))
    is_log = _log_steps(t)
    tokens_per_step = t.batch_size * t.seq_len
    pending: list = []
    last: dict = {}
    best_val = None
    compile_s = None
    interval_t0, interval_steps = time.perf_counter(), 0
    try:
        for step in range(start + 1, t.steps + 1):
            batch = next(data.train)
            if mesh is not None:
                batch = parallel.shard_local_batch(batch, mesh, t.batch_size)
            state, metrics = profiler.run(step, step_fn, state, rest, batch)
            pending.append(metrics)
            interval_steps += 1
            console.step()
            if compile_s is None:  # the first step compiles: time it apart from throughput
                jax.block_until_ready(metrics)
                compile_s = time.perf_counter() - interval_t0
                interval_t0, interval_steps = time.perf_counter(), 0
            if not is_log(step):
                continue

            # ---- log step: the one place the host waits for the device -----------------------------------
            host = jax.device_get(pending)
            bad_step = int(jax.device_get(state.bad_step))
            elapsed = time.perf_counter() - interval_t0
            if bad_step:
                bad = host[bad_step - step + len(host) - 1]
                ckpt.wait()
                kept = ckpt.latest_step()
                raise NonFiniteLossError(
                    f"non-finite loss or gradient at step {bad_step} (loss={float(bad['loss'])}, "
                    f"grad_norm={float(bad['grad_norm'])}): training stopped, and nothing from that step on was "
                    "saved; "
                    + (
                        f"the latest checkpoint is step {kept}, which a rerun resumes from"
                        if kept is not None
                        else "no checkpoint had been written yet"
                    )
                    + ". Lower train.learning_rate or raise train.warmup_steps."
                )
            record = {
                "step": step,
                "loss": float(np.mean([h["loss"] for h in host])),
                "grad_norm": float(host[-1]["grad_norm"]),
                "lr": float(host[-1]["lr"]),
                "tokens": step * tokens_per_step,
            }
            if "z_loss" in host[-1]:  # train.z_loss > 0: the auxiliary term, apart from the cross entropy
                record["z_loss"] = float(np.mean([h["z_loss"] for h in host]))
            if interval_steps:
                tps = interval_steps * tokens_per_step / max(elapsed, 1e-9)
                peak, _ = peak_flops(m.dtype) if not t.peak_flops else (t.peak_flops, "")
                record["tokens_per_s"] = tps
                record["mfu"] = tps * flops_per_token / (peak * jax.device_count())
            if not last:  # the first record of this process says how long compiling took
                record["compile_s"] = compile_s
            pending = []

            if step % t.eval_every == 0 or step == t.steps:
                val = evaluate_split(graphdef, state.params, rest, data.val, data.token_bytes, place_batch)
                record.update(
                    val_loss=val["loss"],
                    val_ppl=val["perplexity"],
                    val_bpb=val.get("bits_per_byte"),
                    val_tokens=val["tokens"],
                )
                if t.sample_tokens:
                    from flax import nnx

                    seed = int(jax.device_get(state.rng)[-1])
                    record["sample"] = sample_text(
                        nnx.merge(graphdef, state.params, rest),
                        data.tokenizer,
                        t.sample_prompt,
                        t.sample_tokens,
                        temperature=t.sample_temperature,
                        seed=seed,
                        use_cache=m.attention_mask == "causal",
                    )
                best_val = val["loss"] if best_val is None else min(best_val, val["loss"])
                console.print(_eval_line(record))
                if callback:
                    callback("eval", step, record)

            writer.write(record)
            console.status(record)
            last = record
            if callback:
                callback("log", step, record)

            if step % t.checkpoint_every == 0 or step == t.steps:
                meta_out = {
                    "config": config_to_dict(config),
                    "tokenizer": data.tokenizer.to_dict(),
                    "data_state": data.train.state(),
                }
                ckpt.save(
                    step,
                    state.params,
                    meta_out,
                    train_state={k: getattr(state, k) for k in ("opt_state", "step", "rng", "bad_step")},
                    val_loss=record.get("val_loss"),
                )
                if callback:
                    callback("checkpoint", step, {"wait": ckpt.wait})
            interval_t0, interval_steps = time.perf_counter(), 0
    finally:
        profiler.close()
        console.close()
        writer.close()
    if start >= t.steps:
        console.print(f"{workdir} is already trained to step {start} (train.steps={t.steps}); nothing to do")
        val = evaluate_split(graphdef, state.params, rest, data.val, data.token_bytes, place_batch)
        last = {
            "step": start,
            "val_loss": val["loss"],
            "val_ppl": val["perplexity"],
            "val_bpb": val.get("bits_per_byte"),
        }
    return last


def _eval_line(r: dict) -> str:
    s = f"step {r['step']}: val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.2f}"
    if r.get("val_bpb") is not None:
        s += f", {r['val_bpb']:.3f} bits/byte"
    s += ")"
    if "tokens_per_s" in r:
        s += f" | train loss {r['loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%"
    if r.get("sample") is not None:
        s += f"\n  sample: {r['sample']!r}"
    return s
