"""The gridwatch command line run as a real process, and a cluster.toml for it to read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, free_port

PY = sys.executable


def run_cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridwatch", *args], cwd=ROOT, capture_output=True, text=True, input=input, timeout=60)


def gridwatch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "gridwatch", *args], capture_output=True, text=True, timeout=timeout)


def cluster_toml(tmp_path: Path, keys, extra: str = "") -> Path:  # noqa: ANN001
    path = tmp_path / "cluster.toml"
    path.write_text(f'nodes = "127.0.0.1:{free_port()}"\nkey = "{keys.operator_key}"\n'
                    f'known_hosts = "{keys.known_hosts}"\ndb = "incidents.db"\n{extra}')
    return path
