"""On-device generation: prefill (whole or chunked), then the whole decode loop in one jitted while_loop.

Prompts of different lengths are right-padded to a bucket length (a power of two), so a new prompt length
reuses the compiled program. Each row keeps its own length; rows stop independently at a stop token.

Sharded models run the same program: `generate` finds the mesh the weights are laid out on (or takes `mesh=`),
splits the prompts and the KV cache over its batch axes and the cached K/V heads over its tensor axis (the
partition rules of `causal_lm.parallel`), and returns the tokens replicated, so every host of a multi-host run
gets them.

Two paths share the loop and the sampling code and differ only in what they recompute:
  use_cache=True   prefill writes the prompt's K/V once; each step computes K/V for one new token.
  use_cache=False  each step runs the model over the whole sequence so far (every K/V recomputed).

`kv_computed` counts K/V vectors (per layer and KV head) for real tokens, the seed's unit: a 2-token prompt and
3 new tokens cost 2+3+4 = 9 without a cache and 2+1+1 = 4 with one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from causal_lm.decode.sampling import sample
from causal_lm.model.kv_cache import init_cache, require_causal, write_rows


class GenerateError(ValueError):
    """Bad arguments to generate(), raised before anything runs."""


@dataclasses.dataclass
class GenerateResult:
    tokens: list  # per row: the generated ids, up to and including a stop token
    kv_computed: int  # K/V vectors computed for real tokens, per layer and KV head (all rows)
    kv_computed_per_row: list
    steps: int  # decode steps the loop ran (<= max_new_tokens)
    logits: np.ndarray | None = None  # [B, max_new_tokens, V] float32 when return_logits=True


def bucket_length(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= n (at least `minimum`)."""
    b = minimum
    while b < n:
        b *= 2
    return b


def _last_valid_logits(logits, idx):
    """logits [B, T, V], idx [B] -> [B, V] at idx (clipped)."""
    i = jnp.clip(idx, 0, logits.shape[1] - 1)
    return jnp.take_along_axis(logits, i[:, None, None], axis=1)[:, 0]


def _shard_cache(cache, mesh):
    """Keep the cache in the partition rules' layout through prefill and the decode loop (no-op on one device)."""
    if mesh is None:
        return cache
    from causal_lm import parallel

    return jax.lax.with_sharding_constraint(cache, parallel.cache_shardings(cache, mesh))


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "prompt_len",
        "chunk",
        "max_new",
        "use_cache",
        "return_logits",
        "cache_dtype",
        "stream",
        "mesh",
    ),
)
def _generate_jit(
    state,
    tokens,
    lengths,
    key,
    temperature,
    top_k,
    top_p,
    stop_ids,
    *,
    graphdef,
    prompt_len,
    chunk,
    max_new,
    use_cache,
    return_logits,
    cache_dtype,
    stream,
    mesh=None,
):
    model = nnx.merge(graphdef, state)
    c = model.config
    B = tokens.shape[0]
    # Each layer's weights sliced out of the stacked arrays once, here: the decode loop's steps then read them
    # in place instead of copying every layer's weights out of the stack at every step.
    layers = model.split_layers()
    total = prompt_len + max_new
    arange_total = jnp.arange(total, dtype=jnp.int32)

    if use_cache:
        cache = _shard_cache(init_cache(c, B, total, cache_dtype), mesh)

        def prefill_chunk(carry, i):
            cache, last = carry
            piece = jax.lax.dynamic_slice_in_dim(tokens, i * chunk, chunk, axis=1)  # [B, C]
            n_valid = jnp.clip(lengths - i * chunk, 0, chunk)
            seg = (jnp.arange(chunk)[None, :] < n_valid[:, None]).astype(jnp.int32)
            logits, cache = model(piece, segment_ids=seg, cache=cache)
            cache = _shard_cache(cache, mesh)
            idx = lengths - 1 - i * chunk
            in_chunk = (idx >= 0) & (idx < chunk)
            last = jnp.where(in_chunk[:, None], _last_valid_logits(logits, idx), last)
            return (cache, last), None

        last0 = jnp.zeros((B, c.vocab_size), jnp.float32)
        (cache, first_logits), _ = jax.lax.scan(prefill_chunk, (cache, last0), jnp.arange(prompt_len // chunk))
        step_state = cache

        def advance(step_state, tok, active):
            logits, cache = model(
                tok[:, None], segment_ids=active[:, None].astype(jnp.int32), cache=step_state, layers=layers
            )
            return logits[:, 0], _shard_cache(cache, mesh), active.astype(jnp.int32)
    else:
        buf = jnp.zeros((B, total), jnp.int32).at[:, :prompt_len].set(tokens)

        def full(buf, cur):
            seg = (arange_total[None, :] < cur[:, None]).astype(jnp.int32)
            logits, _ = model(buf, segment_ids=seg)
            return _last_valid_logits(logits, cur - 1)

        first_logits = full(buf, lengths)
        step_state = (buf, lengths)

        def advance(step_state, tok, active):
            buf, cur = step_state
            buf = write_rows(buf[:, :, None], tok[:, None, None], cur)[:, :, 0]
            cur = cur + active.astype(jnp.int32)
            return full(buf, cur), (buf, cur), jnp.where(active, cur, 0)

    def emit(step, tok, logits, done, out, out_logits):
        out = out.at[:, step].set(jnp.where(done, -1, tok))
        if return_logits:
            out_logits = out_logits.at[:, step].set(logits)
        if stream:
            # (ordered effects need one device; on a mesh the loop's data dependence keeps steps in order)
            io_callback(_stream_callback, None, step, jnp.where(done, -1, tok), ordered=mesh is None)
        return out, out_logits

    out = jnp.full((B, max_new), -1, jnp.int32)
    out_logits = jnp.zeros((B, max_new, c.vocab_size) if return_logits else (0,), jnp.float32)
    tok = sample(first_logits, jax.random.fold_in(key, 0), temperature, top_k, top_p)
    done = jnp.zeros((B,), bool)
    out, out_logits = emit(0, tok, first_logits, done, out, out_logits)
    done = jnp.isin(tok, stop_ids)
    kv = lengths.astype(jnp.int32)

    def cond(carry):
        step, _, _, done, _, _, _ = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, step_state, tok, done, out, out_logits, kv = carry
        active = ~done
        logits, step_state, kv_step = advance(step_state, tok, active)
        new_tok = sample(logits, jax.random.fold_in(key, step), temperature, top_k, top_p)
        new_tok = jnp.where(done, tok, new_tok)
        out, out_logits = emit(step, new_tok, logits, done, out, out_logits)
        done = done | jnp.isin(new_tok, stop_ids)
        return step + 1, step_state, new_tok, done, out, out_logits, kv + kv_step

    carry = (jnp.int32(1), step_state, tok, done, out, out_logits, kv)
    steps, _, _, _, out, out_logits, kv = jax.lax.while_loop(cond, body, carry)
    result = (out, out_logits, kv, steps)
    if mesh is not None:  # replicated: every process can read the tokens
        from causal_lm import parallel

        result = jax.lax.with_sharding_constraint(result, parallel.replicated(mesh))
    return result


@functools.lru_cache(maxsize=4)
def _replicated_key(mesh):
    """jax.random.key(seed) made on every device of `mesh` (the same key as on one device)."""
    from causal_lm import parallel

    return jax.jit(jax.random.key, out_shardings=parallel.replicated(mesh))


_STREAM: list = [None]
TRACES = [0]  # how many generation programs have been traced; see compile_count()


def compile_count() -> int:
    """Number of generation programs compiled so far in this process (a new prompt bucket, batch size,
    max_new_tokens or model shape compiles a new one; a new prompt length within a bucket does not)."""
    return TRACES[0]


def _stream_callback(step, toks):
    fn = _STREAM[0]
    if fn is not None:
        fn(int(step), np.asarray(toks))


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    chunk_size: int | None = None,
    stop_tokens: Sequence[int] = (),
    return_logits: bool = False,
    cache_dtype: str | None = None,
    on_step: Callable[[int, np.ndarray], None] | None = None,
    mesh=None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` for each prompt (lists of token ids, any lengths) on the device.

    chunk_size: prefill the prompts in chunks of this many tokens (default: one chunk). on_step(step, tokens[B])
    is called from the device loop as each token is produced (-1 for finished rows), for streaming.
    mesh: run on this `causal_lm.parallel` mesh (weights placed by the partition rules if they are not on it
    already). Default: the mesh the model's weights are laid out on, if any, else one device.
    """
    c = model.config
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerateError("prompts must be a non-empty list of token-id lists")
    if prompts and isinstance(prompts[0], (int, np.integer)):
        raise GenerateError("prompts must be a list of token-id lists (wrap a single prompt in a list)")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise GenerateError(f"prompt {lens.index(0)} is empty: generation needs at least one token to condition on")
    for r, p in enumerate(prompts):
        arr = np.asarray(p)
        if not np.issubdtype(arr.dtype, np.integer):
            raise GenerateError(f"prompt {r} holds non-integer values")
        if arr.min() < 0 or arr.max() >= c.vocab_size:
            bad = int(arr[(arr < 0) | (arr >= c.vocab_size)][0])
            raise GenerateError(f"prompt {r} has token id {bad} outside the vocabulary [0, {c.vocab_size})")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if max(lens) + max_new_tokens > c.max_seq_len:
        raise GenerateError(
            f"prompt length {max(lens)} + max_new_tokens {max_new_tokens} = "
            f"{max(lens) + max_new_tokens} exceeds model.max_seq_len={c.max_seq_len}"
        )
    if temperature < 0:
        raise GenerateError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise GenerateError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GenerateError(f"top_p must be in (0, 1] or None, got {top_p}")
    if chunk_size is not None and chunk_size < 1:
        raise GenerateError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if use_cache:
        require_causal(c)

    prompt_len = bucket_length(max(lens))
    chunk = prompt_len if chunk_size is None else int(chunk_size)
    prompt_len = -(-prompt_len // chunk) * chunk  # whole chunks
    tokens = np.zeros((len(prompts), prompt_len), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = p
    stop = np.full((max(8, len(stop_tokens)),), -2, np.int32)
    stop[: len(stop_tokens)] = list(stop_tokens)

    graphdef, state = nnx.split(model)
    args = (
        jnp.asarray(tokens),
        jnp.asarray(lens, jnp.int32),
        jax.random.key(seed),
        jnp.float32(temperature),
        jnp.int32(top_k or 0),
        jnp.float32(1.0 if top_p is None else top_p),
        jnp.asarray(stop),
    )
    if mesh is None:
        from causal_lm import parallel

        mesh = parallel.mesh_of(state)
    if mesh is not None:
        from causal_lm import parallel

        if parallel.mesh_of(state) != mesh:
            state = parallel.shard_tree(state, parallel.tree_shardings(state, mesh))
        # Built from host values on every process (arrays of one process's device cannot join a global jit).
        rows = parallel.shard_global_batch({"tokens": tokens, "lengths": np.asarray(lens, np.int32)}, mesh)
        key = _replicated_key(mesh)(parallel.replicate(np.uint32(seed), mesh))
        args = (rows["tokens"], rows["lengths"], key) + tuple(
            parallel.replicate(a, mesh)
            for a in (np.float32(temperature), np.int32(top_k or 0), np.float32(1.0 if top_p is None else top_p), stop)
        )
    _STREAM[0] = on_step
    try:
        out, out_logits, kv, steps = _generate_jit(
            state,
            *args,
            graphdef=graphdef,
            prompt_len=prompt_len,
            chunk=chunk,
            max_new=int(max_new_tokens),
            use_cache=use_cache,
            return_logits=return_logits,
            cache_dtype=cache_dtype,
            stream=on_step is not None,
            mesh=mesh,
        )
        out = np.asarray(out)
        if on_step is not None:
            jax.effects_barrier()
    finally:
        _STREAM[0] = None
    steps = int(steps)
    rows = [[int(t) for t in row if t >= 0] for row in out]
    kv = [int(x) for x in np.asarray(kv)]
    return GenerateResult(
        tokens=rows,
        kv_computed=sum(kv),
        kv_computed_per_row=kv,
        steps=steps,
        logits=np.asarray(out_logits)[:, :steps] if return_logits else None,
    )
