"""A child process killed with SIGKILL at a line it prints: the tests of exact resume after a crash.

Not a test module (no test_ prefix): pytest does not collect it.
"""

import os
import signal
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_child_at(tmp_path, script: str, args, line_prefix: str = "SAVING") -> list[str]:
    """Run `script` (Python source) with `args` in a child process; SIGKILL it as soon as it prints a line starting
    with `line_prefix`. Returns the lines it printed, that one last; fails unless SIGKILL is what ended it. Its
    stderr is kept in tmp_path/child.err and shown on failure; a child that hangs is killed after 300 s."""
    path = tmp_path / "child.py"
    path.write_text(script)
    with open(tmp_path / "child.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(path), *map(str, args)], stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT
        )
        watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging it
        watchdog.start()
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith(line_prefix):
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=60)
        watchdog.cancel()
    assert proc.returncode == -signal.SIGKILL, (lines, (tmp_path / "child.err").read_text()[-3000:])
    return lines
