"""jax.profiler traces: of a block of code (`profile_trace`, also what a benchmark wraps its timed section in), and
of chosen training steps (`StepProfiler`, driven by train.profile_steps=START,END).

A trace directory gets what `jax.profiler.start_trace` writes into `plugins/profile/<run>/`: `<host>.xplane.pb`,
which TensorBoard's profile plugin reads (`pip install tensorboard tensorboard-plugin-profile`, then
`tensorboard --logdir DIR`), `<host>.trace.json.gz` (the same events as Chrome-trace JSON) and
`perfetto_trace.json.gz`, which https://ui.perfetto.dev opens directly.
Each traced training step is annotated as a step (`jax.profiler.StepTraceAnnotation`), so the trace viewer
shows step boundaries.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Iterator

import jax

PROFILE_DIR = "profile"  # inside a training workdir


@contextlib.contextmanager
def profile_trace(directory: str, *, perfetto: bool = True) -> Iterator[str]:
    """Trace everything JAX runs inside the block into `directory` (created if missing); yields the directory.

    Work dispatched inside the block but still running when it ends may be cut off: block on the results (e.g.
    `jax.block_until_ready`) inside the block. perfetto: also write `perfetto_trace.json.gz`."""
    os.makedirs(directory, exist_ok=True)
    jax.profiler.start_trace(directory, create_perfetto_trace=perfetto)
    try:
        yield directory
    finally:
        jax.profiler.stop_trace()


def trace_files(directory: str) -> list[str]:
    """The trace files under `directory` (xplane protobufs for TensorBoard, trace JSON for Perfetto), sorted."""
    pattern = os.path.join(directory, "plugins", "profile", "*", "*")
    return sorted(f for f in glob.glob(pattern) if f.endswith((".xplane.pb", "trace.json.gz")))


class StepProfiler:
    """Traces training steps START..END (1-based, inclusive) into `directory`.

    `run(step, fn, *args)` calls `fn(*args)` (the jitted step): inside the window as an annotated step of a
    trace that starts with the first step of the window this process runs (a run resumed inside the window
    traces the rest of it) and stops after step END, once its results are computed. Outside the window it is
    a plain call. `close()` stops a trace still open (training ended or failed inside the window).
    """

    def __init__(self, steps: tuple[int, int] | None, directory: str):
        self.steps = steps
        self.directory = directory
        self._trace = None

    def run(self, step: int, fn: Callable, *args):
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return fn(*args)
        if self._trace is None:
            self._trace = profile_trace(self.directory)
            self._trace.__enter__()
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            out = fn(*args)
        if step == self.steps[1]:
            jax.block_until_ready(out)  # the device work of the last step belongs in the trace
            self.close()
        return out

    @property
    def active(self) -> bool:
        return self._trace is not None

    def close(self) -> None:
        if self._trace is not None:
            trace, self._trace = self._trace, None
            trace.__exit__(None, None, None)
