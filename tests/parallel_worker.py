"""The multi-device half of tests/test_parallel.py, run as a subprocess with 8 simulated CPU devices (the pytest
process keeps its single device). Every mesh case runs here in one process, so the shared setup and the
single-device references are built once; the results are printed as one JSON line after "RESULT ".

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel_worker.py WORKDIR
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from causal_lm import parallel  # noqa: E402
from causal_lm.config import Config, MeshConfig, ModelConfig, TrainConfig, config_to_dict, load_config  # noqa: E402
from causal_lm.data.tokenizer import tokenizer_from_spec  # noqa: E402
from causal_lm.decode import generate  # noqa: E402
from causal_lm.model import build_model  # noqa: E402
from causal_lm.train import Checkpointer, load_for_inference, read_metrics, train_and_evaluate  # noqa: E402
from causal_lm.train.state import (  # noqa: E402
    init_params,
    init_sharded_train_state,
    init_train_state,
    make_optimizer,
    train_state_shardings,
)
from causal_lm.train.step import compiled_train_step  # noqa: E402

MESHES = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1)]
STATE_KEYS = ("opt_state", "step", "rng", "bad_step")
# lr 1e-3: Adam divides each update by its own gradient's magnitude, so for a gradient entry near zero the
# rounding difference of a reordered (sharded) sum becomes a visible change of that entry's update, bounded by lr;
# at 1e-2 one entry of w_up moved 1.8e-5, at 1e-3 the largest difference is ~10x under the 1e-5 tolerance.
TRAIN = TrainConfig(batch_size=8, seq_len=16, steps=10, learning_rate=1e-3, warmup_steps=1)


def model_config(kind: str) -> ModelConfig:
    """Tiny variants; the vocabulary (67) is odd on purpose: it cannot be split over tensor=2 (the fallback)."""
    base = dict(vocab_size=67, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_seq_len=32)
    if kind == "mha":  # + q/k/v biases and sink logits: their rules are exercised too
        return ModelConfig(**base, qkv_bias=True, attn_sink=True)
    if kind == "gqa":  # + an untied LM head and the output gate
        return ModelConfig(**base, num_kv_heads=2, tie_embeddings=False, attn_output_gate=True)
    if kind == "mqa":  # one K/V head < tensor size: wk/wv and the cached K/V are replicated over tensor
        return ModelConfig(**base, num_kv_heads=1, tie_embeddings=False)
    raise ValueError(kind)


def batches(n: int = 2):
    """Packed rows: two documents per row (segment ids 1, 2), so the mask and loss weights matter."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tok = rng.integers(0, 67, (TRAIN.batch_size, TRAIN.seq_len + 1)).astype(np.int32)
        seg = np.where(np.arange(TRAIN.seq_len + 1) < 7, 1, 2)[None].repeat(TRAIN.batch_size, 0).astype(np.int32)
        w = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
        out.append({"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": seg[:, :-1], "weights": w})
    return out


def max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def spec(x) -> str:
    return str(x.sharding.spec)


def train_steps(mc: ModelConfig, mesh, data):
    """(losses, state) after len(data) steps from the same initial state, unsharded (mesh None) or on `mesh`."""
    graphdef, params, rest = init_params(mc, 0)
    state = init_train_state(params, make_optimizer(TRAIN), 0)
    if mesh is not None:
        state = parallel.shard_tree(state, train_state_shardings(mc, TRAIN, mesh)[0])
    step = compiled_train_step(mc, TRAIN, graphdef, mesh)
    losses = []
    for b in data:
        if mesh is not None:
            b = parallel.shard_local_batch(b, mesh, TRAIN.batch_size)
        state, metrics = step(state, rest, b)
        losses.append(float(metrics["loss"]))
    return losses, state


def case_train_steps(out: dict) -> dict:
    data = batches()
    kept = {}
    for kind in ("mha", "gqa"):
        mc = model_config(kind)
        ref_losses, ref_state = train_steps(mc, None, data)
        ref_host = jax.device_get((ref_state.params, ref_state.opt_state))
        for shape in MESHES:
            mesh = parallel.make_mesh(MeshConfig(*shape))
            losses, state = train_steps(mc, mesh, data)
            out[f"step/{kind}/{shape}"] = {
                "loss_diff": float(np.max(np.abs(np.array(losses) - ref_losses))),
                "param_diff": max_diff(jax.device_get(state.params), ref_host[0]),
                "opt_diff": max_diff(jax.device_get(state.opt_state), ref_host[1]),
                "losses": losses,
                "ref_losses": ref_losses,
                "wq_spec": spec(state.params["blocks"]["attn"]["wq"]),
                "wk_spec": spec(state.params["blocks"]["attn"]["wk"]),
                "embed_spec": spec(state.params["embed"]),
                "mu_wq_spec": spec(state.opt_state[1][0].mu["blocks"]["attn"]["wq"]),
                "devices": len(state.params["embed"].sharding.device_set),
            }
            if kind == "gqa" and shape == (4, 2, 1):
                kept = {"state": state, "ref": ref_host, "config": mc}
    # Initialising straight into the shardings gives the same numbers as on one device.
    mc = model_config("gqa")
    _, ref_params, _ = init_params(mc, 0)
    _, state, _ = init_sharded_train_state(mc, TRAIN, 0, parallel.make_mesh(MeshConfig(2, 2, 2)))
    out["sharded_init_diff"] = max_diff(jax.device_get(state.params), jax.device_get(ref_params))
    out["sharded_init_wq_spec"] = spec(state.params["blocks"]["attn"]["wq"])
    return kept


def case_generate(out: dict) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 14, 15, 16]]
    for kind, shape in (("gqa", (2, 2, 2)), ("mqa", (4, 1, 2))):
        model = build_model(model_config(kind), 1)
        ref = generate(model, prompts, max_new_tokens=6).tokens
        mesh = parallel.make_mesh(MeshConfig(*shape))
        # The weights laid out on the mesh: generate finds the mesh from them.
        graphdef, state = nnx.split(model)
        sharded = nnx.merge(graphdef, parallel.shard_tree(state, parallel.tree_shardings(state, mesh)))
        got = generate(sharded, prompts, max_new_tokens=6).tokens
        out[f"generate/{kind}/{shape}"] = {"ref": ref, "got": got, "wk_spec": spec(sharded.blocks.attn.wk[...])}
        if kind == "gqa":  # speculative decoding on the mesh: the sharded model as its own draft, and prompt lookup
            out["generate/speculative"] = {
                "ref": ref,
                "self": generate(sharded, prompts, max_new_tokens=6, speculative=sharded, draft_tokens=3).tokens,
                "ngram": generate(sharded, prompts, max_new_tokens=6, speculative="ngram", draft_tokens=3).tokens,
            }


def case_checkpoint(out: dict, kept: dict, workdir: str) -> None:
    """Save the (4,2,1) state, restore it on 1 device and on a (2,1,1) mesh."""
    state, mc = kept["state"], kept["config"]
    saved = jax.device_get((state.params, {k: getattr(state, k) for k in STATE_KEYS}))
    config = Config(model=mc, train=TRAIN)
    meta = {"config": config_to_dict(config), "tokenizer": tokenizer_from_spec("byte").to_dict(), "data_state": None}
    ckpt = Checkpointer(workdir)
    ckpt.save(2, state.params, meta, train_state={k: getattr(state, k) for k in STATE_KEYS})
    ckpt.close()

    def on(shape, n):
        return lambda tree: parallel.tree_shardings(
            tree, parallel.make_mesh(MeshConfig(*shape), devices=jax.devices()[:n])
        )

    targets = {
        "one_device": lambda tree: jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), tree),
        "mesh_211": on((2, 1, 1), 2),
        "mesh_121": on((1, 2, 1), 2),
    }
    for name, shardings_of in targets.items():
        abstract = (state.params, {k: getattr(state, k) for k in STATE_KEYS})
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings_of(abstract)
        )
        reader = Checkpointer(workdir, read_only=True)
        params, train_state, _ = reader.restore(2, abstract[0], abstract[1])
        reader.close()
        restored = (params, train_state)
        exact = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved), strict=True)
        )
        out[f"restore/{name}"] = {
            "exact": exact,
            "leaves": len(jax.tree.leaves(restored)),
            "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(restored)}),
            "wq_spec": str(getattr(params["blocks"]["attn"]["wq"].sharding, "spec", None)),
        }

    mesh2 = parallel.make_mesh(MeshConfig(2, 1, 1), devices=jax.devices()[:2])
    model, _, _ = load_for_inference(workdir, mesh=mesh2)
    loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out["load_for_inference/mesh_211"] = {
        "exact": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(jax.device_get(loaded)), jax.tree.leaves(saved[0]), strict=True)
        ),
        "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(loaded)}),
    }


def case_loop(out: dict, root: str) -> None:
    """The training loop on a mesh, and a resume onto a different mesh shape equal to the uninterrupted run."""
    base = [
        "model.d_model=32",
        "model.num_layers=1",
        "model.mlp_dim=64",
        "model.max_seq_len=32",
        "data.max_documents=40",
        "train.batch_size=8",
        "train.seq_len=16",
        "train.eval_batches=1",
        "train.log_every=1",
        "train.eval_every=2",
        "train.checkpoint_every=2",
        "train.min_lr_ratio=1.0",
        "train.warmup_steps=1",
        "train.sample_tokens=0",
        "train.progress=false",
    ]
    straight, resumed = os.path.join(root, "straight"), os.path.join(root, "resumed")
    train_and_evaluate(load_config("tiny", base + ["train.steps=4", "mesh.fsdp=2"]), straight)
    train_and_evaluate(load_config("tiny", base + ["train.steps=2", "mesh.fsdp=2"]), resumed)
    train_and_evaluate(load_config("tiny", base + ["train.steps=4", "mesh.tensor=2"]), resumed)  # (4, 1, 2)
    a, b = read_metrics(straight), read_metrics(resumed)

    def params_of(workdir):
        config = load_config("tiny", base)
        model, _, _ = load_for_inference(workdir)
        return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))), config

    pa, _ = params_of(straight)
    pb, _ = params_of(resumed)
    out["loop"] = {
        "steps": [r["step"] for r in b],
        "losses": [r["loss"] for r in a],
        "loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)),
        "val_diff": max(abs(x["val_loss"] - y["val_loss"]) for x, y in zip(a, b, strict=True) if "val_loss" in x),
        "param_diff": max_diff(pa, pb),
    }


def main() -> None:
    root = sys.argv[1]
    assert jax.device_count() == 8, jax.devices()
    out: dict = {"seconds": {}}
    t = time.perf_counter()

    def lap(name):
        nonlocal t
        out["seconds"][name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()

    kept = case_train_steps(out)
    lap("train_steps")
    case_generate(out)
    lap("generate")
    case_checkpoint(out, kept, os.path.join(root, "ckpt"))
    lap("checkpoint")
    case_loop(out, root)
    lap("loop")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
