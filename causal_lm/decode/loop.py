"""The decode loop protocol: start, step, resume. Plain decoding, speculative decoding and the engine implement it.

    start(until)      prefill the prompts, draw the first token, then step until `until` (the loop's own unit:
                      tokens for plain decoding, target passes for speculative decoding) or every row is done
    step(state)       one iteration of the loop (the body of its jitted while_loop: one token per row, or one
                      draft-and-check pass)
    resume(s, until)  continue a paused loop (a streaming caller showed what came so far)
    progress(s)       the host's view of a state: tokens so far, how many per row, which rows are done

`drive` is the one host loop over any implementation: run to the end, or pause every few units to hand new tokens to
a streaming callback. Each loop keeps its own state type (a typed carry, never a tuple) and takes its sampling
settings as one pytree (`BatchSampling`), so no loop threads them positionally.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar

import numpy as np

from causal_lm.decode.streaming import StreamReporter

S = TypeVar("S")

# Streaming shows the first token as soon as it exists, then pauses the loop every STREAM_EVERY units to hand the
# new tokens to the callback: a host round trip per pause, no host callbacks inside the compiled programs (which
# would keep them out of the persistent compilation cache).
STREAM_EVERY = 8


@dataclasses.dataclass(frozen=True)
class Progress:
    """A loop state seen from the host."""

    out: np.ndarray  # [B, W] tokens so far, -1 where none
    count: np.ndarray  # [B] tokens emitted per row
    done: np.ndarray  # [B] bool
    clock: int  # the loop's own unit so far (tokens, or passes): where `until` counts from


class DecodeLoop(Protocol[S]):
    """What `drive` needs from a decode loop (see the module docstring)."""

    limit: int  # the `until` that runs the loop to its end
    first_pause: int  # the `until` of a streaming start: as soon as the first token exists

    def start(self, until: int) -> S: ...

    def step(self, s: S) -> S: ...

    def resume(self, s: S, until: int) -> S: ...

    def progress(self, s: S) -> Progress: ...


def drive(loop: DecodeLoop[S], on_step=None) -> S:
    """Run `loop` to its end; with `on_step(column, tokens [B])`, pause every STREAM_EVERY units to report."""
    if on_step is None:
        return loop.start(loop.limit)
    s = loop.start(loop.first_pause)
    report = StreamReporter(on_step)
    while True:
        p = loop.progress(s)
        report(p.out, p.count, p.done)
        if p.done.all() or p.clock >= loop.limit:
            return s
        s = loop.resume(s, min(loop.limit, p.clock + STREAM_EVERY))
