"""Fused attention backends and the choice among them: cuDNN on NVIDIA GPUs, Pallas splash attention on TPUs.

`model.attention_impl` names a family; what one call runs depends on the platform and on the call:

    xla                    the einsum kernels of kernels.py (every platform, every phase)
    dot_product_attention  jax.nn.dot_product_attention over the dense mask, XLA's own choice of implementation
    cudnn                  jax.nn.dot_product_attention(implementation="cudnn"): NVIDIA GPUs, bf16/fp16 compute
    splash                 jax.experimental.pallas.ops.tpu.splash_attention: TPUs (on a CPU in Pallas interpret
                           mode, exact but slow: what the tests run)
    auto                   splash on a single TPU device, cudnn on GPUs where the config and compute dtype allow,
                           else xla

A fused kernel takes the mask as structure, never as the dense [B, T, S] array: causal by index, a sliding window
by index, and segment ids (packed documents, 0 = padding). That equals the position mask (mask.py) exactly when the
positions are the ones the decoder makes itself: 0..T-1, restarting at each segment, each segment one contiguous
run (as packing and padding make them). The decoder marks such masks (`AttentionMask.windows`); every other mask
(explicit positions, a cache's prefill chunk and decode step, the research masks) goes to the XLA kernels. So the
fused kernels serve attention over a call's own tokens: training, evaluation and the recompute path; a prefill into
a cache and the decode steps keep the cache kernels.

What each kernel can compute is one table, config.ATTENTION_BACKENDS: config validation refuses a named backend for
a model it cannot run (config.check_backend), and `resolve` here refuses it for a call it cannot run (platform,
compute dtype, head size) while `auto` skips it: sink logits and softcapping in cuDNN (splash has both), float32
compute in cuDNN, MLA in both.
The platform is checked where the model first runs (and at train/generate start-up, `describe`), not when a config
is parsed: a config written for a GPU job loads on a CPU host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from causal_lm.config import ATTENTION_BACKENDS, ConfigError, ModelConfig, backend_unsupported
from causal_lm.model.mask import AttentionMask

FUSED = tuple(name for name, b in ATTENTION_BACKENDS.items() if b.fused)
AUTO = {"tpu": "splash", "gpu": "cudnn"}  # what `auto` tries on each platform (else the XLA kernels)


def platform() -> str:
    """'gpu', 'tpu' or 'cpu': the platform of JAX's default backend."""
    return {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "cpu")


def call_unsupported(backend: str, dtype, head_dim: int, *, sink: bool = False, softcap: bool = False) -> str | None:
    """Why `backend` cannot run this call (its compute dtype, head size, sink logits, softcapping; read from
    config.ATTENTION_BACKENDS), or None if it can."""
    b = ATTENTION_BACKENDS[backend]
    name = jnp.dtype(dtype).name
    if name not in b.compute_dtypes:
        return f"{name} compute ({b.label} takes {' or '.join(b.compute_dtypes)})"
    if head_dim % b.head_dim_multiple or (b.max_head_dim and head_dim > b.max_head_dim):
        return f"head_dim={head_dim} ({b.label} needs a multiple of {b.head_dim_multiple}, at most {b.max_head_dim})"
    if sink and not b.sink:
        return "sink logits"
    if softcap and not b.softcap:
        return "score softcapping"
    return None


def cudnn_unsupported(dtype, head_dim: int, *, sink: bool = False, softcap: bool = False) -> str | None:
    """Why cuDNN's fused attention cannot run this call, or None if it can."""
    return call_unsupported("cudnn", dtype, head_dim, sink=sink, softcap=softcap)


def resolve(
    impl: str, plat: str, dtype, head_dim: int, *, sink: bool = False, softcap: bool = False, devices: int = 1
) -> str | None:
    """The fused kernel ("cudnn" or "splash") that attention over a call's own tokens runs, or None for the XLA
    kernels. Raises ConfigError when `impl` names a fused kernel the platform or the call cannot run.

    devices: how many devices the process sees. cuDNN's kernel carries XLA partitioning rules, so a sharded batch
    stays sharded; a Pallas call has none (it would need a shard_map over the training mesh, not written yet), so
    splash is used only where one device runs the program (`multi_device` in the table)."""
    if impl == "auto":
        name = AUTO.get(plat)
        if name is None:
            return None
        b = ATTENTION_BACKENDS[name]
        if devices > 1 and not b.multi_device:
            return None
        return name if call_unsupported(name, dtype, head_dim, sink=sink, softcap=softcap) is None else None
    if impl not in FUSED:
        return None
    b = ATTENTION_BACKENDS[impl]
    if plat not in b.platforms:
        raise ConfigError(
            f"model.attention_impl={impl!r} {b.platform_note}, but JAX's backend here is {plat!r}; "
            "use attention_impl=auto or xla"
        )
    if devices > 1 and not b.multi_device:
        raise ConfigError(
            f"model.attention_impl={impl!r} runs on one device, but this process sees {devices} (the kernel is "
            "not partitioned over a mesh yet); use attention_impl=auto or xla"
        )
    why = call_unsupported(impl, dtype, head_dim, sink=sink, softcap=softcap)
    if why:
        raise ConfigError(f"model.attention_impl={impl!r} cannot run {why}; use attention_impl=auto or xla")
    return impl


def describe(m: ModelConfig, plat: str | None = None, devices: int | None = None) -> str:
    """One line: which kernels attention runs in each phase for this model on this platform and device count
    (default: this process's; raises ConfigError for a named backend that cannot run here, before any compute)."""
    plat = plat or platform()
    fused = None
    target = AUTO.get(plat) if m.attention_impl == "auto" else m.attention_impl
    if target in FUSED and backend_unsupported(m, target) is None:  # else `auto` skips it (a named one: refused)
        fused = resolve(
            m.attention_impl,
            plat,
            m.dtype,
            m.head_dim,
            sink=m.attn_sink,
            softcap=bool(m.attn_softcap),
            devices=jax.device_count() if devices is None else devices,
        )
    base = "dot_product_attention" if m.attention_impl == "dot_product_attention" else "xla"
    whole = fused or base
    note = " (Pallas interpret mode: exact, slow)" if fused == "splash" and plat != "tpu" else ""
    return (
        f"attention: model.attention_impl={m.attention_impl} on {plat}: {whole}{note} for training and "
        f"forward passes without a cache; {base} kernels for prefill and decode over the KV cache"
    )


def applies(mask: AttentionMask, q, k) -> bool:
    """Whether a fused kernel can compute this call: the mask is the decoder's own structured self-attention mask
    (see the module docstring) and the keys are the queries' own tokens."""
    return bool(mask.windows) and mask.zero_after is None and q.shape[1] == k.shape[1]


def _per_window(fn, mask: AttentionMask, *args):
    """fn(window, *args) for the mask's sliding window; with several (the layers of a scan differ) a switch on the
    traced index picks among one static kernel per window."""
    if len(mask.windows) == 1:
        return fn(mask.windows[0], *args)
    branches = [functools.partial(fn, w) for w in mask.windows]
    return jax.lax.switch(mask.window_index, branches, *args)


def _zero_empty_rows(out, mask: AttentionMask):
    """A query that sees no key (padding) gets zeros, as in the reference; the fused kernels give it something else."""
    return out * jnp.any(mask.visible, axis=-1)[:, :, None, None].astype(out.dtype)


# ---- cuDNN ------------------------------------------------------------------------------------------------


def cudnn_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None):
    """jax.nn.dot_product_attention(implementation="cudnn") with the causal flag and local_window_size; segments,
    when there are any, through a [B, 1, T, T] same-segment mask (cuDNN adds it as a bias)."""
    if sink is not None or softcap:
        raise ValueError("cuDNN's fused attention has no sink logit or softcapping")
    seg_mask = None
    if mask.segment_ids is not None:
        s = mask.segment_ids
        seg_mask = (s[:, :, None] == s[:, None, :])[:, None]  # [B, 1, T, S]

    def run(window, q, k, v):
        return jax.nn.dot_product_attention(
            q,
            k.astype(q.dtype),
            v.astype(q.dtype),
            mask=seg_mask,
            scale=scale,
            is_causal=True,
            local_window_size=(window - 1, 0) if window else None,
            implementation="cudnn",
        )

    return _zero_empty_rows(_per_window(run, mask, q, k, v), mask)


# ---- splash (Pallas, TPU) ---------------------------------------------------------------------------------

SPLASH_BLOCK = 128  # splash's key blocks must be multiples of 128 lanes; sequences are padded to a multiple


@functools.lru_cache(maxsize=64)
def _splash_kernel(T: int, N: int, window: int, softcap: float | None, interpret: bool, block: int | None = None):
    """A splash kernel for T (a multiple of SPLASH_BLOCK) tokens and N query heads: causal, or the sliding window
    (a query at index i sees keys i - window + 1 .. i). Built on the host from static facts, so cached. block:
    the tile size (default: the largest multiple of 128 up to 512 that divides T)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    one = sm.LocalMask((T, T), window_size=(window - 1, 0), offset=0) if window else sm.CausalMask((T, T))
    b = block or min(T, 512)  # a divisor of T (T is a multiple of 128): larger blocks where the sequence allows
    while T % b:
        b -= SPLASH_BLOCK
    blocks = sk.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    # The kernel holds its mask tables as arrays: made concrete here, so the cached kernel never keeps the tracers
    # of the trace that first built it.
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(
            sm.MultiHeadMask([one] * N),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            attn_logits_soft_cap=softcap,
            interpret=interpret,
        )


def splash_attention(q, k, v, mask: AttentionMask, *, scale, sink=None, softcap=None, interpret=None, block=None):
    """Pallas splash attention: q [B, T, N, H], k/v [B, T, K, H] (GQA/MQA natively: query head n reads KV head
    n // G), causal or windowed by index, segment ids from the mask, optional sink logits and softcapping.

    The scale is folded into q; T is padded to a multiple of 128 at the end (padded keys come after every real
    query, so causality hides them; with segments they also get their own id). interpret: Pallas interpret mode
    (default: off a TPU), what lets the tests run it on a CPU. block: the tile size (a multiple of 128)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    if interpret is None:
        interpret = platform() != "tpu"
    B, T, N, _ = q.shape
    Tp = -(-T // SPLASH_BLOCK) * SPLASH_BLOCK
    pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    dt = q.dtype
    qh = jnp.pad((q.astype(jnp.float32) * jnp.float32(scale)).astype(dt), pad).transpose(0, 2, 1, 3)  # [B, N, Tp, H]
    kh = jnp.pad(k.astype(dt), pad).transpose(0, 2, 1, 3)  # [B, K, Tp, H]
    vh = jnp.pad(v.astype(dt), pad).transpose(0, 2, 1, 3)
    seg = None
    if mask.segment_ids is not None:
        seg = jnp.pad(mask.segment_ids.astype(jnp.int32), [(0, 0), (0, Tp - T)], constant_values=-1)  # [B, Tp]
    sinks = None if sink is None else sink.astype(jnp.float32)

    def run(window, qh, kh, vh, seg):
        kernel = _splash_kernel(Tp, N, int(window), float(softcap) if softcap else None, bool(interpret), block)

        def one_row(qb, kb, vb, sb):
            ids = None if sb is None else SegmentIds(q=sb, kv=sb)
            return kernel(qb, kb, vb, segment_ids=ids, sinks=sinks)

        if seg is None:
            return jax.vmap(lambda a, b, c: one_row(a, b, c, None))(qh, kh, vh)
        return jax.vmap(one_row)(qh, kh, vh, seg)

    out = _per_window(run, mask, qh, kh, vh, seg)  # [B, N, Tp, Hv]
    return _zero_empty_rows(out.transpose(0, 2, 1, 3)[:, :T].astype(v.dtype), mask)


KERNELS = {"cudnn": cudnn_attention, "splash": splash_attention}
