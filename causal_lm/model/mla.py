"""Multi-head latent attention (MLA, DeepSeek-V2): cache a low-rank latent instead of K and V.

Shape letters as in kernels.py, plus R kv_lora_rank (the cached latent), Q q_lora_rank, Hn the no-position
dims of each head's query/key, Hr the RoPE dims, Hv the value dims.

Per token, one down-projection gives the latent c = norm(x W_dkv) [R] and one RoPE key k_r [Hr] shared by all
heads; both are cached, nothing else. Each head expands its key and value from the latent:

    k_n = c W_uk[n]  [Hn],   v_n = c W_uv[n]  [Hv],   score = (q_nope_n . k_n + q_rope_n . k_r) / sqrt(Hn + Hr)

RoPE sits on the separate k_r: a rotation depends on the position, so if it were applied to the expanded key it
could not be folded into the query (below), and the cache would have to hold per-head rotated keys again.

Two ways to attend over a cache, chosen by `mla.absorb`, equal up to float rounding:
    expanded  expand every cached latent to K and V, then attend as MHA. Cheap when there are few keys.
    absorbed  reassociate the products: q_nope_n W_uk[n]^T is a query in latent space [R], so the scores are
              taken against the cached latents directly, the weighted sum of latents is formed, and W_uv[n]
              is applied once to that sum: K and V are never materialised, which is what makes decoding
              over a long cache cheap (DeepSeek's inference code does the same).
Without a cache (training, and the recompute path of generate) the expanded form is used.

Both forms go through the shared kernels (kernels.py): the expanded one is ordinary attention over N heads whose
keys are [k_nope | k_r] (k_r broadcast over the heads), the absorbed one is MQA over the latent (one "KV head"
whose key is [latent | k_r] and whose value is the latent).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from causal_lm.config import ModelConfig
from causal_lm.model.context import AttentionContext
from causal_lm.model.kernels import attention, grouped_scores, grouped_values, masked_softmax
from causal_lm.model.kv_cache import KVCache
from causal_lm.model.layers import normal_param, project, rms_norm
from causal_lm.model.rope import apply_rope


class MLAttention(nnx.Module):
    """DeepSeek-V2 multi-head latent attention. Same call signature as `Attention`; what it caches per layer and
    token is the latent [R] and the rope key [Hr]."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        m = c.mla
        D, N, R = c.d_model, c.num_heads, m.kv_lora_rank
        Hn, Hr, Hv = m.qk_nope_head_dim, c.rope_dim, m.v_head_dim
        pd = jnp.dtype(c.param_dtype)
        std = c.init_std
        self.config = c
        if m.q_lora_rank:
            self.wq_a = normal_param(rngs, (D, m.q_lora_rank), std, pd)  # down to the query latent
            self.q_norm = nnx.Param(jnp.ones((m.q_lora_rank,), pd))
            self.wq_b = normal_param(rngs, (m.q_lora_rank, N, Hn + Hr), std, pd)
        else:
            self.wq = normal_param(rngs, (D, N, Hn + Hr), std, pd)
        self.wkv_a = normal_param(rngs, (D, R + Hr), std, pd)  # down to [latent | rope key]
        self.kv_norm = nnx.Param(jnp.ones((R,), pd))
        self.wk_b = normal_param(rngs, (R, N, Hn), std, pd)  # latent -> each head's no-position key
        self.wv_b = normal_param(rngs, (R, N, Hv), std, pd)  # latent -> each head's value
        self.wo = normal_param(rngs, (N, Hv, D), std / (2 * c.num_layers) ** 0.5, pd)
        if c.attn_output_gate:
            self.wg = normal_param(rngs, (D, N, Hv), std, pd)
        if c.attn_sink:
            self.sink = nnx.Param(jnp.zeros((N,), pd))

    def project_q(self, x, cos, sin):
        """Queries split into their no-position part [B, T, N, Hn] and rotated RoPE part [B, T, N, Hr]."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.mla.q_lora_rank:
            cq = rms_norm(project(x, self.wq_a[...].astype(dt)), self.q_norm[...], c.norm_eps)
            q = checkpoint_name(project(cq, self.wq_b[...].astype(dt)), "attn_q")
        else:
            q = checkpoint_name(project(x, self.wq[...].astype(dt)), "attn_q")
        Hn = c.mla.qk_nope_head_dim
        q_nope, q_rope = q[..., :Hn], q[..., Hn:]
        if cos is not None:
            q_rope = apply_rope(q_rope, cos, sin)
        return q_nope, q_rope

    def project_latent(self, x, cos, sin):
        """What the cache stores for the new tokens: latent [B, T, R] (normalised) and rope key [B, T, Hr]."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        ckv = checkpoint_name(project(x, self.wkv_a[...].astype(dt)), "attn_kv_latent")
        R = c.mla.kv_lora_rank
        latent = rms_norm(ckv[..., :R], self.kv_norm[...], c.norm_eps)
        rope_key = ckv[..., R:]
        if cos is not None:
            rope_key = apply_rope(rope_key[:, :, None, :], cos, sin)[:, :, 0, :]
        return latent, rope_key

    def __call__(self, x, ctx: AttentionContext, cache: KVCache | None = None, layer=0):
        """x [B, T, D] -> (out [B, T, D], the cache with this layer's latent written, weights [B, N, T, S] or None)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        cos, sin = ctx.rope_for(layer)
        q_nope, q_rope = self.project_q(x, cos, sin)  # [B, T, N, Hn], [B, T, N, Hr]
        latent, rope_key = self.project_latent(x, cos, sin)  # [B, T, R], [B, T, Hr]
        if cache is not None:
            cache, kv = cache.update(layer, {"latent": latent, "rope_key": rope_key}, ctx.plan)
            latent, rope_key = kv["latent"], kv["rope_key"]  # [B, S, R], [B, S, Hr]
        mask = ctx.mask_for(layer)
        wk_b, wv_b = self.wk_b[...].astype(dt), self.wv_b[...].astype(dt)
        scale = float(c.mla.qk_nope_head_dim + c.rope_dim) ** -0.5
        sink = self.sink[...] if c.attn_sink else None
        B, T, N, _ = q_nope.shape
        if c.mla.absorb and cache is not None:
            # MQA over the latent: q_nope W_uk^T is a query in latent space; one shared key [latent | k_r] and
            # value (the latent) for all N heads; W_uv is applied once to the weighted sum of latents.
            q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, wk_b)  # [B, T, N, R]
            scores = grouped_scores(q_latent, latent[:, :, None], scale) + grouped_scores(
                q_rope, rope_key[:, :, None], scale
            )  # [B, 1, N, T, S]
            weights = masked_softmax(scores, mask.visible, sink=sink, zero_after=mask.zero_after)
            out_latent = grouped_values(weights, latent[:, :, None])  # [B, T, N, R]
            out = jnp.einsum("btnr,rnh->btnh", out_latent, wv_b)
            weights = weights.reshape(B, N, T, -1) if ctx.return_weights else None
        else:
            # Expanded: every head's key [k_nope | k_r] and value from the latent, then ordinary attention.
            S = latent.shape[1]
            k_nope = jnp.einsum("bsr,rnh->bsnh", latent, wk_b)  # [B, S, N, Hn]
            k = jnp.concatenate([k_nope, jnp.broadcast_to(rope_key[:, :, None, :], (B, S, N, c.rope_dim))], -1)
            v = jnp.einsum("bsr,rnh->bsnh", latent, wv_b)  # [B, S, N, Hv]
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            out, weights = attention(
                q, k, v, mask, scale=scale, sink=sink, return_weights=ctx.return_weights, invariant=ctx.invariant
            )
        if c.attn_output_gate:
            gate = jax.nn.sigmoid(project(x, self.wg[...].astype(dt)).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate).astype(dt)
        out = checkpoint_name(project(out.astype(dt), self.wo[...].astype(dt), n_in=2), "attn_o")
        return out, cache, weights
