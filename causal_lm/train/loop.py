"""`train_and_evaluate(config, workdir)`: the training loop, resumable from its own checkpoints.

Three parts: restore-or-init (`_restore_or_init`), the step loop (`_step_loop`) and hooks (`causal_lm.train.hooks`).
One jitted step with the train state donated; the host does not wait for the device inside the loop except at
log steps (every `train.log_every`, the last step, and every step a hook is due: eval and checkpoint steps, and a
user's `Hook(fn, every=N)` passed as `train_and_evaluate(..., hooks=[...])`). There it reads the interval's
losses into the step's record and runs the hooks due, in order: the divergence check (the non-finite flag the
step keeps on the device, so the halt names the exact step and a non-finite state is never saved), evaluation
and a sample every `train.eval_every`, the user's hooks, the metrics write, and a save every
`train.checkpoint_every` and at the end.

Rerunning on a workdir that has checkpoints resumes from the latest intact one (checksums verified; damaged
ones are skipped with a note): parameters, optimizer state, RNG and the data iterator's position are restored,
metrics.jsonl is cut back to that step, and the run continues exactly as if it had never stopped (bitwise on
CPU). `train.resume_step=N` resumes from checkpoint N instead and deletes the later ones, saying so.

One run per workdir: the run holds an exclusive lock on `workdir/train.lock` (`causal_lm.train.lock`) from
before it reads anything until it ends. Divergence (`causal_lm.train.divergence`): every step's loss is checked
at the log step against the recent running statistics, and a spike or a non-finite loss or gradient stops the run
before anything from that step on is written or saved, naming the last healthy checkpoint.

On several devices (`config.mesh`, see `causal_lm.parallel`) the same loop runs sharded: the state is initialised
in its shardings, each process feeds the batch rows its devices hold, checkpoints are written and restored shard
by shard (onto whatever mesh the resuming run has), and only process 0 writes logs, metrics and workdir files.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from causal_lm import parallel
from causal_lm.config import Config, ConfigError, config_to_dict
from causal_lm.data.tokenizer import tokenizer_from_dict
from causal_lm.model import backends
from causal_lm.notes import note
from causal_lm.train.checkpoint import (
    CHECKPOINT_DIR,
    Checkpointer,
    CheckpointError,
    IntegrityError,
    check_model_config,
    load_frozen_base,
    save_frozen_base,
    write_workdir_files,
)
from causal_lm.train.evaluate import evaluate_split
from causal_lm.train.hooks import (
    CheckDivergence,
    EvaluateAndSample,
    Hook,
    ProfileSteps,
    Run,
    SaveCheckpoint,
    StepInfo,
    WriteMetrics,
)
from causal_lm.train.lock import WorkdirLock
from causal_lm.train.lora import FROZEN_DIR, LoraGraph, adapter_count, init_adapters, lora_scale
from causal_lm.train.metrics import MetricsWriter, peak_flops, train_flops_per_token
from causal_lm.train.post_tasks import REFERENCE_TASKS, build_task_data, task_step, with_reference
from causal_lm.train.profile import PROFILE_DIR
from causal_lm.train.state import (
    check_optimizer_resume,
    init_params,
    init_sharded_train_state,
    init_train_state,
    make_optimizer,
    train_state_shardings,
)
from causal_lm.train.step import compiled_train_step

# Settings that change nothing about what is trained: not reported as changed when a run resumes.
_UNTRACKED = {"train.progress", "train.resume_step"}


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
    config: Config,
    workdir: str,
    *,
    callback: Callable[[str, int, dict], None] | None = None,
    hooks: Sequence[Hook] = (),
) -> dict:
    """Train `config` in `workdir` (resuming from its latest checkpoint, if any) and return the last record
    written to metrics.jsonl, with the last validation metrics.

    hooks: `causal_lm.train.Hook`s, run at their cadence (`every=N` steps) with the step's metrics, after the
    built-in evaluation and before the record is written (see `causal_lm.train.hooks`).
    callback(event, step, info), if given, is called after each "log", "eval" and "checkpoint" event; for a
    checkpoint, info["wait"]() blocks until that save is on disk.
    Raises ConfigError / DataError / CheckpointError before any compute for bad input, WorkdirLockedError when
    another run holds the workdir, and DivergenceError (NonFiniteLossError for a non-finite loss or gradient)
    naming the step and the last healthy checkpoint when training diverges.
    """
    # A named attention backend that cannot run on this platform fails before the workdir is touched.
    backends.describe(resolve_config(config).model)
    hooks = list(hooks)
    for h in hooks:
        if not isinstance(h, Hook):
            raise TypeError(f"hooks: {h!r} is not a causal_lm.train.Hook (wrap a function as Hook(fn, every=N))")
    # Only process 0 locks: the other processes of a multi-host run share the workdir on purpose.
    lock = WorkdirLock(workdir) if parallel.is_main_process() else None
    if lock is not None:
        lock.acquire()
    try:
        return _locked(config, workdir, callback, hooks)
    finally:
        if lock is not None:
            lock.release()


def _resume_candidates(workdir: str, config: Config) -> list[int]:
    """The checkpoint steps a run may resume from, newest first (all of them, or train.resume_step's)."""
    if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
        if config.train.resume_step is not None:
            raise ConfigError(f"train.resume_step={config.train.resume_step}: {workdir!r} has no checkpoints")
        return []
    reader = Checkpointer(workdir, read_only=True)
    try:
        steps = sorted(reader.all_steps(), reverse=True)
        want = config.train.resume_step
        if want is None:
            return steps
        if want not in steps:
            raise ConfigError(f"train.resume_step={want}: no checkpoint for that step in {workdir!r}; steps: {steps}")
        if steps[0] > want:  # rerunning the command that went back to `want` continues instead of going back again
            try:
                saved = reader.read_meta(steps[0])["config"]
            except IntegrityError:
                saved = None
            if saved is not None and _setting_changes(saved, config) == []:
                note(
                    f"train.resume_step={want} was already applied: checkpoint {steps[0]} was written by a run with "
                    f"these same settings, so this one resumes from it (change a setting to go back to {want} again)"
                )
                return steps
        return [want]
    finally:
        reader.close()


def _setting_changes(saved: dict, config: Config) -> list[str]:
    """'train.learning_rate: 0.01 -> 0.001' for each train/data setting that differs from a checkpoint's config."""
    now = config_to_dict(config)
    out = []
    for sec in ("train", "data"):
        a, b = saved.get(sec, {}), now[sec]
        for k in sorted(set(a) | set(b)):
            if f"{sec}.{k}" not in _UNTRACKED and a.get(k) != b.get(k):
                out.append(f"{sec}.{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return out


def _locked(config: Config, workdir: str, callback, hooks: list[Hook]) -> dict:
    # ---- everything that can be wrong with the input fails here, before any compute or any write ----------
    candidates = _resume_candidates(workdir, config)
    meta = None
    if candidates:  # the newest whose metadata verifies decides the tokenizer; its arrays are checked on restore
        reader = Checkpointer(workdir, read_only=True)
        try:
            for i, s in enumerate(candidates):
                try:
                    meta = reader.read_meta(s)
                except IntegrityError as e:
                    note(f"{e}: skipped")
                    continue
                candidates = candidates[i:]
                break
            else:
                raise CheckpointError(
                    f"no intact checkpoint to resume from in {workdir!r} (the notes above say why each was refused); "
                    "train in a new --workdir, or remove the damaged checkpoints to start over"
                )
        finally:
            reader.close()
    tokenizer = tokenizer_from_dict(meta["tokenizer"]) if meta else None
    data = build_task_data(config, tokenizer)
    requested_vocab = config.model.vocab_size
    config = resolve_config(config, data.tokenizer)
    notes = check_model_config(meta, config, candidates[0], workdir) if meta is not None else []
    if meta is not None and meta.get("has_train_state"):  # the saved optimizer state must fit this optimizer
        check_optimizer_resume(
            meta["config"].get("train", {}), config.train, f"checkpoint {candidates[0]} in {workdir}"
        )
    t, m = config.train, config.model
    prompt_ids = data.tokenizer.encode(t.sample_prompt)
    if t.sample_tokens and len(prompt_ids) >= m.max_seq_len:
        raise ConfigError(
            f"train.sample_prompt encodes to {len(prompt_ids)} tokens, which leaves no room in "
            f"model.max_seq_len={m.max_seq_len}"
        )

    ckpt = Checkpointer(workdir, keep=t.keep_checkpoints)
    try:
        result = _train(config, workdir, ckpt, data, candidates, notes, requested_vocab, callback, hooks)
    except BaseException:
        try:
            ckpt.close()
        except Exception:  # a failed pending save matters less than what stopped the run
            pass
        raise
    ckpt.close()  # waits for pending asynchronous saves, surfacing their errors
    return result


def _restore_newest_intact(ckpt: Checkpointer, candidates: list[int], state, tokenizer, workdir: str):
    """(step, params, train_state or None, meta) of the newest candidate whose arrays verify; damaged ones are
    skipped with a note. Other errors (a different architecture) are not skipped: they are the user's to fix."""
    state_target = {k: getattr(state, k) for k in ("opt_state", "step", "rng", "bad_step")}
    refused = []
    for s in candidates:
        try:
            params, train_state, meta = ckpt.restore(s, state.params, state_target)
        except IntegrityError as e:
            refused.append(s)
            note(f"{e}: skipped")
            continue
        if meta["tokenizer"] != tokenizer.to_dict():
            raise CheckpointError(
                f"checkpoint {s}, the newest intact one in {workdir!r}, was saved with a different tokenizer than "
                f"checkpoint {candidates[0]}; resume from a checkpoint explicitly with train.resume_step=N"
            )
        if refused:
            note(f"resuming from checkpoint {s}, the newest intact one (refused: {', '.join(map(str, refused))})")
        return s, params, train_state, meta
    raise CheckpointError(
        f"no intact checkpoint to resume from in {workdir!r} (refused: {', '.join(map(str, refused))}; the notes "
        "above say why); train in a new --workdir, or remove the damaged checkpoints to start over"
    )


def _train(
    config: Config, workdir: str, ckpt: Checkpointer, data, candidates, notes, requested_vocab, callback, hooks
) -> dict:
    t, m = config.train, config.model
    main = parallel.is_main_process()
    attention_line = backends.describe(m)  # which attention kernels run, said once at start-up
    mesh = parallel.training_mesh(config.mesh)  # None on one device: the unsharded path
    graphdef, state, rest, start, changed = _restore_or_init(config, workdir, ckpt, data, candidates, mesh)
    if t.task in REFERENCE_TASKS:  # DPO/GRPO: the frozen reference beside the trained weights
        graphdef, rest = _with_reference(config, workdir, data, graphdef, state, rest, mesh)
    place_batch = None
    if mesh is not None:
        state = parallel.shard_tree(state, train_state_shardings(m, t, mesh)[0])
        place_batch = lambda b: parallel.shard_global_batch(b, mesh)  # noqa: E731
    if main:
        write_workdir_files(workdir, config, data.tokenizer)
    console = _Console(t.progress and main, t.steps, start)
    full_params = rest["base"] if t.lora_rank else state.params
    flops_per_token = train_flops_per_token(m, full_params, t.seq_len)
    _resume_lines(console, workdir, start, notes, changed, requested_vocab, m, data.tokenizer.kind)
    _banner(console, config, data, mesh, full_params, flops_per_token, attention_line)
    if t.lora_rank:
        console.print(
            f"LoRA: {adapter_count(state.params):,} adapter parameters train (rank {t.lora_rank}, alpha "
            f"{t.lora_alpha:g}, targets {t.lora_targets}); the base is frozen in {os.path.join(workdir, FROZEN_DIR)}"
        )

    run = Run(config, workdir, graphdef, rest, data, ckpt, console, main, place_batch, callback)
    writer = WriteMetrics(MetricsWriter(workdir, start) if main else _NoWriter())
    hooks = [
        ProfileSteps(t.profile_range, os.path.join(workdir, PROFILE_DIR)),
        CheckDivergence(t, m.vocab_size),
        EvaluateAndSample(t.eval_every, t.steps),
        *hooks,
        writer,
        SaveCheckpoint(t.checkpoint_every, t.steps),
    ]
    try:
        if t.task in REFERENCE_TASKS:
            step_fn = task_step(config, graphdef, data.tokenizer, console)
        else:
            step_fn = compiled_train_step(m, t, graphdef, mesh)
        state = _step_loop(run, state, start, step_fn, hooks, mesh, flops_per_token)
    finally:
        _close_all([*hooks, console])
    if start >= t.steps:
        console.print(f"{workdir} is already trained to step {start} (train.steps={t.steps}); nothing to do")
        val = evaluate_split(graphdef, state.params, rest, data.val, data.token_bytes, place_batch)
        return {
            "step": start,
            "val_loss": val["loss"],
            "val_ppl": val["perplexity"],
            "val_bpb": val.get("bits_per_byte"),
        }
    return writer.last


def _restore_or_init(config: Config, workdir: str, ckpt: Checkpointer, data, candidates, mesh):
    """(graphdef, state, rest, start step, changed settings): a fresh train state, or the newest intact checkpoint's
    (parameters, optimizer state, RNG, data iterator position), deleting or moving aside the later checkpoints."""
    t, m = config.train, config.model
    if t.lora_rank:
        return _restore_or_init_lora(config, workdir, ckpt, data, candidates, mesh)
    optimizer = make_optimizer(t)
    if mesh is None:
        graphdef, params, rest = init_params(m, t.seed)
        state = init_train_state(params, optimizer, t.seed)
    else:
        graphdef, state, rest = init_sharded_train_state(m, t, t.seed, mesh)
        params = state.params
        if jax.process_count() > 1:  # each process reads only the rows its devices hold
            data.train.local_rows = parallel.process_rows(mesh, t.batch_size)
    start, changed = 0, []
    if candidates:
        restored, params, train_state, meta = _restore_newest_intact(ckpt, candidates, state, data.tokenizer, workdir)
        if train_state is None:  # an inference-only checkpoint (e.g. a converted model): fine-tune from it
            state = init_train_state(params, optimizer, t.seed)
        elif meta["config"].get("train", {}).get("task", "lm") != t.task:  # a trained model, a new task
            state = dataclasses.replace(init_train_state(params, optimizer, t.seed), step=train_state["step"])
            start = int(state.step)
            note(
                f"train.task={t.task} continues {workdir!r} from its {meta['config']['train'].get('task', 'lm')} "
                f"checkpoint {restored}: its weights, a fresh optimizer, steps {start + 1}..{t.steps}"
            )
        else:
            state = dataclasses.replace(state, params=params, **train_state)
            start = int(state.step)
            if meta.get("data_state") is not None:
                data.train.restore(meta["data_state"])  # the next batch is the one step start+1 saw
            changed = _setting_changes(meta["config"], config)
        _drop_later(ckpt, restored, t, workdir)
    return graphdef, state, rest, start, changed


def _with_reference(config: Config, workdir: str, data, graphdef, state, rest, mesh):
    """(graphdef, rest) holding DPO/GRPO's frozen reference: with LoRA the base (already in rest); otherwise the
    weights this task started from, saved once to workdir/frozen_base and read back on every resume."""
    if config.train.lora_rank:
        return graphdef, rest
    if mesh is not None:
        raise ConfigError(f"train.task={config.train.task} runs on one device for now (no mesh)")
    if os.path.isdir(os.path.join(workdir, FROZEN_DIR, CHECKPOINT_DIR)):
        reference = load_frozen_base(workdir, state.params)
    else:
        reference = jax.tree.map(lambda x: x.copy(), state.params)  # the step donates state.params
        if parallel.is_main_process():
            meta = {"config": config_to_dict(config), "tokenizer": data.tokenizer.to_dict(), "data_state": None}
            save_frozen_base(workdir, reference, meta)
    return with_reference(graphdef, rest, reference)


def _drop_later(ckpt: Checkpointer, restored: int, t, workdir: str) -> None:
    """Delete (train.resume_step) or move aside (refused as damaged) the checkpoints after the restored one."""
    main = parallel.is_main_process()
    later = [s for s in ckpt.all_steps() if s > restored]
    if later and restored == t.resume_step:
        if main:
            which = f"checkpoint{'s' if len(later) > 1 else ''} {', '.join(map(str, later))}"
            note(
                f"discarding {which} of {workdir!r}: train.resume_step={t.resume_step} resumes from checkpoint "
                f"{restored}"
            )
        ckpt.delete_after(restored)
    elif later:  # refused as damaged: kept for a person to look at, out of the way of the new saves
        moved = ckpt.move_aside(later) if main else []
        if main:
            note(f"moved the refused checkpoints {', '.join(map(str, later))} to {os.path.dirname(moved[0])}")
        ckpt.reload()


def _is_lora_checkpoint(ckpt: Checkpointer, step: int) -> bool:
    try:
        return bool(ckpt.read_meta(step)["config"].get("train", {}).get("lora_rank"))
    except IntegrityError:
        return True  # damaged: left to the restore, which skips it with a note


def _restore_or_init_lora(config: Config, workdir: str, ckpt: Checkpointer, data, candidates, mesh):
    """`_restore_or_init` of a LoRA run: the state's params are the adapters; the frozen base (a fresh model, or
    the converted model a workdir holds as an inference-only checkpoint) is saved once to workdir/frozen_base and
    travels in `rest` beside the model's other state (see causal_lm.train.lora)."""
    t, m = config.train, config.model
    if mesh is not None:
        raise ConfigError("train.lora_rank: LoRA runs on one device for now (no mesh)")
    graphdef, params, rest = init_params(m, t.seed)
    base_step = 0  # > 0: the step of the full training run whose weights are the base
    lora_steps = [s for s in candidates if _is_lora_checkpoint(ckpt, s)]
    others = [s for s in candidates if s not in lora_steps]
    if os.path.isdir(os.path.join(workdir, FROZEN_DIR, CHECKPOINT_DIR)):
        base = load_frozen_base(workdir, params)
    elif lora_steps:
        base = load_frozen_base(workdir, params)  # raises: adapters without their base
    else:
        base = params
        if others:  # a converted model (inference-only checkpoint) or a trained one to fine-tune: it is the base
            s = others[0]
            base, _, meta = ckpt.restore(s, params)
            if meta.get("has_train_state"):  # a full training run: continue its step count, as a new task does
                base_step = s
                note(
                    f"train.lora_rank={t.lora_rank} continues {workdir!r} from its "
                    f"{meta['config'].get('train', {}).get('task', 'lm')} checkpoint {s}: its weights as the frozen "
                    f"base, fresh adapters, steps {base_step + 1}..{t.steps}"
                )
        if parallel.is_main_process():
            meta = {"config": config_to_dict(config), "tokenizer": data.tokenizer.to_dict(), "data_state": None}
            save_frozen_base(workdir, base, meta)
    adapters = init_adapters(base, t.lora_targets, t.lora_rank, t.seed)
    state = init_train_state(adapters, make_optimizer(t), t.seed)
    start, changed = 0, []
    if base_step:
        state = dataclasses.replace(state, step=base_step)
        start = base_step
    if lora_steps:
        restored, adapters, train_state, meta = _restore_newest_intact(ckpt, lora_steps, state, data.tokenizer, workdir)
        state = dataclasses.replace(state, params=adapters, **train_state)
        start = int(state.step)
        if meta.get("data_state") is not None:
            data.train.restore(meta["data_state"])
        changed = _setting_changes(meta["config"], config)
        _drop_later(ckpt, restored, t, workdir)
    return LoraGraph(graphdef, lora_scale(t)), state, {"base": base, "rest": rest}, start, changed


def _resume_lines(console, workdir, start, notes, changed, requested_vocab, m, tokenizer_kind):
    """The start-up lines about where the run starts from."""
    if requested_vocab != m.vocab_size:
        console.print(
            f"model.vocab_size set to {m.vocab_size} to match the {tokenizer_kind} tokenizer "
            f"(config had {requested_vocab})"
        )
    if start:
        console.print(
            f"resuming {workdir} from step {start}" + (f" (model config changed: {'; '.join(notes)})" if notes else "")
        )
    if changed and parallel.is_main_process():
        note(f"resuming from step {start} with changed settings (checkpoint -> now): {'; '.join(changed)}")


def _banner(console, config, data, mesh, params, flops_per_token, attention_line):
    """The start-up lines: what is trained, on what."""
    t, m = config.train, config.model
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    console.print(
        f"model: {n_params:,} parameters, {m.num_layers} layers, d_model {m.d_model}, "
        f"{m.attention_label if hasattr(m, 'attention_label') else m.attention_type}, vocab {m.vocab_size} "
        f"({data.tokenizer.kind} tokenizer), {m.dtype} compute on {jax.default_backend()}"
    )
    console.print(attention_line)
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


def _step_loop(run: Run, state, start: int, step_fn, hooks: list[Hook], mesh, flops_per_token: float):
    """Steps start+1..train.steps; at each log step the record and the hooks due (see `causal_lm.train.hooks`).
    Returns the last state."""
    t, m = run.config.train, run.config.model
    wrappers = [h for h in hooks if type(h).around_step is not Hook.around_step]
    tokens_per_step = t.batch_size * t.seq_len
    pending: list = []
    first_record = True
    compile_s = None
    interval_t0, interval_steps = time.perf_counter(), 0
    for step in range(start + 1, t.steps + 1):
        batch = next(run.data.train)
        if mesh is not None:
            batch = parallel.shard_local_batch(batch, mesh, t.batch_size)
        fn = step_fn
        for h in reversed(wrappers):
            fn = functools.partial(h.around_step, step, fn)
        state, metrics = fn(state, run.rest, batch)
        pending.append(metrics)
        interval_steps += 1
        run.console.step()
        if compile_s is None:  # the first step compiles: time it apart from throughput
            jax.block_until_ready(metrics)
            compile_s = time.perf_counter() - interval_t0
            interval_t0, interval_steps = time.perf_counter(), 0
        # Checkpoint steps are log steps too (the checkpoint hook is due there), so a resumed run's logging
        # intervals line up with an uninterrupted run's.
        due = [h.due(step) for h in hooks]
        if not (step % t.log_every == 0 or step == t.steps or any(due)):
            continue

        # ---- log step: the one place the host waits for the device -----------------------------------------
        host = jax.device_get(pending)
        elapsed = time.perf_counter() - interval_t0
        record = {
            "step": step,
            "loss": float(np.mean([h["loss"] for h in host])),
            "grad_norm": float(host[-1]["grad_norm"]),
            "lr": float(host[-1]["lr"]),
            "tokens": step * tokens_per_step,
        }
        if "z_loss" in host[-1]:  # train.z_loss > 0: the auxiliary term, apart from the cross entropy
            record["z_loss"] = float(np.mean([h["z_loss"] for h in host]))
        for k in host[-1]:  # a task's own metrics (DPO margins, GRPO rewards): the interval's mean
            if k not in record and k != "tokens":
                vals = [h[k] for h in host if k in h]
                record[k] = float(np.max(vals) if k.endswith("_max") else np.mean(vals))
        if interval_steps:
            tps = interval_steps * tokens_per_step / max(elapsed, 1e-9)
            peak, _ = peak_flops(m.dtype) if not t.peak_flops else (t.peak_flops, "")
            record["tokens_per_s"] = tps
            record["mfu"] = tps * flops_per_token / (peak * jax.device_count())
        if first_record:  # the first record of this process says how long compiling took
            record["compile_s"] = compile_s
            first_record = False
        pending = []
        info = StepInfo(step, record, state, run, host)
        for hook, is_due in zip(hooks, due, strict=True):
            if is_due or hook.every is None:
                hook(info)
        interval_t0, interval_steps = time.perf_counter(), 0
    return state


def _close_all(things) -> None:
    """close() each in order, all of them even when one fails; the first failure is raised after."""
    error = None
    for thing in things:
        try:
            thing.close()
        except BaseException as e:  # noqa: PERF203
            error = error or e
    if error is not None:
        raise error
