"""Device mesh, partition rules and multi-host start-up: everything that decides where an array lives.

The mesh has three named axes (sizes from the config keys mesh.data, mesh.fsdp, mesh.tensor; -1 = the rest):

    data    pure data parallelism: the batch is split, parameters are replicated.
    fsdp    the batch is split AND parameters / optimizer state are split along their model dim (D); XLA gathers
            a layer's weights where it uses them and reduce-scatters the gradients (ZeRO-3 / FSDP).
    tensor  Megatron-style tensor parallelism: query heads, K/V heads, the MLP hidden dim (F) and the vocabulary
            are split; activations are combined by XLA inside each block.

Nothing here is a runtime: the rules produce `NamedSharding`s, the jitted step and generation loop are compiled
with them (`jax.jit(..., out_shardings=...)`, `lax.with_sharding_constraint`), and XLA's SPMD partitioner
inserts the collectives. The same code runs on one CPU, on 8 simulated CPU devices and on a pod.

Partition rules (logical axes of each parameter, by its name; stacked block parameters get a leading layer axis
that is never split):

    embed [V, D]   vocab->tensor, embed->fsdp        lm_head [D, V]     embed->fsdp, vocab->tensor
    wq / wg [D, N, H]   embed, heads                 wk / wv [D, K, H]  embed, kv_heads
    wo [N, H, D]   heads, embed                      w_gate / w_up [D, F]  embed, mlp     w_down [F, D]  mlp, embed
    biases / sinks: their head axis                  norm scales: replicated
    MLA: wq_a / wkv_a [D, r] embed; wq_b / wk_b / wv_b [r, N, h] heads; the latent (r) is not split

    logical -> mesh axis:   vocab, heads, kv_heads, mlp -> tensor;   embed -> fsdp;   batch -> (data, fsdp)

A dimension that an axis size does not divide is left unsplit on that axis (replicated) instead of failing: a
vocabulary of 259 stays whole over tensor=2, a batch of 1 prompt is replicated. That is also the K/V-head
fallback: with num_kv_heads < tensor size (MQA, or GQA with few groups) wk/wv and the cached K/V are
REPLICATED over the tensor axis: every tensor shard computes all K/V heads (a small projection) while the query
heads stay split, so no shard ever needs a K/V head it does not hold. (Splitting head_dim instead would need an
all-reduce inside every attention score; replicating costs K/V-projection FLOPs and cache memory on each shard.)

Optimizer state follows the parameter it belongs to (matched by the parameter's name and shape inside the optax
state), scalars (step counts, RNG, flags) are replicated. The KV cache [L, B, S, K, H] is split over batch
(data x fsdp) and K/V heads (tensor), the MLA latent cache over batch only.

Multi-host: every host runs the same command; `initialize_distributed()` connects them through
`jax.distributed.initialize` (auto-detected under SLURM `srun`, Open MPI, a TPU pod with `--distributed`, or
given explicitly). Each host feeds only the batch rows its own devices hold (`process_rows`,
`shard_local_batch` via `jax.make_array_from_process_local_data`) and only process 0 writes logs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from causal_lm.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> the mesh axes it is split over (tried together first, then one at a time).
LOGICAL_AXES = {
    "batch": BATCH_AXES,
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
}

# Parameter name -> logical axes of its dims (without the leading layer axis of stacked blocks).
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "pos_embed": (None, "embed"),
    "lm_head": ("embed", "vocab"),
    "scale": (None,),  # RMSNorm gains
    # attention (MHA / GQA / MQA)
    "wq": ("embed", "heads", None),
    "wk": ("embed", "kv_heads", None),
    "wv": ("embed", "kv_heads", None),
    "wo": ("heads", None, "embed"),
    "wg": ("embed", "heads", None),  # output gate
    "bq": ("heads", None),
    "bk": ("kv_heads", None),
    "bv": ("kv_heads", None),
    "sink": ("heads",),
    # MLP (SwiGLU)
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    # MLA (its wq, wo and wg share the rules above)
    "wq_a": ("embed", None),
    "q_norm": (None,),
    "wq_b": (None, "heads", None),
    "wkv_a": ("embed", None),
    "kv_norm": (None,),
    "wk_b": (None, "heads", None),
    "wv_b": (None, "heads", None),
}

# KV-cache arrays (by their name in a CacheGroup, see model/kv_cache.py) -> logical axes.
CACHE_AXES = {
    "k": (None, "batch", None, "kv_heads", None),  # [Lg, B, C, K, H]
    "v": (None, "batch", None, "kv_heads", None),
    "k_scale": (None, "batch", None, "kv_heads"),  # [Lg, B, C, K] (int8 / float8 storage)
    "v_scale": (None, "batch", None, "kv_heads"),
    "latent": (None, "batch", None, None),  # [Lg, B, C, R]
    "rope_key": (None, "batch", None, None),  # [Lg, B, C, Hr]
    "latent_scale": (None, "batch", None),  # [Lg, B, C]
    "rope_key_scale": (None, "batch", None),
    "positions": ("batch", None),  # [B, C]
    "lengths": ("batch",),  # [B]
}


class MeshError(ConfigError):
    """A mesh that does not fit the devices, or data that does not fit the mesh."""


# ---- the mesh ----------------------------------------------------------------------------------------------


def mesh_shape(mesh_config: MeshConfig | None = None, num_devices: int | None = None) -> tuple:
    """(data, fsdp, tensor) sizes for `num_devices` (default: all devices), resolving the one -1."""
    mc = mesh_config or MeshConfig()
    n = jax.device_count() if num_devices is None else num_devices
    sizes = [mc.data, mc.fsdp, mc.tensor]
    for name, s in zip(AXES, sizes, strict=True):
        if not isinstance(s, int) or (s < 1 and s != -1):
            raise MeshError(f"mesh.{name} must be a positive integer or -1 (the rest of the devices), got {s!r}")
    rest = [i for i, s in enumerate(sizes) if s == -1]
    if len(rest) > 1:
        raise MeshError(f"only one of mesh.data/fsdp/tensor may be -1, got {dict(zip(AXES, sizes, strict=True))}")
    fixed = math.prod(s for s in sizes if s != -1)
    if rest:
        if n % fixed:
            raise MeshError(
                f"the mesh does not fit {n} device(s): "
                + " x ".join(f"mesh.{a}={s}" for a, s in zip(AXES, sizes, strict=True) if s != -1)
                + f" = {fixed} does not divide {n}"
            )
        sizes[rest[0]] = n // fixed
    if math.prod(sizes) != n:
        raise MeshError(
            f"mesh {dict(zip(AXES, sizes, strict=True))} needs {math.prod(sizes)} devices but {n} are available; "
            "set one of mesh.data/fsdp/tensor to -1 to take the rest"
        )
    return tuple(sizes)


def make_mesh(mesh_config: MeshConfig | None = None, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: every device of every process).

    Device order comes from `jax.make_mesh`, which lays the axes out along the physical topology on TPU/GPU
    (the last axis, tensor, over the closest devices); its axes are "auto" (XLA propagates shardings between the
    ones given here)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_config, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def training_mesh(mesh_config: MeshConfig | None = None) -> Mesh | None:
    """The mesh training runs on, or None on a single device (the unsharded code path, exactly as before)."""
    mesh = make_mesh(mesh_config)
    return None if mesh.size == 1 else mesh


def describe(mesh: Mesh | None) -> str:
    if mesh is None:
        return f"1 device ({jax.devices()[0].platform})"
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"mesh {sizes} over {mesh.size} {mesh.devices.flat[0].platform} devices{procs}"


def mesh_of(tree) -> Mesh | None:
    """The mesh a pytree of arrays is laid out on (None when it sits on one device)."""
    for leaf in jax.tree.leaves(tree):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.size > 1:
            return s.mesh
    return None


# ---- partition rules ---------------------------------------------------------------------------------------


def _axis_size(mesh, axis: str) -> int:
    return dict(mesh.shape).get(axis, 1)


def _fit(dim: int, candidates: tuple, mesh, used: set):
    """The mesh axes (None, a name or a tuple) that split a dimension of size `dim`: all `candidates` together
    if their product divides it, else the first single one that does, else none (replicated)."""
    axes = tuple(a for a in candidates if _axis_size(mesh, a) > 1 and a not in used)
    options = [axes] + [(a,) for a in axes] if len(axes) > 1 else [axes]
    for opt in options:
        if opt and dim % math.prod(_axis_size(mesh, a) for a in opt) == 0:
            used.update(opt)
            return opt[0] if len(opt) == 1 else opt
    return None


def logical_spec(logical: Sequence[str | None], shape: Sequence[int], mesh) -> P:
    """PartitionSpec of an array with these logical axes (see LOGICAL_AXES) on `mesh`, leaving undivisible
    dimensions replicated. `mesh` may be a Mesh or an AbstractMesh (only its axis sizes are read)."""
    used: set = set()
    parts = [
        None if name is None else _fit(int(d), LOGICAL_AXES[name], mesh, used)
        for name, d in zip(logical, shape, strict=True)
    ]
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def _names(path) -> list:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
    return out


def param_logical_axes(path, shape) -> tuple | None:
    """Logical axes of the parameter (or optimizer-state leaf) at `path` with `shape`, or None when no rule
    applies (then it is replicated). The parameter is found by the innermost path name that has a rule, so the
    same rule serves a pure param dict, an nnx.State and the optax state built over the params."""
    for name in reversed(_names(path)):
        rule = PARAM_AXES.get(name)
        if rule is None:
            continue
        if len(shape) == len(rule):
            return tuple(rule)
        if len(shape) == len(rule) + 1:  # stacked blocks: a leading layer axis, never split
            return (None,) + tuple(rule)
        return None
    return None


def param_spec(path, shape, mesh) -> P:
    logical = param_logical_axes(path, shape)
    return P() if logical is None else logical_spec(logical, shape, mesh)


def tree_shardings(tree, mesh: Mesh):
    """A NamedSharding for every array leaf of `tree` (params, an optax state, a TrainState, an nnx.State):
    by the partition rules, replicated where none applies (scalars, RNG keys, step counters)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, np.shape(x), mesh)), tree
    )


def unmatched_params(params) -> list[str]:
    """Names of parameters no partition rule covers (they would be replicated): a test keeps this empty."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [".".join(_names(p)) for p, x in flat if param_logical_axes(p, np.shape(x)) is None]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, batch_size: int, ndim: int = 2) -> NamedSharding:
    """[B, ...] split over data x fsdp (or the part of it that divides B)."""
    return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1), mesh))


def batch_split(mesh: Mesh | None, batch_size: int) -> int:
    """How many ways a batch of `batch_size` rows is split on `mesh` (1 on one device)."""
    if mesh is None:
        return 1
    spec = batch_sharding(mesh, batch_size).spec
    axes = spec[0] if len(spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def cache_shardings(cache, mesh: Mesh):
    """Shardings of a KVCache: batch over data x fsdp, K/V heads over tensor (where they divide)."""

    def one(path, x):
        names = _names(path)
        logical = CACHE_AXES.get(names[-1]) if names else None
        if logical is None or len(logical) != np.ndim(x):
            return replicated(mesh)
        return NamedSharding(mesh, logical_spec(logical, np.shape(x), mesh))

    return jax.tree_util.tree_map_with_path(one, cache)


def shard_tree(tree, shardings):
    """Place (or re-lay) `tree` in `shardings`. Arrays already there are returned as they are. With several
    processes, arrays held by this process alone go through host memory (each process must hold the same
    values; JAX checks): device_put only moves arrays that already span the processes."""
    if jax.process_count() > 1:
        tree = jax.tree.map(
            lambda x: (
                np.asarray(x)
                if isinstance(x, jax.Array)
                and x.is_fully_addressable
                and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                else x
            ),
            tree,
        )
    return jax.device_put(tree, shardings)


def replicate(x, mesh: Mesh):
    """A host value (numpy / Python scalar, the same on every process) as an array replicated over `mesh`."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, replicated(mesh), lambda idx: x[idx])


# ---- batches -----------------------------------------------------------------------------------------------


def process_rows(mesh: Mesh, batch_size: int) -> np.ndarray:
    """The global batch rows this process's devices hold (sorted), i.e. the rows its data loader must read."""
    sharding = batch_sharding(mesh, batch_size)
    rows = set()
    for idx in sharding.addressable_devices_indices_map((batch_size, 1)).values():
        rows.update(range(*idx[0].indices(batch_size)))
    return np.asarray(sorted(rows), np.int64)


def shard_local_batch(batch: dict, mesh: Mesh, batch_size: int) -> dict:
    """Global arrays from this process's rows of a batch (`process_rows` of it, [rows, ...] numpy each)."""
    sharding = batch_sharding(mesh, batch_size)
    if jax.process_count() == 1:  # this process holds every row
        return jax.device_put(batch, sharding)
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (batch_size,) + v.shape[1:]) for k, v in batch.items()
    }


def shard_global_batch(batch: dict, mesh: Mesh) -> dict:
    """Global arrays from a batch every process holds whole (evaluation batches, prompts); each process only
    copies the rows its devices hold."""

    def one(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.shape[0], x.ndim) if x.ndim else replicated(mesh)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(one, batch)


# ---- multi-host ---------------------------------------------------------------------------------------------


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def detect_launcher() -> str | None:
    """The multi-process launcher this process runs under ("slurm", "openmpi", "tpu", "env"), or None."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS") and _env_int("JAX_NUM_PROCESSES") not in (None, 1):
        return "env"
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and (_env_int("SLURM_STEP_NUM_TASKS") or 1) > 1:
        # A job step started by srun with several tasks (srun sets SLURM_STEP_NUM_TASKS; the batch script itself,
        # which also sees SLURM_NTASKS of the whole allocation, is a single process).
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "openmpi"
    hosts = env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1 or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Connect this process to the others with `jax.distributed.initialize` when there are others.

    Explicit: `coordinator` ("host:port" of process 0), `num_processes`, `process_id` (the `causal-lm train
    --coordinator --num-processes --process-id` flags). Otherwise detected: a SLURM job step with several tasks
    (`srun`), Open MPI (`mpirun`), TPU pod workers (TPU_WORKER_HOSTNAMES), JAX_COORDINATOR_ADDRESS +
    JAX_NUM_PROCESSES + JAX_PROCESS_ID in the environment; `auto=True` (`--distributed`) calls it regardless and
    lets JAX find the cluster (a TPU VM slice created with gcloud, whose workers learn their peers from the
    metadata server). Must run before anything touches a device. Returns whether it initialised; a second call
    is a no-op. CPU processes talk through gloo collectives.
    """
    if jax.distributed.is_initialized():
        return True
    explicit = [coordinator, num_processes, process_id]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise MeshError(
                "--coordinator, --num-processes and --process-id go together (got "
                f"coordinator={coordinator!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r})"
            )
        if not 0 <= process_id < num_processes:
            raise MeshError(f"--process-id must be in [0, {num_processes}), got {process_id}")
        if num_processes == 1:
            return False
        _cpu_collectives()
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
        return True
    launcher = detect_launcher()
    if launcher is None and not auto:
        return False
    _cpu_collectives()
    if launcher == "env":
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=_env_int("JAX_NUM_PROCESSES"),
            process_id=_env_int("JAX_PROCESS_ID"),
        )
    else:
        jax.distributed.initialize()
    return True


def _cpu_collectives() -> None:
    # Cross-process collectives on CPU (the tests, CPU clusters): gloo, the installed JAX's own implementation.
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # an older/newer JAX without the option: its default
        pass


def is_main_process() -> bool:
    """Process 0: the one that writes logs, metrics and workdir files."""
    return jax.process_index() == 0
