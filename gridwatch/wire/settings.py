"""What every settings file shares (agent.toml, cluster.toml, relay.toml): the error and HOST:PORT."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the file (or flag), the key and what it expects."""


def split_hostport(value: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a pair; an empty host listens everywhere."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what}: expected HOST:PORT with a port from 0 to 65535, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)
