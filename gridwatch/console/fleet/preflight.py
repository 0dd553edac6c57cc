"""Pre-flight across the fleet: ask every agent in parallel, judge nodes against each other, report.

A node's own checks (GPUs, network, storage) come back as they are; what needs
the whole fleet is judged here: the software stack against the majority (or a
baseline file), clock offsets against the fleet's median, and the all-reduce
bandwidth of every pair of nodes. Data code: never imports textual or torch.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from loguru import logger

from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.wire import protocol as p
from gridwatch.wire.preflight import CheckOutcome  # one check-result type: the node's, as the node sent it

CHECK_COLUMNS = ("gpus", "stack", "network", "storage", "time", "comm")
STACK_FIELDS = ("driver", "cuda", "nccl", "kernel", "python")
CLOCK_PROBES = 3


@dataclass
class PreflightOptions:
    """What to check and how strictly; defaults suit a launch on an idle cluster."""

    gpus: int | None = None  # expected GPUs per node
    comm: bool = True
    baseline: p.StackFingerprint | None = None  # None: the majority is the baseline
    baseline_name: str = "majority"
    max_clock_offset_s: float = 0.5
    checkpoint_gb: float = 0.0
    write_test_mb: float = 16.0
    min_write_mbps: float = 0.0
    nic_speed_mbps: float | None = None
    net_sample_s: float = 0.5
    comm_port: int = 29499
    comm_size_bytes: int = 1 << 20
    comm_iters: int = 10
    comm_timeout_s: float = 60.0
    mesh_max_nodes: int = 4  # full-mesh pairs up to this many nodes (the seeds' 2-4 node test)
    # A pair under this share of the run's reference (1/k, k about 3) is an outlier; 0: no relative judging.
    slow_pair_fraction: float = 0.3
    # The bus bandwidth a pair should reach (0: no expectation). A run whose median pair is under it is a
    # warning for the whole run (the fabric or the host), not a node's failure.
    min_busbw_gbps: float = 0.0
    connect_timeout: float = 10.0
    action_timeout: float = 120.0
    on_progress: Callable[[int, int], None] | None = None


@dataclass
class NodeReport:
    name: str
    endpoint: str
    reachable: bool = True
    error: str | None = None  # why the node could not be checked at all
    checks: dict[str, CheckOutcome] = field(default_factory=dict)
    clock_offset_s: float | None = None  # node wall clock minus the console's, at the round-trip midpoint
    clock_rtt_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.reachable and self.error is None and all(c.ok for c in self.checks.values())

    @property
    def reasons(self) -> list[str]:
        """One line per failure, in the table's column order."""
        if self.error is not None:
            return [self.error]
        return [f"{name}: {self.checks[name].detail}" for name in CHECK_COLUMNS if name in self.checks and not self.checks[name].ok]


@dataclass
class CommReport:
    """The all-reduce test: whole-world and per-pair bus bandwidth (GB/s), by node name."""

    nodes: list[str]
    backend: str | None = None
    world_busbw_gbps: float | None = None
    pairs: dict[str, float] = field(default_factory=dict)  # "a~b" -> GB/s
    slow_pairs: list[str] = field(default_factory=list)  # outliers against the other pairs of the run
    failed_pairs: list[str] = field(default_factory=list)
    skipped: str | None = None
    median_gbps: float | None = None  # the run's median pair
    reference_gbps: float | None = None  # what an outlier is judged against (see judge_comm)
    expected_gbps: float | None = None  # the operator's expectation (--min-busbw), if any
    suspect_pairs: list[str] = field(default_factory=list)  # slow pairs whose end to blame is a tie: named, nobody failed
    warnings: list[str] = field(default_factory=list)  # about the whole run, not a node (also in the report's notes)


@dataclass
class PreflightReport:
    """Everything one pre-flight found; JSON-able with :meth:`to_json`, read back with :meth:`from_json`."""

    nodes: list[NodeReport] = field(default_factory=list)
    baseline: str = "majority"
    comm: CommReport | None = None
    console_offset_s: float | None = None  # fleet median clock minus this console's
    notes: list[str] = field(default_factory=list)
    started_at: float = 0.0

    @property
    def passed_nodes(self) -> list[str]:
        return [n.name for n in self.nodes if n.ok]

    @property
    def passed_endpoints(self) -> list[str]:
        """``host:port`` of the nodes that passed, for a launcher that works by endpoint."""
        return [n.endpoint for n in self.nodes if n.ok]

    @property
    def failed(self) -> dict[str, list[str]]:
        """Node name -> its reasons, one line each."""
        return {n.name: n.reasons for n in self.nodes if not n.ok}

    @property
    def ok(self) -> bool:
        return bool(self.nodes) and all(n.ok for n in self.nodes)

    @property
    def reachable(self) -> int:
        return sum(1 for n in self.nodes if n.reachable)

    def node(self, name: str) -> NodeReport | None:
        for n in self.nodes:
            if n.name == name or n.endpoint == name:
                return n
        return None

    def to_json(self) -> dict[str, Any]:
        data = msgspec.to_builtins(self, enc_hook=_plain_str)
        data["passed"] = self.passed_nodes
        data["failed"] = self.failed
        data["ok"] = self.ok
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreflightReport:
        return msgspec.convert({k: v for k, v in data.items() if k not in ("passed", "failed", "ok")}, cls)


def _plain_str(obj: Any) -> Any:
    if isinstance(obj, str):  # node text arrives as protocol Text, a str subclass
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _text_hook(type_: type, obj: Any) -> Any:
    if type_ is p.Text and isinstance(obj, str):
        return p.Text(p.clean_text(obj))
    raise NotImplementedError(f"unsupported type {type_!r}")


def to_fingerprint(data: Any) -> p.StackFingerprint:
    """A fingerprint from JSON-able data; raises msgspec.ValidationError."""
    return msgspec.convert(p.as_builtins(data), p.StackFingerprint, strict=False, dec_hook=_text_hook)


# --------------------------------------------------------------------- baseline


def load_baseline(path: str) -> p.StackFingerprint:
    """A stack fingerprint saved as JSON (``--save-baseline``); ValueError with a one-line reason."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"baseline {path}: cannot read: {exc.strerror}") from None
    try:
        return to_fingerprint(msgspec.json.decode(raw))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"baseline {path}: not a stack fingerprint: {exc}") from None


def save_baseline(fp: p.StackFingerprint, path: str) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(msgspec.to_builtins(fp, enc_hook=_plain_str))) + b"\n")


def stack_differences(fp: p.StackFingerprint, baseline: p.StackFingerprint) -> list[str]:
    """``"torch 2.12.0 (baseline 2.13.0)"`` for each field or package that differs."""
    diffs = []
    for name in STACK_FIELDS:
        mine, theirs = getattr(fp, name), getattr(baseline, name)
        if mine != theirs:
            diffs.append(f"{name} {mine or 'missing'} (baseline {theirs or 'missing'})")
    for name in sorted(set(fp.packages) | set(baseline.packages)):
        mine, theirs = fp.packages.get(name), baseline.packages.get(name)
        if mine != theirs:
            diffs.append(f"{name} {mine or 'missing'} (baseline {theirs or 'missing'})")
    return diffs


def majority_hash(hashes: Iterable[str]) -> tuple[str | None, bool]:
    """The most common stack hash, and whether it is clear (no other hash as common): the fleet's one rule."""
    counts = Counter(hashes)
    if not counts:
        return None, False
    (top, n), *rest = counts.most_common()
    return top, not rest or rest[0][1] < n


def majority_stack(fps: list[p.StackFingerprint]) -> tuple[p.StackFingerprint | None, bool]:
    """The most common fingerprint, and whether it is clear (not a tie)."""
    top, clear = majority_hash(str(fp.hash) for fp in fps)
    return next((fp for fp in fps if str(fp.hash) == top), None), clear


def judge_stacks(report: PreflightReport, baseline: p.StackFingerprint | None) -> p.StackFingerprint | None:
    """Turn each node's reported fingerprint into a verdict against the baseline (or majority)."""
    fps: dict[str, p.StackFingerprint] = {}
    for node in report.nodes:
        check = node.checks.get("stack")
        if check is None or "fingerprint" not in check.values:
            continue
        try:
            fps[node.name] = to_fingerprint(check.values["fingerprint"])
        except msgspec.ValidationError as exc:
            node.checks["stack"] = CheckOutcome(False, f"unreadable stack fingerprint: {exc}")
    clear = True
    if baseline is None:
        baseline, clear = majority_stack(list(fps.values()))
        if baseline is not None and not clear:
            report.notes.append("stacks split evenly: no majority to compare against; give --baseline FILE")
    if baseline is None:
        return None
    for name, fp in fps.items():
        reported = report.node(name)
        assert reported is not None
        check = reported.checks["stack"]
        diffs = stack_differences(fp, baseline)
        if diffs:
            more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
            check.ok, check.detail = False, "differs: " + "; ".join(diffs[:3]) + more
            check.values["differences"] = diffs
        elif not clear:
            check.ok, check.detail = False, "no majority stack: the fleet is split evenly"
        else:
            check.detail = f"same as the {report.baseline} ({str(fp.hash)[:12]})"
    return baseline


# ------------------------------------------------------------------------ clock


def judge_clocks(report: PreflightReport, max_offset_s: float) -> None:
    """Each node's clock against the fleet's median; the console's own clock noted, not failed."""
    offsets = [n.clock_offset_s for n in report.nodes if n.clock_offset_s is not None]
    if not offsets:
        return
    median = statistics.median(offsets)
    report.console_offset_s = round(median, 6)
    if abs(median) > max_offset_s:
        report.notes.append(f"this console's clock differs from the nodes' median by {median:+.3f} s")
    for node in report.nodes:
        check = node.checks.get("time")
        if check is None or node.clock_offset_s is None:
            continue
        skew = node.clock_offset_s - median
        check.values.update(offset_s=round(node.clock_offset_s, 6), skew_s=round(skew, 6), rtt_s=node.clock_rtt_s)
        check.ok = abs(skew) <= max_offset_s
        check.detail = f"clock {skew:+.3f} s from the fleet median (±{(node.clock_rtt_s or 0) / 2:.3f} s)"
        if not check.ok:
            check.detail = f"clock off by {skew:+.3f} s from the fleet median (limit {max_offset_s:g} s)"


# ------------------------------------------------------------------------- comm


def pair_key(a: str, b: str) -> str:
    return f"{a}~{b}"


def judge_comm(report: PreflightReport, ranks: list[str], results: list[p.ActionResult], options: PreflightOptions) -> CommReport:
    """Merge each rank's measurements; fail the nodes of failed pairs and of outlier pairs, warn about a slow run.

    The rule: a pair that failed (an error, or a rank with no answer) fails its nodes. A pair is slow only as
    an outlier against the other pairs of the same run: its bandwidth under ``slow_pair_fraction`` (1/k, k about
    3) of the run's reference, and under ``min_busbw_gbps`` where one is given; outliers need at least 3 pairs.
    The reference is the median of each node's best pair: in a 3- or 4-node mesh one bad node owns half or more
    of the pairs, which drags the plain median of pairs down with it, while every healthy node still has one
    healthy pair. The node that appears in most outlier pairs is blamed; a tie names the pair and fails nobody.
    With fewer than 3 pairs only failures count, and a pair under a tenth of ``min_busbw_gbps`` (a link fallen
    back to a slower path, not a loaded host). A median pair under ``min_busbw_gbps`` says the whole fabric (or
    the host) is slow: a warning with the figures, not a node's failure.
    """
    comm = CommReport(nodes=list(ranks))
    per_node: dict[str, dict[str, Any]] = {}
    pair_bw: dict[str, float] = {}
    failed: set[str] = set()
    for name, res in zip(ranks, results):
        data = res.data.get("comm") if isinstance(res.data, dict) else None
        node = report.node(name)
        assert node is not None
        if not isinstance(data, dict):
            node.checks["comm"] = CheckOutcome(False, str(res.message) or "no answer to the all-reduce test")
            continue
        per_node[name] = data
        comm.backend = comm.backend or data.get("backend")
        if data.get("world_busbw_gbps") is not None and data.get("rank") == 0:
            comm.world_busbw_gbps = float(data["world_busbw_gbps"])
        for pair, bw in (data.get("pairs") or {}).items():
            key = _pair_by_name(pair, ranks)
            if key is not None and isinstance(bw, (int, float)) and not isinstance(bw, bool):
                # Both ends time the same collective; the slower view is the link's.
                pair_bw[key] = min(pair_bw.get(key, float(bw)), float(bw))
        for pair in data.get("pair_errors") or {}:
            key = _pair_by_name(pair, ranks)
            if key is not None:
                failed.add(key)
    measured = {k: v for k, v in pair_bw.items() if k not in failed}
    comm.pairs = {k: round(v, 4) for k, v in sorted(pair_bw.items())}
    comm.failed_pairs = sorted(failed)
    expected = options.min_busbw_gbps or None
    comm.expected_gbps = expected
    if measured:
        comm.median_gbps = round(statistics.median(measured.values()), 4)
    outliers = _outlier_pairs(ranks, measured, options, comm)
    if len(measured) < MIN_PAIRS_FOR_OUTLIERS and expected:
        failed |= {k for k, v in measured.items() if v < BROKEN_PAIR_SHARE * expected}
        comm.failed_pairs = sorted(failed)
    comm.slow_pairs = sorted(outliers)
    blamed, comm.suspect_pairs = _blame(ranks, failed, outliers, comm.pairs, comm.reference_gbps)
    healthy = {k: v for k, v in measured.items() if k not in failed}  # a broken pair is a failure, not the run's figure
    run_median = statistics.median(healthy.values()) if healthy else None
    if expected and run_median is not None and run_median < expected:
        every = all(v < expected for v in healthy.values())
        comm.warnings.append(
            f"{'every pair is slow' if every else 'the median pair is slow'}: median {run_median:.4g} GB/s, "
            f"expected {expected:g} GB/s ({', '.join(f'{k} {v:.4g}' for k, v in sorted(healthy.items()))}) "
            "— the fabric or the host is slow; no node failed for it"
        )
    for key in comm.suspect_pairs:
        comm.warnings.append(
            f"pair {key} is slow ({comm.pairs[key]:g} GB/s against the run's {comm.reference_gbps:g}) "
            "and neither end is in more slow pairs than the other: neither failed for it"
        )
    report.notes.extend(comm.warnings)
    for name in ranks:
        node = report.node(name)
        assert node is not None
        if "comm" in node.checks:
            continue  # no answer at all: already explained
        data = per_node[name]
        mine = {k: v for k, v in comm.pairs.items() if name in k.split("~")}
        values = {
            "busbw_gbps": data.get("world_busbw_gbps"), "pairs": mine, "backend": data.get("backend"),
            "median_gbps": comm.median_gbps, "reference_gbps": comm.reference_gbps, "expected_gbps": expected,
        }
        if comm.warnings:
            values["warnings"] = list(comm.warnings)
        if data.get("error"):
            node.checks["comm"] = CheckOutcome(False, p.clean_text(str(data["error"]), 300), values)
        elif name in blamed:
            node.checks["comm"] = CheckOutcome(False, "; ".join(blamed[name]), values)
        else:
            bw = data.get("world_busbw_gbps")
            detail = f"{bw} GB/s bus bandwidth over {len(ranks)} nodes ({data.get('backend')})"
            if comm.warnings:
                detail += f"; warning: {comm.warnings[0]}"
            node.checks["comm"] = CheckOutcome(True, p.clean_text(detail, 300), values)
    return comm


MIN_PAIRS_FOR_OUTLIERS = 3  # with fewer there are no "other pairs" to judge a pair against
BROKEN_PAIR_SHARE = 0.1  # a link fallen back to a slower path is ten times slower or worse; a loaded host is a few


def _outlier_pairs(ranks: list[str], measured: dict[str, float], options: PreflightOptions, comm: CommReport) -> set[str]:
    """Pairs under ``slow_pair_fraction`` of the median of each node's best pair (and under the expectation, if any)."""
    if len(measured) < MIN_PAIRS_FOR_OUTLIERS:
        return set()
    best: dict[str, float] = {}
    for key, bw in measured.items():
        for name in key.split("~"):
            best[name] = max(best.get(name, bw), bw)
    reference = statistics.median(best[name] for name in ranks if name in best)
    comm.reference_gbps = round(reference, 4)
    if not options.slow_pair_fraction:
        return set()
    limit = options.slow_pair_fraction * reference
    if options.min_busbw_gbps:
        limit = min(limit, options.min_busbw_gbps)  # a pair that meets the expectation is not slow
    return {k for k, v in measured.items() if v < limit}


def _pair_by_name(pair: str, ranks: list[str]) -> str | None:
    a, _, b = str(pair).partition("-")
    if not (a.isdigit() and b.isdigit()) or int(a) >= len(ranks) or int(b) >= len(ranks):
        return None
    return pair_key(ranks[int(a)], ranks[int(b)])


def _blame(
    ranks: list[str], failed: set[str], outliers: set[str], figures: dict[str, float] | None = None, reference: float | None = None
) -> tuple[dict[str, list[str]], list[str]]:
    """Who fails for which pair, and the slow pairs no end can be blamed for.

    A node in nothing but bad pairs is the culprit; both ends of a failed pair are named; of an outlier pair,
    the end that is in more bad pairs (failed or outlier); a tie names the pair and fails neither.
    """
    blamed: dict[str, list[str]] = {}
    suspects: list[str] = []
    bad = set(failed) | set(outliers)
    if not bad:
        return blamed, suspects
    figures = figures or {}
    mine = {name: [k for k in (pair_key(a, b) for i, a in enumerate(ranks) for b in ranks[i + 1 :]) if name in k.split("~")] for name in ranks}
    culprits = {name for name, pairs in mine.items() if pairs and all(k in bad for k in pairs)}
    for name in culprits:
        blamed[name] = [f"slow or failing with every peer ({', '.join(mine[name])})"]
    counts = Counter(name for key in bad for name in key.split("~"))
    for key in sorted(bad):
        a, b = key.split("~")
        if a in culprits or b in culprits:
            continue
        if key in failed:
            for name, peer in ((a, b), (b, a)):
                blamed.setdefault(name, []).append(f"slow or failing pair with {peer}")
        elif counts[a] == counts[b]:
            suspects.append(key)
        else:
            name, peer = (a, b) if counts[a] > counts[b] else (b, a)
            against = f" against the run's {reference:g}" if reference is not None else ""
            blamed.setdefault(name, []).append(f"slow pair with {peer} ({figures.get(key, 0.0):g} GB/s{against})")
    return blamed, suspects


# -------------------------------------------------------------------------- run


def node_args(options: PreflightOptions) -> dict[str, Any]:
    """The ``preflight`` action's args for the node-side checks."""
    args: dict[str, Any] = {
        "checks": ["gpus", "stack", "network", "storage", "time"],
        "idle": True,
        "checkpoint_gb": options.checkpoint_gb,
        "write_test_mb": options.write_test_mb,
        "min_write_mbps": options.min_write_mbps,
        "net_sample_s": options.net_sample_s,
    }
    if options.gpus is not None:
        args["gpus"] = options.gpus
    if options.nic_speed_mbps is not None:
        args["nic_speed_mbps"] = options.nic_speed_mbps
    return args


async def _wait_connected(fleet: Any, timeout: float) -> None:
    """Until every link has connected or failed once (a refused key fails at once)."""
    from gridwatch.sshlink.client import LinkState

    changed = asyncio.Event()
    previous = fleet.on_status

    def on_status(link: Any) -> None:
        previous(link)
        changed.set()

    fleet.on_status = on_status
    deadline = time.monotonic() + timeout
    try:
        while not all(l.state in (LinkState.CONNECTED, LinkState.STALE, LinkState.DOWN, LinkState.REFUSED) for l in fleet.links.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return
    finally:
        fleet.on_status = previous


async def _probe_clock(fleet: Any, name: str) -> tuple[float | None, float | None]:
    """Offset of a node's wall clock at the round-trip midpoint; the tightest of a few probes wins."""
    best: tuple[float | None, float | None] = (None, None)
    for _ in range(CLOCK_PROBES):
        t0 = time.time()
        res = await fleet.action(name, p.AgentAction.PREFLIGHT, {"checks": ["time"]}, reason="preflight clock probe", timeout=10.0)
        t1 = time.time()
        wall = (res.data.get("time") or {}).get("wall") if res.ok else None
        if not isinstance(wall, (int, float)):
            return best
        rtt = t1 - t0
        if best[1] is None or rtt < best[1]:
            best = (wall - (t0 + t1) / 2, rtt)
    return best


def _checks_from(data: dict[str, Any]) -> dict[str, CheckOutcome]:
    checks: dict[str, CheckOutcome] = {}
    for name, raw in data.items():
        if not isinstance(raw, dict):
            continue
        values = {k: v for k, v in raw.items() if k not in ("ok", "detail")}
        checks[str(name)] = CheckOutcome(bool(raw.get("ok")), p.clean_text(str(raw.get("detail", "")), 300), values)
    return checks


async def _check_node(fleet: Any, link: Any, options: PreflightOptions) -> NodeReport:
    from gridwatch.sshlink.client import LinkState

    node = NodeReport(name=link.name, endpoint=str(link.endpoint))
    if link.state not in (LinkState.CONNECTED, LinkState.STALE):
        node.reachable = False
        node.error = link.last_error or f"{link.endpoint}: not reachable"
        return node
    node.clock_offset_s, node.clock_rtt_s = await _probe_clock(fleet, link.name)
    res = await fleet.action(link.name, p.AgentAction.PREFLIGHT, node_args(options), reason="preflight", timeout=options.action_timeout)
    if not res.data:
        node.error = p.clean_text(str(res.message), 300) or "the agent gave no pre-flight result"
        return node
    node.checks = _checks_from(res.data)
    return node


async def _run_comm(fleet: Any, report: PreflightReport, options: PreflightOptions) -> CommReport:
    ranks = [n.name for n in report.nodes if n.ok]
    if len(ranks) < 2:
        return CommReport(nodes=ranks, skipped="fewer than 2 nodes passed the other checks: no all-reduce test")
    roles = {link.name: link.role for link in fleet.links.values()}
    viewers = [name for name in ranks if roles.get(name) != "operator"]
    if viewers:
        # Agents start the all-reduce only for an operator: it runs torch and connects to a peer.
        return CommReport(nodes=ranks, skipped=f"the all-reduce test needs an operator key; this key is a viewer on {', '.join(viewers[:3])}"
                          + (f" (+{len(viewers) - 3} more)" if len(viewers) > 3 else ""))
    first = report.node(ranks[0])
    assert first is not None
    master = first.endpoint.rsplit(":", 1)[0].strip("[]")
    pairs = len(ranks) <= options.mesh_max_nodes

    async def one(rank: int, name: str) -> p.ActionResult:
        comm = {
            "master_addr": master,
            "master_port": options.comm_port,
            "rank": rank,
            "world": len(ranks),
            "size_bytes": options.comm_size_bytes,
            "iters": options.comm_iters,
            "timeout_s": options.comm_timeout_s,
            "pairs": pairs,
        }
        return await fleet.action(
            name, p.AgentAction.PREFLIGHT, {"checks": ["comm"], "comm": comm}, reason="preflight all-reduce", timeout=options.comm_timeout_s + 60.0
        )

    results = await asyncio.gather(*(one(i, name) for i, name in enumerate(ranks)))
    return judge_comm(report, ranks, list(results), options)


async def preflight_fleet(fleet: Any, options: PreflightOptions | None = None) -> PreflightReport:
    """Pre-flight over a started :class:`gridwatch.sshlink.client.Fleet` (the console's own links); leaves it running."""
    options = options or PreflightOptions()
    report = PreflightReport(baseline=options.baseline_name, started_at=time.time())
    await _wait_connected(fleet, options.connect_timeout + 1.0)
    total, done = len(fleet.links), 0

    async def one(link: Any) -> NodeReport:
        nonlocal done
        node = await _check_node(fleet, link, options)
        done += 1
        if options.on_progress is not None:
            options.on_progress(done, total)
        return node

    report.nodes = list(await asyncio.gather(*(one(link) for link in fleet.links.values())))
    judge_stacks(report, options.baseline)
    judge_clocks(report, options.max_clock_offset_s)
    if options.comm:
        report.comm = await _run_comm(fleet, report, options)
    for node in report.nodes:
        log = logger.bind(node=node.name)
        if node.ok:
            log.info("preflight passed")
        else:
            log.warning("preflight failed: {}", " | ".join(node.reasons))
    return report


async def run_preflight_async(endpoints: list[Endpoint], key: str, known_hosts: str, options: PreflightOptions | None = None) -> PreflightReport:
    """Connect to every endpoint, pre-flight them, disconnect; RuntimeError if the key cannot be read."""
    from gridwatch.sshlink.client import Fleet, FleetOptions

    options = options or PreflightOptions()
    fleet = Fleet(endpoints, FleetOptions(key_path=key, known_hosts=known_hosts, connect_timeout=options.connect_timeout))
    await fleet.start()
    try:
        return await preflight_fleet(fleet, options)
    finally:
        await fleet.stop()


def run_preflight(endpoints: list[Endpoint], key: str, known_hosts: str, options: PreflightOptions | None = None) -> PreflightReport:
    """The blocking form of :func:`run_preflight_async`, for a CLI handler (not inside a running loop)."""
    return asyncio.run(run_preflight_async(endpoints, key, known_hosts, options))
