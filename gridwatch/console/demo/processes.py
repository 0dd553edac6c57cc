"""Child processes of the demo, each in its own process group, so a shutdown leaves nothing behind."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from loguru import logger

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Runs in the child before exec: it dies with the demo, and hears Ctrl-C as the demo does."""
    # A demo started in the background (`cmd &`) inherits SIGINT ignored, and so would
    # the trainer, whose clean stop is SIGINT: give it the default action back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # If the demo itself is killed outright, its children go too (Linux only). The
    # signal follows the thread that forked, so spawn() is only called from the main thread.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)  # the demo died before the signal was armed


@dataclass
class Child:
    """One process the demo started, with its own process group and log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]  # as started, so that a dead one can be started again
    env: dict[str, str] | None = None  # as started too (None: the demo's own)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


def spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Child:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
    logger.bind(node=name).debug("started pid {}: {}", proc.pid, " ".join(argv))
    return Child(name, proc, log_path, list(argv), env)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        if os.getpgid(pid) == os.getpgrp():
            os.kill(pid, sig)  # never signal our own group
        else:
            os.killpg(os.getpgid(pid), sig)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def stop_all(children: list[Child], grace: float = 5.0, first: signal.Signals = signal.SIGTERM) -> None:
    """Signal every group with ``first``, wait up to ``grace`` seconds, then SIGKILL everything left.

    Processes a child started in sessions of their own (the trainer's nodes)
    are found through the process tree before the leader goes, so they go too.
    """
    tree = {child.pid: descendants(child.pid) for child in children}
    for child in children:
        _signal_group(child.pid, first)
        # A process stopped by an injected hang only sees the signal once continued.
        _signal_group(child.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    left: dict[int, psutil.Process] = {}
    for child in children:
        for proc in [*tree[child.pid], *(d for t in tree[child.pid] for d in descendants(t.pid))]:
            left[proc.pid] = proc
        _signal_group(child.pid, signal.SIGKILL)
    for proc in left.values():
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(left.values()), timeout=2.0)
    for child in children:
        try:
            child.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            logger.bind(node=child.name).warning("pid {} did not exit after SIGKILL", child.pid)
