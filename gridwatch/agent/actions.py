"""What an operator can ask a node to do. Roles are checked before any handler runs.

No handler passes a node- or client-supplied string to a shell.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from gridwatch.agent.fencing import Handler, guarded
from gridwatch.agent.job_scene import job_evidence
from gridwatch.agent.proc_stacks import process_stacks, py_spy_dump
from gridwatch.agent.scenes import read_scene
from gridwatch.agent.sources.ib import simulated as ib
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from gridwatch.wire import simdevices as sd
from gridwatch.wire.control import pid_alive

if TYPE_CHECKING:
    from gridwatch.agent.agent import Agent  # a type only: the agent imports this module

# Faults the simulator takes directly; the rest are handled by the agent itself.
GPU_FAULTS = {"xid", "ecc-dbe", "thermal", "fell-off-bus", "hang"}
AGENT_FAULTS = {"trainer-hang", "trainer-crash", "agent-kill", "net-cut"}
IB_FAULTS = set(ib.IB_FAULTS)  # simulated HCA ports; ``gpu`` picks the HCA (mlx5_<gpu>)
FAULT_KINDS = sorted(GPU_FAULTS | AGENT_FAULTS | IB_FAULTS)
TRAINER_CONTROLS = {p.AgentAction.CHECKPOINT_NOW, p.AgentAction.PAUSE, p.AgentAction.RESUME, p.AgentAction.LEAVE,
                    p.AgentAction.RESTART_FROM}


def _result(action: p.Action, ok: bool, message: str, **data: Any) -> p.ActionResult:
    return p.ActionResult(id=action.id, action=action.action, ok=ok, message=p.Text(message), data=data)


def _unchanged(action: p.Action, ok: bool, message: str, **data: Any) -> p.ActionResult:
    """A result for an action that changed nothing: the agent publishes no event for it."""
    return _result(action, ok, message, changed=False, **data)


def _int_arg(args: dict[str, Any], name: str) -> int | None:
    value = args.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).lstrip("-").isdigit():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


async def ping(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    return _result(action, True, "pong", role=caller.role, seq=agent.ring.last_seq)


async def inject_fault(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    kind = str(action.args.get("kind", ""))
    try:
        gpu = _int_arg(action.args, "gpu")
        code = _int_arg(action.args, "code")
    except ValueError as exc:
        return _unchanged(action, False, str(exc))
    if kind in GPU_FAULTS:
        if agent.gpus is None or not getattr(agent.gpus, "simulated", False):
            return _unchanged(action, False, "faults can only be injected into simulated GPUs; this node has real ones")
        if kind == "xid" and code is None:
            return _unchanged(action, False, "an xid fault needs a code (e.g. --code 79)")
        try:
            what = agent.gpus.inject(kind, gpu=gpu, code=code)
        except ValueError as exc:
            return _unchanged(action, False, str(exc))
        agent.event("fault_injected", f"injected {what}", severity="info", fault=kind, gpu=gpu, code=code)
        share_device_fault(agent, kind, 0 if gpu is None else gpu, code)
        return _result(action, True, f"injected {what}")
    if kind in IB_FAULTS:
        if agent.infiniband is None or not agent.infiniband.simulated:
            return _unchanged(action, False, "link faults can only be injected into simulated HCAs; this node has none")
        try:
            what = agent.infiniband.inject(kind, gpu)
        except ValueError as exc:
            return _unchanged(action, False, str(exc))
        agent.event("fault_injected", f"injected {what}", severity="info", fault=kind, hca=gpu)
        share_device_fault(agent, kind, 0 if gpu is None else gpu, code)
        return _result(action, True, f"injected {what}")
    if kind == "net-cut":
        agent.event("fault_injected", "injected net-cut: the agent stops answering", severity="info", fault=kind)
        # Let this reply leave first, then go silent.
        asyncio.get_running_loop().call_later(0.2, setattr, agent, "net_cut", True)
        return _result(action, True, "net-cut: the agent stops answering")
    if kind == "agent-kill":
        agent.event("fault_injected", "injected agent-kill", severity="info", fault=kind)
        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGKILL)
        return _result(action, True, "agent-kill: the agent dies now")
    if kind in ("trainer-hang", "trainer-crash"):
        status = agent.trainer.status if agent.trainer is not None else None
        pid = status.pid if status is not None else None
        if not pid or not pid_alive(pid):
            return _unchanged(action, False, "no local trainer process to fault")
        sig = signal.SIGSTOP if kind == "trainer-hang" else signal.SIGKILL
        os.kill(pid, sig)
        agent.event("fault_injected", f"injected {kind} (pid {pid})", severity="info", fault=kind, pid=pid)
        return _result(action, True, f"{kind}: sent {sig.name} to trainer pid {pid}")
    return _unchanged(action, False, f"unknown fault kind {p.clean_text(kind, 60)!r}; known: {', '.join(FAULT_KINDS)}")


def share_device_fault(agent: Agent, kind: str | None, gpu: int = 0, code: int | None = None,
                       only_gpu: bool = False) -> None:
    """Sim only: tell the trainer beside this agent what the injected fault does to it (``None``: cleared,
    every GPU's or, with ``only_gpu``, that one GPU's, as after its reset), and write the driver's lines
    to the node's simulated kernel log."""
    directory = sd.sim_dir()
    if directory is None:
        return
    node = agent.config.node_name
    path = sd.state_path(directory, node)
    state = sd.read_state(path, node)
    if kind is None:
        state.faults = [f for f in state.faults if f.gpu != gpu] if only_gpu else []
    else:
        fault = sd.fault_for(kind, code)
        if fault is None:
            return
        seq = max((f.seq for f in state.faults), default=0) + 1
        state.faults = [f for f in state.faults if f.fault is not fault]
        state.faults.append(sd.FaultRecord(fault=fault, at=time.time(), gpu=gpu, code=code, seq=seq))
        infos = agent.gpus.info() if agent.gpus is not None else []
        pci = str(infos[gpu].pci_bus_id or "") if 0 <= gpu < len(infos) else ""
        status = agent.trainer.status if agent.trainer is not None else None
        try:
            sd.append_kernel_lines(sd.kernel_log_path(directory, node),
                                   sd.driver_lines(fault, code, pci or "0000:00:00.0", status.pid if status else None),
                                   node)
        except OSError as exc:
            agent.event("sim_devices", f"simulated kernel log not written: {exc}", severity="warning")
    try:
        sd.write_state(path, state)
    except OSError as exc:
        agent.event("sim_devices", f"simulated device state not shared with the trainer: {exc}", severity="warning")


async def clear_faults(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    if agent.gpus is not None and getattr(agent.gpus, "simulated", False):
        agent.gpus.clear_faults()
        share_device_fault(agent, None)
    if agent.infiniband is not None:
        agent.infiniband.clear_faults()
    agent.net_cut = False
    return _result(action, True, "faults cleared")


def _not_persisted(agent: Agent, action: p.Action, what: str, exc: OSError) -> p.ActionResult:
    return _unchanged(
        action,
        False,
        f"{what}: the state file {agent.config.state_file} could not be written ({exc.strerror or exc}), "
        "so the change would not survive an agent restart; free the disk or fix the path and try again",
    )


async def isolate(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    if agent.isolated:
        return _unchanged(action, True, "already isolated")
    try:
        agent.set_isolated(True)
    except OSError as exc:
        return _not_persisted(agent, action, "not isolated", exc)
    agent.event("isolated", f"node isolated by {caller.username}: {action.reason}", severity="warning")
    left = ""
    if agent.trainer is not None:
        reply = await agent.trainer.control("leave", {})
        left = f"; trainer: {reply.get('message', 'asked to leave') if reply.get('ok') else reply.get('error', 'no answer')}"
    return _result(action, True, f"isolated{left}")


async def unisolate(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    if not agent.isolated:
        return _unchanged(action, True, "was not isolated")
    try:
        agent.set_isolated(False)
    except OSError as exc:
        return _not_persisted(agent, action, "still isolated", exc)
    agent.event("unisolated", f"node returned to service by {caller.username}: {action.reason}", severity="info")
    return _result(action, True, "returned to service")


async def trainer_control(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    name = str(action.action)
    if agent.trainer is None:
        return _result(action, False, f"{name}: no trainer is attached to this node")
    reply = await agent.trainer.control(name, dict(action.args))
    ok = bool(reply.get("ok"))
    message = str(reply.get("message") or reply.get("error") or ("done" if ok else "failed"))
    code = reply.get("code")  # why it failed, where the caller acts on it (ResultCode)
    return p.ActionResult(id=action.id, action=action.action, ok=ok, message=p.Text(message),
                          data={"reply": reply}, code=p.Text(code) if code is not None else None)


async def capture_scene(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    """Keep the scene before anyone touches it: frames, logs, trainer status, stacks."""
    try:
        where = scene_path(agent.config.scene_dir, str(action.args.get("label", "scene")), str(action.id), time.strftime("%Y%m%dT%H%M%S"))
    except ValueError as exc:
        return _unchanged(action, False, str(exc))
    try:
        files = await asyncio.to_thread(_write_scene, agent, where)
    except OSError as exc:
        return _result(action, False, f"could not write the scene to {where}: {exc.strerror or exc}")
    return _result(action, True, f"scene kept in {where}", path=str(where), files=files)


def _safe_part(text: str, limit: int) -> str:
    cleaned = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "-_.") else "_" for ch in p.clean_text(text, limit))
    # No name of only dots: "." and ".." are directories already.
    return cleaned.strip(".") or "_"


def scene_path(scene_dir: str, label: str, action_id: str, stamp: str) -> Path:
    """Where one bundle goes: a single new name inside ``scene_dir``, whatever the label and id say.

    Raises ValueError if the name would resolve outside the scene directory.
    """
    root = Path(scene_dir).resolve()
    where = root / f"{stamp}-{_safe_part(label, 60)}-{_safe_part(action_id, 80)}"
    if where.resolve().parent != root:
        raise ValueError(f"scene name {where.name!r} would leave the scene directory {root}; not written")
    return where


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir leaves an existing directory (or the umask) as it was


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_scene(agent: Agent, where: Path) -> list[str]:
    # Bundles hold logs and stacks: only the agent's user may read them.
    _private_dir(where.parent)
    where.mkdir(mode=0o700)
    os.chmod(where, 0o700)
    frames, _ = agent.ring.since(max(agent.ring.last_seq - 600, 0))
    _write_private(where / "frames.jsonl", b"".join(frames))
    files = ["frames.jsonl"]
    if agent.tailer is not None:
        lines = agent.tailer.entries()[-5000:]
        _write_private(where / "logs.txt", "".join(f"{ts:.3f} {src}: {line}\n" for src, line, ts in lines).encode())
        files.append("logs.txt")
    link = agent.trainer
    status = link.status if link is not None else None
    if link is not None and status is not None:
        _write_private(where / "trainer.json", p.encode(p.Sample(trainer=status)))
        files.append("trainer.json")
        if status.pid and pid_alive(status.pid):
            _write_private(where / "stacks.txt", process_stacks(status.pid).encode())
            files.append("stacks.txt")
            _write_private(where / "pystacks.txt", python_stacks(int(status.pid), link.socket_path).encode())
            files.append("pystacks.txt")
        record, _ = asyncio.run(link.collectives(viewer=False))
        if record is not None:
            _write_private(where / "collectives.json", msgspec.json.encode(record, enc_hook=p.text_enc_hook))
            files.append("collectives.json")
    trainer_pid = int(status.pid) if status is not None and status.pid else None
    for name, data in job_evidence(agent.jobs, agent.job_pids, trainer_pid, agent.tailer):
        _write_private(where / name, data)
        files.append(name)
    meta = json.dumps({"node": str(agent.node), "seq": agent.ring.last_seq, "isolated": agent.isolated,
                       "jobs": [f"{j.scheduler} {j.id}" for j in agent.jobs]})
    _write_private(where / "meta.json", meta.encode())
    files.append("meta.json")
    return files


def python_stacks(pid: int, trainer_socket: str) -> str:
    """Every thread's Python stack of ``pid``: ``py-spy dump`` (works on a frozen process), else the trainer's own dump.

    Where py-spy is missing or may not trace (ptrace), the first line says so and the trainer's control
    thread's dump follows (which a frozen trainer cannot give).
    """
    dump, why = py_spy_dump(pid)
    if dump is not None:
        return dump
    from gridwatch.wire.controlsock import TrainerUnavailable, read_stacks

    try:
        lines = asyncio.run(read_stacks(trainer_socket))
    except TrainerUnavailable as exc:
        return f"# {why}; the trainer's own dump is unavailable too: {exc}\n"
    return f"# {why}; the trainer's own dump (its control thread):\n" + "\n".join(lines) + "\n"


async def dump_collectives(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    """The local trainer's collective record (which collective each rank is in): what blame is judged on."""
    if agent.trainer is None:
        return _unchanged(action, False, "dump_collectives: no trainer is attached to this node")
    try:
        asked = _int_arg(dict(action.args), "limit")
    except ValueError as exc:
        return _unchanged(action, False, f"dump_collectives: {exc}")
    record, why = await agent.trainer.collectives(viewer=caller.role != "operator", limit=asked)
    if record is None:
        return _unchanged(action, False, f"dump_collectives: {why}")
    return _unchanged(action, True, f"{len(record.entries)} collectives of pid {record.pid}",
                      record=msgspec.to_builtins(record, enc_hook=p.text_enc_hook))


async def ras_status(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    """What NCCL's RAS service on this node reports (dead, missing ranks), parsed; ok=False when no RAS answers."""
    from gridwatch.agent import ras

    addr = agent.config.ras
    if not addr:
        return _unchanged(action, False, "ras_status: asking NCCL's RAS service is turned off on this node (ras = \"\")")
    try:
        timeout = min(float(action.args.get("timeout") or 3.0), 30.0)
        report = await ras.status(addr, timeout=timeout)
    except (ValueError, TypeError) as exc:
        return _unchanged(action, False, f"ras_status: {exc}")
    except ras.RasUnavailable as exc:
        return _unchanged(action, False, f"ras_status: {exc}")
    if report is None:
        return _unchanged(action, False, f"ras_status: no NCCL RAS service listens on {addr} (no NCCL 2.24+ job here)")
    blamed = report.blamed_nodes
    said = f"RAS reports {len(report.culprits())} dead or missing ranks on {', '.join(blamed)}" if blamed \
        else "RAS reports no dead or missing rank"
    return _unchanged(action, True, said, report=msgspec.to_builtins(report),
                      addresses=await ras.local_addresses())


async def preflight(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    try:
        from gridwatch.agent.preflight import run_checks
    except ImportError:
        return _result(action, False, "this agent has no pre-flight checks")
    return await run_checks(agent, action, caller.role)


# nvidia-smi takes a few seconds to reset an idle GPU; one that takes this long is not coming back.
RESET_TIMEOUT = 120.0


def reset_argv(index: int) -> list[str]:
    """The real command: ``nvidia-smi --gpu-reset -i INDEX`` (never through a shell)."""
    return ["nvidia-smi", "--gpu-reset", "-i", str(index)]


async def reset_gpu(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    """Reset one GPU: the real argv on NVML GPUs (refused while compute processes hold it), a clean slate in sim."""
    try:
        index = _int_arg(action.args, "gpu")
    except ValueError as exc:
        return _unchanged(action, False, str(exc))
    if agent.gpus is None or not agent.gpu_info:
        return _unchanged(action, False, "this node has no GPUs to reset")
    if index is None or not 0 <= index < len(agent.gpu_info):
        return _unchanged(action, False, f"reset_gpu needs the GPU to reset: gpu 0 to {len(agent.gpu_info) - 1}")
    from gridwatch.agent.sources.simulated import SimulatedGpus

    if isinstance(agent.gpus, SimulatedGpus):
        done = agent.gpus.reset(index)
        share_device_fault(agent, None, index, only_gpu=True)  # the trainer beside it sees a healthy GPU again
        return _result(action, True, f"{done} (simulated); it reads healthy", gpu=index, argv=reset_argv(index))
    from gridwatch.agent.workers import ChildTimeout, run_child

    readings = await asyncio.to_thread(agent.gpus.sample)
    held = next((g.procs for g in readings if g.index == index), None)
    if held:
        return _unchanged(action, False, f"GPU {index} not reset: {held} compute process{'es' if held != 1 else ''} "
                                         "still hold it; stop the job on it (or isolate the node) and reset again")
    argv = reset_argv(index)
    timeout = float(action.args.get("timeout") or RESET_TIMEOUT)
    try:
        child = await run_child(argv, None, timeout)
    except ChildTimeout:
        return _result(action, False, f"GPU {index} not reset: {' '.join(argv)} did not finish within {timeout:g}s "
                                      "and was killed", gpu=index, argv=argv)
    except OSError as exc:
        return _result(action, False, f"GPU {index} not reset: {argv[0]} could not run ({exc.strerror or exc})",
                       gpu=index, argv=argv)
    said = p.clean_text((child.stdout + child.stderr).decode(errors="replace").strip(), 300)
    if child.returncode != 0:
        return _result(action, False, f"GPU {index} not reset: {argv[0]} exited {child.returncode}: {said}",
                       gpu=index, argv=argv)
    after = next((g for g in await asyncio.to_thread(agent.gpus.sample) if g.index == index), None)
    if after is None or after.state != "ok":
        state = after.state if after is not None else "unreadable"
        return _result(action, False, f"GPU {index} was reset but reads {state}: it needs a reboot or service",
                       gpu=index, argv=argv)
    return _result(action, True, f"GPU {index} reset and reads healthy: {said}", gpu=index, argv=argv)


HANDLERS: dict[str, Handler] = {
    p.AgentAction.PING: ping,
    p.AgentAction.INJECT_FAULT: inject_fault,
    p.AgentAction.CLEAR_FAULTS: clear_faults,
    p.AgentAction.RESET_GPU: reset_gpu,
    p.AgentAction.ISOLATE: isolate,
    p.AgentAction.UNISOLATE: unisolate,
    p.AgentAction.CAPTURE_SCENE: capture_scene,
    p.AgentAction.DUMP_COLLECTIVES: dump_collectives,
    p.AgentAction.RAS_STATUS: ras_status,
    p.AgentAction.PREFLIGHT: preflight,
    p.AgentAction.READ_SCENE: read_scene,
    **{name: trainer_control for name in TRAINER_CONTROLS},
}
# Every action that changes something checks the sender's fencing token and its step key first (agents/fencing.py).
HANDLERS.update({name: guarded(handler) for name, handler in HANDLERS.items()
                 if name not in p.VIEWER_ACTIONS | p.READ_ACTIONS})
