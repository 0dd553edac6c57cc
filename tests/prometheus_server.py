"""A real Prometheus (Debian's ``prometheus`` package) for tests: config and storage in a temp dir, a free port."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import free_port
from tests.servers import log_tail, served

BINARY = "/usr/bin/prometheus"


class PrometheusUnavailable(Exception):
    """Prometheus is not installed or did not become ready; the message says which."""


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a successful answer."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus answered {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query: the result vector."""
        return list(self.api("query", query=expr)["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists."""
        return list(self.api(f"label/{label}/values", **{"match[]": match}))


@contextmanager
def prometheus(tmp: Path, targets: list[str], scrape_interval: str = "500ms", ready_s: float = 15.0) -> Iterator[Prometheus]:
    """Run Prometheus scraping ``targets`` (``host:port`` of /metrics) until the block ends."""
    binary = shutil.which("prometheus") or BINARY
    if not Path(binary).exists():
        raise PrometheusUnavailable("prometheus is not installed (Debian package prometheus)")
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        "  - job_name: gridwatch\n"
        f"    scrape_timeout: {scrape_interval}\n"
        f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )
    port = free_port()
    log = tmp / "prometheus.log"
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    url = f"http://127.0.0.1:{port}"
    with served(argv, log, url + "/-/ready", ready_s) as process:
        if process is None:
            raise PrometheusUnavailable(f"prometheus did not become ready: {log_tail(log)}")
        yield Prometheus(url, process)
