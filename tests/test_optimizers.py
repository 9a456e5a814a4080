"""The optimizers (train.optimizer = adamw | muon | lion | adafactor), the z-loss and the optimizer-state dtype.

Which parameters are weight-decayed and which Muon updates (named, over models with biases, sinks, gates, MLA and
norms); the learning-rate schedule's exact values; Muon's update is the orthogonalised 2-D matrix form of each
stacked weight; the z-loss gradient against finite differences; for every optimizer, microbatches equal one big
batch and a non-finite step is skipped whole; hyperparameters are traced (no recompile); and one short run per
optimizer that learns below the unigram loss and resumes exactly after SIGKILL."""

import math
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from children import kill_child_at
from flax import nnx
from test_train import CHILD  # the child that blocks each save past step n, for a SIGKILL mid-save
from variants import tiny_config

from causal_lm.cli import main
from causal_lm.config import ConfigError, TrainConfig, apply_overrides, load_config
from causal_lm.data import build_data, builtin_documents
from causal_lm.model import build_model
from causal_lm.train import Checkpointer, read_metrics, train_and_evaluate
from causal_lm.train.checkpoint import CHECKPOINT_DIR
from causal_lm.train.state import (
    decay_mask,
    init_params,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    muon_labels,
    split_params,
)
from causal_lm.train.step import compiled_train_step, loss_and_grads, train_step_program

# A model with every kind of parameter: q/k/v biases, sink logits, the output gate, learned positions, an untied
# LM head; and an MLA model (its latent norms are parameters of their own name).
FULL = tiny_config("gqa", "learned", gate=True, sink=True, qkv_bias=True, tie_embeddings=False)
MLA = tiny_config(
    "mha", "rope_full", attention_type="mla", num_kv_heads=None, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4
)
MATRICES = {"blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv", "blocks.attn.wo", "blocks.attn.wg"}
MLP = {"blocks.mlp.w_gate", "blocks.mlp.w_up", "blocks.mlp.w_down"}
MLA_MATRICES = {"blocks.attn.wq_a", "blocks.attn.wq_b", "blocks.attn.wkv_a", "blocks.attn.wk_b", "blocks.attn.wv_b"}
NORMS = {"blocks.attn_norm.scale", "blocks.mlp_norm.scale", "final_norm.scale"}
BIASES_SINKS = {"blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv", "blocks.attn.sink"}
OPTIMIZERS = ("adamw", "muon", "lion", "adafactor")


def _abstract_params(config):
    return split_params(nnx.eval_shape(lambda: build_model(config, 0)))[1]


def _flat(tree) -> dict:
    return {
        ".".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _split(flags: dict, value) -> set:
    return {name for name, v in flags.items() if v == value}


def test_decay_mask_names_which_parameters_decay():
    """Kills "weight decay applied to norm gains, biases and sink logits" (a mask that is True everywhere, or a
    name pattern that misses one kind): every parameter of both models is named on its side."""
    flags = _flat(decay_mask(_abstract_params(FULL)))
    assert _split(flags, True) == MATRICES | MLP | {"embed", "pos_embed", "lm_head"}
    assert _split(flags, False) == NORMS | BIASES_SINKS
    flags = _flat(decay_mask(_abstract_params(MLA)))
    assert _split(flags, True) == MLA_MATRICES | {"blocks.attn.wo"} | MLP | {"embed"}
    assert _split(flags, False) == NORMS | {"blocks.attn.q_norm", "blocks.attn.kv_norm"}


def test_muon_updates_the_hidden_matrices_and_adamw_the_rest():
    labels = _flat(muon_labels(_abstract_params(FULL)))
    assert _split(labels, "muon") == MATRICES | MLP
    assert _split(labels, "adamw") == NORMS | BIASES_SINKS | {"embed", "pos_embed", "lm_head"}
    labels = _flat(muon_labels(_abstract_params(MLA)))
    assert _split(labels, "muon") == MLA_MATRICES | {"blocks.attn.wo"} | MLP
    assert _split(labels, "adamw") == NORMS | {"blocks.attn.q_norm", "blocks.attn.kv_norm", "embed"}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_zero_gradient_step_decays_matrices_only(optimizer):
    """One update with a zero gradient is weight decay alone: matrices and embeddings shrink by exactly
    (1 - lr * weight_decay), while norm gains stay at 1 and biases and sinks keep their (non-zero) values."""
    _, params, _ = init_params(FULL, 0)
    flat = _flat(params)
    assert all(np.all(np.asarray(flat[n]) == 1.0) for n in NORMS)  # gains start at 1
    # Biases and sinks start at 0, which decay would leave at 0: give them values decay would move.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.5 if str(getattr(path[-1], "key", "")) in ("bq", "bk", "bv", "sink") else x, params
    )
    t = TrainConfig(optimizer=optimizer, learning_rate=0.1, warmup_steps=0, steps=10, weight_decay=0.5, grad_clip=0)
    opt = make_optimizer(t)
    updates, _ = jax.jit(opt.update)(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    new = _flat(jax.tree.map(lambda p, u: p + u, params, updates))
    old = _flat(params)
    shrink = 1.0 - float(learning_rate_schedule(t)(0)) * 0.5
    for name in NORMS:
        np.testing.assert_array_equal(new[name], 1.0)
    for name in BIASES_SINKS:
        np.testing.assert_array_equal(new[name], 0.5 + np.asarray(_flat(init_params(FULL, 0)[1])[name]))
    for name in MATRICES | MLP | {"embed", "pos_embed", "lm_head"}:
        np.testing.assert_allclose(new[name], np.asarray(old[name]) * shrink, rtol=1e-6, err_msg=name)


def test_learning_rate_schedule_exact_values():
    """Kills "warmup off by one": the first update already gets lr/warmup (never 0), the last warmup update the
    peak, the last update of the run exactly min_lr_ratio * peak; cosine in between."""
    peak, warm, total, floor = 3e-3, 10, 100, 0.1
    t = TrainConfig(learning_rate=peak, warmup_steps=warm, steps=total, min_lr_ratio=floor)
    lr = learning_rate_schedule(t)
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert float(lr(0)) == pytest.approx(f32(peak / warm), rel=1e-6)
    for k in range(warm):  # linear: update k (0-based) gets peak * (k + 1) / warmup
        assert float(lr(k)) == pytest.approx(peak * (k + 1) / warm, rel=1e-6)
    assert float(lr(warm - 1)) == pytest.approx(peak, rel=1e-6)  # the end of warmup
    after = peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / (total - warm))))
    assert float(lr(warm)) == pytest.approx(after, rel=1e-6)
    assert float(lr((warm + total) // 2 - 1)) == pytest.approx(peak * (floor + (1 - floor) * 0.5), rel=1e-6)
    assert float(lr(total - 1)) == pytest.approx(floor * peak, rel=1e-6)  # the end
    # Without warmup the first update is already on the cosine.
    lr0 = learning_rate_schedule(TrainConfig(learning_rate=peak, warmup_steps=0, steps=total, min_lr_ratio=floor))
    assert float(lr0(0)) == pytest.approx(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi / total))))


def _newton_schulz(g: np.ndarray) -> np.ndarray:
    """Muon's quintic Newton-Schulz orthogonalisation (5 steps, coefficients 3.4445, -4.7750, 2.0315), in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (np.linalg.norm(g) + 1e-8)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x if wide else x.T


# Each Muon weight's 2-D matrix form: (reduction dims, output dims) of the unstacked shape.
MATRIX_FORM = {
    "wq": 1,  # [D | N, H]: the number of leading (reduction) dims
    "wk": 1,
    "wv": 1,
    "wg": 1,
    "wo": 2,  # [N, H | D]
    "w_gate": 1,
    "w_up": 1,
    "w_down": 1,
    "wq_a": 1,
    "wkv_a": 1,
    "wq_b": 1,
    "wk_b": 1,
    "wv_b": 1,
}


@pytest.mark.parametrize("config", [FULL, MLA], ids=["mha", "mla"])
def test_muon_orthogonalises_each_layers_matrix_form(config):
    """Muon's first update of a stacked [L, ...] weight is, layer by layer, the orthogonalised gradient of the
    layer's linear map (wq [D, N, H] as [D, N*H], wo [N, H, D] as [N*H, D]), scaled to RMS 0.2 times the
    learning rate; AdamW's first update of the rest is -lr * sign(gradient). Catches heads orthogonalised one
    by one, the layer axis mixed into the matrix, wrong axes, a missing scale, an embedding given to Muon."""
    _, params, _ = init_params(config, 0)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params)
    t = TrainConfig(optimizer="muon", learning_rate=0.1, warmup_steps=0, steps=10, weight_decay=0.0, grad_clip=0)
    opt = make_optimizer(t)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    lr = float(learning_rate_schedule(t)(0))
    labels = _flat(muon_labels(params))
    g, u = _flat(grads), _flat(updates)
    for name, label in labels.items():
        gn, un = np.asarray(g[name], np.float64), np.asarray(u[name])
        if label == "adamw":
            np.testing.assert_allclose(un, -lr * gn / (np.abs(gn) + 1e-8), rtol=1e-5, atol=1e-9, err_msg=name)
            continue
        k = MATRIX_FORM[name.split(".")[-1]]
        for layer in range(gn.shape[0]):  # stacked blocks: one matrix per layer
            shape = gn[layer].shape
            m = gn[layer].reshape(math.prod(shape[:k]), -1)
            expected = -lr * 0.2 * math.sqrt(max(m.shape)) * _newton_schulz(m)
            np.testing.assert_allclose(
                un[layer].reshape(m.shape), expected, atol=2e-5 * np.abs(expected).max(), err_msg=f"{name}[{layer}]"
            )


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bfloat16_optimizer_state_rounds_the_float32_state(optimizer):
    """train.opt_state_dtype=bfloat16 stores every moment in bf16 (half the bytes) and computes in float32: the
    first update equals the float32 optimizer's (up to XLA's fusion order) and the stored state is its state
    rounded to bf16; constants that are not statistics (Muon's Newton-Schulz coefficients) and counters keep
    their dtype."""
    _, params, _ = init_params(FULL, 0)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(params))))
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype) * 1e-2, params)
    outs = {}
    for dtype in ("auto", "bfloat16"):
        opt = make_optimizer(TrainConfig(optimizer=optimizer, opt_state_dtype=dtype))
        state = opt.init(params)
        outs[dtype] = (state, *jax.jit(opt.update)(grads, state, params))
    (s32, u32, n32), (s16, u16, n16) = outs["auto"], outs["bfloat16"]
    for a, b in zip(jax.tree.leaves(u32), jax.tree.leaves(u16), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
    big = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(n32)[0], jax.tree.leaves(n16), strict=True):
        if "ns_coeffs" in jax.tree_util.keystr(path) or a.ndim == 0 or not jnp.issubdtype(a.dtype, jnp.floating):
            assert b.dtype == a.dtype, jax.tree_util.keystr(path)
            np.testing.assert_array_equal(a, b)
        else:
            assert b.dtype == jnp.bfloat16, jax.tree_util.keystr(path)
            np.testing.assert_allclose(np.asarray(b, np.float32), a, rtol=2**-8, atol=1e-30)  # half a bf16 ulp
            big += a.size
    assert big > sum(x.size for x in jax.tree.leaves(params)) // 2  # the moments really are in bf16
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    assert nbytes(s16) < 0.6 * nbytes(s32)


def test_z_loss_gradient_matches_finite_differences():
    """train.z_loss adds coef * mean(log Z^2) over the weighted tokens: the logged cross entropy is unchanged, the
    logged term equals that mean computed here from the logits, and the gradient changes by exactly coef times
    the gradient of the mean (a central finite difference along a random direction, in float64 from the logits)."""
    config = tiny_config()
    graphdef, params, rest = init_params(config, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (2, 17)).astype(np.int32)
    segments = np.ones((2, 16), np.int32)
    segments[1, 11:] = 0  # padding: its tokens weigh nothing
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segments,
        "weights": (segments > 0).astype(np.float32),
    }
    coef = 0.5
    loss0, g0, n0, z0 = jax.jit(lambda p: loss_and_grads(graphdef, p, rest, batch))(params)
    loss1, g1, n1, z1 = jax.jit(lambda p, c: loss_and_grads(graphdef, p, rest, batch, 1, c))(params, coef)
    w = batch["weights"].astype(np.float64)

    forward = jax.jit(lambda p: nnx.merge(graphdef, p, rest)(batch["tokens"], segment_ids=batch["segment_ids"])[0])

    def mean_log_z2(p) -> float:
        x = np.asarray(forward(p), np.float64)
        m = x.max(-1, keepdims=True)
        log_z = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
        return float((w * log_z**2).sum() / w.sum())

    assert float(n0) == float(n1) == w.sum() and float(z0) == 0.0
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-6)  # the cross entropy alone
    assert float(z1) == pytest.approx(coef * mean_log_z2(params), rel=1e-5)
    keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))
    direction = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype), params)
    norm = math.sqrt(sum(float(jnp.sum(d**2)) for d in jax.tree.leaves(direction)))
    direction = jax.tree.map(lambda d: d / norm, direction)
    h = 1e-2
    shifted = lambda s: jax.tree.map(lambda p, d: p + s * h * d, params, direction)  # noqa: E731
    fd = (mean_log_z2(shifted(1)) - mean_log_z2(shifted(-1))) / (2 * h)
    analytic = sum(
        float(jnp.sum((a - b) * d)) for a, b, d in zip(*map(jax.tree.leaves, (g1, g0, direction)), strict=True)
    )
    assert abs(fd) > 1e-2  # the direction moves log Z: the check has something to measure
    assert analytic == pytest.approx(coef * fd, rel=2e-3)


# ---- every optimizer through the real training step ------------------------------------------------------------

STEP_CASES = {
    "adamw+z_loss+bf16_state": ["train.z_loss=1e-2", "train.opt_state_dtype=bfloat16"],
    "muon": ["train.optimizer=muon", "train.z_loss=1e-4"],
    "lion": ["train.optimizer=lion", "train.learning_rate=3e-3"],
    "adafactor": ["train.optimizer=adafactor"],
}


def _unequal_batch(config):
    """One batch whose 4 microbatches hold very unequal token counts (as in tests/test_train.py)."""
    batch = next(build_data(config).train)
    batch["segment_ids"][0:2, 10:] = 0
    batch["weights"][0:2, 10:] = 0
    batch["segment_ids"][2:4] = 0
    batch["weights"][2:4] = 0
    return batch


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_microbatches_and_non_finite_halt_for_every_optimizer(case):
    config = load_config("tiny", STEP_CASES[case])
    batch = _unequal_batch(config)
    graphdef, params, rest = init_params(config.model, 0)
    outs = []
    for c in (config, apply_overrides(config, ["train.microbatches=4"])):
        state = init_train_state(params, make_optimizer(c.train), 0)
        state = jax.tree.map(lambda x: x.copy(), state)  # the step donates its input state
        new, metrics = compiled_train_step(c.model, c.train, graphdef)(state, rest, batch)
        outs.append((jax.device_get(new), jax.device_get(metrics)))
    (s1, m1), (s4, m4) = outs
    assert float(m1["lr"]) == float(learning_rate_schedule(config.train)(0))  # the logged lr of step 1
    assert ("z_loss" in m1) == (config.train.z_loss > 0)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=2e-6)
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=1e-5)
    if "z_loss" in m1:  # normalised by the whole batch's tokens too, not averaged per microbatch
        np.testing.assert_allclose(m4["z_loss"], m1["z_loss"], rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves((s4.params, s4.opt_state)), jax.tree.leaves((s1.params, s1.opt_state)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)

    # A non-finite step is skipped whole: parameters AND optimizer state stay as they were, the step is named.
    state = init_train_state(params, make_optimizer(config.train), 0)
    state.params["final_norm"]["scale"] = state.params["final_norm"]["scale"].at[0].set(jnp.nan)
    before = jax.device_get(state)
    new, _ = compiled_train_step(config.model, config.train, graphdef)(
        jax.tree.map(lambda x: x.copy(), state), rest, batch
    )
    new = jax.device_get(new)
    assert int(new.bad_step) == 1 and int(new.step) == 0
    kept = lambda s: jax.tree.leaves((s.params, s.opt_state, s.rng))  # noqa: E731
    for a, b in zip(kept(new), kept(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_hyperparameters_are_traced_so_a_change_does_not_recompile():
    """An lr sweep (or any other hyperparameter change) reuses the compiled step, and each value really reaches
    the step: the same program gives different parameters for each changed value."""
    config = load_config("tiny", [*STEP_CASES["muon"], "train.warmup_steps=1"])  # step 2 is on the cosine
    batch = _unequal_batch(config)
    graphdef, params, rest = init_params(config.model, 0)
    program = train_step_program(config.model, config.train, graphdef)

    def two_steps(c):
        assert train_step_program(c.model, c.train, graphdef) is program
        step = compiled_train_step(c.model, c.train, graphdef)
        state = jax.tree.map(lambda x: x.copy(), init_train_state(params, make_optimizer(c.train), 0))
        for _ in range(2):
            state, _ = step(state, rest, batch)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(state.params))])

    base = two_steps(config)
    compiled = program._cache_size()
    changes = [
        "train.learning_rate=2e-3",
        "train.warmup_steps=2",
        "train.steps=50",
        "train.min_lr_ratio=0.5",
        "train.weight_decay=0.5",
        "train.beta1=0.5",
        "train.beta2=0.5",
        "train.muon_momentum=0.5",
        "train.z_loss=0.1",
        "train.grad_clip=1e-3",
    ]
    for change in changes:
        assert not np.array_equal(two_steps(apply_overrides(config, [change])), base), change
    assert program._cache_size() == compiled == 1


# ---- one short run per optimizer: learns, resumes exactly after SIGKILL ---------------------------------------

N = 50  # 2N steps; the child is killed in the middle of saving step 2N, the resume starts from step N
RUN = [
    f"train.steps={2 * N}",
    f"train.checkpoint_every={N}",
    f"train.eval_every={N}",
    "train.log_every=5",
    "train.progress=false",
    "train.sample_tokens=0",
]
RESUME_CASES = {
    "muon+z_loss": ["train.optimizer=muon", "train.z_loss=1e-4"],
    "lion+bf16_state": [
        "train.optimizer=lion",
        "train.learning_rate=3e-3",
        "train.beta2=0.99",
        "train.opt_state_dtype=bfloat16",
    ],
    "adafactor": ["train.optimizer=adafactor"],
}


def _unigram_loss() -> float:
    """The best context-free predictor's loss on the built-in corpus (its byte entropy, nats)."""
    text = np.frombuffer("".join(builtin_documents()).encode(), np.uint8)
    p = np.bincount(text, minlength=256) / len(text)
    return float(-(p[p > 0] * np.log(p[p > 0])).sum())


def _tensorboard_tags(directory) -> set:
    """Scalar tags in the TensorBoard event files of `directory` (TFRecord framing read by hand)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for name in os.listdir(directory):
        if not name.startswith("events.out.tfevents"):
            continue
        data = open(os.path.join(directory, name), "rb").read()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            tags.update(v.tag for v in event.summary.value)
            i += 12 + n + 4
    return tags


def _run_child_until_killed(tmp_path, workdir, overrides):
    # killed in the middle of writing the checkpoint of the last step
    lines = kill_child_at(tmp_path, CHILD, [workdir, N, *overrides])
    assert lines[-2:] == [f"SAVED {N}", f"SAVING {2 * N}"]


def _restore(directory, step, config):
    _, params, _ = init_params(config.model, 0)
    state = init_train_state(params, make_optimizer(config.train), 0)
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return ckpt.restore(
            step, state.params, {k: getattr(state, k) for k in ("opt_state", "step", "rng", "bad_step")}
        )
    finally:
        ckpt.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_each_optimizer_learns_and_resumes_exactly_after_sigkill(case, tmp_path):
    overrides = [*RUN, *RESUME_CASES[case]]
    config = load_config("tiny", overrides)
    workdir = str(tmp_path / "run")
    _run_child_until_killed(tmp_path, workdir, overrides)
    # The child got through all 2N steps (its metrics are the uninterrupted run's) and was killed while saving
    # the last checkpoint: its files are complete in orbax's temporary directory, only the commit is missing.
    # A copy of them under the final name is the uninterrupted run's state.
    straight = read_metrics(workdir)
    ckdir = os.path.join(workdir, CHECKPOINT_DIR)
    (partial,) = [d for d in os.listdir(ckdir) if d.startswith(f"{2 * N}.") and "tmp" in d]
    reference = tmp_path / "straight"
    shutil.copytree(os.path.join(ckdir, partial), reference / CHECKPOINT_DIR / str(2 * N))
    shutil.rmtree(os.path.join(ckdir, partial))
    assert Checkpointer(workdir, read_only=True).latest_step() == N

    train_and_evaluate(config, workdir)  # the same command again: resumes from step N

    resumed = read_metrics(workdir)
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "val_bpb", "z_loss")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in straight]
    (p1, s1, _), (p2, s2, _) = _restore(str(reference), 2 * N, config), _restore(workdir, 2 * N, config)
    leaves1, leaves2 = jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))
    assert len(leaves1) == len(leaves2) > 10
    for a, b in zip(leaves1, leaves2, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise: params, optimizer state, step, RNG
    # It learned: below the best context-free predictor.
    final = [r for r in resumed if "val_loss" in r][-1]
    assert final["step"] == 2 * N and final["val_loss"] < _unigram_loss(), final

    if config.train.z_loss > 0:  # logged apart from the cross entropy, in metrics.jsonl and TensorBoard
        assert all(0 < r["z_loss"] < 1 for r in resumed)
        assert "train/z_loss" in _tensorboard_tags(os.path.join(workdir, "tb"))
    if case == "lion+bf16_state":
        assert s2["opt_state"][1][0].mu["embed"].dtype == jnp.bfloat16  # chain(clip, lion): Lion's momentum
        # Resuming under another optimizer is refused before anything runs or changes.
        before = open(os.path.join(workdir, "metrics.jsonl")).read()
        other = load_config("tiny", [*RUN, "train.optimizer=muon"])
        with pytest.raises(ConfigError, match=r"train.optimizer: 'lion' -> 'muon'.*opt_state_dtype: 'bfloat16'"):
            train_and_evaluate(other, workdir)
        assert main(["train", "--config", "tiny", *RUN, "train.optimizer=adamw", "--workdir", workdir]) == 2
        assert open(os.path.join(workdir, "metrics.jsonl")).read() == before
        assert Checkpointer(workdir, read_only=True).all_steps() == [N, 2 * N]


def test_bad_optimizer_settings_fail_at_the_config():
    for override, message in [
        ("train.optimizer=sgd", "train.optimizer must be one of"),
        ("train.opt_state_dtype=float16", "train.opt_state_dtype must be one of"),
        ("train.z_loss=-1", "train.z_loss must be >= 0"),
        ("train.muon_momentum=1.0", "train.muon_momentum must be in"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config("tiny", [override])
