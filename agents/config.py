"""Agent settings: defaults, then a TOML file, then command-line flags."""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the file and the key."""


@dataclass
class AgentConfig:
    node_name: str = field(default_factory=socket.gethostname)
    listen: str = "0.0.0.0:8022"
    host_key: str = "/etc/gridwatch/agent_host_key"
    authorized_viewers: str = "/etc/gridwatch/authorized_viewers"
    authorized_operators: str = "/etc/gridwatch/authorized_operators"
    metrics_listen: str | None = None
    interval: float = 1.0
    log: list[str] = field(default_factory=list)
    kernel_log: bool = True
    simulate_gpus: int = 0
    sim_seed: int = 0
    trainer_socket: str | None = None
    ring_frames: int = 3600  # about an hour of samples at 1 Hz plus events
    scene_dir: str = "/var/lib/gridwatch/scenes"
    state_file: str | None = None  # keeps "isolated" across agent restarts when set
    patrol_interval: float = 0.0  # 0: no patrol
    nics: list[str] = field(default_factory=list)
    checkpoint_paths: list[str] = field(default_factory=list)
    # Each client key may send this many actions and searches at once, then this many a second.
    action_burst: float = 20.0
    action_rate: float = 2.0
    search_timeout: float = 5.0  # seconds a log search may run before its worker is killed
    # Connections still authenticating at once (as sshd's MaxStartups), and how long each may take.
    max_unauthenticated: int = 64
    login_timeout: float = 30.0

    def listen_addr(self) -> tuple[str, int]:
        return split_hostport(self.listen, "listen")

    def metrics_addr(self) -> tuple[str, int] | None:
        return split_hostport(self.metrics_listen, "metrics_listen") if self.metrics_listen else None


def split_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def load(path: str | None, overrides: dict[str, Any]) -> AgentConfig:
    """Build the config: TOML file (its ``[agent]`` table or top level) under CLI overrides."""
    values: dict[str, Any] = {}
    known = {f.name: f for f in fields(AgentConfig)}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        table = data.get("agent", data)
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            values[name] = value
    values.update({k: v for k, v in overrides.items() if v is not None and k in known})
    cfg = AgentConfig(**values)
    if cfg.interval <= 0:
        raise ConfigError(f"interval must be positive, got {cfg.interval}")
    for name in ("action_rate", "search_timeout", "login_timeout"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.action_burst < 1:
        raise ConfigError(f"action_burst must be at least 1, got {cfg.action_burst}")
    if cfg.max_unauthenticated < 1:
        raise ConfigError(f"max_unauthenticated must be at least 1, got {cfg.max_unauthenticated}")
    if cfg.simulate_gpus < 0:
        raise ConfigError("simulate_gpus must be 0 or more")
    cfg.listen_addr()
    cfg.metrics_addr()
    return cfg
