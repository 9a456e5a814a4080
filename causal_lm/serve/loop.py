"""The engine as a decode loop: `EngineLoop` implements `DecodeLoop` (causal_lm/decode/loop.py), so `drive` runs
and streams engine requests exactly as it runs plain and speculative decoding.

    loop = EngineLoop(engine, prompts, max_new_tokens=20, temperature=0.0)   # submit's other arguments
    end = drive(loop, on_step)             # on_step(column, tokens [B]) as for generate(..., on_step=...)
    loop.results(end)                      # one RequestResult per prompt, in order

The loop's unit (`until`, `clock`) is tokens, as for plain decoding: start(until) submits the prompts and runs
engine steps until every request has emitted `until` tokens or finished; step runs one engine step; resume(s,
until) continues, its decode bursts (several tokens per engine step) cut so as not to run past `until`. Other
requests already in the engine are scheduled alongside (and run by the same steps); the loop's state reports only
its own. Each request's tokens are the engine's: greedy ones equal `generate` of that prompt alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from causal_lm.decode.loop import Progress


@dataclasses.dataclass(frozen=True)
class EngineState:
    """The loop's requests seen after some engine steps (host values: the engine keeps the device state)."""

    ids: tuple  # request id of each prompt
    out: np.ndarray  # [B, max_new_tokens] tokens so far, -1 where none
    count: np.ndarray  # [B] tokens emitted per request
    done: np.ndarray  # [B] bool: finished (length, stop or cancelled)
    steps: int  # engine steps run by this loop


class EngineLoop:
    """`DecodeLoop` over an `Engine` (see the module docstring). submit_kwargs: submit's arguments other than
    prompt_ids and max_tokens (temperature, top_k, top_p, seed, stop, logprobs, ...), the same for every prompt."""

    first_pause = 1  # a streaming start pauses as soon as every request has its first token

    def __init__(self, engine, prompts, max_new_tokens: int, **submit_kwargs):
        self.engine = engine
        self.prompts = [list(p) for p in prompts]
        if not self.prompts:
            raise ValueError("EngineLoop needs at least one prompt")
        self.limit = int(max_new_tokens)
        self.submit_kwargs = dict(submit_kwargs)

    def start(self, until: int) -> EngineState:
        ids = tuple(self.engine.submit(p, max_tokens=self.limit, **self.submit_kwargs) for p in self.prompts)
        B = len(ids)
        s = EngineState(ids, np.full((B, self.limit), -1, np.int32), np.zeros(B, np.int64), np.zeros(B, bool), 0)
        return self.resume(self._seen(s, 0), until)

    def step(self, s: EngineState, max_burst: int | None = None) -> EngineState:
        self.engine.step(max_burst=max_burst)
        return self._seen(s, s.steps + 1)

    def resume(self, s: EngineState, until: int) -> EngineState:
        while not s.done.all() and self._clock(s) < until:
            s = self.step(s, max_burst=until - self._clock(s))  # a decode burst stops where the caller pauses
        return s

    def progress(self, s: EngineState) -> Progress:
        return Progress(s.out, s.count, s.done, self._clock(s))

    def results(self, s: EngineState) -> list:
        """One RequestResult per prompt, in order."""
        return [self.engine.result(rid) for rid in s.ids]

    def _clock(self, s: EngineState) -> int:
        """Tokens every unfinished request has emitted (the limit once all are done)."""
        return self.limit if s.done.all() else int(s.count[~s.done].min())

    def _seen(self, s: EngineState, steps: int) -> EngineState:
        out, count, done = s.out.copy(), s.count.copy(), s.done.copy()
        for b, rid in enumerate(s.ids):
            r = self.engine.result(rid)
            out[b, : len(r.tokens)] = r.tokens
            count[b], done[b] = len(r.tokens), r.finish_reason is not None
        return EngineState(s.ids, out, count, done, steps)
