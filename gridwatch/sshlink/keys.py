"""Keys a deployment needs, made and trusted with no other tool, in OpenSSH formats."""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from gridwatch.sshlink.policy import client_options, weak_key_reason

KEY_ALG = "ssh-ed25519"
PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644
DIR_MODE = 0o700

KNOWN_HOSTS_HEADER = (
    "# Pin each agent's own host key here: gridwatch keys trust HOST:PORT --known-hosts THIS_FILE\n"
)


@dataclass(frozen=True)
class KeySet:
    """Where ``keys init`` put everything."""

    dir: Path

    @property
    def host_key(self) -> Path:
        """The fleet-wide host key; only there when asked for (``shared_host_key``)."""
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


class WeakHostKey(ValueError):
    """An agent presented a host key too weak to pin; the message says which and why."""


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` through a temp file in the same directory, with ``mode`` whatever the umask.

    A reader never sees half a file, and a file that existed with a looser
    mode does not keep it: the new one replaces it.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _write_private(path: Path, key: asyncssh.SSHKey, comment: str) -> None:
    key.set_comment(comment)
    write_atomic(path, key.export_private_key("openssh"), PRIVATE_MODE)
    write_atomic(path.with_name(path.name + ".pub"), key.export_public_key("openssh"), PUBLIC_MODE)


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and parents) and make sure others can neither write nor list it."""
    directory.mkdir(parents=True, exist_ok=True)
    # The umask may have left it open; a key directory is never world-writable.
    if directory.stat().st_mode & 0o022:
        os.chmod(directory, DIR_MODE)


def make_host_key(path: str | Path, comment: str = "gridwatch-agent-host") -> asyncssh.SSHKey:
    """A new ed25519 host key at ``path`` (0600, atomic; its .pub beside it, 0644); a missing directory is made 0700."""
    target = Path(path)
    if not target.parent.exists():
        target.parent.mkdir(parents=True, mode=DIR_MODE)
        os.chmod(target.parent, DIR_MODE)  # mkdir's mode is cut by the umask
    key = asyncssh.generate_private_key(KEY_ALG)
    _write_private(target, key, comment)
    return key


def init_keys(directory: str | Path, force: bool = False, *, shared_host_key: bool = False,
              hosts_pattern: str = "*") -> KeySet:
    """Generate a viewer and an operator key and the files that list them (and, if asked, one host key for all).

    By default no host key is made: each agent makes its own on first start and
    the console pins each one with ``keys trust``. ``shared_host_key`` writes
    ``agent_host_key`` and a ``known_hosts`` line trusting it for
    ``hosts_pattern`` (all hosts by default): anyone who reads that key off one
    node can pose as every node. Refuses to overwrite unless ``force``.
    """
    ks = KeySet(Path(directory))
    make_private_dir(ks.dir)
    mine = (ks.host_key, ks.viewer_key, ks.operator_key) if shared_host_key else (ks.viewer_key, ks.operator_key)
    existing = [p for p in mine if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; use --force to replace the keys in {ks.dir}")
    viewer = asyncssh.generate_private_key(KEY_ALG)
    operator = asyncssh.generate_private_key(KEY_ALG)
    _write_private(ks.viewer_key, viewer, "gridwatch-viewer")
    _write_private(ks.operator_key, operator, "gridwatch-operator")
    write_atomic(ks.authorized_viewers, viewer.export_public_key("openssh"), PUBLIC_MODE)
    write_atomic(ks.authorized_operators, operator.export_public_key("openssh"), PUBLIC_MODE)
    known = KNOWN_HOSTS_HEADER.encode()
    if shared_host_key:
        host = asyncssh.generate_private_key(KEY_ALG)
        _write_private(ks.host_key, host, "gridwatch-agent-host")
        known += f"{hosts_pattern} ".encode() + host.export_public_key("openssh")
    write_atomic(ks.known_hosts, known, PUBLIC_MODE)
    return ks


def host_name(host: str, port: int) -> str:
    """How known_hosts names ``host:port``."""
    return host if port == 22 else f"[{host}]:{port}"


def known_hosts_entry(host: str, port: int, key: asyncssh.SSHKey) -> str:
    return f"{host_name(host, port)} {key.export_public_key('openssh').decode().strip()}\n"


async def fetch_host_key(host: str, port: int, timeout: float = 5.0) -> asyncssh.SSHKey:
    """The host key an agent presents (no authentication happens), under the one algorithm policy.

    Raises WeakHostKey for a key the policy refuses, ConnectionError when none came.
    """
    opts = client_options()  # only these two apply before any key is trusted
    key = await asyncio.wait_for(
        asyncssh.get_server_host_key(host, port, kex_algs=opts["kex_algs"], server_host_key_algs=opts["server_host_key_algs"]),
        timeout,
    )
    if key is None:
        raise ConnectionError(f"{host}:{port} presented no host key")
    weak = weak_key_reason(key)
    if weak:
        raise WeakHostKey(f"{host}:{port} presented {weak}; not trusted (give the agent an ed25519 host key)")
    return key


def pinned_keys(known_hosts: str | Path, host: str, port: int) -> list[asyncssh.SSHKey]:
    """The keys ``known_hosts`` holds for exactly ``host:port`` (not wildcard lines)."""
    path = Path(known_hosts)
    if not path.exists():
        return []
    name = host_name(host, port)
    found = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 3 or line.lstrip().startswith("#") or name not in parts[0].split(","):
            continue
        try:
            found.append(asyncssh.import_public_key(" ".join(parts[1:3])))
        except (asyncssh.KeyImportError, ValueError):
            continue
    return found


def trust(known_hosts: str | Path, host: str, port: int, key: asyncssh.SSHKey, *, replace: bool = False) -> bool:
    """Pin ``key`` for ``host:port``; True if the file changed.

    A key already pinned is left as it is. With ``replace`` the host's other
    keys are dropped (its key changed); without it the new key is added beside
    them. Written atomically, 0644.
    """
    path = Path(known_hosts)
    pinned = pinned_keys(path, host, port)
    others = [k for k in pinned if k.public_data != key.public_data]
    if len(others) < len(pinned) and not (replace and others):
        return False
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    if replace:
        name = host_name(host, port)
        lines = [line for line in lines if line.lstrip().startswith("#") or len(line.split()) < 3
                 or name not in line.split()[0].split(",")]
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    if not any(k.public_data == key.public_data for k in pinned) or replace:
        entry = known_hosts_entry(host, port, key)
        if entry not in lines:
            lines.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(lines).encode(), PUBLIC_MODE)
    return True
