"""train.task=dpo and train.task=grpo in the training loop, from the CLI (causal_lm/train/post_tasks.py).

The bug classes: a reference that moves with the policy (DPO's loss not ln 2 at the start, or a second copy
that drifts), a resume that does not continue the same run (data position, adapters, optimizer), a GRPO log that
does not report the sampler/trainer ratio, a task that cannot start from a converted or a trained model.
"""

import json
import math
import os

import jax
import numpy as np
import pytest

from causal_lm.cli import main
from causal_lm.config import load_config
from causal_lm.train.checkpoint import Checkpointer
from causal_lm.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def _prefs(path, n=24):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(0, 20, 2))
            rec = {"prompt": f"{a} + {b}?", "chosen": f"It is {a + b}.", "rejected": f"It is {a + b + 1}."}
            f.write(json.dumps(rec) + "\n")
    return str(path)


def _hf_workdir(tmp_path):
    """A tiny Llama with a ChatML BPE tokenizer, written as a Hugging Face folder and converted to a workdir."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_chat_template import make_folder

    from causal_lm.interop.hf import read_hf_tokenizer

    src, hf = make_folder(tmp_path / "hf", "chatml")
    tok = read_hf_tokenizer(src, hf)
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=128,
        **hf,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    wd = str(tmp_path / "converted")
    assert main(["convert", "--from-hf", src, "--workdir", wd]) == 0
    return wd


def _adapters(workdir, step):
    """(meta, the checksums of the arrays) of a checkpoint: equal checksums, equal bits."""
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        return ckpt.read_meta(step), ckpt.read_integrity(step)["arrays"]
    finally:
        ckpt.close()


def test_dpo_with_lora_on_a_converted_hf_model_from_the_cli_resumes_exactly(tmp_path, capsys):
    """DPO + LoRA from the CLI on a converted Hugging Face model: the loss starts at ln 2 (the reference is the
    base without adapters), margins and accuracy are logged, and 1 step + a resumed 2nd equals 2 straight
    (metrics and the checkpointed adapters and optimizer state, by their checksums)."""
    import shutil

    wd = _hf_workdir(tmp_path)
    prefs = _prefs(tmp_path / "prefs.jsonl")
    args = ["train.task=dpo", f"data.corpus={prefs}", "train.batch_size=4", "train.seq_len=96"]
    args += ["train.lora_rank=2", "train.lora_alpha=4", "train.lora_targets=q,v,down", "train.learning_rate=0.01"]
    args += ["train.log_every=1", "train.eval_every=2", "train.checkpoint_every=1", "train.sample_tokens=0"]
    args += ["train.warmup_steps=1", "train.min_lr_ratio=1.0", "train.progress=false"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    shutil.copytree(wd, straight)
    shutil.copytree(wd, resumed)
    config = os.path.join(wd, "config.json")
    assert main(["train", "--config", config, "--workdir", straight, *args, "train.steps=2"]) == 0
    assert main(["train", "--config", config, "--workdir", resumed, *args, "train.steps=1"]) == 0
    assert main(["train", "--config", config, "--workdir", resumed, *args, "train.steps=2"]) == 0
    capsys.readouterr()
    rows = lambda w: [r for r in read_metrics(w) if "loss" in r]  # noqa: E731
    first = rows(straight)[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert {"reward_chosen", "reward_rejected", "reward_accuracy"} <= set(first)
    keys = ("step", "loss", "grad_norm", "reward_margin", "reward_accuracy")
    assert [{k: r[k] for k in keys} for r in rows(resumed)] == [{k: r[k] for k in keys} for r in rows(straight)]
    assert rows(straight)[1]["loss"] != first["loss"]  # it trained
    meta_a, arrays_a = _adapters(straight, 2)
    meta_b, arrays_b = _adapters(resumed, 2)
    assert {k.split(".")[-1] for k in meta_a["param_shapes"]} == {"lora_a", "lora_b"}
    assert arrays_a == arrays_b  # adapters, optimizer state, step, rng: the same bits
    assert not os.path.isdir(os.path.join(straight, "frozen_base", "checkpoints", "1"))  # one frozen copy only


def test_grpo_on_a_trained_workdir_logs_the_first_ratio_and_rewards(tmp_path, capsys):
    """lm training, then train.task=grpo on the same workdir from the CLI: the console states the first update's
    max |ratio - 1| (sampler vs trainer: exactly 0 on CPU float32), the record holds reward, ratio, KL and
    length statistics, and the checkpoint continues the step count."""
    wd = str(tmp_path / "wd")
    base = ["train.sample_tokens=0", "train.progress=true", "train.seq_len=64", "train.batch_size=4"]
    assert main(["train", "--config", "configs/tiny.py", "--workdir", wd, *base, "train.steps=1"]) == 0
    grpo = ["train.task=grpo", "train.steps=2", "train.group_size=3", "train.prompts_per_step=2"]
    grpo += ["train.max_new_tokens=8", "train.kl_coef=0.1", "train.log_every=1", "train.eval_every=2"]
    grpo += ["train.inner_steps=2"]  # two clipped updates per rollout batch, one step of the count
    assert main(["train", "--config", "configs/tiny.py", "--workdir", wd, "--task", "grpo", *base, *grpo[1:]]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("GRPO first update: max |ratio - 1| = "))
    assert float(line.split("= ")[1].split()[0]) == 0.0  # bitwise parity: the first update's ratio is exactly 1
    rec = [r for r in read_metrics(wd) if r["step"] == 2][-1]
    for k in ("reward_mean", "reward_std", "ratio_mean", "ratio_min", "ratio_max", "kl", "length_mean", "val_loss"):
        assert k in rec, k
    assert rec["length_max"] <= 8 and rec["kl"] >= 0
    assert rec["ratio_max_dev"] == 0.0 < rec["last_ratio_max_dev"]  # the second inner update sees a moved policy
    assert max(Checkpointer(wd, read_only=True).all_steps()) == 2
    cfg = load_config(os.path.join(wd, "config.json"))
    assert cfg.train.task == "grpo"
    # resumed for one more rollout: the step count is rollouts, not inner updates (else the restored step is
    # already past 3 and nothing runs)
    more = [a if a != "train.steps=2" else "train.steps=3" for a in grpo[1:]]
    assert main(["train", "--config", "configs/tiny.py", "--workdir", wd, "--task", "grpo", *base, *more]) == 0
    assert [r for r in read_metrics(wd) if r["step"] == 3 and "reward_mean" in r]
    assert max(Checkpointer(wd, read_only=True).all_steps()) == 3
    jax.clear_caches()
