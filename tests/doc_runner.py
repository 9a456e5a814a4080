"""One long-lived Python process that runs a docs group's `causal-lm` commands and Python snippets (doc_commands.py).

A fresh interpreter per command spends seconds importing JAX and tracing programs another command of the same group
already traced; here every command of a group runs in this one process, through the real entry point
(`causal_lm.cli.main`, with `causal-lm` as argv[0]) or, for a snippet, `exec` in a fresh `__main__` namespace, in
the command's working directory, with its output captured at the file-descriptor level (what a subprocess would
print, including tqdm bars and C++ logs). Requests arrive one JSON object per line on stdin; each answer (exit
status, stdout, stderr) is one JSON line on the file descriptor named by argv[1].

Not a test module (no test_ prefix).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def _run(request: dict) -> int:
    os.chdir(request["cwd"])
    if request["kind"] == "cli":
        from causal_lm import cli

        sys.argv = ["causal-lm"] + request["argv"]
        return int(cli.main(request["argv"]) or 0)
    code = compile(request["code"], "<docs snippet>", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    return 0


def _captured(request: dict) -> dict:
    """Run one request with fds 1 and 2 sent to temporary files; its exit status and what it printed."""
    files = [tempfile.TemporaryFile(mode="w+b") for _ in range(2)]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        try:
            status = _run(request)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - a snippet's failure is its exit status and its traceback
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    out = []
    for f in files:
        f.seek(0)
        out.append(f.read().decode("utf-8", "replace"))
        f.close()
    return {"status": status, "stdout": out[0], "stderr": out[1]}


def main() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    home = os.getcwd()
    for line in sys.stdin:
        answer = _captured(json.loads(line))
        os.chdir(home)
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
