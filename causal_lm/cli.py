"""`causal-lm <command>`: a thin argparse front over importable functions.

Each command lives in `causal_lm/commands/<name>.py` with a `register(subparsers)` that adds its parser and
sets `func`; adding a command is one line in COMMANDS.

`main()` is the one place that turns exceptions into exit statuses: a failure the user can cause and fix (a bad
config, a missing or damaged file, a read-only or full disk, a workdir in use, a diverged run) is one
`causal-lm CMD: error: ...` line, maybe a `hint:` line, and a non-zero status; anything else is a bug and keeps
its traceback. `--debug` shows the traceback of every error. Notes (`causal_lm.train.notes.Note`) and other
warnings of ours print as one `note:` / `warning:` line each.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import sys
import warnings

COMMANDS = [
    "causal_lm.commands.info",
    "causal_lm.commands.generate",
    "causal_lm.commands.train",
    "causal_lm.commands.eval",
    "causal_lm.commands.plot",
    "causal_lm.commands.kv_bytes",
    "causal_lm.commands.experiment",
    "causal_lm.commands.convert",
    "causal_lm.commands.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="causal-lm",
        description="Small decoder-only language models in JAX/Flax: train, generate, compare cache vs recompute.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of any error")
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


class _QuietOrbaxErrors(logging.Filter):
    """Orbax logs the traceback of a failed background save or read (through absl's logger) before it re-raises the
    same error to the caller, where `main` reports it as one error line, and its background threads may log more
    of the same after `main` has returned: drop those records for the rest of the process (not with --debug)."""

    installed = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and "orbax" in record.pathname)

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            logging.getLogger("absl").addFilter(cls())
            cls.installed = True


def _show_our_warnings(prefix: str) -> None:
    """Print this package's warnings as `PREFIX: note: ...` lines, every time (not once per call site)."""
    from causal_lm.train.notes import Note

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
    """(message, hint, exit status) for an exception a user can cause and fix; None for a bug."""
    from causal_lm.train.divergence import DivergenceError
    from causal_lm.train.lock import WorkdirLockedError

    if isinstance(e, DivergenceError):
        return str(e), e.hint, 1
    if isinstance(e, WorkdirLockedError):
        return str(e), "", 3
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
