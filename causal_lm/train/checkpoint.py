"""Checkpoints with orbax: weights, optimizer state, RNG, config, tokenizer and data position, together.

Layout of `workdir/checkpoints/<step>/` (an orbax `CheckpointManager` directory):

    params/       the model parameters (a pure dict of arrays)
    train_state/  optimizer state, step, RNG, non-finite flag (absent in inference-only checkpoints)
    meta/         JSON: config, tokenizer, data-iterator state, parameter shapes, val_loss
    integrity/    JSON: a checksum, dtype and shape of every array above, and a SHA-256 of each meta entry

Orbax writes each step into a temporary directory and renames it when complete, so a process killed in the
middle of a save leaves the previous checkpoint as the latest restorable one (and a reader never sees a
half-written one). The manager keeps the last `train.keep_checkpoints` steps plus the one with the best
validation loss.

Integrity (`causal_lm.train.integrity`): the checksums are computed from the arrays in memory before they are
written and committed by the same rename, so a checkpoint exists with its checksums or not at all. Every restore
recomputes them on the restored arrays and compares; a changed byte, a truncated or missing file, or non-finite
parameters make the checkpoint refused with an `IntegrityError` naming the step and the array. Loading the latest
checkpoint (resume, `load_for_inference`, `restore_params`) then falls back to the newest intact one, warning
which ones it skipped and why; asking for a particular step never falls back.

Orbax restores whatever part of a checkpoint matches the target and may silently skip the rest, so shapes are
compared first, from the saved metadata, and a mismatch is an error naming every parameter that differs.

Entry points for other code:
    load_for_inference(workdir)                     -> (model, tokenizer, config)
    save_for_inference(workdir, model, config, tok) writes a checkpoint `causal-lm generate/eval --workdir` read
    restore_params(workdir, model)                  loads a workdir's weights into a model built elsewhere
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from causal_lm import parallel
from causal_lm.config import Config, ConfigError, apply_overrides, config_from_dict, config_to_dict
from causal_lm.data.tokenizer import tokenizer_from_dict
from causal_lm.model import build_model
from causal_lm.notes import note
from causal_lm.train import integrity, lora
from causal_lm.train.state import param_shapes

CHECKPOINT_DIR = "checkpoints"
REFUSED_DIR = "checkpoints_refused"  # damaged checkpoints a resumed run moved out of the way
META_VERSION = 2  # 2: an integrity item with checksums; 1: none (read without verification, with a warning)


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the model it is restored into."""


class IntegrityError(CheckpointError):
    """A checkpoint whose bytes changed, whose files are truncated or missing, or whose parameters are not finite:
    what it would load is not what was saved (or not usable). Loading the latest checkpoint skips such ones."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def _host_copy(tree):
    """Fresh host copies: the training loop donates its device buffers to the next step while orbax is still
    writing in the background, so the save must not alias them. Arrays spread over several processes cannot be
    fetched by one host: those are copied on their devices (same sharding), and orbax writes each process's
    shards from its own host."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else np.array(x, copy=True), tree)


def _abstract(tree, saved: dict | None = None):
    """The restore target: shapes, dtypes and, for arrays laid out on devices, their shardings. Orbax reads each
    array straight into the target's sharding, which is what restores a checkpoint onto a different mesh
    (or device count) than the one that saved it. `saved` (integrity records by array name) gives the dtype each
    array was saved in, which is the one it is read in."""
    saved = saved or {}

    def one(path, x):
        dtype = jax.numpy.dtype(saved.get(integrity.leaf_name(path), {}).get("dtype", x.dtype))
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))

    return jax.tree_util.tree_map_with_path(one, tree)


def shape_mismatches(saved: dict, expected: dict) -> list[str]:
    """Lines naming every parameter whose shape differs, or that only one side has."""
    lines = []
    for name in sorted(set(saved) | set(expected)):
        if name not in expected:
            lines.append(f"  {name}: in the checkpoint {list(saved[name])}, not in the model")
        elif name not in saved:
            lines.append(f"  {name}: in the model {list(expected[name])}, not in the checkpoint")
        elif list(saved[name]) != list(expected[name]):
            lines.append(f"  {name}: checkpoint {list(saved[name])} vs model {list(expected[name])}")
    return lines


def _flat(d: dict, prefix: str = "") -> dict:
    """{"mla": {"kv_lora_rank": 8}} -> {"mla.kv_lora_rank": 8}: sub-structures compared key by key."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _config_diff(saved: dict, current: dict) -> list[str]:
    saved, current = _flat(saved), _flat(current)
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]


class Checkpointer:
    """A thin wrapper over an orbax CheckpointManager in `workdir/checkpoints`."""

    def __init__(self, workdir: str, keep: int = 2, *, read_only: bool = False):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        self.directory = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)
        self.shown = os.path.join(workdir, CHECKPOINT_DIR)  # in messages: the path as the user gave it
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoints in {workdir!r} (expected {self.shown}); train there first")
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            # orbax would find out at the first save, after the training it was meant to keep
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self.directory)
        policy = cm.AnyPreservationPolicy(
            [
                cm.LatestN(keep),
                cm.BestN(
                    get_metric_fn=lambda m: m["val_loss"],
                    reverse=True,
                    n=1,  # reverse: keep the lowest
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        # (orbax's own read_only option only logs warnings; not saving is enough)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, create=not read_only, enable_async_checkpointing=True
        )
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "train_state", "meta", "integrity")
        )

    # ---- queries ---------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _read_json(self, step: int, item: str):
        ocp = self._ocp
        return self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]

    def read_meta(self, step: int) -> dict:
        """The checkpoint's JSON metadata, checked against its recorded SHA-256s (IntegrityError if it changed)."""
        try:
            meta = self._read_json(step, "meta")
        except Exception as e:
            raise IntegrityError(
                step, f"checkpoint {step} in {self.shown}: its metadata (meta/) cannot be read: {_short(e)}"
            ) from None
        if not isinstance(meta, dict) or "config" not in meta:
            raise IntegrityError(step, f"checkpoint {step} in {self.shown} has no causal_lm metadata")
        if meta.get("version", 1) < 2:
            note(
                f"checkpoint {step} in {self.shown} was written before checkpoints carried checksums: "
                "it is read without verification"
            )
            return meta
        record = self.read_integrity(step)
        saved = record.get("json", {})
        bad = [k for k in sorted(set(saved) | set(meta)) if saved.get(k) != integrity.json_digest(meta.get(k))]
        if bad:
            raise IntegrityError(
                step,
                f"checkpoint {step} in {self.shown} is damaged: its metadata entries {', '.join(bad)} do not "
                "match their recorded SHA-256",
            )
        return meta

    def read_integrity(self, step: int) -> dict:
        if os.path.isdir(self.step_dir(step)) and not os.path.isdir(os.path.join(self.step_dir(step), "integrity")):
            raise IntegrityError(
                step,
                f"checkpoint {step} in {self.shown} is damaged: its checksums (integrity/) are missing, so what it "
                "holds cannot be verified",
            )
        try:
            record = self._read_json(step, "integrity")
        except Exception as e:
            raise IntegrityError(
                step,
                f"checkpoint {step} in {self.shown} is damaged: its checksums (integrity/) cannot be read: {_short(e)}",
            ) from None
        if not isinstance(record, dict) or "arrays" not in record or "json" not in record:
            raise IntegrityError(step, f"checkpoint {step} in {self.shown} is damaged: integrity/ holds no checksums")
        return record

    def best_step(self) -> int | None:
        """The kept step with the lowest validation loss (None if no kept step was evaluated). Steps whose
        metadata cannot be read are left out."""
        scored = []
        for s in self.all_steps():
            try:
                m = self.read_meta(s)
            except IntegrityError:
                continue
            if m.get("val_loss") is not None:
                scored.append((m["val_loss"], s))
        return min(scored)[1] if scored else None

    def move_aside(self, steps: Iterable[int]) -> list[str]:
        """Move these steps' directories to `workdir/checkpoints_refused/` (where orbax does not look); returns the
        folder each went to."""
        aside = os.path.join(os.path.dirname(self.directory), REFUSED_DIR)
        out = []
        for s in steps:
            dest = os.path.join(aside, str(s))
            n = 1
            while os.path.exists(dest):
                dest, n = os.path.join(aside, f"{s}.{n}"), n + 1
            os.makedirs(aside, exist_ok=True)
            os.rename(self.step_dir(s), dest)
            out.append(dest)
        return out

    def reload(self) -> None:
        """Re-read the list of steps (after another process changed the directory); multi-process: after a
        barrier, so every process sees process 0's changes."""
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("causal_lm.checkpoint.reload")
        self.manager.reload()

    def delete_after(self, step: int) -> list[int]:
        """Delete every checkpoint later than `step`; returns the deleted steps."""
        later = sorted(s for s in self.all_steps() if s > step)
        for s in later:
            self.manager.delete(s)
        return later

    # ---- save / restore --------------------------------------------------------------------------------------
    def save(
        self, step: int, params, meta: dict, train_state: dict | None = None, val_loss: float | None = None
    ) -> None:
        """Start an asynchronous save of step `step` (arrays are copied first, so the caller may donate them)."""
        ocp = self._ocp
        # Checksums from the arrays as they are in memory (on their devices), before anything is written.
        arrays = {"params": integrity.array_records(params)}
        if train_state is not None:
            arrays["train_state"] = integrity.array_records(train_state)
        params = _host_copy(params)
        items = {"params": ocp.args.StandardSave(params)}
        if train_state is not None:
            items["train_state"] = ocp.args.StandardSave(_host_copy(train_state))
        meta = dict(
            meta,
            step=step,
            val_loss=val_loss,
            has_train_state=train_state is not None,
            param_shapes=param_shapes(params),
            version=META_VERSION,
        )
        items["meta"] = ocp.args.JsonSave(meta)
        json_digests = {k: integrity.json_digest(v) for k, v in meta.items()}
        items["integrity"] = ocp.args.JsonSave({"arrays": arrays, "json": json_digests})
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(**items),
                metrics=None if val_loss is None else {"val_loss": float(val_loss)},
                force=True,
            )
        except Exception as e:  # includes the deferred error of the previous asynchronous save
            raise self._save_error(e, step) from None

    def _save_error(self, e: Exception, step: int | None) -> CheckpointError:
        """One line for a failed (possibly asynchronous, so reported one save late) save: which step, the OS's
        reason when TensorStore gives one (e.g. 'No space left on device'), and what is still on disk."""
        text = str(e)
        failed = re.search(r"/(\d+)\.orbax-checkpoint-tmp", text)
        oserror = re.search(r": ([^:\[\]\"]+?) \[os_error_code='?(\d+)'?\]", text)
        reason = f"{oserror.group(1)} (errno {oserror.group(2)})" if oserror else _short(e)
        self.manager.reload()
        steps = self.all_steps()
        return CheckpointError(
            f"saving checkpoint {failed.group(1) if failed else step} in {self.shown} failed: {reason}; "
            + (
                f"the checkpoints already written ({', '.join(map(str, steps))}) are untouched"
                if steps
                else "no checkpoint had been written"
            )
        )

    def restore(self, step: int, abstract_params, abstract_train_state=None) -> tuple[Any, Any, dict]:
        """(params, train_state or None, meta) of `step`, after checking every parameter's shape."""
        ocp = self._ocp
        meta = self.read_meta(step)
        bad = shape_mismatches(meta.get("param_shapes", {}), param_shapes(abstract_params))
        if bad:
            raise CheckpointError(
                f"checkpoint {step} in {self.shown} does not fit this model; parameters that differ:\n" + "\n".join(bad)
            )
        record = self.read_integrity(step) if meta.get("version", 1) >= 2 else None
        saved_arrays = record["arrays"] if record else {}
        targets = {"params": abstract_params}
        want_state = abstract_train_state is not None and meta.get("has_train_state")
        if want_state:
            targets["train_state"] = abstract_train_state
        # Restore each array in the dtype it was saved in (the checksum is of those bits); cast afterwards.
        items = {k: ocp.args.StandardRestore(_abstract(t, saved_arrays.get(k))) for k, t in targets.items()}
        _quiet_abandoned_reads()
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            gone = not os.path.isdir(self.step_dir(step))
            raise IntegrityError(
                step,
                f"checkpoint {step} in {self.shown} "
                + ("was removed while it was being read" if gone else f"is damaged: {_read_error(e)}"),
            ) from None
        restored = {k: out[k] for k in targets}
        for k, tree in restored.items():
            records = integrity.array_records(tree)
            if record is not None:
                if k not in saved_arrays:
                    raise IntegrityError(step, f"checkpoint {step} in {self.shown} has no checksums for {k}/")
                diff = integrity.compare(saved_arrays[k], records)
                if diff:
                    raise IntegrityError(
                        step,
                        f"checkpoint {step} in {self.shown} is damaged: what was read is not what was saved: "
                        + "; ".join(f"{k}.{line}" for line in diff[:8])
                        + (f" (and {len(diff) - 8} more)" if len(diff) > 8 else ""),
                    )
            if k == "params" and (nan := integrity.non_finite(records)):
                raise IntegrityError(
                    step,
                    f"checkpoint {step} in {self.shown} holds non-finite parameters (NaN or infinity) in "
                    + ", ".join(nan[:8])
                    + (f" and {len(nan) - 8} more" if len(nan) > 8 else ""),
                )
            restored[k] = jax.tree.map(
                lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), restored[k], targets[k]
            )
        return restored["params"], restored.get("train_state"), meta

    def wait(self) -> None:
        """Block until pending saves are on disk (and raise their errors, which async saves defer)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(e, self.latest_step()) from None

    def close(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self.manager.close()
            raise self._save_error(e, self.latest_step()) from None
        self.manager.close()


_QUIET = False


def _quiet_abandoned_reads() -> None:
    """When one array of a restore fails to read, orbax re-raises at once and abandons the other reads of that
    restore mid-flight. As they finish later (in TensorStore's threads, after orbax's event loop has closed) or are
    garbage-collected, Python reports each through `sys.unraisablehook`: a page of "Event loop is closed" and
    "Exception ignored in <coroutine _read_array_index_and_device_put>" tracebacks per array, long after the error
    was reported (or the next checkpoint loaded fine). From the first restore on, exactly those reports are
    dropped; every other unraisable exception still reaches the previous hook."""
    global _QUIET
    if _QUIET:
        return
    _QUIET = True
    previous = sys.unraisablehook

    def hook(u):
        code = getattr(u.object, "cr_code", None)
        if code is not None and "orbax" in code.co_filename:
            return  # an abandoned orbax read coroutine, closed by the garbage collector
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            frames = traceback.extract_tb(u.exc_traceback)
            if any(f.name == "call_soon_threadsafe" for f in frames):
                return  # a TensorStore read finishing after orbax's loop closed
        previous(u)

    sys.unraisablehook = hook


def _read_error(e: BaseException) -> str:
    """What went wrong reading arrays, in one line naming the array: orbax wraps TensorStore's error (e.g.
    'OUT_OF_RANGE: Error reading "blocks.attn.wo/0.0.0.0" in OCDBT database at local file ".../20/params/"')
    in an exception whose message is a page of TensorStore spec."""
    chain, x = [], e
    while x is not None and len(chain) < 16:
        chain.append(x)
        x = x.__cause__ or x.__context__
    inner = chain[-1]
    text = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
    found = re.search(r'Error reading "([^"]+?)/[^"]*" in OCDBT database at [^"]*"([^"]+)"', text)
    if found:
        item = os.path.basename(found.group(2).rstrip("/"))
        return f"cannot read {item}.{found.group(1)}: {text.split(': ', 1)[0]}: {text.rsplit(': ', 1)[-1]}"
    path = re.search(r"'path': '([^'/]+)/'", str(e))
    where = f"cannot read {path.group(1)}: " if path else ""
    return where + (text if len(text) < 300 else text[:300] + "...")


def _short(e: BaseException) -> str:
    """An exception as one line: its type (for library errors) and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return f"{type(e).__name__}: {text}" if not isinstance(e, CheckpointError) else text


def newest_intact(ckpt: Checkpointer, steps: Iterable[int], attempt: Callable[[int], Any], workdir: str):
    """(step, attempt(step)) for the newest of `steps` whose `attempt` does not raise IntegrityError; each step
    skipped is reported with a `Note` saying why. No intact one: a CheckpointError listing them all."""
    tried: list[str] = []
    seen: set[int] = set()
    todo = sorted(steps, reverse=True)
    while todo:
        s = todo.pop(0)
        seen.add(s)
        try:
            out = attempt(s)
        except IntegrityError as e:
            tried.append(f"step {s}: {e}")
            if not os.path.isdir(ckpt.step_dir(s)):  # a training run pruned it: look for newer ones too
                ckpt.manager.reload()
                todo = sorted((t for t in ckpt.all_steps() if t not in seen), reverse=True)
            note(f"{e}: skipped")
            continue
        if tried:
            note(f"using checkpoint {s} of {workdir!r}, the newest intact one")
        return s, out
    raise CheckpointError(f"no intact checkpoint in {workdir!r}: " + ("; ".join(tried) if tried else "there are none"))


def check_model_config(meta: dict, config: Config, step: int, directory: str) -> list[str]:
    """Raise if the checkpoint's parameter shapes do not fit `config`'s model; return the model-config fields that
    differ without changing shapes (e.g. remat, dtype) for the caller to report."""

    try:  # read through this version's config, so an older layout (flat rope_*/MLA keys) compares by meaning
        saved_model = config_to_dict(config_from_dict(meta["config"]))["model"]
    except (ConfigError, TypeError):
        saved_model = meta["config"]["model"]
    current = config_to_dict(config)["model"]
    diff = _config_diff(saved_model, current)
    if not diff:
        return []
    abstract = nnx.eval_shape(lambda: build_model(config.model))
    expected = param_shapes(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    bad = shape_mismatches(meta.get("param_shapes", {}), expected)
    if bad:
        raise CheckpointError(
            f"checkpoint {step} in {directory} was written by a different architecture; parameters that differ:\n"
            + "\n".join(bad)
            + "\nmodel config differences (checkpoint -> now): "
            + "; ".join(diff)
            + "\nUse a new --workdir for a new architecture."
        )
    return diff


# ---- inference -------------------------------------------------------------------------------------------


def _load(ckpt: Checkpointer, step: None | int | str, attempt: Callable[[int], Any], workdir: str):
    """attempt(s) for the checkpoint `step` names: the newest intact one for None / "latest" (and for "best" when
    no checkpoint has a validation loss), else exactly the one asked for (its IntegrityError propagates)."""
    steps = ckpt.all_steps()
    if not steps:
        raise CheckpointError(f"no checkpoints in {workdir!r}: train there first (causal-lm train --workdir ...)")
    if step == "best":
        step = ckpt.best_step()
    if step is None or step == "latest":
        return newest_intact(ckpt, steps, attempt, workdir)[1]
    if int(step) not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {workdir!r}; steps: {steps}")
    return attempt(int(step))


def restore_params(workdir: str, model, step: None | int | str = None):
    """Load the weights of `workdir`'s checkpoint (latest, "best" or a step) into `model` in place, e.g. to
    evaluate one model's weights under another mask config. Shapes must match (error names those that don't);
    the latest falls back to the newest intact checkpoint, and on any error the model is left unchanged.
    Returns the checkpoint's metadata."""

    ckpt = Checkpointer(workdir, read_only=True)
    target = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    try:
        params, _, meta = _load(ckpt, step, lambda s: ckpt.restore(s, target), workdir)
    finally:
        ckpt.close()
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return meta


def load_for_inference(workdir: str, step: None | int | str = None, overrides: Iterable[str] = (), mesh=None):
    """(model, tokenizer, config) from a workdir: the latest checkpoint, or `step` ("best" or a number).

    The latest means the newest intact one: a checkpoint whose checksums do not match, whose files are missing,
    or whose parameters are not finite is skipped with a `Note` warning saying why. A step asked for by number
    (or "best") is used or refused, never replaced by another.
    overrides: config `key=value` strings applied to the saved config before the model is built (settings that
    keep parameter shapes, e.g. `model.attention_mask=none` or `model.dtype=bfloat16`).
    mesh: a `causal_lm.parallel.make_mesh` mesh to restore the weights onto, split by the partition rules
    (whatever mesh or device count saved them); `generate` then runs sharded. None: the default device.
    """

    def attempt(s: int):
        meta = ckpt.read_meta(s)
        config = apply_overrides(config_from_dict(meta["config"]), overrides)
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
        abstract = nnx.eval_shape(lambda: build_model(config.model))
        graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree.leaves(rest):  # non-parameter state needs real initial values
            graphdef, _, rest = nnx.split(build_model(config.model), nnx.Param, ...)
        target = nnx.to_pure_dict(abstract_params)
        if mesh is not None:
            shardings = parallel.tree_shardings(target, mesh)
        else:  # an explicit device: a checkpoint saved from a mesh restores only onto a given layout
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), target)
        target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), target, shardings)
        if config.train.lora_rank:  # a LoRA run's checkpoint holds adapters: the base is in workdir/frozen_base
            params = load_lora_merged(workdir, ckpt, s, config.train, target)
        else:
            params, _, _ = ckpt.restore(s, target)
        return nnx.merge(graphdef, params, rest), tokenizer, config

    ckpt = Checkpointer(workdir, read_only=True)
    try:
        model, tokenizer, config = _load(ckpt, step, attempt, workdir)
    finally:
        ckpt.close()
    return model, tokenizer, config


def load_frozen_base(workdir: str, target):
    """The frozen params of `workdir` (LoRA's base, DPO/GRPO's reference: workdir/frozen_base, checksums verified)."""
    base_dir = os.path.join(workdir, lora.FROZEN_DIR)
    if not os.path.isdir(os.path.join(base_dir, CHECKPOINT_DIR)):
        raise CheckpointError(
            f"{workdir!r} holds LoRA adapters but not their base weights ({os.path.join(base_dir, CHECKPOINT_DIR)} "
            "is missing)"
        )
    store = Checkpointer(base_dir, read_only=True)
    try:
        return store.restore(0, target)[0]
    finally:
        store.close()


def save_frozen_base(workdir: str, params, meta: dict) -> None:
    """Write a run's frozen params (LoRA's base, DPO/GRPO's reference) once, as step 0 of workdir/frozen_base."""
    store = Checkpointer(os.path.join(workdir, lora.FROZEN_DIR), keep=1)
    try:
        store.save(0, params, meta)
    finally:
        store.close()


def load_lora_merged(workdir: str, ckpt: Checkpointer, step: int, train_config, target):
    """Base + adapters of LoRA checkpoint `step`, merged (W + alpha/r * A @ B): the weights the run trained."""
    base = load_frozen_base(workdir, target)
    abstract = jax.eval_shape(lambda: lora.init_adapters(base, train_config.lora_targets, train_config.lora_rank, 0))
    adapters, _, _ = ckpt.restore(step, abstract)
    return lora.merge(base, adapters, lora.lora_scale(train_config))


def save_for_inference(workdir: str, model, config: Config, tokenizer, step: int = 0) -> str:
    """Write `model`'s weights with its config and tokenizer as a checkpoint of `workdir` (e.g. a converted Hugging
    Face model), so `causal-lm generate --workdir` and `causal-lm eval --workdir` use it, and
    `causal-lm train --workdir` fine-tunes it (with a fresh optimizer). Returns the checkpoint directory."""

    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
            f"{model.config.vocab_size}: ids past it would be clamped silently"
        )
    if config.model != model.config:
        config = Config(model=model.config, data=config.data, train=config.train, mesh=config.mesh)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nan = integrity.non_finite(integrity.array_records(params))
    if nan:
        raise CheckpointError(
            f"the model holds non-finite parameters (NaN or infinity) in {', '.join(nan[:8])}: not saved"
        )
    os.makedirs(workdir, exist_ok=True)
    write_workdir_files(workdir, config, tokenizer)
    ckpt = Checkpointer(workdir, keep=max(config.train.keep_checkpoints, 1))
    try:
        meta = {"config": config_to_dict(config), "tokenizer": tokenizer.to_dict(), "data_state": None}
        ckpt.save(step, params, meta)
    finally:
        ckpt.close()
    return os.path.join(ckpt.directory, str(step))


def write_workdir_files(workdir: str, config: Config, tokenizer) -> None:
    """config.json and tokenizer/ at the top of the workdir, for people and tools (checkpoints carry their own)."""

    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_to_dict(config), f, indent=2)
    tokenizer.save(os.path.join(workdir, "tokenizer"))
