"""The README's commands run, with those of docs/model.md and docs/development.md: see tests/doc_commands.py.

The other docs/ pages run in tests/test_docs_*.py, one module per group of pages, so that the groups run on
different workers. This module also holds the parser's own tests.
"""

from __future__ import annotations

import pytest
from doc_commands import command_tests, group_items, readme_items

ITEMS, repo_copy, test_readme = command_tests("test_readme")


def test_readme_parser_reads_markers_groups_and_duplicates():
    text = "\n".join(
        [
            "```bash",
            "causal-lm a   # first",
            "causal-lm b \\",
            "  --flag",
            "```",
            "<!-- readme-test: 2: skip=needs a cluster -->",
            "<!-- readme-test: 1: run=causal-lm a2 -->",
            "<!-- readme-test: 3: status=2 -->",
            "<!-- readme-test: needs=safetensors -->",
            "```sh",
            "causal-lm c",
            "causal-lm d",
            "X=1 causal-lm e &",
            "causal-lm f",
            "```",
            "<!-- readme-test: sub=steps=100 => steps=3 -->",
            "```python",
            "train(steps=100)",
            "```",
            "```bash",
            "causal-lm a   # first",
            "```",
            "```",
            "causal-lm not-a-command: output",
            "```",
        ]
    )
    items = readme_items(text)
    assert [(it.line, it.code, it.skip) for it in items] == [
        (2, "causal-lm a   # first", None),
        (3, "causal-lm b \\\n  --flag", None),
        (11, "causal-lm a2", None),
        (12, "causal-lm d", "needs a cluster"),
        (13, "X=1 causal-lm e &\ncausal-lm f\nwait", None),
        (18, "train(steps=3)", None),
        (21, "causal-lm a   # first", "the same command as README.md line 2, which ran"),
    ]
    assert items[2].written == "causal-lm c"
    assert [it.status for it in items] == [0, 0, 0, 0, 2, 0, 0]
    assert [it.needs for it in items] == [(), ()] + [("safetensors",)] * 3 + [(), ()]
    with pytest.raises(ValueError, match="is not in the block"):
        readme_items("<!-- readme-test: sub=nowhere => x -->\n```python\npass\n```")


def test_markers_out_of_range_and_duplicates_across_pages():
    with pytest.raises(ValueError, match="the block has 1 commands"):
        readme_items("<!-- readme-test: 2: skip=x -->\n```bash\ncausal-lm a\n```")
    items = readme_items("```bash\ncausal-lm a\n```", "docs/a.md")
    assert items[0].id == "a-L2-bash-causal-lm_a" and items[0].page == "docs/a.md"


def test_every_group_has_commands_and_its_module():
    import os

    from doc_commands import GROUPS, ROOT

    for group in GROUPS:
        assert os.path.isfile(os.path.join(ROOT, "tests", group + ".py")), group
        assert any(item.skip is None for item in group_items(group)), f"{group} runs nothing"
