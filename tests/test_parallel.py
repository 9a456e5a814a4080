"""Sharded == single device: the mesh, the partition rules, training steps on four mesh shapes (MHA and GQA),
generation, checkpoints restored onto other meshes, resume onto another mesh, two real processes against one,
and the launch scripts' dry runs.

This process keeps its single CPU device. Multi-device cases run in subprocesses: tests/parallel_worker.py with
8 simulated devices (all mesh cases in one process, results as JSON), and `causal-lm train` in 2 processes x 2
devices connected by `jax.distributed` on localhost, all started together so their compiles overlap.
Subprocesses compile at XLA's optimisation level 0 without the CPU fusion emitters (a third of the compile time of
these tiny programs, which is most of this file's time); each comparison is between programs compiled with the
same flags. A deliberately broken data split (every process reading the first rows of each batch) fails the
two-process test by 0.04 in the loss.
"""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from causal_lm import parallel
from causal_lm.cli import main
from causal_lm.config import MeshConfig, ModelConfig, TrainConfig, load_config
from causal_lm.model import build_model, init_cache
from causal_lm.parallel import MeshError
from causal_lm.train.state import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_COMPILE = (  # as tests/conftest.py
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
MESHES = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1)]
ATOL = 1e-5


def _env(devices: int) -> dict:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_DEFAULT_MATMUL_PRECISION="highest",
        PYTHONPATH=ROOT,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
    )
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _abstract_params(config: ModelConfig) -> dict:
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(config, 0)), nnx.Param))


def _specs(tree, mesh) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(parallel.tree_shardings(tree, mesh))[0]
    return {jax.tree_util.keystr(p): s.spec for p, s in flat}


# ---- the mesh and the rules (this process, no devices needed) ------------------------------------------------


def test_mesh_shape_resolves_the_rest_and_rejects_what_does_not_fit():
    assert parallel.mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert parallel.mesh_shape(MeshConfig(fsdp=2), 8) == (4, 2, 1)
    assert parallel.mesh_shape(MeshConfig(data=2, fsdp=2, tensor=2), 8) == (2, 2, 2)
    assert parallel.mesh_shape(MeshConfig(data=1, fsdp=-1), 8) == (1, 8, 1)
    assert parallel.mesh_shape(MeshConfig(), 1) == (1, 1, 1)
    with pytest.raises(MeshError, match=r"does not fit 8 device\(s\): mesh.fsdp=3 x mesh.tensor=1 = 3"):
        parallel.mesh_shape(MeshConfig(fsdp=3), 8)
    with pytest.raises(MeshError, match="only one of"):
        parallel.mesh_shape(MeshConfig(data=-1, fsdp=-1), 8)
    with pytest.raises(MeshError, match="needs 4 devices but 8"):
        parallel.mesh_shape(MeshConfig(data=2, fsdp=2), 8)
    with pytest.raises(MeshError, match="positive integer or -1"):
        parallel.mesh_shape(MeshConfig(tensor=0), 8)


def test_one_device_takes_the_unsharded_path_and_a_bigger_mesh_is_an_error():
    assert parallel.training_mesh(MeshConfig()) is None  # the default run: no shardings at all
    config = load_config("tiny", ["mesh.fsdp=2"])
    with pytest.raises(MeshError, match=r"mesh.fsdp=2 x mesh.tensor=1 = 2 does not divide 1"):
        parallel.training_mesh(config.mesh)


VARIANTS = {
    "mha+bias+sink": ModelConfig(
        vocab_size=256, d_model=64, num_layers=2, num_heads=4, mlp_dim=128, qkv_bias=True, attn_sink=True
    ),
    "gqa+gate+untied": ModelConfig(
        vocab_size=259,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=128,
        attn_output_gate=True,
        tie_embeddings=False,
    ),
    "mqa+learned": ModelConfig(
        vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=1, mlp_dim=128, position="learned"
    ),
    "mla": ModelConfig(
        vocab_size=256,
        d_model=64,
        num_layers=2,
        num_heads=4,
        mlp_dim=128,
        attention_type="mla",
        kv_lora_rank=16,
        attn_output_gate=True,
        attn_sink=True,
    ),
    "mla+q_lora": ModelConfig(
        vocab_size=256,
        d_model=64,
        num_layers=2,
        num_heads=4,
        mlp_dim=128,
        attention_type="mla",
        kv_lora_rank=16,
        q_lora_rank=24,
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_parameter_has_a_partition_rule(name):
    assert parallel.unmatched_params(_abstract_params(VARIANTS[name])) == []


def test_partition_rules_on_a_2x2x2_mesh():
    mesh = AbstractMesh((2, 2, 2), parallel.AXES)
    gqa = _specs(_abstract_params(VARIANTS["gqa+gate+untied"]), mesh)
    assert gqa["['blocks']['attn']['wq']"] == P(None, "fsdp", "tensor")  # [L, D, N, H]
    assert gqa["['blocks']['attn']['wk']"] == P(None, "fsdp", "tensor")  # 2 KV heads over tensor=2
    assert gqa["['blocks']['attn']['wo']"] == P(None, "tensor", None, "fsdp")  # [L, N, H, D]
    assert gqa["['blocks']['attn']['wg']"] == P(None, "fsdp", "tensor")
    assert gqa["['blocks']['mlp']['w_gate']"] == P(None, "fsdp", "tensor")  # [L, D, F]
    assert gqa["['blocks']['mlp']['w_down']"] == P(None, "tensor", "fsdp")  # [L, F, D]
    assert gqa["['blocks']['attn_norm']['scale']"] == P()
    # A vocabulary of 259 does not divide over tensor=2: that dim stays whole, D is still split over fsdp.
    assert gqa["['embed']"] == P(None, "fsdp")
    assert gqa["['lm_head']"] == P("fsdp")
    mha = _specs(_abstract_params(VARIANTS["mha+bias+sink"]), mesh)
    assert mha["['embed']"] == P("tensor", "fsdp")  # 256 divides
    assert mha["['blocks']['attn']['bk']"] == P(None, "tensor")
    assert mha["['blocks']['attn']['sink']"] == P(None, "tensor")
    mla = _specs(_abstract_params(VARIANTS["mla+q_lora"]), mesh)
    assert mla["['blocks']['attn']['wkv_a']"] == P(None, "fsdp")  # [L, D, R + Hr]: the latent is not split
    assert mla["['blocks']['attn']['wk_b']"] == P(None, None, "tensor")  # [L, R, N, Hn]
    assert mla["['blocks']['attn']['wq_b']"] == P(None, None, "tensor")


def test_kv_heads_fall_back_to_replicated_when_fewer_than_tensor():
    mqa = _specs(_abstract_params(VARIANTS["mqa+learned"]), AbstractMesh((2, 2, 2), parallel.AXES))
    assert mqa["['blocks']['attn']['wk']"] == P(None, "fsdp")  # 1 KV head: replicated over tensor
    assert mqa["['blocks']['attn']['wq']"] == P(None, "fsdp", "tensor")  # query heads still split
    assert mqa["['pos_embed']"] == P(None, "fsdp")
    gqa = _specs(_abstract_params(VARIANTS["gqa+gate+untied"]), AbstractMesh((1, 2, 4), parallel.AXES))
    assert gqa["['blocks']['attn']['wk']"] == P(None, "fsdp")  # 2 KV heads < tensor=4
    assert gqa["['blocks']['attn']['wq']"] == P(None, "fsdp", "tensor")  # 4 query heads over 4


def test_optimizer_state_follows_its_parameter():
    mesh = AbstractMesh((2, 2, 2), parallel.AXES)
    params = _abstract_params(VARIANTS["gqa+gate+untied"])
    opt_state = jax.eval_shape(make_optimizer(TrainConfig()).init, params)
    adam = opt_state[1][0]
    specs = parallel.tree_shardings(adam, mesh)
    assert specs.mu["blocks"]["attn"]["wq"].spec == P(None, "fsdp", "tensor")
    assert specs.nu["blocks"]["mlp"]["w_down"].spec == P(None, "tensor", "fsdp")
    assert specs.count.spec == P()


def test_batch_and_cache_are_split_over_data_and_fsdp_where_they_divide():
    mesh = AbstractMesh((2, 2, 2), parallel.AXES)
    assert parallel.logical_spec(("batch", None), (16, 64), mesh) == P(("data", "fsdp"))
    assert parallel.logical_spec(("batch", None), (6, 64), mesh) == P("data")  # 6 rows: over data only
    assert parallel.logical_spec(("batch", None), (1, 64), mesh) == P()  # one prompt: replicated
    gqa = init_cache(ModelConfig(d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128), 4, 16)
    (sh,) = parallel.cache_shardings(jax.eval_shape(lambda: gqa), mesh).groups
    assert sh.arrays["k"].spec == P(None, ("data", "fsdp"), None, "tensor")  # [L, B, S, K, H]
    assert sh.positions.spec == P(("data", "fsdp"))  # [B, S]
    assert parallel.cache_shardings(gqa, mesh).lengths.spec == P(("data", "fsdp"))
    mqa = init_cache(ModelConfig(d_model=64, num_heads=4, num_kv_heads=1, mlp_dim=128), 4, 16, "int8")
    (sh,) = parallel.cache_shardings(mqa, mesh).groups
    assert sh.arrays["v"].spec == P(None, ("data", "fsdp"))  # K=1: replicated heads
    assert sh.arrays["v_scale"].spec == P(None, ("data", "fsdp"))
    mla = init_cache(VARIANTS["mla"], 4, 16)
    assert parallel.cache_shardings(mla, mesh).groups[0].arrays["latent"].spec == P(None, ("data", "fsdp"))


# ---- multi-host start-up ---------------------------------------------------------------------------------------

LAUNCH_ENV = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16"}, "slurm"),
        ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "16"}, None),  # the batch script, not srun
        ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, None),  # srun -n1
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "tpu"),
        ({"TPU_WORKER_HOSTNAMES": "w0"}, None),  # a single-host slice
        ({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "env"),
    ],
)
def test_launcher_detection(monkeypatch, env, expected):
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert parallel.detect_launcher() == expected


def test_initialize_distributed_without_a_launcher_or_with_partial_flags(monkeypatch):
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    assert parallel.initialize_distributed() is False  # a plain single-process run
    assert parallel.initialize_distributed("localhost:1", 1, 0) is False  # one process: nothing to connect
    with pytest.raises(MeshError, match="go together"):
        parallel.initialize_distributed("localhost:1", None, 0)
    with pytest.raises(MeshError, match=r"--process-id must be in \[0, 2\)"):
        parallel.initialize_distributed("localhost:1", 2, 2)
    assert jax.process_count() == 1


def test_cli_train_rejects_partial_coordinator_flags(tmp_path, capsys):
    assert main(["train", "--config", "tiny", "--workdir", str(tmp_path), "--coordinator", "localhost:1"]) == 2
    assert "--num-processes" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


# ---- launch scripts ------------------------------------------------------------------------------------------


def _dry_run(cmd, **env):
    out = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in dict(os.environ, **env).items() if not k.startswith("SLURM_")},
    )
    assert out.returncode == 0, out.stderr
    return [line[2:] for line in out.stdout.splitlines() if line.startswith("+ ")], out.stdout


def test_tpu_vm_dry_run_prints_create_install_and_the_same_train_command_on_all_workers():
    cmds, text = _dry_run(
        [
            "bash",
            "launch/tpu_vm.sh",
            "--dry-run",
            "--name",
            "lm",
            "--zone",
            "us-central2-b",
            "--type",
            "v4-16",
            "--bucket",
            "my-bucket",
            "--",
            "--config",
            "small",
            "--workdir",
            "~/gcs/runs/small",
            "mesh.fsdp=4",
        ]
    )
    assert cmds[0] == "gcloud compute tpus tpu-vm describe lm --zone us-central2-b"
    assert cmds[1] == (
        "gcloud compute tpus tpu-vm create lm --zone us-central2-b --accelerator-type v4-16 "
        "--version tpu-ubuntu2204-base"
    )
    assert cmds[2].startswith("tar -czf ")
    assert re.match(r"gcloud compute tpus tpu-vm scp \S+\.tar\.gz 'lm:~/causal_lm\.tar\.gz' --worker=all", cmds[3])
    assert cmds[4].startswith("gcloud compute tpus tpu-vm ssh lm --worker=all --zone us-central2-b --command '")
    assert '.venv/bin/pip install -q -e ".[tpu]"' in cmds[4] and "gcsfuse --implicit-dirs my-bucket ~/gcs" in cmds[4]
    assert cmds[5] == (
        "gcloud compute tpus tpu-vm ssh lm --worker=all --zone us-central2-b --command 'cd "
        "~/causal_lm && .venv/bin/causal-lm train --distributed --config small --workdir "
        "~/gcs/runs/small mesh.fsdp=4'"
    )
    assert len(cmds) == 6 and "nothing was created" in text
    # DRY_RUN=1 does the same; without --bucket the default workdir is local (single-worker slices).
    cmds, _ = _dry_run(["bash", "launch/tpu_vm.sh"], DRY_RUN="1", TPU_NAME="solo", ACCELERATOR_TYPE="v4-8")
    assert "gcsfuse" not in cmds[4] and cmds[5].endswith("--distributed --config small --workdir runs/solo'")


def test_slurm_dry_run_prints_install_and_one_srun_task_per_gpu():
    cmds, text = _dry_run(
        [
            "bash",
            "launch/slurm_gpu.sbatch",
            "--dry-run",
            "--config",
            "small",
            "--workdir",
            "runs/small-2n",
            "mesh.fsdp=8",
        ]
    )
    assert cmds == [
        "srun --nodes=1 --ntasks=1 bash launch/_venv.sh gpu",
        "srun --nodes=2 --ntasks=16 --ntasks-per-node=8 --kill-on-bad-exit=1 .venv/bin/causal-lm "
        "train --config small --workdir runs/small-2n mesh.fsdp=8",
    ]
    assert "16 JAX processes" in text
    cmds, _ = _dry_run(["bash", "launch/slurm_gpu.sbatch"], DRY_RUN="1")
    assert cmds[1].endswith("train --config small --workdir runs/slurm-local")


# ---- the multi-device subprocesses, started together ----------------------------------------------------------
# The 8-device worker and the 2+1 `causal-lm train` processes of the two-process test are started at once (for
# whichever of their tests are selected) so that their compiles overlap on the machine's cores.

MESH_TESTS = {
    "test_train_step_on_a_mesh_equals_one_device",
    "test_sharded_initialisation_equals_one_device",
    "test_generation_on_a_mesh_gives_the_same_tokens",
    "test_speculative_decoding_on_a_mesh_gives_the_same_tokens",
    "test_checkpoint_saved_on_4x2_restores_onto_another_mesh",
    "test_training_loop_resumes_onto_a_different_mesh",
}
MP_TEST = "test_two_processes_train_like_one"

MP_OVERRIDES = [
    "model.d_model=32",
    "model.num_layers=1",
    "model.mlp_dim=64",
    "model.max_seq_len=32",
    "data.max_documents=40",
    "train.batch_size=8",
    "train.seq_len=16",
    "train.eval_batches=1",
    "train.steps=3",
    "train.log_every=1",
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "train.learning_rate=1e-3",
    "train.warmup_steps=1",
    "train.sample_tokens=4",
    "train.sample_temperature=0",
    "train.progress=true",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _popen(cmd, devices: int):
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def background(request, tmp_path_factory):
    selected = {getattr(item, "originalname", item.name) for item in request.session.items}
    jobs = {}
    if selected & MESH_TESTS:
        root = tmp_path_factory.mktemp("mesh")
        jobs["mesh"] = [_popen([sys.executable, os.path.join(ROOT, "tests", "parallel_worker.py"), str(root)], 8)]
    if MP_TEST in selected:
        root = tmp_path_factory.mktemp("multiprocess")
        multi, single = str(root / "multi"), str(root / "single")
        port = _free_port()
        cli = [sys.executable, "-m", "causal_lm.cli", "train", "--config", "tiny"] + MP_OVERRIDES
        jobs["mp"] = [
            _popen(
                cli
                + [
                    "mesh.fsdp=2",
                    "--workdir",
                    multi,
                    "--coordinator",
                    f"localhost:{port}",
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                ],
                2,
            )
            for i in range(2)
        ]
        jobs["mp"].append(_popen(cli + ["--workdir", single], 1))
        jobs["mp_dirs"] = (multi, single)
    yield jobs
    for key in ("mesh", "mp"):
        for proc in jobs.get(key, []):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _finish(procs, timeout=900):
    return [p.communicate(timeout=timeout) for p in procs]


@pytest.fixture(scope="module")
def mesh_results(background):
    (proc,) = background["mesh"]
    stdout, stderr = _finish([proc])[0]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("shape", MESHES)
def test_train_step_on_a_mesh_equals_one_device(mesh_results, kind, shape):
    r = mesh_results[f"step/{kind}/{tuple(shape)}"]
    assert r["devices"] == 8
    assert r["loss_diff"] <= ATOL, (r["losses"], r["ref_losses"])
    assert r["param_diff"] <= ATOL and r["opt_diff"] <= ATOL
    # The layout really is the partition rules' (wq [L, D, N, H]; Adam's moments follow it).
    expected = {
        (8, 1, 1): P(),
        (4, 2, 1): P(None, "fsdp"),
        (2, 2, 2): P(None, "fsdp", "tensor"),
        (1, 8, 1): P(None, "fsdp"),
    }[shape]
    assert r["wq_spec"] == r["mu_wq_spec"] == str(expected)


@pytest.mark.slow
def test_sharded_initialisation_equals_one_device(mesh_results):
    assert mesh_results["sharded_init_diff"] == 0.0
    assert mesh_results["sharded_init_wq_spec"] == str(P(None, "fsdp", "tensor"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gqa/(2, 2, 2)", "mqa/(4, 1, 2)"])
def test_generation_on_a_mesh_gives_the_same_tokens(mesh_results, case):
    r = mesh_results[f"generate/{case}"]
    assert r["got"] == r["ref"]
    assert len({tuple(row) for row in r["ref"]}) > 1  # not a degenerate model
    assert r["wk_spec"] == (str(P(None, "fsdp", "tensor")) if case.startswith("gqa") else str(P()))


@pytest.mark.slow
def test_speculative_decoding_on_a_mesh_gives_the_same_tokens(mesh_results):
    r = mesh_results["generate/speculative"]
    assert r["self"] == r["ref"] and r["ngram"] == r["ref"]


@pytest.mark.slow
@pytest.mark.parametrize("target, devices", [("one_device", 1), ("mesh_211", 2), ("mesh_121", 2)])
def test_checkpoint_saved_on_4x2_restores_onto_another_mesh(mesh_results, target, devices):
    r = mesh_results[f"restore/{target}"]
    assert r["exact"] and r["leaves"] > 10
    assert r["devices"] == [devices]
    if target == "mesh_121":
        assert r["wq_spec"] == str(P(None, "fsdp"))  # re-split over the new fsdp axis
    assert mesh_results["load_for_inference/mesh_211"] == {"exact": True, "devices": [2]}


@pytest.mark.slow
def test_training_loop_resumes_onto_a_different_mesh(mesh_results):
    r = mesh_results["loop"]
    assert r["steps"] == [1, 2, 3, 4]
    assert r["loss_diff"] <= ATOL and r["val_diff"] <= ATOL and r["param_diff"] <= ATOL
    assert r["losses"][-1] < r["losses"][0]


# ---- two processes x 2 devices against one process -----------------------------------------------------------

PROBE = r"""
import sys
import jax
from causal_lm import parallel
parallel.initialize_distributed(sys.argv[1], 2, int(sys.argv[2]))
import jax.numpy as jnp
x = jax.make_array_from_process_local_data(
    jax.sharding.NamedSharding(jax.make_mesh((4,), ("d",)), jax.sharding.PartitionSpec("d")), jnp.ones(2))
print(float(jax.jit(jnp.sum)(x)))
"""


def _multiprocess_unsupported() -> str:
    """Why 2 CPU processes cannot run a collective here, or "" when they can."""
    port = _free_port()
    procs = [_popen([sys.executable, "-c", PROBE, f"localhost:{port}", str(i)], 2) for i in range(2)]
    outs = _finish(procs, 120)
    if all(p.returncode == 0 and o[0].strip().endswith("4.0") for p, o in zip(procs, outs, strict=True)):
        return ""
    return "jax.distributed on localhost with 2 CPU processes fails here: " + outs[0][1].strip()[-500:]


def _load_params(workdir):
    from causal_lm.train import load_for_inference

    model, _, _ = load_for_inference(workdir)
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.slow
def test_two_processes_train_like_one(background):
    """`causal-lm train` in 2 processes x 2 CPU devices (mesh data=2 x fsdp=2: parameters split across the
    processes, each process feeding its half of every batch) equals one process on one device: per-step
    losses, validation loss, the greedy eval sample (generation across processes) and the saved parameters."""
    from causal_lm.train import read_metrics

    *procs, ref = background["mp"]
    multi, single = background["mp_dirs"]
    outs = _finish(procs)
    ref_out = _finish([ref])[0]
    assert ref.returncode == 0, ref_out[1][-3000:]
    if any(p.returncode != 0 for p in procs):
        reason = _multiprocess_unsupported()
        if reason:
            pytest.skip(reason)
        raise AssertionError(
            "\n\n".join(
                f"process {i} (rc {p.returncode}):\n{o[1][-4000:]}"
                for i, (p, o) in enumerate(zip(procs, outs, strict=True))
            )
        )
    # Only process 0 logs; both ran on the 4 devices of the 2 processes.
    assert "devices: mesh data=2, fsdp=2, tensor=1 over 4 cpu devices in 2 processes" in outs[0][1]
    assert "step 3" in outs[0][1] and "done: step 3" in outs[0][0]
    assert "step 3" not in outs[1][1] and "done:" not in outs[1][0]

    a, b = read_metrics(multi), read_metrics(single)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) <= ATOL
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) <= ATOL
    assert a[-1]["sample"] == b[-1]["sample"]
    pa, pb = _load_params(multi), _load_params(single)
    assert (
        max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True)) <= ATOL
    )
