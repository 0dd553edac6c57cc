"""Pre-flight checks that run on the node: GPUs, software stack, network, storage, clock, all-reduce.

The agent action ``preflight`` runs the checks named in its args and returns,
in ``ActionResult.data``, one entry per check: ``{"ok": bool, "detail": str,
...values}``. Judging a node against the others (stack majority, clock
offsets, slow pairs) is the console's job; a node only says what it sees.
torch is never imported here: the all-reduce runs in a child process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import json
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import psutil

from gridwatch.agent.workers import ChildTimeout, run_child
from gridwatch.wire import protocol as p
from gridwatch.wire.preflight import (
    ALL_CHECKS,
    MAX_COMM_BYTES,
    MAX_COMM_ITERS,
    MAX_COMM_TIMEOUT_S,
    MAX_COMM_WORLD,
    MAX_NET_SAMPLE_S,
    MAX_WRITE_TEST_MB,
    VIEWER_NET_SAMPLE_S,
    VIEWER_WRITE_TEST_MB,
    CheckOutcome,
    CommArgs,
    PreflightArgs,
)

if TYPE_CHECKING:
    from gridwatch.agent.agent import Agent  # a type only: the agent imports these modules

_MIB = 1024 * 1024
# Events that leave a GPU needing attention (a reset, a drain) until someone clears them.
GPU_FAULT_EVENTS = frozenset({"xid", "ecc_dbe", "row_remap_failure", "fell_off_bus", "gpu_hang"})
# Throttle reasons that are a fault at any load; power capping is only suspicious at idle.
FAULT_THROTTLES = frozenset({"hw_thermal", "sw_thermal", "hw_slowdown", "power_brake"})
IDLE_THROTTLES = frozenset({"sw_power"})
# The write test is skipped where it would leave less than this free.
WRITE_TEST_HEADROOM_GB = 1.0
# Checks that hold the node's resources for a while: one such pre-flight at a time.
SLOW_CHECKS = frozenset({"network", "storage", "comm"})
_HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")


@dataclass(frozen=True)
class NicCounters:
    """Error counters of one interface (``ip -s link``)."""

    rx_errors: int
    tx_errors: int


@dataclass(frozen=True)
class NicLink:
    """Link state of one interface (``ethtool``): up, and speed in Mb/s when the driver says."""

    up: bool
    speed_mbps: float | None


def _check_comm_args(comm: CommArgs) -> None:
    addr = comm.master_addr
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        if not _HOSTNAME.match(addr):
            raise ValueError(f"comm master_addr must be an IP address or a host name, got {p.clean_text(addr, 80)!r}") from None
    if not 0 < comm.master_port < 65536:
        raise ValueError(f"comm master_port must be a TCP port, got {comm.master_port}")
    if not 2 <= comm.world <= MAX_COMM_WORLD or not 0 <= comm.rank < comm.world:
        raise ValueError(f"comm needs 0 <= rank < world <= {MAX_COMM_WORLD}, got rank {comm.rank} of {comm.world}")
    if not 4 <= comm.size_bytes <= MAX_COMM_BYTES:
        raise ValueError(f"comm size_bytes must be between 4 and {MAX_COMM_BYTES}, got {comm.size_bytes}")
    if not 1 <= comm.iters <= MAX_COMM_ITERS:
        raise ValueError(f"comm iters must be between 1 and {MAX_COMM_ITERS}, got {comm.iters}")
    if not 0 < comm.timeout_s <= MAX_COMM_TIMEOUT_S:
        raise ValueError(f"comm timeout_s must be above 0 and at most {MAX_COMM_TIMEOUT_S:g}, got {comm.timeout_s:g}")


def parse_args(args: dict[str, Any], role: str = "viewer") -> PreflightArgs:
    """The action's args as a typed struct, capped for the caller's role; raises ValueError with a one-line reason."""
    try:
        parsed = msgspec.convert(p.as_builtins(args), PreflightArgs)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad preflight args: {exc}") from None
    unknown = [c for c in parsed.checks if c not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(ALL_CHECKS)}")
    operator = role == "operator"
    if "comm" in parsed.checks:
        if not operator:
            raise ValueError(f"the comm check starts an all-reduce with peers: it needs the operator role; this key is a {role}")
        if parsed.comm is None:
            raise ValueError("the comm check needs comm args (master_addr, master_port, rank, world)")
        _check_comm_args(parsed.comm)
    else:
        parsed.comm = None
    write_cap = MAX_WRITE_TEST_MB if operator else VIEWER_WRITE_TEST_MB
    sample_cap = MAX_NET_SAMPLE_S if operator else VIEWER_NET_SAMPLE_S
    parsed.write_test_mb = min(max(parsed.write_test_mb, 0.0), write_cap)
    parsed.net_sample_s = min(max(parsed.net_sample_s, 0.0), sample_cap)
    return parsed


def _summary(problems: list[str], good: str) -> str:
    if not problems:
        return good
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


# ------------------------------------------------------------------------ ring


def _frames_of(agent: Agent, tag: bytes) -> list[bytes]:
    frames, _ = agent.ring.since(agent.ring.first_seq - 1)
    # A byte search before decoding keeps a full-ring scan to a few ms.
    return [f for f in frames if tag in f[:40]]


def latest_gpu_samples(agent: Agent) -> list[p.GpuSample] | None:
    """The GPUs as the agent last sampled them, or ``None`` if it has not sampled yet."""
    for data in reversed(_frames_of(agent, b'"type":"sample"')):
        frame = p.decode_agent_frame(data)
        if isinstance(frame, p.Sample):
            return frame.gpus
    return None


def pending_gpu_faults(agent: Agent, since: float) -> list[p.Event]:
    """GPU fault events after ``since`` and after the last successful clear_faults."""
    pending: list[p.Event] = []
    for data in _frames_of(agent, b'"type":"event"'):
        frame = p.decode_agent_frame(data)
        if not isinstance(frame, p.Event) or frame.ts < since:
            continue
        if frame.kind == "action" and frame.details.get("action") == p.AgentAction.CLEAR_FAULTS and frame.details.get("ok") == "true":
            pending.clear()  # a reset clears what came before it
        elif frame.kind in GPU_FAULT_EVENTS:
            pending.append(frame)
    return pending


# ------------------------------------------------------------------------ gpus


def check_gpus(agent: Agent, args: PreflightArgs, now: float) -> CheckOutcome:
    """Count, health and idleness of every GPU (``nvidia-smi -q``), plus unhandled fault events."""
    expected = args.gpus
    found = len(agent.gpu_info)
    if agent.gpus is None:
        if expected:
            return CheckOutcome(False, f"no GPUs on this node, expected {expected}", {"count": 0, "expected": expected})
        return CheckOutcome(True, "no GPUs on this node", {"count": 0})
    samples = latest_gpu_samples(agent)
    if samples is None:
        samples = agent.gpus.sample()
    simulated = bool(getattr(agent.gpus, "simulated", False))
    problems: list[str] = []
    if expected is not None and found != expected:
        problems.append(f"{found} GPUs found, expected {expected}")
    for s in samples:
        name = f"GPU {s.index}"
        if s.state == "lost":
            problems.append(f"{name} fell off the bus")
            continue
        if s.state == "hung":
            problems.append(f"{name} is hung")
        if s.ecc_dbe:
            problems.append(f"{name}: {s.ecc_dbe} uncorrected ECC error(s)")
        if s.remapped_rows_pending:
            problems.append(f"{name}: row remap pending (needs a reset)")
        if s.remapped_rows_failed:
            problems.append(f"{name}: row remap failed (replace the GPU)")
        bad = [t for t in s.throttle if t in FAULT_THROTTLES or (args.idle and t in IDLE_THROTTLES)]
        if bad:
            problems.append(f"{name} throttled ({', '.join(bad)})")
        # Simulated GPUs always carry a simulated training load: idleness means nothing there.
        if args.idle and not simulated:
            if s.mem_used_mb is not None and s.mem_total_mb and s.mem_used_mb > args.max_mem_used_fraction * s.mem_total_mb:
                problems.append(f"{name}: {s.mem_used_mb:.0f} of {s.mem_total_mb:.0f} MiB already in use")
            if s.procs:
                problems.append(f"{name} held by {s.procs} stray process(es)")
    # An event whose fault the sample already shows is said once, from the sample.
    shown = {s.index for s in samples if s.state == "lost"}
    shown_as = {"ecc_dbe": {s.index for s in samples if s.ecc_dbe}, "gpu_hang": {s.index for s in samples if s.state == "hung"}}
    seen: set[tuple[str, int | None, int | None]] = set()
    for ev in pending_gpu_faults(agent, now - args.fault_window_s):
        key = (str(ev.kind), ev.gpu, ev.code)
        if key in seen or ev.gpu in shown or ev.gpu in shown_as.get(str(ev.kind), set()):
            continue
        seen.add(key)
        what = f"XID {ev.code}" if ev.kind == "xid" and ev.code is not None else str(ev.kind)
        on = f"GPU {ev.gpu}" if ev.gpu is not None else "the node"
        problems.append(f"{what} on {on} at {time.strftime('%H:%M:%S', time.localtime(ev.ts))} not cleared")
    healthy = f"{found} GPUs healthy" + (" (simulated: idle checks skipped)" if simulated and args.idle else "")
    return CheckOutcome(not problems, _summary(problems, healthy), {"count": found, "expected": expected, "problems": problems})


# --------------------------------------------------------------------- network


def read_nic_counters() -> dict[str, NicCounters]:
    try:
        raw = psutil.net_io_counters(pernic=True)
    except (OSError, RuntimeError):
        return {}
    return {name: NicCounters(c.errin, c.errout) for name, c in raw.items()}


def read_nic_links() -> dict[str, NicLink]:
    try:
        raw = psutil.net_if_stats()
    except OSError:
        return {}
    return {name: NicLink(st.isup, float(st.speed) if st.speed > 0 else None) for name, st in raw.items()}


def judge_nics(
    nics: list[str],
    links: dict[str, NicLink],
    before: dict[str, NicCounters],
    after: dict[str, NicCounters],
    seconds: float,
    speed_mbps: float | None = None,
) -> CheckOutcome:
    """Each named NIC up, at ``speed_mbps`` if given, its error counters not climbing between two readings."""
    if not nics:
        return CheckOutcome(True, "no NICs named in the agent's config", {"nics": {}})
    problems: list[str] = []
    values: dict[str, Any] = {}
    for name in nics:
        link = links.get(name)
        if link is None:
            problems.append(f"{name}: no such interface")
            continue
        values[name] = {"up": link.up, "speed_mbps": link.speed_mbps}
        if not link.up:
            problems.append(f"{name} is down")
        if speed_mbps and link.up:
            if link.speed_mbps is None:
                problems.append(f"{name}: link speed not reported, expected {speed_mbps:g} Mb/s")
            elif link.speed_mbps < speed_mbps:
                problems.append(f"{name} at {link.speed_mbps:g} Mb/s, expected {speed_mbps:g}")
        b, a = before.get(name), after.get(name)
        if b is not None and a is not None:
            rx, tx = a.rx_errors - b.rx_errors, a.tx_errors - b.tx_errors
            values[name].update(rx_errors=a.rx_errors, tx_errors=a.tx_errors)
            if rx > 0 or tx > 0:
                problems.append(f"{name} errors climbing (+{rx} rx, +{tx} tx in {seconds:.1f} s)")
    return CheckOutcome(not problems, _summary(problems, f"{len(nics)} NIC(s) up, no errors climbing"), {"nics": values, "problems": problems})


async def check_network(nics: list[str], speed_mbps: float | None, sample_s: float) -> CheckOutcome:
    if not nics:
        return judge_nics(nics, {}, {}, {}, 0.0)
    before = read_nic_counters()
    await asyncio.sleep(sample_s)
    return judge_nics(nics, read_nic_links(), before, read_nic_counters(), sample_s, speed_mbps)


# --------------------------------------------------------------------- storage


def check_storage(paths: list[str], need_gb: float, write_mb: float, min_write_mbps: float) -> CheckOutcome:
    """Free space and a short fsync'd write on each checkpoint path (``df``, ``dd oflag=sync``)."""
    if not paths:
        return CheckOutcome(True, "no checkpoint paths in the agent's config", {"paths": {}})
    problems: list[str] = []
    values: dict[str, Any] = {}
    for path in paths:
        where = Path(path)
        if not where.is_dir():
            problems.append(f"{path} does not exist or is not a directory")
            continue
        try:
            usage = shutil.disk_usage(where)
        except OSError as exc:
            problems.append(f"{path}: cannot read free space: {exc.strerror}")
            continue
        free_gb = usage.free / 1e9
        values[path] = {"free_gb": round(free_gb, 2)}
        if need_gb and free_gb < need_gb:
            problems.append(f"{path}: {free_gb:.1f} GB free, a checkpoint needs {need_gb:g} GB")
        if write_mb > 0:
            values[path]["write_test_mb"] = write_mb
            if free_gb - write_mb * _MIB / 1e9 < WRITE_TEST_HEADROOM_GB:
                problems.append(f"{path}: {free_gb:.1f} GB free: no write test, it would leave under {WRITE_TEST_HEADROOM_GB:g} GB")
                continue
            try:
                rate = _write_test(where, write_mb)
            except OSError as exc:
                problems.append(f"{path}: cannot write: {exc.strerror or exc}")
                continue
            values[path]["write_mbps"] = round(rate, 1)
            if min_write_mbps and rate < min_write_mbps:
                problems.append(f"{path}: writes at {rate:.0f} MB/s, need {min_write_mbps:g}")
    return CheckOutcome(not problems, _summary(problems, f"{len(paths)} checkpoint path(s) writable, space enough"), {"paths": values, "problems": problems})


def _write_test(where: Path, write_mb: float) -> float:
    """MB/s of a synced write of ``write_mb`` MB; the file is removed whatever happens."""
    target = where / f".gridwatch-preflight-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    chunk = os.urandom(_MIB)  # random bytes: a compressing filesystem must not flatter the figure
    total = max(int(write_mb * _MIB), 1)
    t0 = time.perf_counter()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        written = 0
        while written < total:
            written += os.write(fd, chunk[: min(_MIB, total - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
        target.unlink(missing_ok=True)
    seconds = max(time.perf_counter() - t0, 1e-6)
    return total / 1e6 / seconds


# ------------------------------------------------------------------------ comm


async def check_comm(comm: CommArgs) -> CheckOutcome:
    """Run this node's rank of the all-reduce test in a child process (torch stays out of the agent)."""
    if importlib.util.find_spec("torch") is None:
        return CheckOutcome(False, "torch is not installed on this node: no all-reduce test", {})
    argv = [
        sys.executable, "-P", "-m", "gridwatch.trainer.allreduce",
        "--master-addr", comm.master_addr,
        "--master-port", str(comm.master_port),
        "--rank", str(comm.rank),
        "--world", str(comm.world),
        "--size-bytes", str(comm.size_bytes),
        "--iters", str(comm.iters),
        "--timeout", str(comm.timeout_s),
        *([] if comm.pairs else ["--no-pairs"]),
    ]
    try:
        # Killed at its deadline, with the request (a session that ends cancels it) and with the agent.
        child = await run_child(argv, None, comm.timeout_s + 30.0)
    except ChildTimeout:
        return CheckOutcome(False, f"all-reduce test did not finish within {comm.timeout_s + 30:g} s", {})
    out, err = child.stdout, child.stderr
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        tail = err.decode(errors="replace").strip().splitlines()
        why = p.clean_text(tail[-1], 300) if tail else f"exit status {child.returncode}"
        return CheckOutcome(False, f"all-reduce worker failed: {why}", {})
    if result.get("error"):
        return CheckOutcome(False, p.clean_text(str(result["error"]), 300), result)
    errors = result.get("pair_errors") or {}
    if errors:
        pairs = ", ".join(f"{k}: {v}" for k, v in errors.items())
        return CheckOutcome(False, p.clean_text(f"pair(s) failed: {pairs}", 300), result)
    return CheckOutcome(True, f"rank {comm.rank}: {result.get('world_busbw_gbps')} GB/s bus bandwidth", result)


# ------------------------------------------------------------------------- run


def _plain_str(obj: Any) -> Any:
    if isinstance(obj, str):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def check_stack(agent: Agent) -> CheckOutcome:
    fp = agent.stack
    return CheckOutcome(True, f"stack {str(fp.hash)[:12] or 'unknown'}", {"fingerprint": msgspec.to_builtins(fp, enc_hook=_plain_str)})


def check_time(agent: Agent) -> CheckOutcome:
    return CheckOutcome(True, "wall clock read", {"wall": agent.clock()})


async def run_checks(agent: Agent, action: p.Action, role: str = "viewer") -> p.ActionResult:
    """The ``preflight`` action: every asked check, each with a verdict and its numbers.

    Checks that hold the node's resources (network sampling, the write test, the
    all-reduce) run for one request at a time; another gets a "busy" answer.
    """
    try:
        args = parse_args(dict(action.args), role)
    except ValueError as exc:
        return p.ActionResult(id=action.id, action=action.action, ok=False, message=p.Text(str(exc)))
    if not SLOW_CHECKS.intersection(args.checks):
        return await _run_checks(agent, action, args)
    running = getattr(agent, "preflight_running", None)
    if running is not None:
        return p.ActionResult(
            id=action.id, action=action.action, ok=False,
            message=p.Text(f"busy: pre-flight {running} is running on this node; try again when it ends"),
        )
    agent.preflight_running = p.clean_text(str(action.id), 80)
    try:
        return await _run_checks(agent, action, args)
    finally:
        agent.preflight_running = None


async def _run_checks(agent: Agent, action: p.Action, args: PreflightArgs) -> p.ActionResult:
    results: dict[str, CheckOutcome] = {}
    if "time" in args.checks:
        results["time"] = check_time(agent)  # first, so the console's round trip brackets it
    now = agent.clock()
    if "gpus" in args.checks:
        results["gpus"] = check_gpus(agent, args, now)
    if "stack" in args.checks:
        results["stack"] = check_stack(agent)
    slow: dict[str, Any] = {}
    if "network" in args.checks:
        slow["network"] = check_network(list(agent.config.nics), args.nic_speed_mbps, args.net_sample_s)
    if "storage" in args.checks:
        slow["storage"] = asyncio.to_thread(
            check_storage, list(agent.config.checkpoint_paths), args.checkpoint_gb, args.write_test_mb, args.min_write_mbps
        )
    if "comm" in args.checks and args.comm is not None:
        slow["comm"] = check_comm(args.comm)
    for name, outcome in zip(slow, await asyncio.gather(*slow.values())):
        results[name] = outcome
    failed = [name for name in args.checks if name in results and not results[name].ok]
    message = f"failed: {', '.join(failed)}" if failed else f"{len(results)} check(s) passed"
    agent.log.info("preflight: {}", message)
    data = {name: results[name].to_data() for name in args.checks if name in results}
    return p.ActionResult(id=action.id, action=action.action, ok=not failed, message=p.Text(message), data=data)
