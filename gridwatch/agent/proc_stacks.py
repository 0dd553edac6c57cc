"""A process's stacks as a scene keeps them: the kernel's view of each thread, and py-spy's Python view."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from gridwatch.wire import protocol as p

PY_SPY_TIMEOUT_S = 10.0


def process_stacks(pid: int) -> str:
    """Kernel stacks and wait channels of every thread: readable even when Python is stuck."""
    out = []
    for task in sorted(Path(f"/proc/{int(pid)}/task").glob("*")):
        parts = [f"thread {task.name}"]
        for name in ("comm", "wchan", "stack"):
            try:
                parts.append(f"  {name}: {(task / name).read_text(errors='replace').strip()}")
            except OSError as exc:
                parts.append(f"  {name}: unreadable ({exc.strerror})")
        out.append("\n".join(parts))
    return "\n\n".join(out) + "\n"


def py_spy_dump(pid: int, timeout: float = PY_SPY_TIMEOUT_S) -> tuple[str | None, str]:
    """``py-spy dump`` of ``pid`` (works on a frozen process): (its text, "") or (None, why not).

    Fixed argv, no shell, a timeout that kills it; where py-spy is missing or may not trace (ptrace), why.
    """
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(spy, os.X_OK):
        return None, "py-spy is not installed (pip install py-spy)"
    argv = [spy, "dump", "--pid", str(int(pid))]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump --pid {pid} took over {timeout:g} s and was killed"
    except OSError as exc:
        return None, f"py-spy could not start: {exc.strerror or exc}"
    if done.returncode == 0:
        return f"# py-spy dump --pid {pid}\n" + done.stdout.decode(errors="replace"), ""
    err = p.clean_text(done.stderr.decode(errors="replace").strip().splitlines()[0] if done.stderr.strip() else "", 200)
    return None, f"py-spy may not trace pid {pid} (ptrace not permitted?): {err or 'exit ' + str(done.returncode)}"
