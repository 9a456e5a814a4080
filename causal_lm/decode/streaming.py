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
        self._ids = itertools.count(1)

    @contextlib.contextmanager
    def open(self, callback: Callable[[int, np.ndarray], None]):
        """Register `callback` for the duration of one call; yields its stream id."""
        with self._lock:
            sid = next(self._ids) % (2**31 - 1)
            self._callbacks[sid] = callback
        try:
            yield sid
        finally:
            with self._lock:
                self._callbacks.pop(sid, None)

    def dispatch(self, sid, step, tokens) -> None:
        """Called from the device loop: forward (step, tokens [B]) to the callback of stream `sid`."""
        with self._lock:
            callback = self._callbacks.get(int(sid))
        if callback is not None:
            callback(int(step), np.asarray(tokens))


STREAMS = StreamRegistry()
