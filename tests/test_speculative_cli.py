"""`causal-lm generate --speculative ngram|WORKDIR --draft-tokens K --num-samples N` on tiny saved workdirs: the
greedy text equals plain generation's, the stats line reports target passes and acceptance, and every user error
is one `error:` line with exit status 2 before anything is generated."""

import re

import pytest

from causal_lm.cli import main
from causal_lm.config import load_config
from causal_lm.data import ByteTokenizer, CharTokenizer, builtin_documents
from causal_lm.decode import generate
from causal_lm.model import build_model
from causal_lm.train import load_for_inference, save_for_inference

PROMPT = "def f(a):\n    return a\n\ndef g(a):\n    return a\n\ndef h(a):\n"
NEW, K = 24, 3
STATS = re.compile(r"target passes: (\d+) \(.* per token\); drafts accepted: (\d+)/(\d+) \(\d+%\)")


def _save(workdir, tokenizer, seed, *overrides):
    config = load_config("tiny", list(overrides))
    save_for_inference(str(workdir), build_model(config.model, seed=seed), config, tokenizer)
    return str(workdir)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("spec_cli")
    byte = ByteTokenizer()
    return {
        "target": _save(base / "target", byte, 0),
        "other": _save(base / "other", byte, 1, "model.num_layers=1"),  # a smaller, different draft
        "vocab300": _save(base / "vocab300", byte, 0, "model.vocab_size=300"),
        "chars": _save(base / "chars", CharTokenizer.from_texts(builtin_documents()[:20]), 0, "data.tokenizer=char"),
    }


def _generate(capsys, *argv):
    """(status, stdout, stderr lines other than notes and warnings) of `causal-lm generate ARGV` in this process."""
    capsys.readouterr()
    status = main(["generate", *argv])
    cap = capsys.readouterr()
    lines = [x for x in cap.err.splitlines() if ": note: " not in x and ": warning: " not in x]
    return status, cap.out, lines


def test_greedy_text_is_plain_generations_and_the_stats_line_reports_passes_and_acceptance(workdirs, capsys):
    base = ["--workdir", workdirs["target"], "--prompt", PROMPT, "--max-new-tokens", str(NEW)]
    status, plain, err = _generate(capsys, *base, "--no-stream")
    assert status == 0 and plain.startswith(PROMPT) and len(plain) > len(PROMPT) + 1, plain
    assert "target passes:" in err[-1] and "drafts accepted" not in err[-1]
    # the target's own workdir as its draft (every draft accepted, streamed), prompt lookup, a smaller other model
    for spec, stream in (("ngram", "--no-stream"), (workdirs["target"], None), (workdirs["other"], "--no-stream")):
        status, out, err = _generate(
            capsys, *base, "--speculative", spec, "--draft-tokens", str(K), *filter(None, [stream])
        )
        assert status == 0 and out == plain, (spec, out, plain)
        m = STATS.search(err[-1])
        assert m and "tokens/s" in err[-1], err
        passes, accepted, proposed = map(int, m.groups())
        assert accepted <= proposed
        if spec == workdirs["target"]:  # the target drafting for itself: every proposal kept, k + 1 tokens per pass
            assert accepted == proposed > 0
            assert passes <= -(-NEW // (K + 1)) + 1


def test_num_samples_prints_each_sample_as_generate_draws_it(workdirs, capsys):
    n, temp = 3, 0.9
    argv = ["--workdir", workdirs["target"], "--prompt", "The ", "--max-new-tokens", "12", "--temperature", str(temp)]
    status, out, err = _generate(capsys, *argv, "--num-samples", str(n), "--seed", "4")
    assert status == 0 and "over 3 samples" in err[-1]
    assert "per token of the longest sample, each pass serving all 3)" in err[-1]  # what the ratio counts
    model, tok, _ = load_for_inference(workdirs["target"])
    res = generate(
        model,
        [tok.encode("The ")],
        max_new_tokens=12,
        temperature=temp,
        seed=4,
        num_samples=n,
        stop_tokens=[tok.eos_id],
    )
    expected = "".join(f"--- sample {i + 1} of {n} ---\nThe {tok.decode(row)}\n" for i, row in enumerate(res.tokens))
    assert out == expected
    assert len(set(map(tuple, res.tokens))) > 1


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--speculative", "no/such/dir"], "is neither"),
        (["--speculative", "EMPTY"], "no checkpoints"),
        (["--speculative", "vocab300"], "vocabulary (300 ids, byte tokenizer) differs from the model's (259 ids"),
        (["--speculative", "chars"], "vocabulary (259 ids, char tokenizer) differs"),
        (["--speculative", "ngram", "--draft-tokens", "0"], "--draft-tokens must be in 1..16, got 0"),
        (["--draft-tokens", "2"], "add --speculative"),
        (["--speculative", "ngram", "--no-cache"], "--no-cache"),
        (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
        (["--num-samples", "2"], "identical texts: set --temperature > 0"),
    ],
    ids=["no-dir", "not-a-workdir", "vocab-size", "tokenizer", "k0", "k-alone", "no-cache", "n0", "greedy-n"],
)
def test_user_errors_are_one_line_with_status_2(workdirs, capsys, tmp_path, argv, expected):
    argv = [str(tmp_path) if a == "EMPTY" else workdirs.get(a, a) for a in argv]
    status, out, err = _generate(capsys, "--workdir", workdirs["target"], "--max-new-tokens", "4", *argv)
    assert status == 2 and out == "", out
    assert len(err) == 1 and err[0].startswith("causal-lm generate: error: ") and expected in err[0], err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--speculative", "ngram", "--draft-tokens", "0"], "--draft-tokens must be in 1..16, got 0"),
        (["--speculative", "vocab300"], "vocabulary (300 ids) differs from the model's (259)"),
    ],
    ids=["k0", "vocab-size"],
)
def test_bench_decode_refuses_a_bad_speculative_setting_before_it_runs(workdirs, capsys, argv, expected):
    capsys.readouterr()
    argv = [workdirs.get(a, a) for a in argv]
    status = main(
        ["bench", "decode", "--workdir", workdirs["target"], "--no-peer", "--contexts", "8", "--new-tokens", "4", *argv]
    )
    cap = capsys.readouterr()
    err = [x for x in cap.err.splitlines() if ": note: " not in x and ": warning: " not in x]
    assert status == 2 and cap.out == "", cap.out
    assert len(err) == 1 and err[0].startswith("causal-lm bench: error: ") and expected in err[0], err
