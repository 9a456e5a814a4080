"""The README is the front door: every docs/ page is linked from it, every relative link and image of the README
and the pages points at a file (and a heading) that exists, and every page's commands are tested (in a group)."""

from __future__ import annotations

import glob
import os
import re

import pytest
from doc_commands import GROUPS, ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PAGES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
DOCUMENTS = ["README.md", *PAGES]


def _prose(path: str) -> list[str]:
    """The lines of a Markdown file outside its fenced code blocks."""
    out, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced:
                out.append(line)
    return out


def _links(path: str) -> list[str]:
    return [m.group(1) for line in _prose(path) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]


def _anchors(path: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for line in _prose(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_there_are_docs_pages():
    assert len(PAGES) >= 5, PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_docs_page_is_linked_from_the_readme(page):
    targets = {os.path.normpath(link.split("#")[0]) for link in _links(os.path.join(ROOT, "README.md"))}
    assert page in targets, f"README.md has no link to {page}"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_points_at_a_file_and_heading_that_exist(document):
    path = os.path.join(ROOT, document)
    broken = []
    for link in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...
            continue
        target, _, anchor = link.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(full):
            broken.append(f"{link}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            broken.append(f"{link}: no heading with that anchor in {os.path.relpath(full, ROOT)}")
    assert not broken, f"{document}: " + "; ".join(broken)


def test_every_docs_page_runs_in_exactly_one_group():
    grouped = [page for pages in GROUPS.values() for page in pages]
    assert sorted(grouped) == sorted(DOCUMENTS), "tests/doc_commands.py GROUPS must list README.md and every page once"


def test_the_link_checker_reads_links_anchors_and_skips_code(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# A title: with (punctuation)\n[a](b.md#x-y) ![i](f/i.png) `[not](code.md)`\n```\n[no](fence.md)\n```\n",
        encoding="utf-8",
    )
    assert _links(str(page)) == ["b.md#x-y", "f/i.png"]
    assert _anchors(str(page)) == {"a-title-with-punctuation"}


def test_the_docs_runner_reports_what_fails(tmp_path):
    """The one-process runner of a docs group (doc_runner.py) must not turn a failing command into a pass: a snippet
    that raises is status 1 with its traceback, sys.exit(N) is N, a `causal-lm` usage error is 2 and names the
    problem, and the process keeps serving the next command with its output captured."""
    from doc_commands import Runner

    env = dict(os.environ, PYTHONPATH=ROOT)
    runner = Runner(str(tmp_path), env)
    try:
        failed = runner.run({"kind": "python", "code": "raise ValueError('boom')", "cwd": str(tmp_path)}, ["python"])
        assert failed.returncode == 1 and "ValueError: boom" in failed.stderr
        assert (
            runner.run({"kind": "python", "code": "import sys; sys.exit(3)", "cwd": str(tmp_path)}, []).returncode == 3
        )
        argv = ["train", "--workdir", "w", "--no-such-flag"]
        bad = runner.run({"kind": "cli", "argv": argv, "cwd": str(tmp_path)}, ["causal-lm"])
        assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
        ok = runner.run({"kind": "python", "code": "import os; print(os.getcwd())", "cwd": str(tmp_path)}, [])
        assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path)
    finally:
        runner.close()
