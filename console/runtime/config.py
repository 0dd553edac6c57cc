"""cluster.toml, parsed once into a typed struct: what the console, tail, preflight and the demo read of a deployment.

A wrong type or an unknown key is one :class:`ConfigError` sentence naming the
file, the key and what was expected; commands print it and exit 2.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from playbooks.model import SCHEDULERS
from playbooks.notify import check_alertmanager_url


class ConfigError(ValueError):
    """cluster.toml cannot be used; the message names the file, the key and what was expected."""


# The summary cadence: each node's compact summary every this many seconds (events and the
# full samples of the nodes an operator opens come at once whatever it is). "auto" follows
# the fleet's size, because the console's cost per node is per message received (SSH and
# decode), and a fleet view needs no more than a summary every few seconds past a thousand nodes.
AUTO: Literal["auto"] = "auto"
# auto: one summary per sample up to this many nodes, then a second between summaries per this many nodes.
# A console pays ~45 µs of SSH per message whatever it holds: 500 messages a second is ~2 % of a core.
AUTO_NODES_PER_SECOND = 500
AUTO_MAX_EVERY = 5.0  # auto: at most this many seconds between summaries (dcgm-exporter collects every 30 s)
MAX_SUMMARY_EVERY = 60.0  # a node silent for longer is no fleet view
SummaryEvery = float | Literal["auto"]


def summary_cadence(setting: SummaryEvery, nodes: int) -> float:
    """Seconds between a node's summaries in a fleet of ``nodes``: ``setting``, or what "auto" makes of that size.

    "auto" is one per sample (0) up to 500 nodes, then ``nodes / 500`` s, at most 5 s: 1,000 nodes, 2 s;
    2,500 and more, 5 s. 0 means one summary per sample.
    """
    if setting == AUTO:
        return 0.0 if nodes <= AUTO_NODES_PER_SECOND else min(nodes / AUTO_NODES_PER_SECOND, AUTO_MAX_EVERY)
    return float(setting)


def parse_summary_every(text: str) -> SummaryEvery:
    """``--summary-every``'s value: "auto" or seconds from 0 (one per sample) to 60; ValueError saying what it takes."""
    word = text.strip().lower()
    if word == AUTO:
        return AUTO
    try:
        value = float(word)
    except ValueError:
        raise ValueError(f"expected {EXPECTED['summary_every']}, got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_SUMMARY_EVERY:
        raise ValueError(f"expected {EXPECTED['summary_every']}, got {text!r}")
    return value


def cadence_line(every: float, nodes: int) -> str:
    """The cadence in force, in one line: "summaries every 2.5 s from 2,500 nodes; full samples for nodes opened"."""
    fleet = f"{nodes:,} node{'' if nodes == 1 else 's'}"
    pace = f"summaries every {every:g} s" if every > 0 else "a summary per sample"
    return f"{pace} from {fleet}; full samples for nodes opened"


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One deployment, as cluster.toml describes it. Paths are made absolute against the file's folder."""

    nodes: str | list[str] = ""  # hostlist syntax, or a list of such strings; may be left out with prometheus
    key: str | None = None  # private key; the agents' lists decide viewer or operator
    known_hosts: str | None = None  # pins the agents' host keys
    scheduler: str = "none"  # what drain_node tells: none | slurm | kubernetes
    read_only: bool = False  # never act, even with an operator key
    operator: str | None = None  # who this console is in the audit log (default: the login)
    db: str | None = None  # incidents, steps and audit log (SQLite)
    playbooks: str | list[str] = []  # more playbook files or folders
    connect_timeout: float = 5.0  # seconds to reach an agent before trying again
    # etcd's URL (or several): consoles of this cluster elect the one that acts; without it a console acts alone.
    etcd: str | list[str] = []
    cluster: str | None = None  # the name the consoles share the lead under (default: derived from nodes)
    alertmanager: str | None = None  # Alertmanager's URL: notify steps page there too
    metrics: str | None = None  # HOST:PORT where the console serves its own /metrics
    prometheus: str | None = None  # a Prometheus query API (Thanos, VictoriaMetrics, Mimir): the fleet from it too
    summary_every: SummaryEvery = AUTO  # seconds between a node's summaries, or "auto" (by the fleet's size)

    @property
    def node_spec(self) -> str:
        """``nodes`` as one hostlist string."""
        return self.nodes if isinstance(self.nodes, str) else ",".join(self.nodes)

    @property
    def etcd_urls(self) -> list[str]:
        """``etcd`` as a list of endpoints."""
        return [self.etcd] if isinstance(self.etcd, str) else list(self.etcd)

    @property
    def playbook_paths(self) -> list[str]:
        return [self.playbooks] if isinstance(self.playbooks, str) else list(self.playbooks)


# What each key takes, in the words an error shows.
EXPECTED: dict[str, str] = {
    "nodes": 'a hostlist string or a list of them, e.g. "node[01-16]:8022"',
    "key": "a path to the private key",
    "known_hosts": "a path to the known_hosts file",
    "scheduler": f"one of {', '.join(SCHEDULERS)}",
    "read_only": "true or false",
    "operator": "a name for the audit log",
    "db": "a path to the incident database",
    "playbooks": "a path or a list of paths to playbook files or folders",
    "connect_timeout": "a number of seconds above 0",
    "etcd": 'an http(s) URL of etcd or a list of them, e.g. "http://10.0.0.1:2379"',
    "cluster": "a name of up to 100 letters, digits, '.', '_' or '-' (the consoles' key in etcd)",
    "alertmanager": 'an http(s) URL of Alertmanager, e.g. "http://alertmanager:9093"',
    "metrics": 'HOST:PORT to serve the console\'s /metrics on, e.g. "127.0.0.1:9400"',
    "prometheus": 'an http(s) URL of a Prometheus query API, e.g. "http://prometheus:9090"',
    "summary_every": f'"auto" or the seconds between a node\'s summaries, from 0 (one per sample) to {MAX_SUMMARY_EVERY:g}',
}
_AT_KEY = re.compile(r"at `\$\.([A-Za-z0-9_-]+)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def _error(path: str, key: str, value: Any = msgspec.UNSET) -> ConfigError:
    got = "" if value is msgspec.UNSET else f", got {value!r}"[:120]
    return ConfigError(f"{path}: {key}: expected {EXPECTED.get(key, 'something else')}{got}")


def parse_cluster(text: str, path: str) -> ClusterConfig:
    """The struct in ``text`` (read from ``path``, which errors name and relative paths start from)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        config = msgspec.convert(data, ClusterConfig)
    except msgspec.ValidationError as exc:
        message = str(exc)
        unknown = _UNKNOWN.search(message)
        if unknown:
            raise ConfigError(f"{path}: unknown key {unknown.group(1)!r} (known keys: "
                              f"{', '.join(ClusterConfig.__struct_fields__)})") from None
        at = _AT_KEY.search(message)
        if at:
            raise _error(path, at.group(1), data.get(at.group(1), msgspec.UNSET)) from None
        if "missing required field" in message:
            raise ConfigError(f"{path}: no 'nodes': expected {EXPECTED['nodes']}") from None
        raise ConfigError(f"{path}: {message}") from None
    if config.scheduler not in SCHEDULERS:
        raise _error(path, "scheduler", config.scheduler)
    if config.prometheus is not None:
        from console.fleet.prometheus import check_prometheus_url

        try:
            config = msgspec.structs.replace(config, prometheus=check_prometheus_url(config.prometheus))
        except ValueError:
            raise _error(path, "prometheus", config.prometheus) from None
    if not config.node_spec.strip() and config.prometheus is None:
        if "nodes" not in data:
            raise ConfigError(f"{path}: no 'nodes': expected {EXPECTED['nodes']} (or a prometheus URL)")
        raise _error(path, "nodes", config.nodes)
    if not math.isfinite(config.connect_timeout) or config.connect_timeout <= 0:
        raise _error(path, "connect_timeout", config.connect_timeout)
    if config.summary_every != AUTO and not 0 <= float(config.summary_every) <= MAX_SUMMARY_EVERY:
        raise _error(path, "summary_every", config.summary_every)  # nan fails the range too
    if config.operator is not None and not config.operator.strip():
        raise _error(path, "operator", config.operator)
    if any(not u.startswith(("http://", "https://")) for u in config.etcd_urls):
        raise _error(path, "etcd", config.etcd)
    if config.cluster is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", config.cluster):
        raise _error(path, "cluster", config.cluster)
    if config.alertmanager is not None:
        try:
            config = msgspec.structs.replace(config, alertmanager=check_alertmanager_url(config.alertmanager))
        except ValueError:
            raise _error(path, "alertmanager", config.alertmanager) from None
    if config.metrics is not None:
        host, _sep, port = config.metrics.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise _error(path, "metrics", config.metrics)
    base = Path(path).parent

    def resolve(value: str | None) -> str | None:
        return None if value is None else str(base / Path(value).expanduser())

    books = [str(resolve(p)) for p in config.playbook_paths]
    return msgspec.structs.replace(config, key=resolve(config.key), known_hosts=resolve(config.known_hosts),
                                   db=resolve(config.db), playbooks=books)


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and check cluster.toml at ``path``; :class:`ConfigError` in one sentence when it cannot be used."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    return parse_cluster(text, str(path))


def write_cluster(path: str | Path, config: ClusterConfig) -> Path:
    """Write ``config`` as cluster.toml (what ``gridwatch demo`` leaves for a second console to attach with)."""
    lines = []
    for name in ClusterConfig.__struct_fields__:
        value = getattr(config, name)
        if value is None or (name == "etcd" and not value):
            continue
        lines.append(f"{name} = {_toml(value)}")
    out = Path(path)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    # JSON string escapes are valid TOML basic-string escapes.
    return msgspec.json.encode(str(value)).decode()
