"""The engine in a thread of its own, for callers in other threads (the HTTP server's event loop).

`Engine` is not thread-safe, so one thread owns it: a loop that runs the commands handed to it (submit, cancel),
steps while there is work and sleeps on a condition otherwise. Callers never touch the engine; they hand it
commands and get each request's events back through a callback of their own (`sink`), called from the engine's
thread once per event, with the request's `RequestResult` on the event that finishes it:

    runner = EngineRunner(engine).start()
    ids = runner.submit([dict(prompt_ids=[1, 2, 3], max_tokens=8)], sink).result()   # EngineError if refused
    runner.cancel(ids)                                   # the sink then sees finish_reason "cancelled"
    runner.close()                                       # cancel everything, refuse new requests, stop the thread

It also keeps what /metrics reports: the engine's stats after each step, tokens generated, requests finished by
reason, and the time to first token and between tokens as histograms (seconds, from submit).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from causal_lm.serve.engine import EngineError

# Histogram bucket bounds (seconds): time to first token, and between two tokens of a request.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerClosing(EngineError):
    """A request arrived after shutdown began."""


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count (read and written under the runner's lock)."""

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf adds it)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list:
        """[(upper bound, count of observations <= it)], the last bound +Inf."""
        out, total = [], 0
        for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += c
            out.append((b, total))
        return out


class EngineRunner:
    """`Engine` driven by one thread; submit / cancel / close from any thread (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._commands = collections.deque()  # (fn(engine), Future)
        self._sinks = {}  # request id -> sink; engine thread only
        self._times = {}  # request id -> [submitted, last token] (perf_counter); engine thread only
        self._closing = False
        self._stopped = False
        self.error: BaseException | None = None  # the exception that stopped the engine thread (a bug)
        self.lock = threading.Lock()  # guards the metrics below
        self.snapshot = engine.stats()
        self.tokens_generated = 0
        self.finished = collections.Counter()  # finish reason -> requests
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self._thread = threading.Thread(target=self._loop, name="causal-lm-engine", daemon=True)

    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    # ---- from any thread ------------------------------------------------------------------------------------
    def call(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the engine's thread between steps; its result (or exception) in the Future."""
        future = concurrent.futures.Future()
        with self._cv:
            if self._stopped:
                future.set_exception(ServerClosing("the server is shutting down"))
                return future
            self._commands.append((fn, future))
            self._cv.notify()
        return future

    def submit(self, requests, sink) -> concurrent.futures.Future:
        """Submit every request (dicts of `Engine.submit`'s arguments, plus `n`: that many samples sharing the
        prompt, seeds seed .. seed + n - 1) at once, or none of them: the Future holds their ids in order (n per
        dict), or the EngineError that refused one. `sink(event, result)` is called from the engine's thread for
        each event of these requests; `result` (a RequestResult) only with the event that finishes one."""

        def do(engine):
            if self._closing:
                raise ServerClosing("the server is shutting down")
            ids = []
            try:
                for r in requests:
                    r = dict(r)
                    n = r.pop("n", 1)
                    ids.extend(engine.submit_samples(num_samples=n, **r) if n > 1 else [engine.submit(**r)])
            except BaseException:
                for i in ids:  # all or nothing: the ones already queued go (their events reach no sink)
                    engine.cancel(i)
                    engine.forget(i)
                raise
            now = time.perf_counter()
            for i in ids:
                self._sinks[i] = sink
                self._times[i] = [now, None]
            return ids

        return self.call(do)

    def cancel(self, ids) -> concurrent.futures.Future:
        """Cancel the requests still running or waiting among `ids` (their pages go back at once)."""

        def do(engine):
            for i in ids:
                if i in self._sinks:
                    engine.cancel(i)

        return self.call(do)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, cancel the running and waiting ones (their sinks see "cancelled"), stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the engine's thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._commands and not engine.has_work() and not self._closing:
                        self._cv.wait()
                    commands, self._commands = self._commands, collections.deque()
                    if self._closing and not commands and not engine.has_work() and not self._sinks:
                        self._stopped = True
                        return
                for fn, future in commands:
                    try:
                        future.set_result(fn(engine))
                    except BaseException as e:  # a refused request: the caller's to report
                        future.set_exception(e)
                if self._closing:
                    for i in list(self._sinks):
                        engine.cancel(i)
                if engine.has_work():
                    self._dispatch(engine.step())
                with self.lock:
                    self.snapshot = engine.stats()
        except BaseException as e:  # a bug in the engine: every waiting request hears of it
            self.error = e
            with self._cv:
                self._stopped = True
                commands, self._commands = self._commands, collections.deque()
            for _, future in commands:
                future.set_exception(e)
            for sink in self._sinks.values():
                sink(None, e)
            self._sinks.clear()
            raise

    def _dispatch(self, events) -> None:
        now = time.perf_counter()
        for ev in events:
            sink = self._sinks.get(ev.request_id)
            if sink is None:
                continue
            result = None
            times = self._times[ev.request_id]
            with self.lock:
                if ev.token is not None:
                    self.tokens_generated += 1
                    if times[1] is None:
                        self.ttft.observe(now - times[0])
                    else:
                        self.tpot.observe(now - times[1])
                    times[1] = now
                if ev.finish_reason is not None:
                    self.finished[ev.finish_reason] += 1
            if ev.finish_reason is not None:
                result = self.engine.result(ev.request_id)
                self.engine.forget(ev.request_id)
                del self._sinks[ev.request_id], self._times[ev.request_id]
            sink(ev, result)
