"""The decoder: embed -> scan(pre-norm blocks) -> final norm -> logits.

Layers are built once, their parameters stacked along a leading L axis, and run with `lax.scan` so the
compiled program (and compile time) does not grow with depth. `scan_layers=False` unrolls the same body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.model.attention import Attention, _normal, make_mask, project
from causal_lm.model.kv_cache import KVCache, check_capacity, require_causal
from causal_lm.model.mla import MLAttention
from causal_lm.model.rope import rope_tables


class InputError(ValueError):
    """Bad tokens, positions or segment ids given to the model."""


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up))."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(c.param_dtype)
        self.dtype = jnp.dtype(c.dtype)
        self.w_gate = _normal(rngs, (c.d_model, c.mlp_dim), c.init_std, pd)
        self.w_up = _normal(rngs, (c.d_model, c.mlp_dim), c.init_std, pd)
        self.w_down = _normal(rngs, (c.mlp_dim, c.d_model), c.init_std / (2 * c.num_layers) ** 0.5, pd)

    def __call__(self, x):
        dt = self.dtype
        h = jax.nn.silu(project(x, self.w_gate[...].astype(dt))) * project(x, self.w_up[...].astype(dt))  # [B, T, F]
        return project(h, self.w_down[...].astype(dt))


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        pd = jnp.dtype(c.param_dtype)
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps, pd)
        self.attn = MLAttention(c, rngs) if c.attention_type == "mla" else Attention(c, rngs)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps, pd)
        self.mlp = MLP(c, rngs)

    def __call__(self, x, ctx: dict, layer_cache=None):
        h, new_cache, weights = self.attn(
            self.attn_norm(x),
            cos=ctx["cos"],
            sin=ctx["sin"],
            visible=ctx["visible"],
            zero_after=ctx["zero_after"],
            layer_cache=layer_cache,
            starts=ctx["starts"],
            return_weights=ctx["return_weights"],
            query_block=ctx["query_block"],
        )
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return x, new_cache, weights


def _segment_positions(segment_ids):
    """Positions that restart at 0 at every segment boundary: [B, T]."""
    T = segment_ids.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    boundary = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    seg_start = jax.lax.cummax(jnp.where(boundary, idx, 0), axis=1)
    return idx - seg_start


def causal_query_block(T: int) -> int:
    """Query block size for causal attention over T tokens of the model's own positions (0: one block).

    At most 8 blocks of at least 64 queries: block i then scores (i + 1) / 8 of the keys, 56% of the full square in
    all, while each block's matmuls stay large enough for the CPU and the number of ops stays small (measured at
    the benchmark shape, T=256: 64-query blocks take attention's forward + backward from 0.15 to 0.12 CPU-s per
    layer; 32 or 128 are slower).
    """
    if T <= 64:
        return 0
    return max(64, -(-T // 8))


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


class Decoder(nnx.Module):
    """Decoder-only transformer. `logits, cache = model(tokens, positions=..., segment_ids=..., cache=...)`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.config = c
        pd = jnp.dtype(c.param_dtype)
        self.embed = _normal(rngs, (c.vocab_size, c.d_model), c.init_std, pd)
        if c.position == "learned":
            self.pos_embed = _normal(rngs, (c.max_seq_len, c.d_model), c.init_std, pd)
        # Build L blocks, then stack their parameters on a leading axis: one Block whose arrays are [L, ...].
        blocks = [Block(c, rngs) for _ in range(c.num_layers)]
        graphdef, _ = nnx.split(blocks[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
        self.blocks = nnx.merge(graphdef, stacked)
        self.final_norm = RMSNorm(c.d_model, c.norm_eps, pd)
        if not c.tie_embeddings:
            self.lm_head = _normal(rngs, (c.d_model, c.vocab_size), c.init_std, pd)

    # ---- public entry points -----------------------------------------------------------------------------
    def __call__(self, tokens, *, positions=None, segment_ids=None, cache: KVCache | None = None, layers=None):
        """tokens [B, T] int -> (logits [B, T, V] float32, new cache or None).

        positions: [B, T] ints; default 0..T-1 (restarting at each segment when segment_ids are given), or with
        a cache each row's cached length + 0..T-1. segment_ids: [B, T] ints, 0 marks padding; tokens attend only
        within their own segment (packed documents). With a cache, valid tokens must come first in each row
        (right padding) and segment_ids only marks which are valid. layers: `split_layers()` of this model, to
        run the blocks on weights sliced once by the caller (see there).
        """
        logits, cache, _ = self.forward(
            tokens, positions=positions, segment_ids=segment_ids, cache=cache, layers=layers
        )
        return logits, cache

    def attention_weights(self, tokens, *, positions=None, segment_ids=None):
        """Attention weights of every layer and head: float32 [L, B, N, T, T] (einsum path)."""
        _, _, weights = self.forward(tokens, positions=positions, segment_ids=segment_ids, return_weights=True)
        return weights

    def hidden_states(self, tokens, *, positions=None, segment_ids=None):
        """The residual stream: [L+1, B, T, D] in the compute dtype; index 0 is the embedding output, index l the
        output of block l (before the final norm). For probes, e.g. what position the layers encode."""
        return self.forward(tokens, positions=positions, segment_ids=segment_ids, return_hidden=True)[3]

    # ---- implementation -------------------------------------------------------------------------------------
    def validate(self, tokens, positions=None, segment_ids=None, cache=None) -> None:
        """Host-side checks at the API boundary (skipped under tracing). JAX clamps out-of-range gathers and
        cache writes silently, so bad ids and overflows must be caught here, before any compute."""
        c = self.config
        if not _is_concrete(tokens, positions, segment_ids, None if cache is None else cache.lengths):
            return
        t = np.asarray(tokens)
        if t.ndim != 2:
            raise InputError(f"tokens must be [batch, length], got shape {t.shape}")
        if not np.issubdtype(t.dtype, np.integer):
            raise InputError(f"tokens must be integers, got dtype {t.dtype}")
        if t.size and (t.min() < 0 or t.max() >= c.vocab_size):
            bad = np.argwhere((t < 0) | (t >= c.vocab_size))[0]
            raise InputError(
                f"token id {int(t[tuple(bad)])} at [row {bad[0]}, position {bad[1]}] is outside "
                f"the vocabulary [0, {c.vocab_size})"
            )
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and tuple(np.shape(arr)) != t.shape:
                raise InputError(f"{name} shape {np.shape(arr)} does not match tokens shape {t.shape}")
        if cache is None:
            if t.shape[1] > c.max_seq_len:
                raise InputError(f"sequence length {t.shape[1]} exceeds model.max_seq_len={c.max_seq_len}")
        else:
            require_causal(c)
            if cache.batch_size != t.shape[0]:
                raise InputError(f"cache holds {cache.batch_size} rows but tokens have {t.shape[0]}")
            check_capacity(cache, t.shape[1])
            lengths = np.asarray(cache.lengths)
            n_valid = t.shape[1] if segment_ids is None else np.asarray(segment_ids != 0).sum(1)
            if np.max(lengths + n_valid) > c.max_seq_len:
                raise InputError(
                    f"cached length + new tokens ({int(np.max(lengths + n_valid))}) exceeds "
                    f"model.max_seq_len={c.max_seq_len}"
                )
            if positions is not None and not np.array_equal(
                np.asarray(positions), lengths[:, None] + np.arange(t.shape[1])[None]
            ):
                raise InputError(
                    "with a cache, positions must be each row's cached length + 0..T-1 "
                    "(slot index == position); leave positions=None"
                )
        if positions is not None:
            p = np.asarray(positions)
            if p.size and (p.min() < 0 or p.max() >= c.max_seq_len):
                raise InputError(
                    f"positions must be in [0, max_seq_len={c.max_seq_len}), got range [{p.min()}, {p.max()}]"
                )

    def forward(
        self,
        tokens,
        *,
        positions=None,
        segment_ids=None,
        cache=None,
        return_weights=False,
        input_embeddings=None,
        return_hidden=False,
        layers=None,
    ):
        """(logits, new cache, weights). input_embeddings [B, T, D] replaces the token lookup (for gradient
        probes such as the no-leak test); tokens still give the shape. return_hidden=True appends the residual
        stream [L+1, B, T, D] (embeddings, then each block's output) as a fourth element."""
        self.validate(tokens, positions, segment_ids, cache)
        c = self.config
        dt = jnp.dtype(c.dtype)
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        valid = jnp.ones((B, T), bool) if segment_ids is None else (jnp.asarray(segment_ids) != 0)

        query_block = 0
        if cache is None:
            if positions is None:
                positions = (
                    jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
                    if segment_ids is None
                    else _segment_positions(jnp.asarray(segment_ids))
                )
                # Positions made here increase within each segment, so under the causal mask no key after a
                # query's index is visible: attention may skip those blocks (same result, half the work).
                query_block = causal_query_block(T) if c.attention_mask == "causal" else 0
            positions = jnp.asarray(positions, jnp.int32)
            key_pos, key_valid, starts = positions, valid, None
            q_seg = k_seg = None if segment_ids is None else jnp.asarray(segment_ids)
        else:
            starts = cache.lengths
            positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
            new_lengths = starts + jnp.sum(valid, axis=1, dtype=jnp.int32)
            S = cache.max_len
            key_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            key_valid = key_pos < new_lengths[:, None]
            q_seg = k_seg = None

        def masks(window=None):
            """(visible, zero_after) for a layer with this sliding window (None/0: global)."""
            visible_causal = make_mask(positions, key_pos, key_valid, q_seg, k_seg, causal=True, window=window)
            if c.attention_mask == "causal":
                return visible_causal, None
            visible = make_mask(positions, key_pos, key_valid, q_seg, k_seg, causal=False)
            return visible, (visible_causal if c.attention_mask == "causal_after_softmax" else None)

        # Sliding windows: one mask for all layers when they share a window; otherwise each layer builds its own
        # inside the scan from its window (a traced scalar), so the stacked layers still scan as one body.
        windows = c.layer_windows
        visible, zero_after = masks(windows[0] if len(set(windows)) == 1 else None)

        x = self.embed[...].astype(dt)[tokens] if input_embeddings is None else input_embeddings.astype(dt)
        if c.position == "learned":
            # Only padding can sit past max_seq_len (real positions are validated above); clamp it explicitly.
            x = x + self.pos_embed[...].astype(dt)[jnp.minimum(positions, c.max_seq_len - 1)]
        cos = sin = None
        if c.position == "rope":
            cos, sin = rope_tables(positions, c.rope_dim, c.rope_theta)
        ctx = dict(
            cos=cos,
            sin=sin,
            visible=visible,
            zero_after=zero_after,
            starts=starts,
            query_block=query_block,
            return_weights=return_weights,
            return_hidden=return_hidden,
            masks=masks if len(set(windows)) > 1 else None,
        )

        x0 = x
        x, new_kv, weights = self._run_blocks(x, ctx, None if cache is None else cache.buffers, layers)
        hidden = None
        if return_hidden:  # the scan emitted (weights, block outputs)
            weights, hidden = weights
            hidden = jnp.concatenate([x0[None], hidden], axis=0)  # [L+1, B, T, D]
        x = self.final_norm(x)
        head = self.embed[...].T if c.tie_embeddings else self.lm_head[...]
        logits = project(x, head.astype(dt), preferred_element_type=jnp.float32)  # [B, T, V]
        new_cache = None
        if cache is not None:
            new_cache = cache.with_buffers(new_kv, new_lengths)
        if return_hidden:
            return logits, new_cache, weights, hidden
        return logits, new_cache, weights

    def split_layers(self) -> list:
        """The stacked blocks' state as a list of L per-layer states, for `forward(..., layers=...)`.

        A loop that runs the model many times over the same weights (the decode loop of `generate`) slices them
        once, outside the loop, and passes them in: the blocks then run unrolled on these slices. Run from the
        stacked arrays, every step of the loop would first copy each layer's weights out of them (a third of a
        batch-1 decode step at the benchmark shape).
        """
        _, state = nnx.split(self.blocks)
        return [jax.tree.map(lambda a, i=i: a[i], state) for i in range(self.config.num_layers)]

    def _run_blocks(self, x, ctx, kv, layers=None):
        c = self.config
        graphdef, state = nnx.split(self.blocks)
        windows = jnp.asarray(c.layer_windows, jnp.int32)  # [L]

        def body(carry, layer_state):
            x, kv, i = carry
            # The whole cache buffers (k, v) or MLA's (latent, rope_key), [L, B, S, ...], and this layer's index:
            # the layer writes its new entries into them in place and reads its own slice.
            layer_cache = None if kv is None else (kv, i)
            layer_ctx = ctx
            if ctx["masks"] is not None:  # layers differ in their sliding window
                visible, zero_after = ctx["masks"](windows[i])
                layer_ctx = dict(ctx, visible=visible, zero_after=zero_after)
            x, new_kv, w = nnx.merge(graphdef, layer_state)(x, layer_ctx, layer_cache)
            if kv is not None:
                kv = new_kv
            return (x, kv, i + 1), ((w, x) if ctx.get("return_hidden") else w)

        if c.remat:  # keep only each block's input for the backward pass; recompute the rest (least memory)
            body = jax.checkpoint(body, prevent_cse=not c.scan_layers)
        else:
            # Keep the matmul outputs for the backward pass and recompute the elementwise ops from them (norms,
            # RoPE, masked softmax, SwiGLU): cheaper than storing their results per layer and reading them back
            # (4% of a training step at the benchmark shape on a CPU), and less memory. No effect without a grad.
            body = jax.checkpoint(body, prevent_cse=not c.scan_layers, policy=jax.checkpoint_policies.dots_saveable)
        carry = (x, kv, jnp.int32(0))
        if c.scan_layers and layers is None:
            carry, weights = jax.lax.scan(body, carry, state)
        else:
            ws = []
            for i in range(c.num_layers):
                carry, w = body(carry, jax.tree.map(lambda a, i=i: a[i], state) if layers is None else layers[i])
                ws.append(w)
            weights = None if ws[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ws)
        x, kv, _ = carry
        return x, kv, weights

    # ---- sizes ----------------------------------------------------------------------------------------------
    def num_params(self) -> int:
        return int(sum(np.prod(a.shape) for a in jax.tree.leaves(nnx.state(self, nnx.Param))))


def build_model(config: ModelConfig, seed: int = 0) -> Decoder:
    """A freshly initialised decoder for `config` (parameters drawn from `seed`)."""
    if not isinstance(config, ModelConfig):
        config = getattr(config, "model", config)
    return Decoder(config, nnx.Rngs(params=seed))
