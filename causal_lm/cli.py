"""`causal-lm <command>`: a thin argparse front over importable functions.

Each command lives in `causal_lm/commands/<name>.py` with a `register(subparsers)` that adds its parser and sets
`func`; adding a command is one line in COMMANDS. Only the chosen command's module is imported (the others appear
in `--help` by their one-line summary), so `causal-lm kv-bytes` or `causal-lm --help` does not pay for importing
the training stack.

`main()` turns on JAX's persistent compilation cache (`causal_lm.compile_cache`: a second run with the same shapes
loads its compiled programs from disk), tells glibc's malloc to keep freed memory for the next step's temporaries
(`causal_lm.malloc`), and is the one place that turns exceptions into exit statuses: a failure
the user can cause and fix (a bad config, a missing or damaged file, a read-only or full disk, a workdir in use, a
diverged run) is one `causal-lm CMD: error: ...` line, maybe a `hint:` line, and a non-zero status; anything else
is a bug and keeps its traceback. `--debug` shows the traceback of every error. Notes (`causal_lm.notes.Note`)
and other warnings of ours print as one `note:` / `warning:` line each.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import sys
import warnings

from causal_lm import malloc
from causal_lm.notes import Note

# name -> (module, one-line summary for `causal-lm --help`)
COMMANDS = {
    "info": ("causal_lm.commands.info", "build a model, print parameter count and KV bytes/token, run a forward pass"),
    "generate": ("causal_lm.commands.generate", "generate text with or without the KV cache, streaming, with tokens/s"),
    "train": ("causal_lm.commands.train", "train a model (resumes when the workdir has checkpoints)"),
    "eval": ("causal_lm.commands.eval", "evaluate a workdir's checkpoint on held-out text"),
    "plot": ("causal_lm.commands.plot", "plot a workdir's loss curves to a PNG"),
    "kv-bytes": ("causal_lm.commands.kv_bytes", "KV-cache bytes per token and at a context length"),
    "experiment": ("causal_lm.commands.experiment", "run a seed experiment: report.md, a PNG figure and results.json"),
    "convert": ("causal_lm.commands.convert", "Hugging Face folders and GGUF files to a workdir, and back"),
    "serve": ("causal_lm.commands.serve", "an OpenAI-compatible HTTP server (completions, chat, streaming)"),
    "bench": ("causal_lm.commands.bench", "training / decoding throughput vs transformers (PyTorch) and the machine"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the full sub-parser of `command` (all commands' when None) and the others as summaries."""
    parser = argparse.ArgumentParser(
        prog="causal-lm",
        description="Small decoder-only language models in JAX/Flax: train, generate, compare cache vs recompute.",
    )
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of any error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def _command_name(argv) -> str | None:
    """The command named on the command line (the first argument that is not an option), if it is one of ours."""
    name = next((a for a in argv if not a.startswith("-")), None)
    return name if name in COMMANDS else None


def _huge_pages() -> None:
    """Re-execute this command with glibc's heap on huge pages, where that applies (`causal_lm.malloc`: 5-8% on
    a decode step). Only for the command line itself (never when `main` is called with arguments from Python),
    before JAX is imported; the process keeps its ID, so a signal sent to it still reaches the command."""
    if os.path.basename(sys.argv[0]) not in ("causal-lm", "causal-lm.exe", "cli.py") or not sys.executable:
        return
    env = malloc.huge_pages_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        pass  # could not: run on with 4 KiB pages


def main(argv=None) -> int:
    if argv is None:
        _huge_pages()
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_name(argv)
    # Without a known command there is nothing to parse but --help or an error: the summaries suffice.
    parser = build_parser(name) if name else _summary_parser()
    args, extra = parser.parse_known_args(argv)
    if "--debug" in extra:  # also accepted after the command's name
        extra = [e for e in extra if e != "--debug"]
        args.debug = True
    # argparse fills a trailing `KEY=VALUE ...` positional together with the positional before it, so in
    # `experiment NAME --out DIR k=v` the k=v arrive as extras: give them to the command's overrides.
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in e and not e.startswith("-") for e in extra)
    ):
        args.overrides = args.overrides + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    prefix = f"causal-lm {args.command}"
    malloc.keep_freed_memory()  # before JAX allocates anything large
    # Loaded here, as the commands are: it imports JAX, which `_huge_pages` re-executes before paying for.
    importlib.import_module("causal_lm.compile_cache").enable()
    if not args.debug:
        _QuietOrbaxErrors.install()
    with warnings.catch_warnings():
        _show_our_warnings(prefix)
        try:
            return int(args.func(args) or 0)
        except KeyboardInterrupt:
            if args.debug:
                raise
            print(f"{prefix}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:
            user = user_error(e)
            if user is None or args.debug:
                raise  # a bug (or --debug): the traceback is the useful part
            message, hint, status = user
            print(f"{prefix}: error: {message}", file=sys.stderr)
            if hint:
                print(f"  hint: {hint}", file=sys.stderr)
            return status


def _summary_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command as a one-line summary (nothing imported)."""
    return build_parser(command="")


class _QuietOrbaxErrors(logging.Filter):
    """Orbax logs the traceback of a failed background save or read (through absl's logger) before it re-raises the
    same error to the caller, where `main` reports it as one error line, and its background threads may log more
    of the same after `main` has returned: drop those records for the rest of the process (not with --debug)."""

    installed = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and _raised_in_orbax(record))

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            logging.getLogger("absl").addFilter(cls())
            # A save's parallel writes are asyncio tasks: when several fail (a full disk), orbax re-raises one and
            # asyncio logs each other one as "Task exception was never retrieved" with its traceback.
            logging.getLogger("asyncio").addFilter(cls())
            cls.installed = True


def _raised_in_orbax(record: logging.LogRecord) -> bool:
    """Whether a logged error came from orbax: logged by its code, or its exception raised through its frames."""
    if "orbax" in record.pathname:
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _show_our_warnings(prefix: str) -> None:
    """Print this package's warnings as `PREFIX: note: ...` lines, every time (not once per call site)."""
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, Note):
            print(f"{prefix}: note: {message}", file=sys.stderr)
        elif "causal_lm" in filename.replace("\\", "/"):
            print(f"{prefix}: warning: {message}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.filterwarnings("always", module=r"causal_lm\.")
    warnings.simplefilter("always", Note)


_OS_HINTS = {
    errno.EROFS: "the file system is read-only: use a --workdir (or --out) on a writable disk",
    errno.EACCES: "no permission: use a path you can write, or fix its permissions",
    errno.EPERM: "no permission: use a path you can write, or fix its permissions",
    errno.ENOSPC: "the disk is full: free space, or use a --workdir on another disk",
    errno.EDQUOT: "the disk quota is exhausted: free space, or use a --workdir on another disk",
    errno.ENOTDIR: "a file stands where a directory is expected",
    errno.EEXIST: "a file stands where a directory is expected",
}


def user_error(e: BaseException) -> tuple[str, str, int] | None:
    """(message, hint, exit status) for an exception a user can cause and fix; None for a bug.

    Errors that carry their own `exit_status` (a diverged run: 1, a workdir in use: 3) keep it."""
    if isinstance(getattr(e, "exit_status", None), int):
        return str(e), getattr(e, "hint", ""), e.exit_status
    if isinstance(e, OSError):  # FileNotFoundError, PermissionError, read-only or full disk, ...
        what = e.strerror or str(e)
        where = f": {e.filename}" if e.filename else ""
        return f"{what}{where}", _OS_HINTS.get(e.errno, ""), 2
    if isinstance(e, MemoryError):
        return "out of memory", "use a smaller model, batch or context", 2
    if type(e).__name__ == "XlaRuntimeError" and "RESOURCE_EXHAUSTED" in str(e):
        return f"the device ran out of memory: {str(e).splitlines()[0]}", "use a smaller model, batch or context", 2
    if isinstance(e, ValueError):  # ConfigError, CheckpointError, DataError, TokenizerError, ... and plain ones
        return str(e), getattr(e, "hint", ""), 2
    return None


if __name__ == "__main__":
    sys.exit(main())
