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
from typing import Any

from agents import protocol as p
from agents.agent import Agent, Caller
from agents.procs import pid_alive

# Faults the simulator takes directly; the rest are handled by the agent itself.
GPU_FAULTS = {"xid", "ecc-dbe", "thermal", "fell-off-bus", "hang"}
AGENT_FAULTS = {"trainer-hang", "trainer-crash", "agent-kill", "net-cut"}
FAULT_KINDS = sorted(GPU_FAULTS | AGENT_FAULTS)
TRAINER_CONTROLS = {"checkpoint_now", "pause", "resume", "leave", "restart_from"}


def _result(action: p.Action, ok: bool, message: str, **data: Any) -> p.ActionResult:
    return p.ActionResult(id=action.id, action=action.action, ok=ok, message=p.Text(message), data=data)


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
        return _result(action, False, str(exc))
    if kind in GPU_FAULTS:
        if agent.gpus is None or not getattr(agent.gpus, "simulated", False):
            return _result(action, False, "faults can only be injected into simulated GPUs; this node has real ones")
        if kind == "xid" and code is None:
            return _result(action, False, "an xid fault needs a code (e.g. --code 79)")
        try:
            what = agent.gpus.inject(kind, gpu=gpu, code=code)  # type: ignore[attr-defined]
        except ValueError as exc:
            return _result(action, False, str(exc))
        agent.event("fault_injected", f"injected {what}", severity="info", fault=kind, gpu=gpu, code=code)
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
        status = agent.trainer.status if agent.trainer is not None else None  # type: ignore[attr-defined]
        pid = status.pid if status is not None else None
        if not pid or not pid_alive(pid):
            return _result(action, False, "no local trainer process to fault")
        sig = signal.SIGSTOP if kind == "trainer-hang" else signal.SIGKILL
        os.kill(pid, sig)
        agent.event("fault_injected", f"injected {kind} (pid {pid})", severity="info", fault=kind, pid=pid)
        return _result(action, True, f"{kind}: sent {sig.name} to trainer pid {pid}")
    return _result(action, False, f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")


async def clear_faults(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    if agent.gpus is not None and getattr(agent.gpus, "simulated", False):
        agent.gpus.clear_faults()  # type: ignore[attr-defined]
    agent.net_cut = False
    return _result(action, True, "faults cleared")


async def isolate(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    if agent.isolated:
        return _result(action, True, "already isolated")
    agent.set_isolated(True)
    agent.event("isolated", f"node isolated by {caller.username}: {action.reason}", severity="warning")
    left = ""
    if agent.trainer is not None:
        reply = await agent.trainer.control("leave", {})  # type: ignore[attr-defined]
        left = f"; trainer: {reply.get('message', 'asked to leave') if reply.get('ok') else reply.get('error', 'no answer')}"
    return _result(action, True, f"isolated{left}")


async def unisolate(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    if not agent.isolated:
        return _result(action, True, "was not isolated")
    agent.set_isolated(False)
    agent.event("unisolated", f"node returned to service by {caller.username}: {action.reason}", severity="info")
    return _result(action, True, "returned to service")


async def trainer_control(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    name = str(action.action)
    if agent.trainer is None:
        return _result(action, False, f"{name}: no trainer is attached to this node")
    reply = await agent.trainer.control(name, dict(action.args))  # type: ignore[attr-defined]
    ok = bool(reply.get("ok"))
    return _result(action, ok, str(reply.get("message") or reply.get("error") or ("done" if ok else "failed")), reply=reply)


async def capture_scene(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    """Keep the scene before anyone touches it: frames, logs, trainer status, stacks."""
    label = p.clean_text(str(action.args.get("label", "scene")), 60)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
    where = Path(agent.config.scene_dir) / f"{time.strftime('%Y%m%dT%H%M%S')}-{safe}-{action.id}"
    try:
        files = await asyncio.to_thread(_write_scene, agent, where)
    except OSError as exc:
        return _result(action, False, f"could not write the scene to {where}: {exc.strerror or exc}")
    return _result(action, True, f"scene kept in {where}", path=str(where), files=files)


def _write_scene(agent: Agent, where: Path) -> list[str]:
    where.mkdir(parents=True, exist_ok=True)
    frames, _ = agent.ring.since(max(agent.ring.last_seq - 600, 0))
    (where / "frames.jsonl").write_bytes(b"".join(frames))
    files = ["frames.jsonl"]
    if agent.tailer is not None:
        lines = agent.tailer.search(".", None, None, 5000)  # type: ignore[attr-defined]
        (where / "logs.txt").write_text("".join(f"{ts:.3f} {src}: {line}\n" for src, line, ts in lines))
        files.append("logs.txt")
    status = agent.trainer.status if agent.trainer is not None else None  # type: ignore[attr-defined]
    if status is not None:
        (where / "trainer.json").write_bytes(p.encode(p.Sample(trainer=status)))
        files.append("trainer.json")
        if status.pid and pid_alive(status.pid):
            (where / "stacks.txt").write_text(_process_stacks(status.pid))
            files.append("stacks.txt")
    (where / "meta.json").write_text(json.dumps({"node": str(agent.node), "seq": agent.ring.last_seq, "isolated": agent.isolated}))
    files.append("meta.json")
    return files


def _process_stacks(pid: int) -> str:
    """Kernel stacks and wait channels of every thread: readable even when Python is stuck."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        parts = [f"thread {task.name}"]
        for name in ("comm", "wchan", "stack"):
            try:
                parts.append(f"  {name}: {(task / name).read_text(errors='replace').strip()}")
            except OSError as exc:
                parts.append(f"  {name}: unreadable ({exc.strerror})")
        out.append("\n".join(parts))
    return "\n\n".join(out) + "\n"


async def preflight(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
    try:
        from agents.preflight import run_checks  # type: ignore[import-not-found]
    except ImportError:
        return _result(action, False, "this agent has no pre-flight checks")
    return await run_checks(agent, action)


HANDLERS = {
    "ping": ping,
    "inject_fault": inject_fault,
    "clear_faults": clear_faults,
    "isolate": isolate,
    "unisolate": unisolate,
    "capture_scene": capture_scene,
    "preflight": preflight,
    **{name: trainer_control for name in TRAINER_CONTROLS},
}
