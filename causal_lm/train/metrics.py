"""What people watch: FLOP counts and MFU, metrics.jsonl + TensorBoard event files, loss-curve plots.

FLOPs (explicit count, the PaLM-appendix convention): a forward pass costs 2 FLOPs per matmul weight per token
(every weight matrix, the LM head included even when tied to the embedding; embedding lookups, norms and biases
are not matmuls) plus the attention products, 2 * N * (H_qk + H_v) FLOPs per layer per attended key. Under the
causal mask query i attends to i+1 keys, (T+1)/2 on average: the attention term is HALVED against full
attention (a sliding window caps each query's keys at the window). Training costs 3x the forward pass
(backward = 2x forward); recomputation under remat is not counted, which is what makes this *model* FLOPs
utilisation.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import ModelConfig
from causal_lm.notes import note
from causal_lm.train.state import decays, param_shapes

METRICS_FILE = "metrics.jsonl"


def forward_flops_per_token(model_config: ModelConfig, params, seq_len: int) -> float:
    """Forward-pass FLOPs per token of a `seq_len`-token row (see the module docstring)."""
    c = model_config
    matmul = 0
    for name, shape in param_shapes(params).items():
        path = tuple(name.split("."))
        if path[-1] in ("embed", "pos_embed") or not decays(path):
            continue
        matmul += int(np.prod(shape))
    if c.tie_embeddings:
        matmul += c.d_model * c.vocab_size  # the LM head reuses the embedding as a matmul
    qk_dim = c.mla.qk_nope_head_dim + c.rope_dim if c.attention_type == "mla" else c.head_dim
    v_dim = c.mla.v_head_dim if c.attention_type == "mla" else c.head_dim
    i = np.arange(seq_len)
    keys = 0.0  # attended keys per query, summed over layers
    for window in getattr(c, "layer_windows", (0,) * c.num_layers):
        if c.attention_mask != "causal":  # no mask, or masked after a full softmax: every key's score is computed
            visible = np.full(seq_len, seq_len if not window else min(window, seq_len))
        else:  # causal: query i sees i+1 keys (at most the window), on average (T+1)/2 ~ half of full attention
            visible = np.minimum(i + 1, window) if window else i + 1
        keys += float(visible.mean())
    attention = 2 * c.num_heads * (qk_dim + v_dim) * keys
    return 2.0 * matmul + attention


def train_flops_per_token(model_config: ModelConfig, params, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(model_config, params, seq_len)


# Catalogued per-chip figures: dense (no 2:4 sparsity) peak FLOP/s for the compute dtypes used here and HBM
# bandwidth in bytes/s. Matched by substring of jax's device_kind, FIRST match wins, so a variant comes before its
# family name ("H100 PCIe" before "H100", "GH200" before "H200"). Sources: NVIDIA's product datasheets
# (A100: "NVIDIA A100 Tensor Core GPU" datasheet; H100 SXM/PCIe/NVL: "NVIDIA H100 Tensor Core GPU" datasheet;
# H200 SXM/NVL: "NVIDIA H200 Tensor Core GPU" datasheet; GH200: "NVIDIA GH200 Grace Hopper Superchip" datasheet,
# 96 GB HBM3 version; B200: the HGX B200 specification, 8-GPU totals / 8 at 1,000 W, whose sparse BF16 figure
# 4.5 PFLOPS is halved) and Google Cloud's TPU system-architecture pages (v4, v5e, v5p, v6e) — the datasheets
# quote sparse tensor FLOP/s for NVIDIA parts; the dense figure is half of it.
DATASHEET = {  # device_kind substring -> {"bfloat16" / "float32": FLOP/s, "hbm": bytes/s}
    "H100 PCIe": {"bfloat16": 756e12, "float32": 51e12, "hbm": 2.0e12},
    "H100 NVL": {"bfloat16": 835e12, "float32": 60e12, "hbm": 3.9e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12, "hbm": 3.35e12},  # SXM5 80 GB HBM3
    "GH200": {"bfloat16": 989e12, "float32": 67e12, "hbm": 4.0e12},
    "H200 NVL": {"bfloat16": 835e12, "float32": 60e12, "hbm": 4.8e12},
    "H200": {"bfloat16": 989e12, "float32": 67e12, "hbm": 4.8e12},  # SXM5 141 GB HBM3e
    "GB200": {"bfloat16": 2.5e15, "float32": 90e12, "hbm": 8.0e12},  # at 1,200 W
    "B200": {"bfloat16": 2.25e15, "float32": 80e12, "hbm": 8.0e12},  # HGX B200
    "A100": {"bfloat16": 312e12, "float32": 19.5e12, "hbm": 2.039e12},  # SXM4 80 GB (40 GB: 1.555e12)
    "TPU v4": {"bfloat16": 275e12, "hbm": 1.2e12},
    "TPU v5 lite": {"bfloat16": 197e12, "hbm": 819e9},  # v5e
    "TPU v5e": {"bfloat16": 197e12, "hbm": 819e9},
    "TPU v5p": {"bfloat16": 459e12, "hbm": 2.765e12},
    "TPU v6": {"bfloat16": 918e12, "hbm": 1.64e12},  # v6e (Trillium), device_kind "TPU v6 lite"
    "TPU v5": {"bfloat16": 459e12, "hbm": 2.765e12},  # v5p when its device_kind reads "TPU v5"
}


def datasheet(device_kind: str) -> tuple[str, dict] | None:
    """(matched table key, figures) for a jax `device_kind` (e.g. "NVIDIA H200", "TPU v5 lite"), or None for a
    device with no catalogued figures (CPUs, unknown accelerators). No JAX import: usable for a device that this
    process does not hold (a benchmark's JSON, say)."""
    kind = device_kind.lower()
    for key, figures in DATASHEET.items():
        if key.lower() in kind:
            return key, figures
    return None


@functools.lru_cache(maxsize=4)
def peak_flops(dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number comes from): the datasheet for known accelerators, else a
    measured large matmul in `dtype` (on a CPU there is no honest datasheet number)."""

    dev = jax.devices()[0]
    found = datasheet(dev.device_kind)
    if found is not None and dtype in found[1]:
        return found[1][dtype], f"datasheet {dev.device_kind}"
    n = 1024 if dev.platform == "cpu" else 8192
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.3:
        f(a).block_until_ready()
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0), f"measured {n}x{n} {dtype} matmul"


# ---- metrics files -----------------------------------------------------------------------------------------


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch.

    tensorboardX's writer module imports torch when it is installed (only to accept torch tensors as values), which
    adds 3-5 s to the start of every training process on a machine with the `interop` extra. We log Python floats
    and strings, so torch is hidden for the duration of that one import; a torch imported before (or after) is
    untouched."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """One JSON object per logged step in `workdir/metrics.jsonl`, and TensorBoard scalars in `workdir/tb`.

    On resume from step s, lines for steps > s (written by the interrupted run after its last checkpoint) are
    dropped so the file reads as one uninterrupted run; TensorBoard is told the same with `purge_step`. Whatever
    else is off about the history is said in a `Note` and never silently rewritten: a missing file (the history up
    to s is lost; new records are appended to a new file), a file that ends before step s (the missing steps are
    named), a partially written last line (a run killed while writing it: ignored) or a damaged line.
    """

    def __init__(self, workdir: str, start_step: int = 0, tensorboard: bool = True):
        self.path = os.path.join(workdir, METRICS_FILE)
        if os.path.exists(self.path):
            records = read_metrics(workdir, _notes_for="resuming")
            kept = [r for r in records if r.get("step", 0) <= start_step]
            dropped = len(records) - len(kept)
            if dropped:
                note(
                    f"{self.path}: dropped {dropped} record(s) after step {start_step}, "
                    + (
                        "logged after the checkpoint this run resumes from (by a run that was interrupted, or that "
                        "this one goes back from); this run logs those steps again"
                        if start_step
                        else "left by an earlier run that saved no checkpoint"
                    )
                )
            last = max((r.get("step", 0) for r in kept), default=0)
            if start_step and last < start_step:
                note(
                    f"{self.path} ends at step {last} but the run resumes from step {start_step}: the records of "
                    f"steps {last + 1}..{start_step} are missing (the file was truncated); new records are appended "
                    "from there"
                )
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                for r in kept:
                    f.write(json.dumps(r) + "\n")
            os.replace(tmp, self.path)
        elif start_step:
            note(
                f"{self.path} is missing: the history up to step {start_step} is lost; the records from step "
                f"{start_step + 1} on go to a new file"
            )
        self._f = open(self.path, "a")
        self._tb = None
        # The event file is opened at the first record, not here: a rerun that trains nothing (already at
        # train.steps) must not leave an empty event file behind for every rerun.
        self._tb_args = (os.path.join(workdir, "tb"), start_step + 1 if start_step else None) if tensorboard else None

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is None and self._tb_args is not None:
            SummaryWriter = _summary_writer_class()
            logdir, purge_step = self._tb_args
            self._tb = SummaryWriter(logdir, purge_step=purge_step)
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k == "step":
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k if "/" in k else ("eval/" if k.startswith("val_") else "train/") + k, v, step)
                elif isinstance(v, str) and k == "sample":
                    self._tb.add_text("sample", v, step)
            self._tb.flush()

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str, *, _notes_for: str = "reading") -> list[dict]:
    """The records of `workdir/metrics.jsonl`. A partially written last line (a run killed while writing it) and
    lines that are not JSON records are skipped, each with a `Note`."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: has training run in {workdir!r}?")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    torn = lines.pop() if lines else ""  # after the last newline: "" unless the last write was cut short
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            r = None
        if not isinstance(r, dict) or not isinstance(r.get("step"), int):
            note(f"{path}: line {i} is not a metrics record and was skipped: {line[:60]!r}", stacklevel=4)
            continue
        out.append(r)
    if torn.strip():
        what = "it is dropped" if _notes_for == "resuming" else "it is ignored"
        note(
            f"{path}: the last line was only partly written (a run killed while writing it): {what}: {torn[:60]!r}",
            stacklevel=4,
        )
    return out


def plot_metrics(workdir: str, out: str | None = None) -> str:
    """Loss curves (train loss and validation loss against step, learning rate below) as a PNG; returns its
    path (default `workdir/loss.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(workdir)
    if not records:
        raise ValueError(f"{os.path.join(workdir, METRICS_FILE)} holds no records yet")
    out = out or os.path.join(workdir, "loss.png")
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    lr = [(r["step"], r["lr"]) for r in records if "lr" in r]
    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{os.path.basename(os.path.abspath(workdir))}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if lr:
        ax_lr.plot(*zip(*lr, strict=True), color="gray")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
