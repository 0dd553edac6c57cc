"""cluster.toml, parsed once into a typed struct: what the console, tail, preflight and the demo read of a deployment.

A wrong type or an unknown key is one :class:`ConfigError` sentence naming the
file, the key and what was expected; commands print it and exit 2.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from gridwatch.playbooks.model import SCHEDULERS
from gridwatch.playbooks.notify import check_alertmanager_url
from gridwatch.sshlink.hostlist import Endpoint, HostlistError, parse_endpoints
from gridwatch.wire.settings import ConfigError

# The summary cadence: each node's compact summary every this many seconds (events and the
# full samples of the nodes an operator opens come at once whatever it is). "auto" follows
# the fleet's size, because the console's cost per node is per message received (SSH and
# decode), and a fleet view needs no more than a summary every few seconds past a thousand nodes.
AUTO: Literal["auto"] = "auto"
# auto: one summary per sample up to this many nodes, then a second between summaries per this many nodes:
# at most 250 summaries a second from the fleet until the 5 s cap (1,250 nodes). A console pays ~35 µs of
# SSH per message whatever it holds, and its frame, store and engine ~20 more: at 1,000 nodes 4 s (with the
# SSH work of the same round) halved its CPU, 33-38 µs per node per second direct and 22-28 relayed. What
# it costs: a node's numbers are up to 4 s old in the fleet view, and a node that falls silent is stale
# after 12 s instead of 6 (events, XIDs and an opened node's samples come at once whatever the cadence).
# BENCHMARKS.md, issue 25's fifth round.
AUTO_NODES_PER_SECOND = 250
AUTO_MAX_EVERY = 5.0  # auto: at most this many seconds between summaries (dcgm-exporter collects every 30 s)
MAX_SUMMARY_EVERY = 60.0  # a node silent for longer is no fleet view
SummaryEvery = float | Literal["auto"]
# The log store's lifecycle (gridwatch.console.runtime.logstore): lines older than this go, then the oldest
# while it holds more than that; an open incident's evidence stays.
DEFAULT_RETENTION = "14d"
DEFAULT_STORE_MAX = "20GB"
# What the console keeps of one node's scene bundle at most (gridwatch.console.runtime.scene_copy).
DEFAULT_SCENE_MAX = "64MB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def summary_cadence(setting: SummaryEvery, nodes: int) -> float:
    """Seconds between a node's summaries in a fleet of ``nodes``: ``setting``, or what "auto" makes of that size.

    "auto" is one per sample (0) up to 250 nodes, then ``nodes / 250`` s, at most 5 s: 500 nodes, 2 s;
    1,000 nodes, 4 s; 1,250 and more, 5 s. 0 means one summary per sample.
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


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (``20GB``, ``500MB``, ``1.5GiB``, a number of bytes), above 0; ValueError in one line."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 500MB or 20GB")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ValueError(f"{text!r} is not a size: write it as 500MB, 20GB or 1TiB")
        value = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"{text!r} is not a size above 0")
    return value


def parse_retention(text: str | float) -> float:
    """Seconds in ``text`` (``14d``, ``12h``, a number of seconds), above 0; ValueError in one line."""
    from gridwatch.playbooks.durations import parse_duration

    value = parse_duration(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a duration above 0")
    return value


def cadence_line(every: float, nodes: int) -> str:
    """The cadence in force, in one line: "summaries every 2.5 s from 2,500 nodes; full samples for nodes opened"."""
    fleet = f"{nodes:,} node{'' if nodes == 1 else 's'}"
    pace = f"summaries every {every:g} s" if every > 0 else "a summary per sample"
    return f"{pace} from {fleet}; full samples for nodes opened"


class RelayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One ``[[relay]]`` table: a gridwatch relay and the nodes it carries for this console on one link."""

    address: str  # HOST:PORT of the relay, reached and pinned like an agent
    nodes: str | list[str]  # hostlist syntax, or a list of such strings

    @property
    def node_spec(self) -> str:
        """``nodes`` as one hostlist string."""
        return self.nodes if isinstance(self.nodes, str) else ",".join(self.nodes)


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
    # etcd must be private to the consoles: whoever writes its keys decides which console acts (README).
    etcd_user: str | None = None  # etcd's auth: this user (with etcd_password_file)
    etcd_password_file: str | None = None  # a file only its owner can read, holding the password
    etcd_ca: str | None = None  # https etcd: the CA that signed its certificate
    etcd_cert: str | None = None  # client TLS (etcd --client-cert-auth): this console's certificate ...
    etcd_key: str | None = None  # ... and its key
    alertmanager: str | None = None  # Alertmanager's URL: notify steps page there too
    metrics: str | None = None  # HOST:PORT where the console serves its own /metrics
    prometheus: str | None = None  # a Prometheus query API (Thanos, VictoriaMetrics, Mimir): the fleet from it too
    summary_every: SummaryEvery = AUTO  # seconds between a node's summaries, or "auto" (by the fleet's size)
    # [[relay]] tables: nodes reached through a relay (one link for hundreds of nodes); `nodes` then lists
    # only those the console links to itself, and may be left out when relays carry every node.
    relay: list[RelayConfig] = []
    retention: str | float | None = None  # the log store keeps lines this long ("14d"; default DEFAULT_RETENTION)
    store_max: str | int | None = None  # ... and at most this much ("20GB"; default DEFAULT_STORE_MAX)
    scene_max: str | int | None = None  # a node's scene copied at capture up to this much ("64MB"; DEFAULT_SCENE_MAX)

    @property
    def node_spec(self) -> str:
        """``nodes`` as one hostlist string."""
        return self.nodes if isinstance(self.nodes, str) else ",".join(self.nodes)

    @property
    def retention_s(self) -> float:
        """``retention`` in seconds (checked when the file was read)."""
        return parse_retention(DEFAULT_RETENTION if self.retention is None else self.retention)

    @property
    def store_max_bytes(self) -> int:
        """``store_max`` in bytes (checked when the file was read)."""
        return parse_size(DEFAULT_STORE_MAX if self.store_max is None else self.store_max)

    @property
    def scene_max_bytes(self) -> int:
        """``scene_max`` in bytes (checked when the file was read)."""
        return parse_size(DEFAULT_SCENE_MAX if self.scene_max is None else self.scene_max)

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
    "etcd_user": "etcd's user name for this console (with etcd_password_file)",
    "etcd_password_file": "a path to a file only its owner can read (mode 0600), holding etcd's password",
    "etcd_ca": "a path to the CA certificate (PEM) that signed etcd's",
    "etcd_cert": "a path to this console's client certificate (PEM), with etcd_key",
    "etcd_key": "a path to the client certificate's private key (PEM)",
    "alertmanager": 'an http(s) URL of Alertmanager, e.g. "http://alertmanager:9093"',
    "metrics": 'HOST:PORT to serve the console\'s /metrics on, e.g. "127.0.0.1:9400"',
    "prometheus": 'an http(s) URL of a Prometheus query API, e.g. "http://prometheus:9090"',
    "summary_every": f'"auto" or the seconds between a node\'s summaries, from 0 (one per sample) to {MAX_SUMMARY_EVERY:g}',
    "relay": "[[relay]] tables, each with an address and the nodes that relay carries",
    "relay.address": 'HOST:PORT of a gridwatch relay, e.g. "head1:8023"',
    "relay.nodes": 'a hostlist string or a list of them, e.g. "node[017-512]:8022"',
    "retention": 'how long the log store keeps lines, a duration above 0, e.g. "14d" or "12h"',
    "store_max": 'the most the log store may hold, a size above 0, e.g. "20GB" or "500MB"',
    "scene_max": 'the most of one node\'s scene the console copies at capture, a size above 0, e.g. "64MB"',
}
_AT_KEY = re.compile(r"at `\$\.([A-Za-z0-9_-]+)")
_AT_RELAY = re.compile(r"at `\$\.relay\[(\d+)\](?:\.([A-Za-z0-9_-]+))?")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_ADDRESS = re.compile(r"[^\s\[\],=]+:\d+")


def relay_key(index: int, key: str | None = None) -> str:
    """How errors name the ``index``-th (from 0) ``[[relay]]`` table, or a key in it: ``relay[2].nodes`` is the second's."""
    return f"relay[{index + 1}]" + (f".{key}" if key else "")


def parse_relay(text: str) -> RelayConfig:
    """``--relay``'s value, ``ADDRESS=HOSTLIST`` (what a ``[[relay]]`` table says); ValueError saying what it takes."""
    address, sep, nodes = text.partition("=")
    if not sep or not address.strip() or not nodes.strip():
        raise ValueError(f"expected ADDRESS=HOSTLIST, e.g. head1:8023=node[017-512]:8022, got {text!r}"[:200])
    return RelayConfig(address=address.strip(), nodes=nodes.strip())


def relay_endpoints(relays: Sequence[RelayConfig], direct: Sequence[Endpoint] = (),
                    name: Callable[[int, str], str] = relay_key) -> dict[Endpoint, list[Endpoint]]:
    """Each relay -> the nodes it carries, checked against each other and against the nodes linked ``direct``.

    A node is reached one way only: a node under two relays, or linked directly and under a relay, or a
    relay that is itself a node, is a ValueError "<name(i, key)>: <why>" in one line, as is a bad address
    or hostlist (``name`` says how the i-th relay's key is called: ``relay[2].nodes``, or the flag).
    """
    # Who reaches each endpoint so far: None for the console itself (``nodes``), else the relay.
    owner: dict[Endpoint, Endpoint | None] = dict.fromkeys(direct)
    out: dict[Endpoint, list[Endpoint]] = {}

    def reached(ep: Endpoint) -> str:
        via = owner[ep]
        return "listed in nodes" if via is None else f"under relay {via}"

    for index, relay in enumerate(relays):
        address = relay.address.strip()
        try:
            found = parse_endpoints(address) if _ADDRESS.fullmatch(address) else []
        except HostlistError:
            found = []
        if len(found) != 1:
            raise ValueError(f"{name(index, 'address')}: expected {EXPECTED['relay.address']}, got {relay.address!r}"[:300])
        here = found[0]
        if here in out:
            raise ValueError(f"{name(index, 'address')}: relay {here} is listed twice")
        if here in owner:
            raise ValueError(f"{name(index, 'address')}: relay {here} is also {reached(here)}")
        try:
            nodes = parse_endpoints(relay.node_spec)
        except HostlistError as exc:
            raise ValueError(f"{name(index, 'nodes')}: {exc}"[:300]) from None
        for node in nodes:
            if node == here:
                raise ValueError(f"{name(index, 'nodes')}: relay {here} lists itself among its nodes")
            if node in out:
                raise ValueError(f"{name(index, 'nodes')}: relay {node} is also under relay {here}")
            if node in owner:
                also = "relay" if owner[node] is not None else "under relay"  # "under relay a and relay b"
                raise ValueError(f"{name(index, 'nodes')}: {node} is {reached(node)} and {also} {here}")
            owner[node] = here
        out[here] = nodes
    return out


def _relay_error(path: str, data: dict[str, Any], message: str, index: int, key: str | None) -> ConfigError:
    """The one line for a ``[[relay]]`` table msgspec refused."""
    where = f"{path}: {relay_key(index, key)}"
    unknown = _UNKNOWN.search(message)
    if unknown:
        return ConfigError(f"{where}: unknown key {unknown.group(1)!r} (known keys: "
                           f"{', '.join(RelayConfig.__struct_fields__)})")
    missing = _MISSING.search(message)
    if missing:
        field = missing.group(1)
        return ConfigError(f"{where}: no {field!r}: expected {EXPECTED.get('relay.' + field, 'a value')}")
    tables = data.get("relay")
    table = tables[index] if isinstance(tables, list) and index < len(tables) else msgspec.UNSET
    value = table.get(key, msgspec.UNSET) if key and isinstance(table, dict) else table
    got = "" if value is msgspec.UNSET else f", got {value!r}"[:120]
    what = EXPECTED.get(f"relay.{key}", "something else") if key else "a table with an address and nodes"
    return ConfigError(f"{where}: expected {what}{got}")


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
        relay = _AT_RELAY.search(message)
        if relay:
            raise _relay_error(path, data, message, int(relay.group(1)), relay.group(2)) from None
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
        from gridwatch.console.fleet.prometheus import check_prometheus_url

        try:
            config = msgspec.structs.replace(config, prometheus=check_prometheus_url(config.prometheus))
        except ValueError:
            raise _error(path, "prometheus", config.prometheus) from None
    if not config.node_spec.strip() and config.prometheus is None and not config.relay:
        if "nodes" not in data:
            raise ConfigError(f"{path}: no 'nodes': expected {EXPECTED['nodes']} (or a prometheus URL)")
        raise _error(path, "nodes", config.nodes)
    if config.relay:
        # Each node one way: checked here, so the file's error names the table and the key.
        try:
            direct = parse_endpoints(config.node_spec) if config.node_spec.strip() else []
        except HostlistError as exc:
            raise ConfigError(f"{path}: nodes: {exc}") from None
        try:
            relay_endpoints(config.relay, direct)
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
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
    for key, check in (("retention", parse_retention), ("store_max", parse_size), ("scene_max", parse_size)):
        value = getattr(config, key)
        if value is not None:
            try:
                check(value)
            except ValueError:
                raise _error(path, key, value) from None
    if config.metrics is not None:
        host, _sep, port = config.metrics.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise _error(path, "metrics", config.metrics)
    base = Path(path).parent

    def resolve(value: str | None) -> str | None:
        return None if value is None else str(base / Path(value).expanduser())

    books = [str(resolve(p)) for p in config.playbook_paths]
    if (config.etcd_user is None) != (config.etcd_password_file is None):
        raise _error(path, "etcd_user" if config.etcd_user is None else "etcd_password_file")
    if (config.etcd_cert is None) != (config.etcd_key is None):
        raise _error(path, "etcd_cert" if config.etcd_cert is None else "etcd_key")
    return msgspec.structs.replace(config, key=resolve(config.key), known_hosts=resolve(config.known_hosts),
                                   db=resolve(config.db), playbooks=books,
                                   etcd_password_file=resolve(config.etcd_password_file),
                                   etcd_ca=resolve(config.etcd_ca), etcd_cert=resolve(config.etcd_cert),
                                   etcd_key=resolve(config.etcd_key))


def read_secret(path: str) -> str:
    """The first line of a password file; ValueError in one line when it is missing, empty, or others may read it."""
    try:
        st = os.stat(path)
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if st.st_mode & 0o077:
        raise ValueError(f"{path} may be read by others (mode {st.st_mode & 0o777:04o}): chmod 600 {path}")
    secret = text.splitlines()[0].strip() if text.strip() else ""
    if not secret:
        raise ValueError(f"{path} is empty")
    return secret


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
        if value is None or (name in ("etcd", "relay") and not value):
            continue
        if name == "relay":
            continue  # tables come after every key of the file's top level
        lines.append(f"{name} = {_toml(value)}")
    for relay in config.relay:
        lines += ["", "[[relay]]", f"address = {_toml(relay.address)}", f"nodes = {_toml(relay.nodes)}"]
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
