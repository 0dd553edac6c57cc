"""A real etcd (Debian's etcd-server) on loopback ports, for the tests of which console acts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port

BINARY = "/usr/bin/etcd"


@dataclass
class Etcd:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def pause(self) -> None:
        """etcd stops answering (its process stopped): what a partition looks like from a console."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def unpause(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as response:  # noqa: S310 - loopback
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running_etcd(tmp: Path, timeout: float = 20.0) -> Iterator[Etcd | None]:
    """A started single-member etcd with a fresh data dir, or None when it cannot start here."""
    if shutil.which(BINARY) is None:
        yield None
        return
    tmp.mkdir(parents=True, exist_ok=True)
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    log = tmp / "etcd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [BINARY, "--name", "test", "--data-dir", str(tmp / "data"), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}", "--log-level", "warn"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                yield None
                return
            time.sleep(0.05)
        yield Etcd(url, proc, log)
    finally:
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
