"""A real Alertmanager (Debian's prometheus-alertmanager) on a loopback port, for the tests that page through it."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import free_port
from tests.servers import served

BINARY = "/usr/bin/prometheus-alertmanager"

# One route grouping by node: two incidents on one node land in one group.
CONFIG = """\
route:
  receiver: "null"
  group_by: ["node"]
  group_wait: 1h
  group_interval: 1h
  repeat_interval: 4h
receivers:
  - name: "null"
"""


@dataclass
class Alertmanager:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as response:  # noqa: S310 - loopback
            return json.loads(response.read())

    def alerts(self, active_only: bool = False) -> list[dict[str, Any]]:
        """GET /api/v2/alerts: resolved ones are listed too unless ``active_only``."""
        query = "" if active_only else "?active=true&silenced=true&inhibited=true&unprocessed=true"
        return list(self.get("/api/v2/alerts" + query))

    def groups(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v2/alerts/groups"))


@contextmanager
def running_alertmanager(tmp: Path, port: int | None = None, timeout: float = 30.0) -> Iterator[Alertmanager | None]:
    """A started Alertmanager (on ``port``, else a free one), or None when it cannot start here."""
    if shutil.which(BINARY) is None:
        yield None
        return
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "alertmanager.yml"
    config.write_text(CONFIG, encoding="utf-8")
    port = port or free_port()
    log = tmp / "alertmanager.log"
    url = f"http://127.0.0.1:{port}"
    argv = [BINARY, f"--config.file={config}", f"--storage.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"]
    with served(argv, log, url + "/-/ready", timeout) as proc:
        yield Alertmanager(url, proc, log) if proc is not None else None
