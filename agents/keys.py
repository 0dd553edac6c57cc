"""Keys a deployment needs, made and trusted with no other tool, in OpenSSH formats."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import asyncssh

KEY_ALG = "ssh-ed25519"


@dataclass(frozen=True)
class KeySet:
    """Where ``keys init`` put everything."""

    dir: Path

    @property
    def host_key(self) -> Path:
        return self.dir / "agent_host_key"

    @property
    def viewer_key(self) -> Path:
        return self.dir / "viewer_key"

    @property
    def operator_key(self) -> Path:
        return self.dir / "operator_key"

    @property
    def authorized_viewers(self) -> Path:
        return self.dir / "authorized_viewers"

    @property
    def authorized_operators(self) -> Path:
        return self.dir / "authorized_operators"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"


def _write_private(path: Path, key: asyncssh.SSHKey, comment: str) -> None:
    key.set_comment(comment)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.export_private_key("openssh"))
    path.with_name(path.name + ".pub").write_bytes(key.export_public_key("openssh"))


def init_keys(directory: str | Path, force: bool = False, hosts_pattern: str = "*") -> KeySet:
    """Generate the host key, a viewer and an operator key, and the files that list them.

    ``known_hosts`` trusts the host key for ``hosts_pattern`` (all hosts by
    default: one host key shared by a fleet). Refuses to overwrite unless ``force``.
    """
    ks = KeySet(Path(directory))
    ks.dir.mkdir(parents=True, exist_ok=True)
    existing = [p for p in (ks.host_key, ks.viewer_key, ks.operator_key) if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; use --force to replace the keys in {ks.dir}")
    host = asyncssh.generate_private_key(KEY_ALG)
    viewer = asyncssh.generate_private_key(KEY_ALG)
    operator = asyncssh.generate_private_key(KEY_ALG)
    _write_private(ks.host_key, host, "gridwatch-agent-host")
    _write_private(ks.viewer_key, viewer, "gridwatch-viewer")
    _write_private(ks.operator_key, operator, "gridwatch-operator")
    ks.authorized_viewers.write_bytes(viewer.export_public_key("openssh"))
    ks.authorized_operators.write_bytes(operator.export_public_key("openssh"))
    ks.known_hosts.write_bytes(f"{hosts_pattern} ".encode() + host.export_public_key("openssh"))
    return ks


def known_hosts_entry(host: str, port: int, key: asyncssh.SSHKey) -> str:
    name = host if port == 22 else f"[{host}]:{port}"
    return f"{name} {key.export_public_key('openssh').decode().strip()}\n"


async def fetch_host_key(host: str, port: int, timeout: float = 5.0) -> asyncssh.SSHKey:
    """The host key an agent presents (no authentication happens)."""
    key = await asyncio.wait_for(asyncssh.get_server_host_key(host, port), timeout)
    if key is None:
        raise ConnectionError(f"{host}:{port} presented no host key")
    return key


def trust(known_hosts: str | Path, host: str, port: int, key: asyncssh.SSHKey) -> bool:
    """Append ``key`` for ``host:port`` unless an identical entry exists; True if written."""
    path = Path(known_hosts)
    entry = known_hosts_entry(host, port, key)
    current = path.read_text() if path.exists() else ""
    if entry in current:
        return False
    with path.open("a") as fh:
        if current and not current.endswith("\n"):
            fh.write("\n")
        fh.write(entry)
    return True
