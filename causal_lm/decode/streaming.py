"""Streaming: handing tokens to a callback as they come out of a decode loop that pauses now and then.

`generate(..., on_step=callback)` runs its loop in segments (the first token, then a few tokens or speculative
passes at a time) and, after each, gives this reporter the output buffer. Rows can be at different places (a
speculative loop emits several tokens per row and pass, finished rows emit nothing), so a column is passed on once
every row has produced it: callback(column, tokens [B]), in order, each column once; -1 for a row that had already
finished. The callback runs on the host, outside any compiled program.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class StreamReporter:
    """Calls `callback(column, tokens)` for each newly complete column of an output buffer (see the module doc)."""

    def __init__(self, callback: Callable[[int, np.ndarray], None] | None):
        self.callback = callback
        self.reported = 0

    def __call__(self, out: np.ndarray, count: np.ndarray, done: np.ndarray) -> None:
        """out [B, W]: tokens so far (-1 where none); count [B]: tokens emitted per row; done [B]: finished rows."""
        if self.callback is None:
            return
        count, done = np.asarray(count), np.asarray(done)
        ready = int(count.max()) if done.all() else int(min(count[~done].min(), count.max()))
        for col in range(self.reported, ready):
            self.callback(col, out[:, col])
        self.reported = max(self.reported, ready)
