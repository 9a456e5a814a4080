"""Streaming tokens out of the on-device decode loop, one callback per `generate` call.

The loop reports each step through `jax.experimental.io_callback`, whose Python function is fixed when the program
is traced and shared by every later call of the compiled program. So the traced function is `dispatch`, which
looks the call's own callback up by a stream id passed to the program as an ordinary (traced) argument: concurrent
or nested `generate` calls each reach their own callback, and a new callback never recompiles.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable

import numpy as np


class StreamRegistry:
    """Callbacks of the generate calls now running, by stream id."""

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[int, np.ndarray], None]] = {}
        self._reported: dict[int, int] = {}  # columns already passed on, for streams fed whole buffers
        self._ids = itertools.count(1)

    @contextlib.contextmanager
    def open(self, callback: Callable[[int, np.ndarray], None]):
        """Register `callback` for the duration of one call; yields its stream id."""
        with self._lock:
            sid = next(self._ids) % (2**31 - 1)
            self._callbacks[sid] = callback
            self._reported[sid] = 0
        try:
            yield sid
        finally:
            with self._lock:
                self._callbacks.pop(sid, None)
                self._reported.pop(sid, None)

    def dispatch(self, sid, step, tokens) -> None:
        """Called from the device loop: forward (step, tokens [B]) to the callback of stream `sid`."""
        with self._lock:
            callback = self._callbacks.get(int(sid))
        if callback is not None:
            callback(int(step), np.asarray(tokens))

    def dispatch_rows(self, sid, out, count, done) -> None:
        """Called from a loop that emits several tokens per row per step (speculative decoding) with its whole
        output buffer out [B, W], tokens emitted per row count [B] and finished rows done [B]: passes on, in
        order, each column that every row has now produced (a finished row has produced all of its columns, -1
        past its end), as callback(column, tokens [B])."""
        sid = int(sid)
        with self._lock:
            callback, start = self._callbacks.get(sid), self._reported.get(sid, 0)
        if callback is None:
            return
        out, count, done = np.asarray(out), np.asarray(count), np.asarray(done)
        ready = int(count.max()) if done.all() else int(min(count[~done].min(), count.max()))
        for col in range(start, ready):
            callback(col, out[:, col])
        with self._lock:
            if sid in self._reported:
                self._reported[sid] = max(start, ready)


STREAMS = StreamRegistry()
