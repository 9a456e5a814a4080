"""Small building blocks shared by the attention variants and the decoder: projections, RMSNorm, the MLP, init."""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from causal_lm.config import ModelConfig
from causal_lm.model import matvec
from causal_lm.model.quant import QuantizedWeight, concat_outputs

_row_wise = threading.local()


@contextlib.contextmanager
def row_wise(on: bool = True):
    """While tracing inside this context, `project` and `rms_norm` compute one token (row) at a time
    (`lax.map`, fenced by optimization barriers), so a token's result has the same bits whatever number of tokens
    the call holds: XLA:CPU runs a [1, D] @ [D, F] product and a [T, D] @ [D, F] one with different kernels (a
    matrix-vector product for one row) whose sums round differently. The decoder's batch-invariant scoring mode
    (`Decoder.forward(batch_invariant=True)`) sets it; it is read when a function is traced, never at run time."""
    before = getattr(_row_wise, "on", False)
    _row_wise.on = bool(on)
    try:
        yield
    finally:
        _row_wise.on = before


def _one_row_at_a_time(fn, x, n_in: int):
    """fn over x [..., *in] one row of the leading axes at a time: fn gets [1, *in] and returns [1, *out]."""
    lead, inner = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :]

    def one(r):
        return jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(r)[None])[0])

    rows = jax.lax.map(one, x.reshape((-1, *inner)))
    return rows.reshape(lead + rows.shape[1:])


ROW_WISE_OUT_MULTIPLE = 16  # row_wise products have a whole number of these outputs (zero columns added)


def _row_wise_project(x, w, n_in: int, preferred_element_type):
    """`project` one row at a time over a [in, out] weight whose outputs are padded with zero columns to a multiple
    of ROW_WISE_OUT_MULTIPLE. An odd output count (a 259-token vocabulary's head) is what made XLA:CPU's one-row
    product round differently where the row loop has one trip (a decode step) and where it has many (the trainer's
    forward): measured on a trained model, every such logit differed; padded to 260 or more, none does."""
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    k, n = int(np.prod(in_shape)), int(np.prod(out_shape))
    w2 = w.reshape(k, n)
    pad = -n % ROW_WISE_OUT_MULTIPLE
    if pad:
        w2 = jnp.pad(w2, ((0, 0), (0, pad)))
    lead = x.shape[: x.ndim - n_in]
    y = _one_row_at_a_time(lambda r: project(r, w2, 1, preferred_element_type), x.reshape(lead + (k,)), 1)
    return y[..., :n].reshape(lead + out_shape)


def project(x, w, n_in: int = 1, preferred_element_type=None):
    """Contract the last `n_in` dims of x [..., *in] with the first `n_in` of w [*in, *out] -> [..., *out].

    Computed as one 2-D matmul over flattened rows, [rows, prod(in)] @ [prod(in), prod(out)]. The same einsum on
    3-D/4-D operands differentiates into dot_generals whose weight gradient XLA:CPU feeds through a strided
    transpose of the output gradient; on flattened rows both the forward and the backward are plain matmuls.
    Inside `row_wise()`: one row at a time.
    """
    if getattr(_row_wise, "on", False) and not hasattr(w, "matmul"):
        with row_wise(False), matvec.native_products(False):
            return _row_wise_project(x, w, n_in, preferred_element_type)
    if hasattr(w, "matmul"):  # a quantized weight (quant.py) or the decode form's output-major one (matvec.py)
        return w.matmul(x, n_in, preferred_element_type)
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[: x.ndim - n_in]
    y = jnp.matmul(
        x.reshape(-1, int(np.prod(in_shape))),
        w.reshape(int(np.prod(in_shape)), -1),
        preferred_element_type=preferred_element_type,
    )
    return y.reshape(lead + out_shape)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _scaled_normal(key, std, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype) * jnp.asarray(std, dtype)


def normal_param(rngs: nnx.Rngs, shape, std, dtype) -> nnx.Param:
    """A parameter drawn from N(0, std^2) in float32, then cast to `dtype`. One compiled program per shape, whether
    the model is built eagerly or inside a jitted (e.g. sharded) initialisation, so both draw the same bits."""
    return nnx.Param(_scaled_normal(rngs.params(), std, tuple(shape), jnp.dtype(dtype)))


def rms_norm(x, scale, eps, plus_one: bool = False):
    """x / rms(x) * scale over the last axis (* (1 + scale) with plus_one, Gemma's form), computed in float32 and
    returned in x's dtype. Inside `row_wise()`: one row at a time."""
    if getattr(_row_wise, "on", False):
        with row_wise(False):
            return _one_row_at_a_time(lambda r: rms_norm(r, scale, eps, plus_one), x, 1)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    gain = scale.astype(jnp.float32)
    if plus_one:
        gain = 1.0 + gain
    return (y * gain).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned gain `scale`; plus_one (Gemma) applies (1 + scale), so the gain starts at 0."""

    def __init__(self, dim: int, eps: float, param_dtype, plus_one: bool = False):
        self.eps = eps
        self.plus_one = plus_one
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), param_dtype))

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps, self.plus_one)


def norm(c: ModelConfig, dim: int | None = None) -> RMSNorm:
    """The config's RMSNorm over `dim` (default d_model)."""
    return RMSNorm(c.d_model if dim is None else dim, c.norm_eps, jnp.dtype(c.param_dtype), c.norm_scale_plus_one)


def gelu_tanh(x):
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh, Gemma's MLP)."""
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh}


class MLP(nnx.Module):
    """Gated MLP: down(act(x W_gate) * (x W_up)); act = silu (SwiGLU) or tanh-approximate GELU (GeGLU)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(c.param_dtype)
        self.dtype = jnp.dtype(c.dtype)
        self.activation = c.mlp_activation
        self.w_gate = normal_param(rngs, (c.d_model, c.mlp_dim), c.init_std, pd)
        self.w_up = normal_param(rngs, (c.d_model, c.mlp_dim), c.init_std, pd)
        self.w_down = normal_param(rngs, (c.mlp_dim, c.d_model), c.init_std / (2 * c.num_layers) ** 0.5, pd)

    def fuse_products(self, quantized: bool = False) -> None:
        """The decode form (`Decoder.split_layers`): w_gate and w_up replaced by one weight `w_gate_up` [D, 2F], read
        in one matrix-vector product. Float weights, and with `quantized` quantized ones of one format (see
        `Attention.fuse_products`)."""
        names = ("w_gate", "w_up")
        if quantized and all(isinstance(getattr(self, n, None), QuantizedWeight) for n in names):
            fused = concat_outputs([self.w_gate, self.w_up])
            if fused is not None:
                self.w_gate_up = fused
                del self.w_gate, self.w_up
            return
        if not all(isinstance(getattr(self, n, None), nnx.Param) for n in names):
            return
        self.w_gate_up = nnx.Param(jnp.concatenate([self.w_gate[...], self.w_up[...]], axis=1))
        del self.w_gate, self.w_up

    def __call__(self, x):
        dt = self.dtype
        act = ACTIVATIONS[self.activation]
        if "w_gate_up" in vars(self):
            gate, up = jnp.split(project(x, self.w_gate_up[...].astype(dt)), 2, axis=-1)
            return project(act(gate) * up, self.w_down[...].astype(dt))
        gate = checkpoint_name(project(x, self.w_gate[...].astype(dt)), "mlp_gate")  # [B, T, F]
        up = checkpoint_name(project(x, self.w_up[...].astype(dt)), "mlp_up")
        return checkpoint_name(project(act(gate) * up, self.w_down[...].astype(dt)), "mlp_down")  # [B, T, D]
