"""Validation metrics and the eval-time sample.

    evaluate(model, batches, token_bytes=None) -> {"loss", "perplexity", "bits_per_byte", "tokens"}

`loss` is the mean cross entropy in nats per target token over all batches together (sums over tokens divided
by the total count, not a mean of batch means). Bits per byte divides the same total by ln 2 and by the UTF-8
bytes the target tokens stand for (`tokenizer.token_bytes()`; EOS counts 0 bytes but its loss is included), so
models with different tokenizers can be compared.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from causal_lm.decode import generate
from causal_lm.train.state import split_params
from causal_lm.train.step import eval_sums


def evaluate_split(
    graphdef, params, rest, batches: Sequence[dict], token_bytes: np.ndarray | None = None, place=None
) -> dict:
    """`evaluate` over an already split model (what the training loop holds). place: lays each numpy batch out
    on the devices (a sharded model's mesh) before the jitted step; the host-side counts use the numpy batch."""

    if not batches:
        raise ValueError("evaluate() needs at least one batch")
    # dispatched back to back, one sync below
    sums = [eval_sums(graphdef, params, rest, place(b) if place else b) for b in batches]
    loss_sum, count = (float(np.sum(x, dtype=np.float64)) for x in zip(*jax.device_get(sums), strict=True))
    if count == 0:
        raise ValueError("the evaluation batches hold no target tokens")
    loss = loss_sum / count
    out = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count)}
    if token_bytes is not None:
        nbytes = sum(float((token_bytes[b["targets"]] * b["weights"]).sum()) for b in batches)
        out["bits_per_byte"] = loss_sum / math.log(2) / nbytes if nbytes else float("nan")
    return out


def evaluate(model, batches: Sequence[dict], token_bytes: np.ndarray | None = None) -> dict:
    """Validation loss (nats/token), perplexity, bits per byte (with `token_bytes`) and token count of `model`
    over `batches` (dicts of tokens/targets/segment_ids/weights, e.g. `build_data(config).val`)."""
    graphdef, params, rest = split_params(model)
    return evaluate_split(graphdef, params, rest, batches, token_bytes)


def sample_text(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    seed: int = 0,
    use_cache: bool = True,
) -> str:
    """A short continuation of `prompt`, generated on the device through the KV-cache path."""

    ids = tokenizer.encode(prompt) or [tokenizer.bos_id]
    room = model.config.max_seq_len - len(ids)
    if room <= 0 or max_new_tokens <= 0:
        return ""
    res = generate(
        model,
        [ids],
        max_new_tokens=min(max_new_tokens, room),
        use_cache=use_cache,
        temperature=temperature,
        seed=seed,
        stop_tokens=[tokenizer.eos_id],
    )
    return tokenizer.decode(res.tokens[0])
