"""The README runs: every ```bash/```sh command and ```python snippet, in order, from a copy of the repository.

Each command (a line of a shell block; a line ending in `&` runs together with the lines after it, then `wait`) and
each Python snippet is one test, named by its README line. They run in a temporary copy of the tracked files
(`git ls-files`), whose `.venv` is the interpreter running this test, so a command that reads what an earlier one
wrote (a trained `runs/tiny`) finds it. Marker lines (HTML comments, invisible on GitHub) directly above a fence
change what runs; a block without markers runs as written, so a new block is tested the day it appears:

    <!-- readme-test: skip=REASON -->             the whole block is reported as skipped, with REASON
    <!-- readme-test: N: skip=REASON -->          only its N-th command (1-based)
    <!-- readme-test: N: run=COMMAND -->          run COMMAND in place of the N-th command (a shorter run)
    <!-- readme-test: sub=OLD => NEW -->          replace the text OLD by NEW in the block (a Python snippet's
                                                  step count, say); OLD must occur, or the test fails
    <!-- readme-test: needs=MODULE,... -->         skip unless these modules import (an optional extra)
    <!-- readme-test: N: status=S -->             the N-th command shows an error: it must exit with status S

A command that already ran earlier in the README (the same text) is skipped as a duplicate. Commands whose effect
only a shell session keeps (`source .venv/bin/activate`) run too: each test gets a fresh shell with `.venv/bin`
first on PATH, which is what that line sets up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
SHELLS = ("bash", "sh", "shell", "console")
TIMEOUT_S = 300  # per command; the whole file takes a few minutes on 2 cores


@dataclasses.dataclass
class Item:
    line: int  # 1-based README line of the command (or of the snippet's first line)
    lang: str  # "bash" or "python"
    code: str  # what runs
    written: str  # what the README shows
    skip: str | None = None
    needs: tuple[str, ...] = ()
    status: int = 0

    @property
    def id(self) -> str:
        first = self.written.strip().splitlines()[0] if self.written.strip() else ""
        return f"L{self.line}-{self.lang}-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", first)[:48].strip("_")


def _markers(lines: list[str], fence_index: int) -> list[str]:
    """The marker texts on the lines directly above the fence at `fence_index` (blank lines between allowed)."""
    out = []
    i = fence_index - 1
    while i >= 0 and (MARKER.match(lines[i]) or not lines[i].strip()):
        m = MARKER.match(lines[i])
        if m:
            out.append(m.group(1))
        elif out or i < fence_index - 1:  # a blank line above the markers (or above a blank) ends them
            break
        i -= 1
    return out[::-1]


def _split_commands(block: str, first_line: int) -> list[tuple[int, str]]:
    """(README line, command) per command of a shell block: `\\`-continued lines joined, a line ending in `&`
    grouped with the next command (and a `wait` appended), blank and comment-only lines dropped."""
    commands: list[tuple[int, str]] = []
    pending: list[str] = []
    start = None
    group: tuple[int, list[str]] | None = None
    for offset, raw in enumerate(block.splitlines()):
        if start is None:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            start = first_line + offset
        pending.append(raw)
        if raw.rstrip().endswith("\\"):
            continue
        cmd = "\n".join(pending)
        pending, here, start = [], start, None
        background = re.sub(r"\s+#.*$", "", cmd).rstrip().endswith("&")
        if group is not None:
            group[1].append(cmd)
            if not background:
                commands.append((group[0], "\n".join(group[1]) + "\nwait"))
                group = None
        elif background:
            group = (here, [cmd])
        else:
            commands.append((here, cmd))
    if group is not None:
        commands.append((group[0], "\n".join(group[1]) + "\nwait"))
    return commands


def _apply_markers(items: list[Item], markers: list[str], line: int) -> None:
    for text in markers:
        m = re.match(r"^(?:(\d+):\s*)?(skip|run|sub|needs|status)=(.*)$", text, re.S)
        if not m:
            raise ValueError(f"README line {line}: unreadable marker {text!r}")
        index, kind, value = m.group(1), m.group(2), m.group(3).strip()
        targets = items if index is None else [items[int(index) - 1]]
        if kind == "sub":
            old, sep, new = value.partition(" => ")
            if not sep or not any(old in item.code for item in targets):
                raise ValueError(f"README line {line}: marker {text!r}: {old!r} is not in the block")
            for item in targets:
                item.code = item.code.replace(old, new)
            continue
        for item in targets:
            if kind == "skip":
                item.skip = value
            elif kind == "run":
                item.code = value
            elif kind == "status":
                item.status = int(value)
            else:
                item.needs += tuple(filter(None, (x.strip() for x in value.split(","))))


def readme_items(text: str) -> list[Item]:
    """Every command and snippet of the README, markers applied, duplicates marked as skipped."""
    lines = text.splitlines()
    items: list[Item] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang = m.group(1).lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        body = "\n".join(lines[i + 1 : end])
        if lang in SHELLS:
            block = [Item(n, "bash", c, c) for n, c in _split_commands(body, i + 2)]
        elif lang == "python":
            block = [Item(i + 2, "python", body, body)]
        else:  # output samples, diagrams
            block = []
        _apply_markers(block, _markers(lines, i), i + 1)
        items += block
        i = end + 1
    seen: dict[str, int] = {}
    for item in items:
        if item.skip is None and item.code in seen:
            item.skip = f"the same command as README line {seen[item.code]}, which ran"
        seen.setdefault(item.code, item.line)
    return items


ITEMS = readme_items(open(README, encoding="utf-8").read())


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory):
    """The tracked files in a temporary folder (what a fresh clone holds), with `.venv` = this interpreter's."""
    dest = str(tmp_path_factory.mktemp("readme") / "causal_lm")
    try:
        files = (
            subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
            .stdout.decode()
            .split("\0")
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs git to list the tracked files")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    os.symlink(sys.prefix, os.path.join(dest, ".venv"))
    env = dict(os.environ)
    env["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = dest  # the copy's package, not an editable install's
    env["VIRTUAL_ENV"] = sys.prefix
    env["PYTHONUNBUFFERED"] = "1"
    # Compiled programs shared by every command of this file (and kept out of the user's cache).
    env["CAUSAL_LM_COMPILATION_CACHE"] = str(tmp_path_factory.mktemp("jax_cache"))
    env.pop("CAUSAL_LM_CACHE", None)
    return dest, env


def _run(item: Item, cwd: str, env: dict) -> subprocess.CompletedProcess:
    if item.lang == "python":
        argv = [sys.executable, "-c", item.code]
    else:
        argv = ["bash", "-o", "pipefail", "-c", item.code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("item", ITEMS, ids=[it.id for it in ITEMS])
def test_readme(item, repo_copy):
    if item.skip:
        pytest.skip(item.skip)
    missing = [m for m in item.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the interop extra)")
    cwd, env = repo_copy
    proc = _run(item, cwd, env)
    assert proc.returncode == item.status, (
        f"README line {item.line} failed (exit {proc.returncode}):\n{item.code}\n--- stdout ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
    if item.status == 0:  # a command shown working prints no traceback (an error shown may, under --debug)
        assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr[-3000:]


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
        (21, "causal-lm a   # first", "the same command as README line 2, which ran"),
    ]
    assert items[2].written == "causal-lm c"
    assert [it.status for it in items] == [0, 0, 0, 0, 2, 0, 0]
    assert [it.needs for it in items] == [(), ()] + [("safetensors",)] * 3 + [(), ()]
    with pytest.raises(ValueError, match="is not in the block"):
        readme_items("<!-- readme-test: sub=nowhere => x -->\n```python\npass\n```")
