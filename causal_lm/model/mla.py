"""Multi-head latent attention (MLA, DeepSeek-V2): cache a low-rank latent instead of K and V.

Shape letters as in attention.py, plus R kv_lora_rank (the cached latent), Q q_lora_rank, Hn the no-position
dims of each head's query/key, Hr the RoPE dims, Hv the value dims.

Per token, one down-projection gives the latent c = norm(x W_dkv) [R] and one RoPE key k_r [Hr] shared by all
heads; both are cached, nothing else. Each head expands its key and value from the latent:

    k_n = c W_uk[n]  [Hn],   v_n = c W_uv[n]  [Hv],   score = (q_nope_n . k_n + q_rope_n . k_r) / sqrt(Hn + Hr)

RoPE sits on the separate k_r: a rotation depends on the position, so if it were applied to the expanded key it
could not be folded into the query (below), and the cache would have to hold per-head rotated keys again.

Two ways to attend over a cache, chosen by `mla_absorb`, equal up to float rounding:
    expanded  expand every cached latent to K and V, then attend as MHA. Cheap when there are few keys.
    absorbed  reassociate the products: q_nope_n W_uk[n]^T is a query in latent space [R], so the scores are
              taken against the cached latents directly, the weighted sum of latents is formed, and W_uv[n]
              is applied once to that sum: K and V are never materialised, which is what makes decoding
              over a long cache cheap (DeepSeek's inference code does the same).
Without a cache (training, and the recompute path of generate) the expanded form is used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.model.attention import _normal, masked_softmax
from causal_lm.model.kv_cache import write_layer_rows
from causal_lm.model.rope import apply_rope


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


class MLAttention(nnx.Module):
    """DeepSeek-V2 multi-head latent attention. Same call signature as `Attention`; its layer cache is
    (latent [B, S, R], rope_key [B, S, Hr])."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        D, N, R = c.d_model, c.num_heads, c.kv_lora_rank
        Hn, Hr, Hv = c.qk_nope_dim, c.rope_dim, c.v_dim
        pd = jnp.dtype(c.param_dtype)
        std = c.init_std
        self.config = c
        if c.q_lora_rank:
            self.wq_a = _normal(rngs, (D, c.q_lora_rank), std, pd)  # down to the query latent
            self.q_norm = nnx.Param(jnp.ones((c.q_lora_rank,), pd))
            self.wq_b = _normal(rngs, (c.q_lora_rank, N, Hn + Hr), std, pd)
        else:
            self.wq = _normal(rngs, (D, N, Hn + Hr), std, pd)
        self.wkv_a = _normal(rngs, (D, R + Hr), std, pd)  # down to [latent | rope key]
        self.kv_norm = nnx.Param(jnp.ones((R,), pd))
        self.wk_b = _normal(rngs, (R, N, Hn), std, pd)  # latent -> each head's no-position key
        self.wv_b = _normal(rngs, (R, N, Hv), std, pd)  # latent -> each head's value
        self.wo = _normal(rngs, (N, Hv, D), std / (2 * c.num_layers) ** 0.5, pd)
        if c.attn_output_gate:
            self.wg = _normal(rngs, (D, N, Hv), std, pd)
        if c.attn_sink:
            self.sink = nnx.Param(jnp.zeros((N,), pd))

    def project_q(self, x, cos, sin):
        """Queries split into their no-position part [B, T, N, Hn] and rotated RoPE part [B, T, N, Hr]."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.q_lora_rank:
            cq = _rms_norm(jnp.einsum("btd,dq->btq", x, self.wq_a[...].astype(dt)), self.q_norm[...], c.norm_eps)
            q = jnp.einsum("btq,qnh->btnh", cq, self.wq_b[...].astype(dt))
        else:
            q = jnp.einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))
        q_nope, q_rope = q[..., : c.qk_nope_dim], q[..., c.qk_nope_dim :]
        if cos is not None:
            q_rope = apply_rope(q_rope, cos, sin)
        return q_nope, q_rope

    def project_latent(self, x, cos, sin):
        """What the cache stores for the new tokens: latent [B, T, R] (normalised) and rope key [B, T, Hr]."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        ckv = jnp.einsum("btd,dr->btr", x, self.wkv_a[...].astype(dt))
        latent = _rms_norm(ckv[..., : c.kv_lora_rank], self.kv_norm[...], c.norm_eps)
        rope_key = ckv[..., c.kv_lora_rank :]
        if cos is not None:
            rope_key = apply_rope(rope_key[:, :, None, :], cos, sin)[:, :, 0, :]
        return latent, rope_key

    def __call__(
        self,
        x,
        *,
        cos,
        sin,
        visible,
        zero_after=None,
        layer_cache=None,
        starts=None,
        return_weights=False,
        query_block=0,
    ):
        """x: [B, T, D] -> (out [B, T, D], new layer cache or None, weights [B, N, T, S] or None).
        query_block is accepted for the Block interface and unused: MLA scores all keys in one block."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        q_nope, q_rope = self.project_q(x, cos, sin)  # [B, T, N, Hn], [B, T, N, Hr]
        latent_new, rope_new = self.project_latent(x, cos, sin)  # [B, T, R], [B, T, Hr]
        if layer_cache is None:
            latent, rope_key, new_cache = latent_new, rope_new, None
        else:
            (cached_latent, cached_rope), layer = layer_cache  # [L, B, S, R], [L, B, S, Hr]
            new_cache = (
                write_layer_rows(cached_latent, layer, latent_new, starts),
                write_layer_rows(cached_rope, layer, rope_new, starts),
            )
            latent, rope_key = new_cache[0][layer].astype(dt), new_cache[1][layer].astype(dt)  # [B, S, R], [B, S, Hr]
        wk_b, wv_b = self.wk_b[...].astype(dt), self.wv_b[...].astype(dt)
        scale = 1.0 / jnp.sqrt(jnp.float32(c.qk_nope_dim + c.rope_dim))
        f32 = jnp.float32
        rope_scores = jnp.einsum("btnh,bsh->bnts", q_rope, rope_key, preferred_element_type=f32)  # [B, N, T, S]
        absorbed = c.mla_absorb and layer_cache is not None
        if absorbed:
            q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, wk_b)  # W_uk folded into the query: [B, T, N, R]
            scores = jnp.einsum("btnr,bsr->bnts", q_latent, latent, preferred_element_type=f32)
        else:
            k_nope = jnp.einsum("bsr,rnh->bsnh", latent, wk_b)  # [B, S, N, Hn]
            scores = jnp.einsum("btnh,bsnh->bnts", q_nope, k_nope, preferred_element_type=f32)
        scores = (scores + rope_scores) * scale
        sink = self.sink[...] if c.attn_sink else None
        # One KV group of N heads: the [B, K, G, T, S] layout of masked_softmax with K = 1, G = N.
        weights = masked_softmax(scores[:, None], visible, sink=sink, zero_after=zero_after)[:, 0]  # [B, N, T, S]
        if absorbed:
            out_latent = jnp.einsum("bnts,bsr->btnr", weights.astype(dt), latent)  # [B, T, N, R]
            out = jnp.einsum("btnr,rnh->btnh", out_latent, wv_b)  # W_uv applied once, after the sum
        else:
            v = jnp.einsum("bsr,rnh->bsnh", latent, wv_b)  # [B, S, N, Hv]
            out = jnp.einsum("bnts,bsnh->btnh", weights.astype(dt), v)  # [B, T, N, Hv]
        if c.attn_output_gate:
            gate = jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", x, self.wg[...].astype(dt)).astype(f32))
            out = (out.astype(f32) * gate).astype(dt)
        out = jnp.einsum("btnh,nhd->btd", out.astype(dt), self.wo[...].astype(dt))
        return out, new_cache, (weights if return_weights else None)
