"""The attention layer for MHA / GQA / MQA: projections, RoPE, the cache, a kernel, the output gate.

num_kv_heads == num_heads is MHA, 1 is MQA, a divisor in between is GQA: the G = N / K query heads of a group
read their one K/V head through the kernels' grouped einsums, and K/V are cached at the KV-head count, never
repeated to N heads. What a query sees comes from the mask (mask.py), how it is computed from kernels.py, and where
K/V live from kv_cache.py; this file only projects and combines.

Per-architecture options (config fields): `qk_norm` normalises each head's q and k (RMSNorm over H) after the
projection and before RoPE (Qwen3, Gemma 3); `attn_scale` replaces 1/sqrt(H) (Gemma's query_pre_attn_scalar);
`attn_softcap` caps the scores inside the kernels (Gemma 2); the RoPE tables of each layer come from the context
(scaled, a local theta, or none on NoPE layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from causal_lm.config import ModelConfig
from causal_lm.model.context import AttentionContext
from causal_lm.model.kernels import attention
from causal_lm.model.kv_cache import KVCache
from causal_lm.model.layers import norm, normal_param, project
from causal_lm.model.quant import QuantizedWeight, concat_outputs
from causal_lm.model.rope import apply_rope


class Attention(nnx.Module):
    """Multi-head attention with K/V heads shared by groups of query heads (MHA / GQA / MQA)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        D, N, K, H = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
        pd = jnp.dtype(c.param_dtype)
        self.config = c
        self.wq = normal_param(rngs, (D, N, H), c.init_std, pd)
        self.wk = normal_param(rngs, (D, K, H), c.init_std, pd)
        self.wv = normal_param(rngs, (D, K, H), c.init_std, pd)
        self.wo = normal_param(rngs, (N, H, D), c.init_std / (2 * c.num_layers) ** 0.5, pd)
        if c.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((N, H), pd))
            self.bk = nnx.Param(jnp.zeros((K, H), pd))
            self.bv = nnx.Param(jnp.zeros((K, H), pd))
        if c.attn_output_gate:
            # One sigmoid gate per head and head dim, computed from the block input (Gated Attention, 2025).
            self.wg = normal_param(rngs, (D, N, H), c.init_std, pd)
        if c.attn_sink:
            self.sink = nnx.Param(jnp.zeros((N,), pd))
        if c.qk_norm:
            self.q_norm = norm(c, H)
            self.k_norm = norm(c, H)

    def fuse_products(self, quantized: bool = False) -> None:
        """The decode form of this layer (`Decoder.split_layers`): wq, wk and wv replaced by one weight `wqkv`
        [D, (N + 2K) H], so a step reads them in one matrix-vector product instead of three. Float weights, and
        with `quantized` (the C++ kernels read the result) quantized ones of one format (`quant.concat_outputs`);
        otherwise a quantized layer keeps its three products."""
        names = ("wq", "wk", "wv")
        if quantized and all(isinstance(getattr(self, n, None), QuantizedWeight) for n in names):
            fused = concat_outputs([getattr(self, n) for n in names])
            if fused is not None:
                self.wqkv = fused
                del self.wq, self.wk, self.wv
            return
        if not all(isinstance(getattr(self, n, None), nnx.Param) for n in names):
            return
        D = self.config.d_model
        self.wqkv = nnx.Param(
            jnp.concatenate(
                [self.wq[...].reshape(D, -1), self.wk[...].reshape(D, -1), self.wv[...].reshape(D, -1)], axis=1
            )
        )
        del self.wq, self.wk, self.wv

    def _products(self, x):
        """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H], before biases, norms and RoPE."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        if "wqkv" in vars(self):
            N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
            qkv = project(x, self.wqkv[...].astype(dt))  # [B, T, (N + 2K) H]
            q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
            lead = x.shape[:-1]
            return q.reshape(lead + (N, H)), k.reshape(lead + (K, H)), v.reshape(lead + (K, H))
        q = checkpoint_name(project(x, self.wq[...].astype(dt)), "attn_q")  # [B, T, N, H]
        k = checkpoint_name(project(x, self.wk[...].astype(dt)), "attn_k")  # [B, T, K, H]
        v = checkpoint_name(project(x, self.wv[...].astype(dt)), "attn_v")
        return q, k, v

    def project_q(self, x, cos, sin):
        """Queries for the tokens: [B, T, N, H] (rotated with RoPE)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        q = checkpoint_name(project(x, self.wq[...].astype(dt)), "attn_q")  # [B, T, N, H]
        return self._finish_q(q, cos, sin)

    def _finish_q(self, q, cos, sin):
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.qkv_bias:
            q = q + self.bq[...].astype(dt)
        if c.qk_norm:
            q = self.q_norm(q)
        if cos is not None:
            q = apply_rope(q, cos, sin)
        return q

    def project_kv(self, x, cos, sin):
        """K and V for the new tokens: [B, T, K, H] each (K rotated, V never)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        k = checkpoint_name(project(x, self.wk[...].astype(dt)), "attn_k")  # [B, T, K, H]
        v = checkpoint_name(project(x, self.wv[...].astype(dt)), "attn_v")
        return self._finish_kv(k, v, cos, sin)

    def _finish_kv(self, k, v, cos, sin):
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.qkv_bias:
            k = k + self.bk[...].astype(dt)
            v = v + self.bv[...].astype(dt)
        if c.qk_norm:
            k = self.k_norm(k)
        if cos is not None:
            k = apply_rope(k, cos, sin)
        return k, v

    def __call__(self, x, ctx: AttentionContext, cache: KVCache | None = None, layer=0):
        """x [B, T, D] -> (out [B, T, D], the cache with this layer's new K/V written, weights [B, N, T, S] or None).

        Without a cache the keys are the call's own tokens; with one, the new K/V are written into layer `layer`
        and the queries attend over what the cache holds for it (the mask hides empty slots)."""
        c = self.config
        cos, sin = ctx.rope_for(layer)
        q, k, v = self._products(x)
        q = self._finish_q(q, cos, sin)  # [B, T, N, H]
        k, v = self._finish_kv(k, v, cos, sin)  # [B, T, K, H]
        sink = self.sink[...] if c.attn_sink else None
        mask = ctx.mask_for(layer)
        if cache is not None and self._reads_in_place(cache, q, mask, ctx):
            # A decode step on the CPU: a C++ kernel reads K/V where they lie, in the paged pool (instead of
            # gathering each row's pages into a copy, paged_cache.PagedKVCache.attend) or in the contiguous cache's
            # stacked buffers (instead of slicing the layer out into a copy, kv_cache.KVCache.attend).
            cache = cache.write(layer, {"k": k, "v": v}, ctx.plan)
            out = cache.attend(
                layer,
                q,
                mask.visible,
                scale=c.score_scale,
                sink=sink,
                softcap=c.attn_softcap or None,
            ).astype(v.dtype)
            return self._output(x, out), cache, None
        if cache is not None:
            cache, kv = cache.update(layer, {"k": k, "v": v}, ctx.plan)
            k, v = kv["k"], kv["v"]  # [B, S, K, H]
        out, weights = attention(
            q,
            k,
            v,
            mask,
            impl=c.attention_impl,
            scale=c.score_scale,
            sink=sink,
            softcap=c.attn_softcap or None,
            return_weights=ctx.return_weights,
            keys_copied=getattr(cache, "copies_keys", False),
            invariant=ctx.invariant,
        )  # [B, T, N, H]
        return self._output(x, out), cache, weights

    def _reads_in_place(self, cache, q, mask, ctx: AttentionContext) -> bool:
        """Whether this call's attention is the cache's in-place kernel: the cache offers it for these
        queries, and nothing asks for what only the XLA kernels give (the weights, the batch-invariant mode, the
        zero-after-softmax variant, a named fused backend)."""
        attends = getattr(cache, "attends_in_place", None)
        return (
            attends is not None
            and not ctx.return_weights
            and not ctx.invariant
            and mask.zero_after is None
            and self.config.attention_impl in ("auto", "xla")
            and attends(q, ctx.plan)
        )

    def _output(self, x, out):
        """The attention output [B, T, N, H] through the output gate and projection -> [B, T, D]."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.attn_output_gate:
            gate = jax.nn.sigmoid(project(x, self.wg[...].astype(dt)).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate).astype(dt)
        return checkpoint_name(project(out.astype(dt), self.wo[...].astype(dt), n_in=2), "attn_o")  # [B, T, D]
