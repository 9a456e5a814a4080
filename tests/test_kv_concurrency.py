"""`causal-lm experiment kv-concurrency` on a tiny shape: the fit counts are the engine's page arithmetic, the
engine admits exactly that many sequences (at least that many when every layer is local), and the files exist.

The bug class: a fit count computed from a formula the engine does not use (bytes per token without the slot
positions or the int8 scales, a bound that ignores the window), so the table promises users the engine refuses."""

import json
import os

from causal_lm.config import apply_overrides
from causal_lm.experiments import get, kv_concurrency
from causal_lm.model.paged_cache import page_bytes
from causal_lm.serve.engine import parse_bytes

TINY = ["model.d_model=32", "model.num_layers=6", "model.max_seq_len=64"]


def test_fit_counts_are_what_the_engine_admits(tmp_path):
    config = apply_overrides(kv_concurrency.default_config(), TINY)
    out = str(tmp_path)
    names = ("GQA-2", "local-8", "5:1 mixed", "GQA-2 int8")
    res = kv_concurrency.run(
        config, out, budgets=("64KiB",), lengths=(25, 48), window=8, page_size=4, chunk=8, max_seqs=4,
        prompt_len=8, new_tokens=4, reps=0, names=names,
    )  # fmt: skip
    assert get("kv-concurrency") is kv_concurrency
    lay = res["layouts"]
    assert list(lay) == list(names)
    for name in names:
        v = lay[name]
        changes, storage = kv_concurrency.variants(8)[name]
        per_page = page_bytes(config.model.replace(**changes), 4, storage)
        assert v["bytes_per_token"] == per_page / 4
        for length in (25, 48):
            cell = v["cells"][f"64KiB/{length}"]
            if name == "5:1 mixed":  # two layer groups: the least over them of group pages // group pages needed
                need = v["group_pages_needed"][str(length)]
                assert cell["fit"] == min(p // n for p, n in zip(cell["group_pages"], need, strict=True))
            else:
                assert cell["fit"] == parse_bytes("64KiB") // per_page // v["pages_needed"][str(length)]
            assert cell["fit"] >= 1
            check = v["checks"][str(length)]
            if name.startswith("local"):
                assert check["engine_admitted"] >= check["expected"]
            else:
                assert check["engine_admitted"] == check["expected"], (name, length, check)
    # int8 storage: fewer bytes per token, more sequences; a window bounds the pages whatever the length
    assert lay["GQA-2 int8"]["bytes_per_token"] < lay["GQA-2"]["bytes_per_token"] / 2
    assert lay["GQA-2"]["cells"]["64KiB/48"]["fit"] < lay["GQA-2"]["cells"]["64KiB/25"]["fit"]
    assert lay["local-8"]["pages_needed"]["48"] < lay["GQA-2"]["pages_needed"]["48"]
    # 5:1 local/global pages each layer group on its own: its local layers hold the window's pages, so it fits
    # more sequences than GQA (same heads, every layer global); with one shared page table it fit no more
    mixed = lay["5:1 mixed"]
    assert mixed["group_pages_needed"]["48"][0] < mixed["group_pages_needed"]["48"][1]
    assert mixed["cells"]["64KiB/48"]["fit"] > lay["GQA-2"]["cells"]["64KiB/48"]["fit"]
    for f in ("report.md", "kv_concurrency.png", "results.json"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f)["experiment"] == "kv-concurrency"
    assert "engine admits" in kv_concurrency.summary(res)
