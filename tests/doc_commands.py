"""The README and docs/*.md run: every ```bash/```sh command and ```python snippet, in order, from a copy of the repo.

Each command (a line of a shell block; a line ending in `&` runs together with the lines after it, then `wait`) and
each Python snippet is one test, named by its page and line. The pages run in groups (GROUPS below), one test module
per group, so that pytest-xdist's `--dist loadfile` runs the groups on different workers. A group runs its pages in
the order listed, each command in a temporary copy of the tracked files (`git ls-files`) of its own, whose `.venv` is
the interpreter running the test, so a command that reads what an earlier command of its group wrote (a trained
`runs/tiny`) finds it: a page that needs a trained workdir shows the command that trains it. Marker lines (HTML
comments, invisible on GitHub) directly above a fence change what runs; a block without markers runs as written, so
a new block is tested the day it appears:

    <!-- readme-test: skip=REASON -->             the whole block is reported as skipped, with REASON
    <!-- readme-test: N: skip=REASON -->          only its N-th command (1-based)
    <!-- readme-test: N: run=COMMAND -->          run COMMAND in place of the N-th command (a shorter run)
    <!-- readme-test: sub=OLD => NEW -->          replace the text OLD by NEW in the block (a Python snippet's
                                                  step count, say); OLD must occur, or the test fails
    <!-- readme-test: needs=MODULE,... -->         skip unless these modules import (an optional extra)
    <!-- readme-test: N: status=S -->             the N-th command shows an error: it must exit with status S

A command that already ran earlier in its group (the same text) is skipped as a duplicate. Commands whose effect
only a shell session keeps (`source .venv/bin/activate`) run too: each test gets a fresh shell with `.venv/bin`
first on PATH, which is what that line sets up.

A plain `causal-lm ARGS` command (no shell syntax: no pipe, redirection, `&`, `;`, variable, glob or environment
prefix) and every Python snippet run in one long-lived process per group (tests/doc_runner.py: the real entry point
`causal_lm.cli.main`, or `exec` in a fresh `__main__` namespace, in the group's copy, output captured at the file
descriptors), so a group imports JAX once and traces each program once; everything else runs in `bash`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
SHELLS = ("bash", "sh", "shell", "console")
TIMEOUT_S = 300  # per command

# Test module -> the pages it runs, in order. Every docs/*.md page is in exactly one group
# (tests/test_docs_links.py checks it); a group's pages share one copy of the repository.
GROUPS: dict[str, tuple[str, ...]] = {
    "test_readme": ("README.md", "docs/model.md", "docs/development.md", "docs/serving.md"),
    "test_docs_training": ("docs/training.md", "docs/post-training.md"),
    "test_docs_kv_cache": ("docs/kv-cache.md",),
    "test_docs_interop": ("docs/interop.md", "docs/reliability.md", "docs/scaling.md"),
    "test_docs_performance": ("docs/performance.md",),
    "test_docs_experiments": ("docs/experiments.md",),
}


@dataclasses.dataclass
class Item:
    line: int  # 1-based line of the command (or of the snippet's first line) in its page
    lang: str  # "bash" or "python"
    code: str  # what runs
    written: str  # what the page shows
    skip: str | None = None
    needs: tuple[str, ...] = ()
    status: int = 0
    page: str = "README.md"

    @property
    def id(self) -> str:
        first = self.written.strip().splitlines()[0] if self.written.strip() else ""
        stem = os.path.splitext(os.path.basename(self.page))[0]
        return f"{stem}-L{self.line}-{self.lang}-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", first)[:48].strip("_")


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
    """(page line, command) per command of a shell block: `\\`-continued lines joined, a line ending in `&`
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


def _apply_markers(items: list[Item], markers: list[str], where: str) -> None:
    for text in markers:
        m = re.match(r"^(?:(\d+):\s*)?(skip|run|sub|needs|status)=(.*)$", text, re.S)
        if not m:
            raise ValueError(f"{where}: unreadable marker {text!r}")
        index, kind, value = m.group(1), m.group(2), m.group(3).strip()
        if index is not None and not 1 <= int(index) <= len(items):
            raise ValueError(f"{where}: marker {text!r}: the block has {len(items)} commands")
        targets = items if index is None else [items[int(index) - 1]]
        if kind == "sub":
            old, sep, new = value.partition(" => ")
            if not sep or not any(old in item.code for item in targets):
                raise ValueError(f"{where}: marker {text!r}: {old!r} is not in the block")
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


def page_items(text: str, page: str = "README.md") -> list[Item]:
    """Every command and snippet of one page, in order, markers applied (duplicates not yet marked)."""
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
            block = [Item(n, "bash", c, c, page=page) for n, c in _split_commands(body, i + 2)]
        elif lang == "python":
            block = [Item(i + 2, "python", body, body, page=page)]
        else:  # output samples, diagrams
            block = []
        _apply_markers(block, _markers(lines, i), f"{page} line {i + 1}")
        items += block
        i = end + 1
    return items


def mark_duplicates(items: list[Item]) -> list[Item]:
    """Skip a command that already ran earlier in the same list (the same text), naming where it ran."""
    seen: dict[str, Item] = {}
    for item in items:
        if item.skip is None and item.code in seen:
            first = seen[item.code]
            item.skip = f"the same command as {first.page} line {first.line}, which ran"
        seen.setdefault(item.code, item)
    return items


def readme_items(text: str, page: str = "README.md") -> list[Item]:
    """Every command and snippet of one page, markers applied, duplicates marked as skipped."""
    return mark_duplicates(page_items(text, page))


def group_items(group: str) -> list[Item]:
    """The commands of a group's pages, in order, duplicates within the group marked as skipped."""
    items: list[Item] = []
    for page in GROUPS[group]:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            items += page_items(f.read(), page)
    return mark_duplicates(items)


def _copy_repo(tmp_path_factory, name: str) -> tuple[str, dict]:
    """The tracked files in a temporary folder (what a fresh clone holds), with `.venv` = this interpreter's."""
    dest = str(tmp_path_factory.mktemp(name) / "causal_lm")
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
    # Compiled programs shared by every command of this group (and kept out of the user's cache).
    env["CAUSAL_LM_COMPILATION_CACHE"] = str(tmp_path_factory.mktemp(f"{name}_jax_cache"))
    env.pop("CAUSAL_LM_CACHE", None)
    return dest, env


SHELL_SYNTAX = set("|&;<>()$`*?[]{}~\\")


def cli_argv(code: str) -> list[str] | None:
    """The arguments of a plain `causal-lm ARGS` command (a trailing comment allowed), or None when the line needs a
    shell (see the module docstring)."""
    try:
        lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:
        return None
    if not words or words[0] != "causal-lm" or "\n" in code.strip():
        return None
    if any(set(w) & SHELL_SYNTAX for w in words) or any(c in code.split("#")[0] for c in "$`"):
        return None
    return words[1:]


class Runner:
    """A group's tests/doc_runner.py process: `run(request)` -> CompletedProcess (restarted if it died)."""

    def __init__(self, cwd: str, env: dict):
        self.cwd, self.env, self.proc = cwd, env, None

    def _start(self) -> None:
        read, write = os.pipe()
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "doc_runner.py"), str(write)],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=self.log,
            pass_fds=(write,),
            text=True,
        )
        os.close(write)
        self.answers = os.fdopen(read, "r")

    def run(self, request: dict, argv_shown: list) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], TIMEOUT_S)
        line = self.answers.readline() if ready else ""
        if not line:  # timed out or died: report what the process printed outside any command, start anew
            self.close()
            self.log.seek(0)
            died = self.log.read().decode("utf-8", "replace")[-3000:]
            return subprocess.CompletedProcess(argv_shown, -9, "", f"doc_runner gave no answer:\n{died}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(argv_shown, answer["status"], answer["stdout"], answer["stderr"])

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.answers.close()
            self.proc = None


def _run(item: Item, cwd: str, env: dict, runner: Runner | None = None) -> subprocess.CompletedProcess:
    argv = cli_argv(item.code) if item.lang == "bash" else None
    if runner is not None and item.lang == "python":
        return runner.run({"kind": "python", "code": item.code, "cwd": cwd}, ["python", "-c", item.code])
    if runner is not None and argv is not None:
        return runner.run({"kind": "cli", "argv": argv, "cwd": cwd}, ["causal-lm", *argv])
    if item.lang == "python":
        argv = [sys.executable, "-c", item.code]
    else:
        argv = ["bash", "-o", "pipefail", "-c", item.code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def check(item: Item, repo: tuple) -> None:
    """Run one command or snippet in the group's copy and check its exit status (and that it printed no traceback
    when it is shown working)."""
    if item.skip:
        pytest.skip(item.skip)
    missing = [m for m in item.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the interop extra)")
    cwd, env, *runner = repo
    proc = _run(item, cwd, env, runner[0] if runner else None)
    assert proc.returncode == item.status, (
        f"{item.page} line {item.line} failed (exit {proc.returncode}):\n{item.code}\n--- stdout ---\n"
        f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
    if item.status == 0:  # a command shown working prints no traceback (an error shown may, under --debug)
        assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr[-3000:]


def command_tests(group: str):
    """(items, fixture, test) for a group's module: `ITEMS, repo_copy, test_docs = command_tests(__name__)`."""
    items = group_items(group)

    @pytest.fixture(scope="module", name="repo_copy")
    def repo_copy(tmp_path_factory):
        cwd, env = _copy_repo(tmp_path_factory, group)
        runner = Runner(cwd, env)
        yield cwd, env, runner
        runner.close()

    @pytest.mark.slow
    @pytest.mark.parametrize("item", items, ids=[it.id for it in items])
    def test(item, repo_copy):
        check(item, repo_copy)

    return items, repo_copy, test
