"""A real etcd (Debian's etcd-server) on loopback ports, for the tests of which console acts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_ports
from tests.servers import served

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


@contextmanager
def running_etcd(tmp: Path, timeout: float = 20.0) -> Iterator[Etcd | None]:
    """A started single-member etcd with a fresh data dir, or None when it cannot start here."""
    if shutil.which(BINARY) is None:
        yield None
        return
    tmp.mkdir(parents=True, exist_ok=True)
    client, peer = free_ports(2)
    url = f"http://127.0.0.1:{client}"
    log = tmp / "etcd.log"
    argv = [BINARY, "--name", "test", "--data-dir", str(tmp / "data"), "--listen-client-urls", url,
            "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer}", "--log-level", "warn"]
    with served(argv, log, url + "/health", timeout) as proc:
        yield Etcd(url, proc, log) if proc is not None else None
