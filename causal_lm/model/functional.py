"""Jitted pure entry points over a split model (graph definition + state).

Calling an NNX module eagerly runs op by op; these functions split the module once per call, jit a pure
function of its state, and reuse the compiled program for every call with the same shapes.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from causal_lm.model.weights import check_weights


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _forward(state, tokens, positions, segment_ids, cache, *, graphdef):
    return nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segment_ids, cache=cache)


def forward(model, tokens, *, positions=None, segment_ids=None, cache=None):
    """Jitted `model(tokens, ...)`: (logits [B, T, V] float32, new cache or None). The cache is donated.

    Inputs are validated on the host first (token ids, lengths, cache capacity, finite weights), before any compute.
    """
    model.validate(tokens, positions, segment_ids, cache)
    graphdef, state = nnx.split(model)
    check_weights(state)
    return _forward(state, tokens, positions, segment_ids, cache, graphdef=graphdef)
