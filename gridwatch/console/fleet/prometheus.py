"""A fleet read from a Prometheus query API (or Thanos, VictoriaMetrics, Mimir): dcgm-exporter and node_exporter series into the state store.

Only ``/api/v1/query`` and ``/api/v1/query_range`` are used, so anything that
answers Prometheus's HTTP API will do. Every poll turns the answers into the
frames an agent would send (a :class:`~gridwatch.wire.protocol.Hello` per new node, a
:class:`~gridwatch.wire.protocol.Sample` per node per poll, an XID
:class:`~gridwatch.wire.protocol.Event` when ``DCGM_FI_DEV_XID_ERRORS`` changes), so
the state store, the views and the playbook engine take them unchanged. A node
whose gridwatch agent is connected is left to the agent: its frames win.

HTTP runs in worker threads, bounded by a timeout and a size limit; one
request per panel is in flight at a time; a panel that fails backs off on its
own and says why in one sentence (:class:`PanelStatus`). Nothing here blocks
the caller's event loop, and nothing here imports textual.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgspec
from loguru import logger

from gridwatch.console.fleet.history import HISTORY_POINTS
from gridwatch.console.fleet.state import StateStore
from gridwatch.wire.names import node_name_refusal
from gridwatch.wire.protocol import (
    HEARSAY_VERSION,
    Event,
    Frame,
    GpuInfo,
    GpuSample,
    Hello,
    HostSample,
    NicSample,
    Sample,
    Text,
    clean_text,
)
from gridwatch.wire.throttle import decode_throttle
from gridwatch.wire.xid import xid_meaning, xid_severity

# Labels that name the node a series is about, in the order they are believed:
# dcgm-exporter's (its releases spell it "Hostname"; newer ones "hostname"), then
# gridwatch's host metrics, then the scrape target.
NODE_LABELS = ("Hostname", "hostname", "node")
MAX_ANSWER_BYTES = 32 << 20  # a fleet of 10,000 GPUs answers a few MB; past this it is not an answer
MAX_ERROR_CHARS = 300
# While Prometheus does not answer, the engine is told each node reports this seldom, so
# the silence of the source never reads as many lost heartbeats; the views still go stale.
SOURCE_SILENT_INTERVAL_S = 24 * 3600.0
# Nodes taken from Prometheus's labels at most (a label that rotates must not grow the console without end),
# and how long one missing from every answer is remembered.
MAX_NODES = 20_000
FORGET_AFTER_S = 3600.0
# A reading past this is no reading (an exporter's overflow, or 1e308 sent on purpose).
MAX_VALUE = 1e15

GPU_QUERY = (
    '{__name__=~"DCGM_FI_DEV_(GPU_UTIL|MEM_COPY_UTIL|GPU_TEMP|MEMORY_TEMP|POWER_USAGE|FB_USED|FB_FREE'
    '|SM_CLOCK|MEM_CLOCK|ECC_SBE_VOL_TOTAL|ECC_DBE_VOL_TOTAL|XID_ERRORS|ROW_REMAP_PENDING|ROW_REMAP_FAILURE'
    '|CLOCK_THROTTLE_REASONS|CLOCKS_EVENT_REASONS|PCIE_REPLAY_COUNTER)|gridwatch_gpu_state"}'
)
HOST_QUERY = (
    '{__name__=~"node_load1|node_load5|node_load15|node_memory_MemTotal_bytes|node_memory_MemAvailable_bytes'
    '|node_uname_info|gridwatch_host_(cpu_utilization_ratio|memory_used_bytes|memory_total_bytes|load1|load5|load15'
    '|nic_receive_bytes_per_second|nic_transmit_bytes_per_second)"}'
)
# node_exporter counts; Prometheus turns them into rates. The "gw" label says which is which.
RATE_QUERY = (
    'label_replace(100 * (1 - avg by (instance) (rate(node_cpu_seconds_total{mode="idle"}[1m]))), "gw", "cpu", "", "")'
    ' or label_replace(sum by (instance, device) (rate(node_network_receive_bytes_total{device!="lo"}[1m])),'
    ' "gw", "rx", "", "")'
    ' or label_replace(sum by (instance, device) (rate(node_network_transmit_bytes_total{device!="lo"}[1m])),'
    ' "gw", "tx", "", "")'
)
_HISTORY_GPU = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_FB_USED",
                "DCGM_FI_DEV_FB_FREE")
_MIB = 1024.0 * 1024.0


class PrometheusError(Exception):
    """Prometheus could not be asked, or its answer cannot be used; the message is one sentence."""


def check_prometheus_url(url: str) -> str:
    """``url`` without a trailing slash; ValueError in one sentence when it is not an http(s) address."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{url!r} is not a Prometheus address: write it as http://HOST:9090")
    return url.strip().rstrip("/")


# ------------------------------------------------------------------ the query API


class _Result(msgspec.Struct):
    metric: dict[str, str] = {}
    value: tuple[float, str] | None = None  # an instant vector
    values: list[tuple[float, str]] = []  # a range vector


class _Data(msgspec.Struct):
    resultType: str
    result: list[_Result] = []


class _Answer(msgspec.Struct):
    status: str
    data: _Data | None = None
    errorType: str = ""
    error: str = ""


_answer = msgspec.json.Decoder(_Answer)


@dataclass(slots=True)
class Series:
    """One series of an answer: its labels (cleaned) and its points; N/A (NaN, Inf) is None."""

    labels: dict[str, str]
    points: list[tuple[float, float | None]]

    @property
    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and abs(value) <= MAX_VALUE else None


def parse_answer(body: bytes, expect: str) -> list[Series]:
    """The series of a query API answer of type ``expect`` (vector or matrix); PrometheusError on anything else."""
    try:
        answer = _answer.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PrometheusError(f"the answer is not Prometheus's query API ({clean_text(str(exc), 120)})") from None
    if answer.status != "success":
        why = clean_text(answer.error or answer.errorType or answer.status, MAX_ERROR_CHARS)
        raise PrometheusError(f"the query failed: {why}")
    if answer.data is None or answer.data.resultType != expect:
        got = answer.data.resultType if answer.data else "no data"
        raise PrometheusError(f"expected a {expect}, the answer is {clean_text(got, 40)!r}")
    out = []
    for result in answer.data.result:
        labels = {clean_text(k, 200): clean_text(v, 300) for k, v in result.metric.items()}
        if expect == "vector":
            points = [] if result.value is None else [(result.value[0], _number(result.value[1]))]
        else:
            points = [(ts, _number(v)) for ts, v in result.values]
        out.append(Series(labels, points))
    return out


Transport = Callable[[str, float], bytes]


def urllib_get(url: str, timeout: float) -> bytes:
    """GET ``url``: the body of a 2xx (or of Prometheus's JSON error); PrometheusError in one sentence otherwise.

    Reads in chunks against one deadline, so a server that drips bytes is cut off
    at ``timeout`` like one that never answers.
    """
    deadline = time.monotonic() + timeout
    try:
        response = urllib.request.urlopen(url, timeout=timeout)  # noqa: S310 - the operator's own URL
    except urllib.error.HTTPError as exc:
        body = exc.read(64 << 10) if exc.fp is not None else b""
        if body.lstrip().startswith(b"{"):
            return body  # Prometheus says what was wrong in JSON; parse_answer reads it
        raise PrometheusError(f"answered HTTP {exc.code} {clean_text(str(exc.reason), 80)}") from None
    except (TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            raise PrometheusError(f"no answer within {timeout:g} s") from None
        raise PrometheusError(f"cannot be reached: {clean_text(str(reason), 160)}") from None
    chunks: list[bytes] = []
    size = 0
    with response:
        while True:
            if time.monotonic() > deadline:
                raise PrometheusError(f"no complete answer within {timeout:g} s")
            try:
                chunk = response.read(1 << 16)
            except (TimeoutError, OSError):
                raise PrometheusError(f"no complete answer within {timeout:g} s") from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise PrometheusError(f"the answer is larger than {MAX_ANSWER_BYTES >> 20} MB")
            chunks.append(chunk)


# ------------------------------------------------------------------ panels


class Panel(StrEnum):
    """What one group of queries feeds: each fails, backs off and is shown on its own."""

    GPUS = "gpus"  # the fleet view, heatmap and node table
    HOSTS = "hosts"  # host CPU, memory, load and NICs
    HISTORY = "history"  # the past hour or day of the node an operator opened


class PanelState(StrEnum):
    WAITING = "waiting"  # not asked yet
    OK = "ok"
    SLOW = "slow"  # answered, but slower than it should
    FAILING = "failing"  # down, too slow, or answered something we cannot use


@dataclass(slots=True)
class PanelStatus:
    """How a panel's queries go, for the view to say in one line."""

    panel: Panel
    state: PanelState = PanelState.WAITING
    detail: str = ""
    took_s: float | None = None
    last_ok_at: float | None = None  # console clock
    failures: int = 0  # in a row
    retry_at: float | None = None  # console clock; None while no retry is pending

    def line(self, now: float) -> str:
        """``gpus: ok (0.05 s)``; ``gpus: Prometheus ... cannot be reached: ...; retry in 4 s, data from 20 s ago``."""
        if self.state is PanelState.WAITING:
            return f"{self.panel}: waiting for the first answer"
        if self.state is PanelState.OK:
            return f"{self.panel}: ok ({self.took_s or 0.0:.2f} s)"
        text = f"{self.panel}: {self.detail}"
        if self.state is PanelState.FAILING:
            if self.retry_at is not None:
                text += f"; retry in {max(self.retry_at - now, 0.0):.0f} s"
            text += "; no data yet" if self.last_ok_at is None else f"; data from {max(now - self.last_ok_at, 0.0):.0f} s ago"
        return text


@dataclass
class PrometheusOptions:
    url: str
    interval: float = 5.0  # seconds between polls (a scrape interval of 15 s rarely needs less)
    timeout: float = 5.0  # per request
    slow_after: float = 2.0  # an answer later than this is shown as slow
    backoff_max: float = 60.0
    history_points: int = HISTORY_POINTS
    transport: Transport = urllib_get
    rng: random.Random = field(default_factory=random.Random)


class HistoryWindow(StrEnum):
    """What the node view shows: the live ring of samples, or the past hour or day from Prometheus."""

    LIVE = "live"
    HOUR = "1h"
    DAY = "1d"

    @property
    def seconds(self) -> float:
        return {HistoryWindow.LIVE: 0.0, HistoryWindow.HOUR: 3600.0, HistoryWindow.DAY: 86400.0}[self]


@dataclass(slots=True)
class NodeHistory:
    """A node's past from query_range: per GPU the util, temp, power, memory % series (NaN = no data)."""

    node: str
    window: HistoryWindow
    start: float
    end: float
    step: float
    gpus: dict[int, list[list[float]]] = field(default_factory=dict)  # index -> [util, temp, power, mem%]


@dataclass(slots=True)
class _NodeSeen:
    """What the source remembers of a node between polls."""

    name: str
    key: str
    selector: tuple[str, str]  # (label, value) that picks its GPU series, for history queries
    instance_host: str = ""
    gpu_infos: list[GpuInfo] = field(default_factory=list)
    xids: dict[int, float] = field(default_factory=dict)  # gpu -> last DCGM_FI_DEV_XID_ERRORS value
    hello_sent: bool = False
    held: bool = False  # the engine was told the source is silent
    last_seen: float = 0.0  # when an answer last had it


@dataclass(slots=True)
class _Link:
    """The shape of a fleet link the runtime's frame callback reads (``endpoint``)."""

    endpoint: str
    name: str
    hello: Hello | None = None


FrameSink = Callable[[Any, Frame], None]
EngineSink = Callable[[str, Frame], object]


def _host_of(instance: str) -> str:
    """``10.0.0.5:9400`` -> ``10.0.0.5``; ``[fe80::1]:9100`` -> ``fe80::1``."""
    if instance.startswith("["):
        return instance[1:].split("]", 1)[0]
    return instance.rsplit(":", 1)[0] if instance.count(":") == 1 else instance


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class PrometheusFleet:
    """Polls Prometheus and feeds what it says to the state store and the engine, as if agents had sent it."""

    def __init__(self, options: PrometheusOptions, store: StateStore, on_frame: FrameSink,
                 engine_observe: EngineSink | None = None) -> None:
        options.url = check_prometheus_url(options.url)
        self.options = options
        self.store = store
        self.on_frame = on_frame
        self.engine_observe = engine_observe
        self.panels: dict[Panel, PanelStatus] = {p: PanelStatus(p) for p in Panel}
        self.nodes: dict[str, _NodeSeen] = {}
        self.histories: dict[str, NodeHistory] = {}
        self._wanted: tuple[str, HistoryWindow] | None = None
        self._history_wake = asyncio.Event()
        self._host_cache: dict[str, HostSample] = {}
        self._xid_values: dict[tuple[str, int], float] = {}  # (node, gpu) -> DCGM_FI_DEV_XID_ERRORS this poll
        self._tasks: list[asyncio.Task[None]] = []
        self.polls = 0
        self.refused: dict[str, str] = {}  # label values that name no node -> why (kept up to 100, for the log)
        self.over_cap = 0  # series of nodes past MAX_NODES, this poll

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [asyncio.create_task(self._poll_forever()), asyncio.create_task(self._history_forever())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def status_line(self, panels: tuple[Panel, ...] = (Panel.GPUS, Panel.HOSTS)) -> str:
        """The panels' states in one line, for a view's header."""
        now = self.store.clock.now()
        return f"prometheus {self.options.url}: " + "; ".join(self.panels[p].line(now) for p in panels)

    def failing(self, panel: Panel) -> bool:
        return self.panels[panel].state is PanelState.FAILING

    # --------------------------------------------------------------- queries

    async def _ask(self, panel: Panel, path: str, params: dict[str, str], expect: str) -> list[Series]:
        url = f"{self.options.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        timeout = self.options.timeout
        # The thread gives up at the timeout itself; the wait here is a last guard on top.
        body = await asyncio.wait_for(asyncio.to_thread(self.options.transport, url, timeout), timeout + 1.0)
        return parse_answer(body, expect)

    async def _panel(self, panel: Panel, queries: list[tuple[str, dict[str, str], str]]) -> list[list[Series]] | None:
        """Run a panel's queries; its status says how it went. None when it failed (or waits for its retry)."""
        status = self.panels[panel]
        now = self.store.clock.now()
        if status.retry_at is not None and now < status.retry_at:
            return None
        began = time.monotonic()
        try:
            answers = [await self._ask(panel, path, params, expect) for path, params, expect in queries]
        except asyncio.CancelledError:
            raise
        except (PrometheusError, TimeoutError) as exc:
            self._failed(status, str(exc) or f"no answer within {self.options.timeout:g} s")
            return None
        except Exception as exc:  # noqa: BLE001 - whatever a peer does is a state of the panel, never a crash
            self._failed(status, f"{type(exc).__name__}: {clean_text(str(exc), 160)}")
            return None
        took = time.monotonic() - began
        status.failures, status.retry_at, status.took_s = 0, None, took
        status.last_ok_at = self.store.clock.now()
        if took > self.options.slow_after:
            status.state, status.detail = PanelState.SLOW, f"slow: answered in {took:.1f} s"
        else:
            status.state, status.detail = PanelState.OK, ""
        self.store.generation += 1
        return answers

    def _failed(self, status: PanelStatus, why: str) -> None:
        o = self.options
        status.failures += 1
        first = status.state is not PanelState.FAILING
        status.state = PanelState.FAILING
        status.detail = clean_text(f"Prometheus at {o.url} {why}", MAX_ERROR_CHARS)
        delay = min(o.backoff_max, o.interval * 2 ** (status.failures - 1)) * o.rng.uniform(0.75, 1.0)
        status.retry_at = self.store.clock.now() + delay
        self.store.generation += 1
        self.store.news += first  # the panel's source failing: said at once
        if first:
            logger.warning("{}", status.detail)

    # ------------------------------------------------------------------ poll

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next poll may do better; the log says why
                logger.exception("reading the fleet from Prometheus failed")
            await asyncio.sleep(self.options.interval)

    async def poll_once(self) -> None:
        """One round: GPUs and hosts asked side by side, then one frame per node."""
        gpus, hosts = await asyncio.gather(
            self._panel(Panel.GPUS, [("query", {"query": GPU_QUERY}, "vector")]),
            self._panel(Panel.HOSTS, [("query", {"query": HOST_QUERY}, "vector"),
                                      ("query", {"query": RATE_QUERY}, "vector")]),
        )
        self.polls += 1
        if gpus is None:
            if self.failing(Panel.GPUS):
                self._hold_engine(self.nodes.values())
            return
        by_node = self._gpus_by_node(gpus[0])
        if hosts is not None:
            self._host_cache = self._hosts_by_node(hosts[0], hosts[1])
        for name, samples in by_node.items():
            self._emit(name, samples)
        # A node missing from a good answer is unknown (a relabel, an exporter down), not silent.
        now = time.time()
        missing = [seen for name, seen in self.nodes.items() if name not in by_node]
        self._hold_engine(missing)
        for seen in missing:
            if now - seen.last_seen > FORGET_AFTER_S:
                del self.nodes[seen.name]
        if self.over_cap:
            logger.warning("Prometheus names more than {:,} nodes: {:,} series of the others left out", MAX_NODES,
                           self.over_cap)

    def _node_name(self, labels: dict[str, str]) -> tuple[str, tuple[str, str]] | None:
        """The node a series is about, by the rule agents' names follow (None: no node, or one refused)."""
        found = None
        for label in NODE_LABELS:
            value = labels.get(label)
            if value:
                found = value, (label, value)
                break
        else:
            instance = labels.get("instance")
            if instance:
                found = _host_of(instance), ("instance", instance)
        if found is None:
            return None
        refused = node_name_refusal(found[0])
        if refused:
            if found[0] not in self.refused and len(self.refused) < 100:
                self.refused[found[0]] = refused
                logger.warning("Prometheus series with {}={} left out: it is {}", found[1][0],
                               clean_text(found[0][:80]), refused)
            return None
        if found[0] not in self.nodes and len(self.nodes) >= MAX_NODES:
            self.over_cap += 1
            return None
        return found

    def _gpus_by_node(self, series: list[Series]) -> dict[str, dict[int, GpuSample]]:
        out: dict[str, dict[int, GpuSample]] = {}
        free: dict[tuple[str, int], float] = {}
        self._xid_values = {}
        self.over_cap = 0
        for s in series:
            found = self._node_name(s.labels)
            index_text = s.labels.get("gpu", "")
            if found is None or not index_text.isdigit():
                continue
            name, selector = found
            index = int(index_text)
            seen = self._seen(name, selector, s.labels)
            gpus = out.setdefault(name, {})
            gpu = gpus.get(index)
            if gpu is None:
                gpu = gpus[index] = GpuSample(index=index)
                self._info(seen, index, s.labels)
            # A GPU split by MIG has one series per instance (GPU_I_ID) with the device's value: the first is kept.
            if s.labels.get("__name__") == "DCGM_FI_DEV_XID_ERRORS" and s.last is not None:
                self._xid_values.setdefault((name, index), s.last)
            self._fill(gpu, s.labels.get("__name__", ""), s.last, s.labels, free, (name, index))
        for (name, index), mib in free.items():
            gpu = out[name][index]
            # dcgm's total is used + free + reserved; the driver's reserve (under 1 %) is left out, as agents do.
            if gpu.mem_used_mb is not None:
                gpu.mem_total_mb = gpu.mem_used_mb + mib
        return out

    @staticmethod
    def _fill(gpu: GpuSample, metric: str, value: float | None, labels: dict[str, str],
              free: dict[tuple[str, int], float], key: tuple[str, int]) -> None:
        if metric == "gridwatch_gpu_state":
            if value == 1.0 and labels.get("state"):
                gpu.state = Text(labels["state"])
            return
        if value is None:
            return
        direct = {
            "DCGM_FI_DEV_GPU_UTIL": "util", "DCGM_FI_DEV_MEM_COPY_UTIL": "mem_util", "DCGM_FI_DEV_GPU_TEMP": "temp_c",
            "DCGM_FI_DEV_MEMORY_TEMP": "mem_temp_c", "DCGM_FI_DEV_POWER_USAGE": "power_w",
            "DCGM_FI_DEV_FB_USED": "mem_used_mb", "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
            "DCGM_FI_DEV_MEM_CLOCK": "mem_clock_mhz",
        }
        counts = {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_sbe", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe",
                  "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay"}
        if metric in direct:
            if getattr(gpu, direct[metric]) is None:
                setattr(gpu, direct[metric], value)
        elif metric in counts:
            if getattr(gpu, counts[metric]) is None:
                setattr(gpu, counts[metric], int(value))
        elif metric == "DCGM_FI_DEV_FB_FREE":
            free.setdefault(key, value)
        elif metric == "DCGM_FI_DEV_ROW_REMAP_PENDING":
            gpu.remapped_rows_pending = value > 0
        elif metric == "DCGM_FI_DEV_ROW_REMAP_FAILURE":
            gpu.remapped_rows_failed = value > 0
        elif metric in ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"):
            if not gpu.throttle:
                gpu.throttle = [Text(r) for r in decode_throttle(int(value))]

    def _seen(self, name: str, selector: tuple[str, str], labels: dict[str, str]) -> _NodeSeen:
        seen = self.nodes.get(name)
        if seen is None:
            seen = self.nodes[name] = _NodeSeen(name=name, key=name, selector=selector)
        seen.last_seen = time.time()
        instance = labels.get("instance")
        if instance:
            seen.instance_host = _host_of(instance)
        return seen

    @staticmethod
    def _info(seen: _NodeSeen, index: int, labels: dict[str, str]) -> None:
        if any(i.index == index for i in seen.gpu_infos):
            return
        seen.gpu_infos.append(GpuInfo(index=index, uuid=Text(labels.get("UUID", "")),
                                      name=Text(labels.get("modelName", "")),
                                      pci_bus_id=Text(labels["pci_bus_id"]) if labels.get("pci_bus_id") else None,
                                      driver=Text(labels["DCGM_FI_DRIVER_VERSION"])
                                      if labels.get("DCGM_FI_DRIVER_VERSION") else None))
        seen.gpu_infos.sort(key=lambda i: i.index)
        seen.hello_sent = False  # a GPU more: the node's hello is sent again

    def _hosts_by_node(self, plain: list[Series], rates: list[Series]) -> dict[str, HostSample]:
        """Host values by node: gridwatch's by their ``node`` label, node_exporter's by the scrape target's host."""
        by_host = {seen.instance_host: seen.name for seen in self.nodes.values() if seen.instance_host}
        known = set(self.nodes)
        uname: dict[str, str] = {}
        for s in plain:
            if s.labels.get("__name__") == "node_uname_info" and s.labels.get("instance"):
                nodename = s.labels.get("nodename", "")
                short = nodename.split(".", 1)[0]
                uname[s.labels["instance"]] = nodename if nodename in known else (short if short in known else "")

        def owner(labels: dict[str, str]) -> str:
            if labels.get("node"):
                return labels["node"]
            instance = labels.get("instance", "")
            return uname.get(instance) or by_host.get(_host_of(instance), "") or _host_of(instance)

        hosts: dict[str, HostSample] = {}
        nics: dict[str, dict[str, NicSample]] = {}
        for s in plain:
            metric, value = s.labels.get("__name__", ""), s.last
            name = owner(s.labels)
            if not name or value is None or metric == "node_uname_info":
                continue
            host = hosts.setdefault(name, HostSample())
            if metric == "gridwatch_host_cpu_utilization_ratio":
                host.cpu_percent = value * 100.0
            elif metric in ("gridwatch_host_memory_used_bytes",):
                host.mem_used_mb = value / _MIB
            elif metric in ("gridwatch_host_memory_total_bytes", "node_memory_MemTotal_bytes"):
                host.mem_total_mb = value / _MIB
            elif metric == "node_memory_MemAvailable_bytes":
                host.mem_used_mb = -value / _MIB  # made "total - available" below, once both are in
            elif metric.endswith("load1"):
                host.load1 = value
            elif metric.endswith("load5"):
                host.load5 = value
            elif metric.endswith("load15"):
                host.load15 = value
            elif metric.startswith("gridwatch_host_nic_"):
                nic = nics.setdefault(name, {}).setdefault(s.labels.get("nic", "?"), NicSample(name=Text(s.labels.get("nic", "?"))))
                if "receive" in metric:
                    nic.rx_bps = value
                else:
                    nic.tx_bps = value
        for s in rates:
            value, what = s.last, s.labels.get("gw", "")
            name = owner(s.labels)
            if not name or value is None:
                continue
            host = hosts.setdefault(name, HostSample())
            if what == "cpu":
                host.cpu_percent = value
            elif what in ("rx", "tx"):
                device = s.labels.get("device", "?")
                nic = nics.setdefault(name, {}).setdefault(device, NicSample(name=Text(device)))
                if what == "rx":
                    nic.rx_bps = value
                else:
                    nic.tx_bps = value
        for name, host in hosts.items():
            if host.mem_used_mb is not None and host.mem_used_mb < 0:
                host.mem_used_mb = None if host.mem_total_mb is None else host.mem_total_mb + host.mem_used_mb
            host.nics = list(nics.get(name, {}).values())
        for name, found in nics.items():
            hosts.setdefault(name, HostSample(nics=list(found.values())))
        return hosts

    # ------------------------------------------------------------- frames out

    def _agent_speaks(self, name: str) -> bool:
        """An agent is listed for the node (its row is keyed by the agent's endpoint): its frames win, and
        while its link is down Prometheus does not speak for it either, or the agent's silence would read
        as a node that is fine, and known only from Prometheus."""
        node = self.store.by_name(name)
        return node is not None and node.key != name

    def _emit(self, name: str, gpus: dict[int, GpuSample]) -> None:
        seen = self.nodes[name]
        if self._agent_speaks(name):
            return
        node = self.store.by_name(name)
        key = node.key if node is not None else seen.key  # a node listed in cluster.toml keeps its row
        link = _Link(endpoint=key, name=name)
        now = time.time()
        node_text = Text(name)
        if not seen.hello_sent or seen.held:
            hello = Hello(node=node_text, ts=now, interval=self.options.interval, gpus=list(seen.gpu_infos), role=Text(""),
                          agent_version=Text(HEARSAY_VERSION), notes=[Text(f"read from Prometheus at {self.options.url}")])
            link.hello = hello
            self.on_frame(link, hello)
            seen.hello_sent, seen.held = True, False
        for index, gpu in sorted(gpus.items()):
            self._xid(seen, link, index, gpu, now)
        sample = Sample(node=node_text, ts=now, gpus=[gpus[i] for i in sorted(gpus)],
                        host=self._host_cache.get(name) or HostSample())
        self.on_frame(link, sample)

    def _xid(self, seen: _NodeSeen, link: _Link, index: int, gpu: GpuSample, now: float) -> None:
        """A new value of ``DCGM_FI_DEV_XID_ERRORS`` is an XID event; the value found on first sight is history."""
        value = self._xid_values.get((seen.name, index))
        if value is None:
            return
        before = seen.xids.get(index)
        seen.xids[index] = value
        if before is None or value == before or value <= 0:
            return
        code = int(value)
        event = Event(node=Text(seen.name), ts=now, kind=Text("xid"), severity=Text(xid_severity(code)), gpu=index,
                      code=code, source=Text("prometheus"), message=Text(f"XID {code}: {xid_meaning(code)}"))
        self.on_frame(link, event)

    def _hold_engine(self, nodes: Iterable[_NodeSeen]) -> None:
        """Prometheus is silent about ``nodes``, which is no word from them: the engine must not count it
        as lost heartbeats (their views still go stale)."""
        if self.engine_observe is None:
            return
        for seen in nodes:
            if seen.held or self._agent_speaks(seen.name):
                continue
            seen.held = True
            self.engine_observe(seen.key, Hello(node=Text(seen.name), ts=time.time(), role=Text(""),
                                                interval=SOURCE_SILENT_INTERVAL_S, agent_version=Text(HEARSAY_VERSION)))

    # ---------------------------------------------------------------- history

    def request_history(self, node: str, window: HistoryWindow) -> None:
        """The node view wants ``node``'s past ``window`` (LIVE: nothing); fetched in the background."""
        self._wanted = None if window is HistoryWindow.LIVE else (node, window)
        self._history_wake.set()

    def history(self, node: str, window: HistoryWindow) -> NodeHistory | None:
        found = self.histories.get(node)
        return found if found is not None and found.window is window else None

    async def _history_forever(self) -> None:
        while True:
            await self._history_wake.wait()
            self._history_wake.clear()
            wanted = self._wanted
            if wanted is None:
                continue
            status = self.panels[Panel.HISTORY]
            status.retry_at = None  # an operator asked: try now
            try:
                await self.fetch_history(*wanted)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the panel says so; the view keeps going
                logger.exception("reading a node's history from Prometheus failed")
            if self.failing(Panel.HISTORY) and self._wanted == wanted and status.retry_at is not None:
                asyncio.get_running_loop().call_later(max(status.retry_at - self.store.clock.now(), 0.5),
                                                      self._history_wake.set)

    async def fetch_history(self, name: str, window: HistoryWindow) -> NodeHistory | None:
        """``name``'s GPUs over the past ``window`` from query_range; None when Prometheus did not say."""
        seen = self.nodes.get(name)
        label, value = seen.selector if seen is not None else ("Hostname", name)
        end = time.time()
        start = end - window.seconds
        step = max(window.seconds / max(self.options.history_points, 1), 1.0)
        names = "|".join(_HISTORY_GPU)
        query = f'{{__name__=~"{names}",{label}={_quote(value)}}}'
        answers = await self._panel(Panel.HISTORY, [("query_range", {"query": query, "start": f"{start:.3f}",
                                                                      "end": f"{end:.3f}", "step": f"{step:g}"},
                                                     "matrix")])
        if answers is None:
            return None
        points = self.options.history_points
        history = NodeHistory(name, window, start, end, step)
        raw: dict[tuple[int, str], list[float]] = {}
        for s in answers[0]:
            index_text = s.labels.get("gpu", "")
            if not index_text.isdigit():
                continue
            key = (int(index_text), s.labels.get("__name__", ""))
            if key in raw:
                continue  # one MIG instance's series speaks for the device
            row = [math.nan] * points
            for ts, v in s.points:
                slot = min(int((ts - start) / step), points - 1)  # the range ends on ``end`` itself
                if 0 <= slot < points and v is not None:
                    row[slot] = v
            raw[key] = row
        for index in sorted({i for i, _ in raw}):
            nan = [math.nan] * points
            util, temp, power, used, free = (raw.get((index, m), nan) for m in _HISTORY_GPU)
            mem = [100.0 * u / (u + f) if not (math.isnan(u) or math.isnan(f)) and u + f > 0 else math.nan
                   for u, f in zip(used, free)]
            history.gpus[index] = [util, temp, power, mem]
        self.histories[name] = history
        self.store.generation += 1
        return history

