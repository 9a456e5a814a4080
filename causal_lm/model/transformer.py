"""The decoder: embed -> pre-norm blocks (stacked, scanned) -> final norm -> logits.

Gemma's variations are config fields of the same decoder: `scale_embeddings` (x sqrt(d_model) after the lookup),
`post_norms` (an RMSNorm on each sublayer's output before the residual add), `norm_scale_plus_one` (every RMSNorm
multiplies by 1 + w) and `final_softcap` (logits -> c * tanh(logits / c)).

Layers are built once, their parameters stacked along a leading L axis, and run with `lax.scan` so the compiled
program (and compile time) does not grow with depth. `scan_layers=False` unrolls the same body, and so does a call
over a cache with several slot layouts (local and global layers: each layout's arrays have their own shapes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import ModelConfig
from causal_lm.model import matvec
from causal_lm.model.attention import Attention
from causal_lm.model.context import AttentionContext
from causal_lm.model.kv_cache import KVCache, check_cache_matches, check_capacity, require_causal
from causal_lm.model.layers import MLP, norm, normal_param, project, row_wise
from causal_lm.model.mask import AttentionMask, increasing_within_segments, make_mask, segment_positions
from causal_lm.model.mla import MLAttention
from causal_lm.model.quant import QUANTIZED, QuantizedWeight, lookup, quantize
from causal_lm.model.rope import layer_rope_tables
from causal_lm.model.weights import check_weights

# The projection outputs `model.remat=minimal` keeps for the backward pass (named with checkpoint_name where they
# are computed: attention.py, mla.py, layers.py); everything else in a block is recomputed from them.
SAVED_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_kv_latent", "attn_o", "mlp_gate", "mlp_up", "mlp_down")


def remat_policy(remat: str):
    """The jax.checkpoint policy of each block for `model.remat`.

    none:    keep every matmul output (dots_saveable) and recompute only the elementwise ops from them (norms, RoPE,
             masked softmax, SwiGLU): cheaper than storing their results per layer and reading them back, and less
             memory; the attention scores are matmul outputs, so they are kept too. No effect without a gradient.
    minimal: keep only the named projection outputs (SAVED_PROJECTIONS); the attention scores and softmax are
             recomputed from q and k (what a fused kernel does anyway).
    full:    keep nothing but each block's input; the backward pass runs the block's forward again (least memory).
    """
    if remat == "none":
        return jax.checkpoint_policies.dots_saveable
    if remat == "minimal":
        return jax.checkpoint_policies.save_only_these_names(*SAVED_PROJECTIONS)
    return jax.checkpoint_policies.nothing_saveable


class InputError(ValueError):
    """Bad tokens, positions or segment ids given to the model."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """What `Decoder.forward` returns."""

    logits: jax.Array  # [B, T, V] float32
    cache: KVCache | None = None  # the cache with this call's tokens added (when one was given)
    weights: jax.Array | None = None  # [L, B, N, T, S] float32 attention weights (return_weights=True)
    hidden: jax.Array | None = None  # [L+1, B, T, D] residual stream: embeddings, then each block (return_hidden)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeLayers:
    """`Decoder.split_layers()`: each layer's weights sliced out of the stack once (and in their decode form), with
    the graph definition that rebuilds a layer from them."""

    graphdef: nnx.GraphDef = dataclasses.field(metadata=dict(static=True))
    states: list
    head: object = None  # the output head in the kernels' output-major layout, where the model's own is not
    native: bool = dataclasses.field(default=False, metadata=dict(static=True))  # laid out for the C++ kernels

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]


_FUSED = {"wqkv": 1, "w_gate_up": 1}  # the decode form's concatenated weights (`fuse_products`), n_in


def _kernel_layout(block, tiled: bool) -> None:
    """Each projection weight of a block's decode form stored output-major for the C++ kernels (matvec.py):
    float32 ones as `OutMajorWeight`, quantized ones as `QuantizedWeight.out_major()`; in tiles if `tiled`."""
    for _, module in list(nnx.iter_graph(block)):
        if not isinstance(module, nnx.Module):
            continue
        names = {**QUANTIZED.get(type(module).__name__, {}), **_FUSED}
        for name, n_in in names.items():
            w = vars(module).get(name)
            if isinstance(w, QuantizedWeight):
                setattr(module, name, w.out_major(tiled))
            elif isinstance(w, nnx.Param) and jnp.dtype(w[...].dtype) == jnp.float32:
                setattr(module, name, matvec.OutMajorWeight(w[...], n_in, tiled))


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        self.post_norms = c.post_norms
        self.attn_norm = norm(c)
        self.attn = MLAttention(c, rngs) if c.attention_type == "mla" else Attention(c, rngs)
        self.mlp_norm = norm(c)
        self.mlp = MLP(c, rngs)
        if c.post_norms:
            self.post_attn_norm = norm(c)
            self.post_mlp_norm = norm(c)

    def fuse_products(self, quantized: bool = False) -> None:
        """The decode form of the block's products (see `Decoder.split_layers`)."""
        if isinstance(self.attn, Attention):
            self.attn.fuse_products(quantized)
        self.mlp.fuse_products(quantized)

    def __call__(self, x, ctx: AttentionContext, cache: KVCache | None = None, layer=0):
        """x [B, T, D] -> (x, cache, attention weights or None)."""
        h, cache, weights = self.attn(self.attn_norm(x), ctx, cache, layer)
        if self.post_norms:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_norms:
            h = self.post_mlp_norm(h)
        x = x + h
        return x, cache, weights


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


class Decoder(nnx.Module):
    """Decoder-only transformer. `logits, cache = model(tokens, positions=..., segment_ids=..., cache=...)`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        self.config = c
        pd = jnp.dtype(c.param_dtype)
        self.embed = normal_param(rngs, (c.vocab_size, c.d_model), c.init_std, pd)
        if c.position == "learned":
            self.pos_embed = normal_param(rngs, (c.max_seq_len, c.d_model), c.init_std, pd)
        # Build L blocks, then stack their parameters on a leading axis: one Block whose arrays are [L, ...].
        blocks = [Block(c, rngs) for _ in range(c.num_layers)]
        graphdef, _ = nnx.split(blocks[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
        self.blocks = nnx.merge(graphdef, stacked)
        self.final_norm = norm(c)
        if not c.tie_embeddings:
            self.lm_head = normal_param(rngs, (c.d_model, c.vocab_size), c.init_std, pd)

    # ---- public entry points -----------------------------------------------------------------------------
    def __call__(self, tokens, *, positions=None, segment_ids=None, cache: KVCache | None = None, layers=None):
        """tokens [B, T] int -> (logits [B, T, V] float32, new cache or None).

        positions: [B, T] ints; default 0..T-1 (restarting at each segment when segment_ids are given), or with
        a cache each row's cached length + 0..T-1. segment_ids: [B, T] ints, 0 marks padding; tokens attend only
        within their own segment (packed documents). With a cache, valid tokens must come first in each row
        (right padding) and segment_ids only marks which are valid. layers: `split_layers()` of this model, to
        run the blocks on weights sliced once by the caller (see there).
        """
        out = self.forward(tokens, positions=positions, segment_ids=segment_ids, cache=cache, layers=layers)
        return out.logits, out.cache

    def attention_weights(self, tokens, *, positions=None, segment_ids=None):
        """Attention weights of every layer and head: float32 [L, B, N, T, T] (the reference kernel)."""
        return self.forward(tokens, positions=positions, segment_ids=segment_ids, return_weights=True).weights

    def hidden_states(self, tokens, *, positions=None, segment_ids=None):
        """The residual stream: [L+1, B, T, D] in the compute dtype; index 0 is the embedding output, index l the
        output of block l (before the final norm). For probes, e.g. what position the layers encode."""
        return self.forward(tokens, positions=positions, segment_ids=segment_ids, return_hidden=True).hidden

    def validate(self, tokens, positions=None, segment_ids=None, cache=None, *, require_increasing_positions=False):
        """Host-side checks at the API boundary (skipped under tracing). JAX clamps out-of-range gathers and
        cache writes silently, so bad ids and overflows must be caught here, before any compute.

        require_increasing_positions: also refuse positions that do not strictly increase within each segment of a
        row. They are accepted by default on purpose: positions, not array order, define what the mask lets a
        token see, and repeated or decreasing ones mean exactly what the mask's formula says."""
        c = self.config
        if cache is not None:  # static shapes and metadata: checked while tracing too
            check_cache_matches(c, cache)
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
            lengths = np.asarray(cache.lengths)
            n_valid = t.shape[1] if segment_ids is None else np.asarray(segment_ids != 0).sum(1)
            check_capacity(cache, n_valid)
            if np.max(lengths + n_valid) > c.max_seq_len:
                raise InputError(
                    f"cached length + new tokens ({int(np.max(lengths + n_valid))}) exceeds "
                    f"model.max_seq_len={c.max_seq_len}"
                )
            if positions is not None and not np.array_equal(
                np.asarray(positions), lengths[:, None] + np.arange(t.shape[1])[None]
            ):
                raise InputError(
                    "with a cache, positions must be each row's cached length + 0..T-1 (the cache assigns them); "
                    "leave positions=None"
                )
        if positions is not None:
            p = np.asarray(positions)
            if p.size and (p.min() < 0 or p.max() >= c.max_seq_len):
                raise InputError(
                    f"positions must be in [0, max_seq_len={c.max_seq_len}), got range [{p.min()}, {p.max()}]"
                )
            if require_increasing_positions and not increasing_within_segments(p, segment_ids):
                raise InputError("positions must strictly increase within each segment of a row")

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
        logits_at=None,
        batch_invariant=False,
    ) -> ModelOutput:
        """The whole forward pass as a `ModelOutput`. input_embeddings [B, T, D] replaces the token lookup (for
        gradient probes such as the no-leak test); tokens still give the shape. logits_at [B, K] int: compute the
        logits only at these indices along T (logits [B, K, V]; a sampler needs one per row, and the output
        projection of every other token would be wasted: 49,152 x 576 multiply-adds a token on the 135M shape).
        batch_invariant: the scoring mode whose per-token results do not depend on the call's shapes (attention one
        query at a time over fixed key chunks, `kernels.invariant_attention`; projections and norms one token at a
        time, `layers.row_wise`): a decode step over a paged cache and a forward pass over the whole sequence then
        give the same bits for the same token (docs/post-training.md says where that holds). Slower; RL's sampler
        and trainer use it.

        Called eagerly (concrete weights), the parameters are checked finite first, once per array object (see
        `causal_lm.model.weights`); under jit the caller checks them (generate, functional.forward)."""
        self.validate(tokens, positions, segment_ids, cache)
        if logits_at is not None and _is_concrete(logits_at):
            at, shape = np.asarray(logits_at), np.shape(tokens)
            if at.ndim != 2 or at.shape[0] != shape[0] or at.size and not (0 <= at.min() and at.max() < shape[1]):
                raise InputError(f"logits_at must be [B={shape[0]}, K] indices in [0, {shape[1]}), got {at.tolist()}")
        if not isinstance(self.embed[...], jax.core.Tracer):
            check_weights(self)
        invariant = bool(batch_invariant)
        # Decoding (a cache, not the batch-invariant mode): small products through the C++ kernels (model/matvec.py).
        with row_wise(invariant), matvec.native_products(cache is not None and not invariant):
            return self._forward(
                tokens,
                positions,
                segment_ids,
                cache,
                return_weights,
                input_embeddings,
                return_hidden,
                layers,
                logits_at,
                invariant,
            )

    def _forward(
        self,
        tokens,
        positions,
        segment_ids,
        cache,
        return_weights,
        input_embeddings,
        return_hidden,
        layers,
        logits_at,
        invariant,
    ) -> ModelOutput:
        """`forward`'s body (inside `row_wise(invariant)`)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        valid = jnp.ones((B, T), bool) if segment_ids is None else (jnp.asarray(segment_ids) != 0)

        if cache is None:
            positions, ctx = self._self_attention_context(positions, segment_ids, valid)
        else:
            plan = cache.plan_write(valid)
            positions = plan.query_positions
            masks = tuple(
                AttentionMask(
                    make_mask(positions, kp, kp >= 0, window=group.window or None),
                )
                for group, kp in ((g, cache.key_positions(i, plan)) for i, g in enumerate(cache.groups))
            )
            mask_of_layer = tuple(cache.locate(layer)[0] for layer in range(c.num_layers))
            ctx = AttentionContext(masks, mask_of_layer, plan=plan)

        if input_embeddings is None:
            x = lookup(self.embed[...], tokens, dt)
            if c.scale_embeddings:  # sqrt(d_model) rounded to the compute dtype first, as Gemma does
                x = x * jnp.asarray(np.float32(c.d_model**0.5), dt)
        else:  # the embedding layer's output (after any scaling)
            x = input_embeddings.astype(dt)
        if c.position == "learned":
            # Only padding can sit past max_seq_len (real positions are validated above); clamp it explicitly.
            x = x + self.pos_embed[...].astype(dt)[jnp.minimum(positions, c.max_seq_len - 1)]
        if c.position == "rope":
            ropes, rope_of_layer = layer_rope_tables(c, positions)
            ctx = dataclasses.replace(ctx, ropes=ropes, rope_of_layer=rope_of_layer)
        ctx = dataclasses.replace(ctx, return_weights=return_weights, invariant=invariant)

        x0 = x
        x, cache, weights, hidden = self._run_blocks(x, ctx, cache, layers, return_hidden)
        if return_hidden:
            hidden = jnp.concatenate([x0[None], hidden], axis=0)  # [L+1, B, T, D]
        if logits_at is not None:
            at = jnp.clip(jnp.asarray(logits_at, jnp.int32), 0, T - 1)  # indices the caller computed, inside T
            x = jnp.take_along_axis(x, at[..., None], axis=1)  # [B, K, D]
        x = self.final_norm(x)
        table = self.embed[...]
        rows = x.shape[0] * x.shape[1]
        if layers is not None and layers.head is not None:  # the decode form's output-major head
            logits = project(x, layers.head, preferred_element_type=jnp.float32)
        elif (
            layers is not None
            and layers.native
            and c.tie_embeddings
            and not hasattr(table, "matmul")
            and matvec.native_here(rows, x.dtype, table.dtype)
        ):
            logits = matvec.project_table(x, table)  # decoding on a CPU: a table that does not tile, read in place
        else:
            head = table.T if c.tie_embeddings else self.lm_head[...]
            logits = project(x, head.astype(dt), preferred_element_type=jnp.float32)  # [B, T, V]
        if c.final_softcap:
            logits = jnp.tanh(logits / jnp.float32(c.final_softcap)) * jnp.float32(c.final_softcap)
        if cache is not None:
            cache = cache.commit(ctx.plan)
        return ModelOutput(logits=logits, cache=cache, weights=weights, hidden=hidden)

    def _self_attention_context(self, positions, segment_ids, valid):
        """(positions, context) for a call without a cache: the keys are the call's own tokens."""
        c = self.config
        B, T = valid.shape
        causal = c.attention_mask == "causal"
        if positions is None:
            positions = (
                jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
                if segment_ids is None
                else segment_positions(jnp.asarray(segment_ids))
            )
            # Positions made here increase within each segment: no key after a query's index is visible to it.
            index_causal = causal
            structured = causal  # and the mask is the index structure a fused kernel takes (see AttentionMask)
        else:
            index_causal = (
                causal and _is_concrete(positions, segment_ids) and increasing_within_segments(positions, segment_ids)
            )
            structured = False
        positions = jnp.asarray(positions, jnp.int32)
        seg = None if segment_ids is None else jnp.asarray(segment_ids)
        windows = sorted(set(c.layer_windows))
        masks = []
        for w in windows:
            visible_causal = make_mask(positions, positions, valid, seg, seg, causal=True, window=w or None)
            if causal:
                masks.append(
                    AttentionMask(
                        visible_causal,
                        index_causal=index_causal,
                        windows=(w,) if structured else (),
                        segment_ids=seg if structured else None,
                    )
                )
            else:  # the research variants: no mask before the softmax, and maybe causal zeroing after it
                visible = make_mask(positions, positions, valid, seg, seg, causal=False)
                zero_after = visible_causal if c.attention_mask == "causal_after_softmax" else None
                masks.append(AttentionMask(visible, zero_after))
        mask_of_layer = tuple(windows.index(w) for w in c.layer_windows)
        return positions, AttentionContext(tuple(masks), mask_of_layer)

    def split_layers(self, fuse: bool = True, native: bool = True, rows: int | None = None) -> DecodeLayers:
        """The stacked blocks' state as L per-layer states, for `forward(..., layers=...)`.

        A loop that runs the model many times over the same weights (the decode loop of `generate`) slices them
        once, outside the loop, and passes them in: the blocks then run unrolled on these slices. Run from the
        stacked arrays, every step of the loop would first copy each layer's weights out of them.

        fuse: the slices are also the layers' decode form: q/k/v and gate/up concatenated into one weight each
        (`Attention.fuse_products`, `MLP.fuse_products`), so a batch-1 step reads them in 4 matrix-vector products a
        layer instead of 7 (measured on the 135M shape: docs/performance.md). The same copy, another layout; the
        products' values are the same up to float rounding. Off under a mesh (the concatenation would mix shardings).
        Quantized weights are fused only for the C++ kernels (`native`), whose product reads any width; XLA's
        dequantizes a weight wider than `quant.WIDE_OUT` outputs.

        native (with fuse): where the C++ decode kernels are usable (`matvec.usable()`, float32 compute), the
        projection weights are stored output-major for them (`matvec.OutMajorWeight`, `QuantizedWeight.out_major`),
        and a head stored otherwise gets an output-major copy (`DecodeLayers.head`). Off for the batch-invariant
        mode, whose XLA row-at-a-time products the RL trainer reproduces bit for bit.

        rows (with native): the most rows any product on these layers will have. At most `matvec.MAX_ROWS` (every
        product goes to the kernels, as in `generate`'s decode loop and the engine's calls of that many token
        slots), float32 and int8 weights are stored in the kernels' tiles (`matvec.tile`, 1.1-1.3x faster reads)
        and a tied float32 head gets a tiled copy; None (speculative decoding, whose verify passes may exceed it:
        XLA's product is slower over tiles) keeps [out, in].
        """
        graphdef, state = nnx.split(self.blocks)
        states = [jax.tree.map(lambda a, i=i: a[i], state) for i in range(self.config.num_layers)]
        native = bool(fuse and native and jnp.dtype(self.config.dtype) == jnp.float32 and matvec.usable())
        tiled = native and rows is not None and rows <= matvec.MAX_ROWS
        if fuse:
            fused = []
            for s in states:
                block = nnx.merge(graphdef, s)
                block.fuse_products(quantized=native)
                graphdef_fused, s = nnx.split(block)
                fused.append(s)
            graphdef, states = graphdef_fused, fused
        head = None
        if native:
            native_states = []
            for s in states:
                block = nnx.merge(graphdef, s)
                _kernel_layout(block, tiled)
                graphdef_native, s = nnx.split(block)
                native_states.append(s)
            graphdef, states = graphdef_native, native_states
            table = self.embed[...]
            if not self.config.tie_embeddings:
                w = self.lm_head[...]
                head = w.out_major(tiled) if hasattr(w, "out_major") else matvec.out_major(w, 1, tiled)
            elif hasattr(table, "matmul"):  # a quantized table, stored as the input-major head
                head = table.T.out_major(tiled)
            elif tiled and matvec.tiles(*table.shape):  # a float table read 1.3x faster tiled, at the cost of a copy
                head = matvec.out_major(table.T, 1, tiled)
        return DecodeLayers(graphdef, states, head, native)

    def _run_blocks(self, x, ctx: AttentionContext, cache, layers, return_hidden):
        """(x, cache, weights [L, ...] or None, block outputs [L, B, T, D] or None)."""
        c = self.config
        graphdef, state = nnx.split(self.blocks)

        def block_body(graphdef):
            def body(x, cache, layer_state, i):
                x, cache, w = nnx.merge(graphdef, layer_state)(x, ctx, cache, i)
                return x, cache, (w, x if return_hidden else None)

            return body

        body = block_body(graphdef)
        policy = remat_policy(c.remat)
        # A caller's split_layers() carry their own graph definition (the decode form of the products).
        checkpointed = jax.checkpoint(
            body if layers is None else block_body(layers.graphdef),
            prevent_cse=not c.scan_layers,
            policy=policy,
            static_argnums=(3,),
        )
        one_layout = cache is None or len(cache.groups) == 1
        if c.scan_layers and layers is None and one_layout:

            def scan_body(carry, xs):
                layer_state, i = xs
                x, cache, out = jax.checkpoint(body, prevent_cse=False, policy=policy)(*carry, layer_state, i)
                return (x, cache), out

            (x, cache), (weights, hidden) = jax.lax.scan(
                scan_body, (x, cache), (state, jnp.arange(c.num_layers, dtype=jnp.int32))
            )
            return x, cache, weights, hidden
        outs = []
        for i in range(c.num_layers):
            layer_state = jax.tree.map(lambda a, i=i: a[i], state) if layers is None else layers[i]
            x, cache, out = checkpointed(x, cache, layer_state, i)
            outs.append(out)
        weights, hidden = (None if outs[0][k] is None else jnp.stack([o[k] for o in outs]) for k in (0, 1))
        return x, cache, weights, hidden

    # ---- sizes ----------------------------------------------------------------------------------------------
    def num_params(self) -> int:
        return int(sum(np.prod(a.shape) for a in jax.tree.leaves(nnx.state(self, nnx.Param))))


def build_model(config: ModelConfig, seed: int = 0) -> Decoder:
    """A freshly initialised decoder for `config` (parameters drawn from `seed`)."""
    if not isinstance(config, ModelConfig):
        config = getattr(config, "model", config)
    model = Decoder(config.replace(weights="float32", weights_embed=""), nnx.Rngs(params=seed))
    if config.weights == "float32":
        return model
    # A quantized model (a checkpoint of one): the same structure from quantized random weights.
    return quantize(
        model, config.weights, config.weights_group_size, config.weights_minimums, config.weights_embed or None
    )
