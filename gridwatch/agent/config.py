"""Agent settings: one typed struct, from defaults, then a TOML file, then command-line flags."""

from __future__ import annotations

import difflib
import json
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from gridwatch.wire.names import node_name_refusal
from gridwatch.wire.settings import ConfigError, split_hostport

# Each bound is also what an operator reads in the error: "expected a number from 0.05 to 3600".
Seconds = Annotated[float, Meta(gt=0, le=3600, description="seconds")]
PathText = Annotated[str, Meta(min_length=1, description="a path")]
HostPort = Annotated[str, Meta(min_length=1, description="HOST:PORT")]
# A journal source: the kernel's messages, or a systemd unit by its full name (never an option: no leading "-").
JOURNAL_SOURCE = r"^(?:kernel|[A-Za-z0-9:_.@-]+\.(?:service|socket|scope|slice|target|timer|mount))$"
JOURNAL_HELP = '"kernel" or systemd unit names such as "nvidia-fabricmanager.service"'
JournalSource = Annotated[str, Meta(pattern=JOURNAL_SOURCE)]


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything an agent is told. Parsed once (:func:`load`); code that builds one directly is trusted."""

    node_name: Annotated[str, Meta(min_length=1, max_length=200)] = msgspec.field(default_factory=socket.gethostname)
    listen: HostPort = "0.0.0.0:8022"
    host_key: PathText = "/etc/gridwatch/agent_host_key"
    authorized_viewers: PathText = "/etc/gridwatch/authorized_viewers"
    authorized_operators: PathText = "/etc/gridwatch/authorized_operators"
    metrics_listen: HostPort | None = None
    # Under 0.05 s the sampler takes most of a core; past an hour a console calls the node stale anyway.
    interval: Annotated[float, Meta(ge=0.05, le=3600, description="seconds between samples")] = 1.0
    # How often the scheduler's jobs on the node are read from /proc (cgroups, Slurm's environment); 0: never.
    jobs_every: Annotated[float, Meta(ge=0, le=3600, description="seconds, 0: jobs are not read")] = 10.0
    # Application logs (the trainer's, a job's): they report application faults (NCCL, CUDA, tracebacks) only.
    log: list[PathText] = msgspec.field(default_factory=list)
    kernel_log: bool = True
    # Files holding the kernel's own lines (rsyslog's kern.log or syslog): they may report driver and hardware
    # faults (XID, NVSwitch, machine checks), and only while no one but root can write them.
    kernel_logs: list[PathText] = msgspec.field(default_factory=list)
    # Nodes whose kernel log is only in the journal: "kernel", and units such as "nvidia-fabricmanager.service".
    journal: Annotated[list[JournalSource], Meta(description=JOURNAL_HELP)] = msgspec.field(default_factory=list)
    journal_cursor: PathText = "/var/lib/gridwatch/journal.cursor"  # where the journal reader resumes after a restart
    simulate_gpus: Annotated[int, Meta(ge=0, le=1024)] = 0
    sim_seed: int = 0
    trainer_socket: PathText | None = None
    ring_frames: Annotated[int, Meta(ge=1, le=10_000_000)] = 3600  # about an hour of samples at 1 Hz plus events
    scene_dir: PathText = "/var/lib/gridwatch/scenes"
    state_file: PathText | None = None  # keeps "isolated" across agent restarts when set
    patrol_interval: Annotated[float, Meta(ge=0, le=7 * 86400, description="seconds, 0: no patrol")] = 0.0
    nics: list[Annotated[str, Meta(min_length=1)]] = msgspec.field(default_factory=list)
    checkpoint_paths: list[PathText] = msgspec.field(default_factory=list)
    # Each client key may send this many actions and searches at once, then this many a second.
    action_burst: Annotated[float, Meta(ge=1, le=1_000_000)] = 20.0
    action_rate: Annotated[float, Meta(gt=0, le=1_000_000, description="requests a second")] = 2.0
    search_timeout: Seconds = 5.0  # seconds a log search may run before its worker is killed
    # Connections still authenticating at once (as sshd's MaxStartups), and how long each may take.
    max_unauthenticated: Annotated[int, Meta(ge=1, le=100_000)] = 64
    login_timeout: Seconds = 30.0
    # How long one source (NVML, host, logs) may take to answer a tick before it counts as hung.
    source_timeout: Annotated[float, Meta(gt=0, le=60, description="seconds")] = 2.0
    # InfiniBand / RoCE HCA ports: where sysfs lists them, and how they are judged.
    ib_root: PathText = "/sys/class/infiniband"
    # One error counter of a port growing faster than this (per second, between two samples): degraded.
    ib_error_rate: Annotated[float, Meta(gt=0, le=1e12, description="errors a second")] = 1.0
    # A link flap as gpud counts one: down at least ib_flap_down_s, then back to ACTIVE, ib_flap_count
    # times within ib_flap_window_s (gpud: 25 s, 3 times, 12 h 5 min).
    ib_flap_down_s: Annotated[float, Meta(gt=0, le=86400, description="seconds")] = 25.0
    ib_flap_count: Annotated[int, Meta(ge=1, le=1000)] = 3
    ib_flap_window_s: Annotated[float, Meta(gt=0, le=30 * 86400, description="seconds")] = 43500.0
    # NCCL's RAS service on this node (NCCL_RAS_ADDR of the job; NCCL 2.24+); empty: never asked.
    ras: Annotated[str, Meta(pattern=r"^$|^\S+:\d{1,5}$", description="HOST:PORT, or empty")] = "127.0.0.1:28028"

    def listen_addr(self) -> tuple[str, int]:
        return split_hostport(self.listen, "listen")

    def metrics_addr(self) -> tuple[str, int] | None:
        return split_hostport(self.metrics_listen, "metrics_listen") if self.metrics_listen else None


_FIELDS = {f.name: f for f in msgspec.structs.fields(AgentConfig)}


def _number(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:g}"


def expected(kind: Any) -> str:
    """What a setting of this (msgspec) type accepts, in an operator's words."""
    info = kind if isinstance(kind, msgspec.inspect.Type) else msgspec.inspect.type_info(kind)
    note = ""
    if isinstance(info, msgspec.inspect.Metadata):
        note = (info.extra_json_schema or {}).get("description", "")
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):  # "X or nothing": TOML has no null, so say X
        inner = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return expected(inner[0]) if len(inner) == 1 else " or ".join(expected(t) for t in inner)
    if isinstance(info, (msgspec.inspect.FloatType, msgspec.inspect.IntType)):
        text = "a number" if isinstance(info, msgspec.inspect.FloatType) else "a whole number"
        low = info.ge if info.ge is not None else info.gt
        if low is not None and info.le is not None:
            text += f" {'above' if info.ge is None else 'from'} {_number(low)} {'up ' if info.ge is None else ''}to {_number(info.le)}"
        elif low is not None:
            text += f" {'above' if info.ge is None else 'of at least'} {_number(low)}"
        elif info.le is not None:
            text += f" of at most {_number(info.le)}"
    elif isinstance(info, msgspec.inspect.StrType):
        text = "a non-empty string" if info.min_length else "a string"
        if info.max_length:
            text += f" of at most {info.max_length} characters"
    elif isinstance(info, msgspec.inspect.BoolType):
        text = "true or false"
    elif isinstance(info, msgspec.inspect.ListType):
        item = info.item_type.type if isinstance(info.item_type, msgspec.inspect.Metadata) else info.item_type
        text = "a list of strings" if isinstance(item, msgspec.inspect.StrType) else "a list"
    else:
        text = "a value of another type"
    return f"{text} ({note})" if note and note not in text else text


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check(name: str, value: Any, where: str) -> Any:
    """``value`` as setting ``name`` takes it, or :class:`ConfigError` naming ``where``, the key and what it expects."""
    field = _FIELDS[name]
    try:
        return msgspec.convert(value, field.type)
    except msgspec.ValidationError:
        hint = ""
        if isinstance(value, str) and isinstance(_bare(field.type), msgspec.inspect.ListType):
            hint = f" (a list: write [{json.dumps(value)}])"
        raise ConfigError(f"{where}: expected {expected(field.type)}, got {_shown(value)}{hint}") from None


def _bare(kind: Any) -> msgspec.inspect.Type:
    info = msgspec.inspect.type_info(kind)
    return info.type if isinstance(info, msgspec.inspect.Metadata) else info


def _unknown(where: str, key: str) -> ConfigError:
    close = difflib.get_close_matches(key.replace("-", "_"), _FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(sorted(_FIELDS))}"
    return ConfigError(f"{where}: unknown setting {key!r}{hint}")


def _table(path: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if "agent" not in data:
        return data
    table = data["agent"]
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: agent: expected a table ([agent]), got {_shown(table)}")
    for key in data:
        if key != "agent":  # settings beside [agent] would be silently ignored
            raise _unknown(path, key)
    return table


def load(path: str | None, overrides: dict[str, Any]) -> AgentConfig:
    """Build the config: TOML file (its ``[agent]`` table or top level) under command-line overrides.

    Every key is checked against its type and bounds; flags (``overrides``,
    by field name, ``None`` for "not given") are checked the same way.
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}  # where each setting came from, for the error that names it
    if path:
        for key, value in _table(path).items():
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise _unknown(path, key)
            origin[name] = f"{path}: {key}"
            values[name] = check(name, value, origin[name])
    for name, value in overrides.items():
        if value is not None and name in _FIELDS:
            origin[name] = f"--{name.replace('_', '-')}"
            values[name] = check(name, value, origin[name])
    cfg = msgspec.convert(values, AgentConfig)  # every value already passed its own check
    for name in ("listen", "metrics_listen"):
        value = getattr(cfg, name)
        if value is not None:
            split_hostport(value, origin.get(name, name))
    refused = node_name_refusal(cfg.node_name)
    if refused:
        raise ConfigError(f"{origin.get('node_name', 'node_name')}: consoles would refuse the name {refused}")
    if 0 < cfg.patrol_interval < 1:
        where = origin.get("patrol_interval", "patrol_interval")
        raise ConfigError(f"{where}: expected 0 (no patrol) or at least 1 second, got {cfg.patrol_interval:g}")
    return cfg
