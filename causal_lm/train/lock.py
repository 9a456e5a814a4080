"""One training run per workdir: an exclusive OS file lock on `workdir/train.lock`.

`fcntl.flock` locks belong to the open file, and the kernel drops them when the process exits however it exits,
SIGKILL included, so a dead run never leaves a stale lock behind. The holder writes its PID, host and start
time into the file, and a second run that finds the lock taken reports them. Readers (`generate`, `eval`) take
no lock: orbax commits each checkpoint by renaming a finished temporary directory, so they never see a
half-written one.

The lock file is left in place when the run ends (deleting a lock file lets two later runs lock two different
files); only a workdir the lock itself created, in which nothing else was written, is removed again, so input
errors that stop a run before it starts leave no empty workdir behind.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket

LOCK_FILE = "train.lock"


class WorkdirLockedError(RuntimeError):
    """Another process holds the workdir's lock (the CLI's exit status 3, `exit_status`)."""

    exit_status = 3
    hint = ""


class WorkdirLock:
    """`with WorkdirLock(workdir):` holds the workdir's exclusive lock for the block (creating the workdir)."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None
        self._created = False

    def acquire(self) -> WorkdirLock:
        if not os.path.isdir(self.workdir):
            os.makedirs(self.workdir)  # OSError (a file in the way, read-only, ...) goes to the caller
            self._created = True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            self._remove_if_created()
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirLockedError(
                    f"workdir {self.workdir!r} is in use by another training run ({holder(self.path)}); "
                    "wait for it to finish, or stop it, or train in another --workdir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        started = datetime.datetime.now().isoformat(timespec="seconds")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {started}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Unlocked by close; the file stays (see the module docstring) unless this lock made an otherwise empty dir.
        if self._created and os.listdir(self.workdir) == [LOCK_FILE]:
            os.unlink(self.path)
            os.close(fd)
            self._remove_if_created()
        else:
            os.close(fd)

    def _remove_if_created(self) -> None:
        if self._created:
            try:
                os.rmdir(self.workdir)
            except OSError:
                pass

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder(path: str) -> str:
    """What the lock file says about its holder: 'pid 1234 on host since ...' (or that it says nothing yet)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return text or "a process that has not written its PID yet"
