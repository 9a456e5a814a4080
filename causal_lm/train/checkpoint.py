"""Checkpoints with orbax: weights, optimizer state, RNG, config, tokenizer and data position, together.

Layout of `workdir/checkpoints/<step>/` (an orbax `CheckpointManager` directory):

    params/       the model parameters (a pure dict of arrays)
    train_state/  optimizer state, step, RNG, non-finite flag (absent in inference-only checkpoints)
    meta/         JSON: config, tokenizer, data-iterator state, parameter shapes, val_loss

Orbax writes each step into a temporary directory and renames it when complete, so a process killed in the
middle of a save leaves the previous checkpoint as the latest restorable one. The manager keeps the last
`train.keep_checkpoints` steps plus the one with the best validation loss.

Orbax restores whatever part of a checkpoint matches the target and may silently skip the rest, so shapes are
compared first, from the saved metadata, and a mismatch is an error naming every parameter that differs.

Entry points for other code:
    load_for_inference(workdir)                     -> (model, tokenizer, config)
    save_for_inference(workdir, model, config, tok) writes a checkpoint `causal-lm generate/eval --workdir` read
    restore_params(workdir, model)                  loads a workdir's weights into a model built elsewhere
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from causal_lm.config import Config, apply_overrides, config_from_dict, config_to_dict
from causal_lm.data.tokenizer import tokenizer_from_dict
from causal_lm.train.state import param_shapes

CHECKPOINT_DIR = "checkpoints"
META_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the model it is restored into."""


def _host_copy(tree):
    """Fresh host copies: the training loop donates its device buffers to the next step while orbax is still
    writing in the background, so the save must not alias them. Arrays spread over several processes cannot be
    fetched by one host: those are copied on their devices (same sharding), and orbax writes each process's
    shards from its own host."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else np.array(x, copy=True), tree)


def _abstract(tree):
    """The restore target: shapes, dtypes and, for arrays laid out on devices, their shardings. Orbax reads each
    array straight into the target's sharding, which is what restores a checkpoint onto a different mesh
    (or device count) than the one that saved it."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


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


def _config_diff(saved: dict, current: dict) -> list[str]:
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
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoints in {workdir!r} (expected {self.directory}); train there first")
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
            self.directory, options=options, item_names=("params", "train_state", "meta")
        )

    # ---- queries ---------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def read_meta(self, step: int) -> dict:
        ocp = self._ocp
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise CheckpointError(f"cannot read the metadata of checkpoint {step} in {self.directory}: {e}") from None
        if not isinstance(meta, dict) or "config" not in meta:
            raise CheckpointError(f"checkpoint {step} in {self.directory} has no causal_lm metadata")
        return meta

    def best_step(self) -> int | None:
        """The kept step with the lowest validation loss (None if no kept step was evaluated)."""
        scored = [(m["val_loss"], s) for s in self.all_steps() if (m := self.read_meta(s)).get("val_loss") is not None]
        return min(scored)[1] if scored else None

    # ---- save / restore --------------------------------------------------------------------------------------
    def save(
        self, step: int, params, meta: dict, train_state: dict | None = None, val_loss: float | None = None
    ) -> None:
        """Start an asynchronous save of step `step` (arrays are copied first, so the caller may donate them)."""
        ocp = self._ocp
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
        self.manager.save(
            step,
            args=ocp.args.Composite(**items),
            metrics=None if val_loss is None else {"val_loss": float(val_loss)},
            force=True,
        )

    def restore(self, step: int, abstract_params, abstract_train_state=None) -> tuple[Any, Any, dict]:
        """(params, train_state or None, meta) of `step`, after checking every parameter's shape."""
        ocp = self._ocp
        meta = self.read_meta(step)
        bad = shape_mismatches(meta.get("param_shapes", {}), param_shapes(abstract_params))
        if bad:
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} does not fit this model; parameters that differ:\n"
                + "\n".join(bad)
            )
        items = {"params": ocp.args.StandardRestore(_abstract(abstract_params))}
        want_state = abstract_train_state is not None and meta.get("has_train_state")
        if want_state:
            items["train_state"] = ocp.args.StandardRestore(_abstract(abstract_train_state))
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            raise CheckpointError(
                f"cannot restore checkpoint {step} from {self.directory}: {type(e).__name__}: {e}"
            ) from None
        return out["params"], out["train_state"] if want_state else None, meta

    def wait(self) -> None:
        """Block until pending saves are on disk (and raise their errors, which async saves defer)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def check_model_config(meta: dict, config: Config, step: int, directory: str) -> list[str]:
    """Raise if the checkpoint's parameter shapes do not fit `config`'s model; return the model-config fields that
    differ without changing shapes (e.g. remat, dtype) for the caller to report."""
    from flax import nnx

    from causal_lm.model import build_model

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


def _pick_step(ckpt: Checkpointer, step: None | int | str, workdir: str) -> int:
    steps = ckpt.all_steps()
    if not steps:
        raise CheckpointError(f"no checkpoints in {workdir!r}: train there first (causal-lm train --workdir ...)")
    if step is None or step == "latest":
        return max(steps)
    if step == "best":
        best = ckpt.best_step()
        return best if best is not None else max(steps)
    if int(step) not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {workdir!r}; steps: {steps}")
    return int(step)


def restore_params(workdir: str, model, step: None | int | str = None):
    """Load the weights of `workdir`'s checkpoint (latest, "best" or a step) into `model` in place, e.g. to
    evaluate one model's weights under another mask config. Shapes must match (error names those that don't).
    Returns the checkpoint's metadata."""
    from flax import nnx

    ckpt = Checkpointer(workdir, read_only=True)
    try:
        s = _pick_step(ckpt, step, workdir)
        params, _, meta = ckpt.restore(s, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    finally:
        ckpt.close()
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return meta


def load_for_inference(workdir: str, step: None | int | str = None, overrides: Iterable[str] = (), mesh=None):
    """(model, tokenizer, config) from a workdir: the latest checkpoint, or `step` ("best" or a number).

    overrides: config `key=value` strings applied to the saved config before the model is built (settings that
    keep parameter shapes, e.g. `model.attention_mask=none` or `model.dtype=bfloat16`).
    mesh: a `causal_lm.parallel.make_mesh` mesh to restore the weights onto, split by the partition rules
    (whatever mesh or device count saved them); `generate` then runs sharded. None: the default device.
    """
    from flax import nnx

    from causal_lm.model import build_model

    ckpt = Checkpointer(workdir, read_only=True)
    try:
        s = _pick_step(ckpt, step, workdir)
        meta = ckpt.read_meta(s)
        config = apply_overrides(config_from_dict(meta["config"]), overrides)
        abstract = nnx.eval_shape(lambda: build_model(config.model))
        graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree.leaves(rest):  # non-parameter state needs real initial values
            graphdef, _, rest = nnx.split(build_model(config.model), nnx.Param, ...)
        target = nnx.to_pure_dict(abstract_params)
        if mesh is not None:
            from causal_lm import parallel

            shardings = parallel.tree_shardings(target, mesh)
        else:  # an explicit device: a checkpoint saved from a mesh restores only onto a given layout
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), target)
        target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), target, shardings)
        params, _, _ = ckpt.restore(s, target)
    finally:
        ckpt.close()
    model = nnx.merge(graphdef, params, rest)
    return model, tokenizer_from_dict(meta["tokenizer"]), config


def save_for_inference(workdir: str, model, config: Config, tokenizer, step: int = 0) -> str:
    """Write `model`'s weights with its config and tokenizer as a checkpoint of `workdir` (e.g. a converted Hugging
    Face model), so `causal-lm generate --workdir` and `causal-lm eval --workdir` use it, and
    `causal-lm train --workdir` fine-tunes it (with a fresh optimizer). Returns the checkpoint directory."""
    from flax import nnx

    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is "
            f"{model.config.vocab_size}: ids past it would be clamped silently"
        )
    if config.model != model.config:
        config = Config(model=model.config, data=config.data, train=config.train, mesh=config.mesh)
    os.makedirs(workdir, exist_ok=True)
    write_workdir_files(workdir, config, tokenizer)
    ckpt = Checkpointer(workdir, keep=max(config.train.keep_checkpoints, 1))
    try:
        ckpt.save(
            step,
            nnx.to_pure_dict(nnx.state(model, nnx.Param)),
            {"config": config_to_dict(config), "tokenizer": tokenizer.to_dict(), "data_state": None},
        )
    finally:
        ckpt.close()
    return os.path.join(ckpt.directory, str(step))


def write_workdir_files(workdir: str, config: Config, tokenizer) -> None:
    """config.json and tokenizer/ at the top of the workdir, for people and tools (checkpoints carry their own)."""
    import json

    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_to_dict(config), f, indent=2)
    tokenizer.save(os.path.join(workdir, "tokenizer"))
