"""Divergence detection: a loss spike against the recent running statistics, or a non-finite step.

A run that diverges rarely goes straight to NaN: the loss first jumps by orders of magnitude (say 1.6e7), the
weights are wrecked, and the following steps sit at ln(V), a uniform guess, with finite numbers throughout. So
the loop checks every step's loss (at each log step, before anything is written or saved) two ways:

    spike  <=>  loss - mean > train.spike_threshold (nats)   and   loss - mean > train.spike_zscore * std

against the mean and standard deviation of the previous `train.spike_window` healthy steps, once at least
`MIN_HISTORY` are known (a resumed run starts a new history); and, from the first step on,

    worse than a uniform guess  <=>  loss > max(ln(vocab_size), first loss of this run) + train.spike_threshold

which catches a run that blows up before it has a history (a freshly initialised model scores about ln(V); a
model that scores far worse is confidently wrong, and a fine-tuned one starting above ln(V) is measured from its
own start). Both conditions of the spike test must hold: the nats keep a noisy low-loss run (a model that copies
its input, loss ~0.07) from tripping on relative noise, the standard deviations keep a fast-falling early run
with large step-to-step swings from tripping on one bump. A non-finite loss or gradient norm is caught on the
device (`TrainState.bad_step`). Training losses fall or wobble; they do not jump by a nat in one step unless
something broke, and the defaults were chosen from the largest jumps of healthy runs of the presets (see
docs/reliability.md).
"""

from __future__ import annotations

import collections
import math

MIN_HISTORY = 5


class DivergenceError(RuntimeError):
    """Training diverged (a loss spike, or a non-finite loss or gradient); nothing from that step on was saved.

    The CLI reports it as one error line with its `hint` and exit status 1 (`exit_status`).

    `step`: the first divergent step; `last_healthy`: the newest checkpoint before it (None if there is none);
    `hint`: how to resume from it."""

    exit_status = 1

    def __init__(self, message: str, step: int, last_healthy: int | None, hint: str = ""):
        super().__init__(message)
        self.step, self.last_healthy, self.hint = step, last_healthy, hint


class NonFiniteLossError(DivergenceError):
    """Training produced a non-finite loss, gradient or parameter; nothing from that step on was saved."""


class SpikeMonitor:
    """Running statistics of the recent healthy losses; `check(step, loss)` says whether `loss` is a spike."""

    def __init__(self, threshold: float, zscore: float, window: int, vocab_size: int):
        self.threshold, self.zscore = threshold, zscore
        self.uniform = math.log(vocab_size)
        self.ceiling: float | None = None  # max(ln V, the first loss) + threshold, set by the first check
        self.losses: collections.deque[float] = collections.deque(maxlen=window)

    def check(self, step: int, loss: float) -> str | None:
        """None for a healthy loss (which then joins the history), else what is wrong with it."""
        if not math.isfinite(loss):
            return f"the loss at step {step} is {loss}"
        if self.threshold > 0 and self.ceiling is None:
            self.ceiling = max(self.uniform, loss) + self.threshold
        if self.threshold > 0 and loss > self.ceiling:
            return (
                f"the loss at step {step} is {loss:.6g}, more than train.spike_threshold={self.threshold:g} nats above "
                f"{self.ceiling - self.threshold:.4f} (ln of the vocabulary size, a uniform guess, or this run's first "
                "loss if higher): worse than guessing"
            )
        if self.threshold > 0 and len(self.losses) >= MIN_HISTORY:
            n = len(self.losses)
            mean = sum(self.losses) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / n)
            jump = loss - mean
            if jump > self.threshold and jump > self.zscore * std:
                return (
                    f"the loss jumped to {loss:.6g} at step {step}, {jump:.4g} nats above the mean {mean:.4f} of the "
                    f"previous {n} steps ({jump / std if std > 0 else math.inf:.1f} standard deviations; limits: "
                    f"train.spike_threshold={self.threshold:g} nats and train.spike_zscore={self.zscore:g})"
                )
        self.losses.append(loss)
        return None
