"""Start and stop the demo's local cluster: keys, agent processes on loopback, the trainer across them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from gridwatch.console.demo.processes import Child, spawn, stop_all
from gridwatch.console.demo.state import DemoNode, DemoState, clear_state, write_state
from gridwatch.wire.simdevices import SIM_DEVICES_ENV, kernel_log_path, state_path

Progress = Callable[[str], None]


@dataclass
class ClusterOptions:
    nodes: int = 4
    gpus: int = 8
    interval: float = 1.0
    trainer: bool = True
    steps: int = 1_000_000  # the demo trains until it is stopped
    trainer_args: list[str] = field(default_factory=list)  # extra flags for `gridwatch train`
    ready_timeout: float = 30.0
    # Simulated GPU faults reach the trainer (it hangs, crashes, slows) as real ones would; False: readings only.
    faults_hurt: bool = True


class ClusterError(RuntimeError):
    """The cluster could not start; the message says which part and why."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now. Held open together while they are chosen: one at a time, the kernel may
    give the next node the port it just gave the last, whose agent has not bound it yet (two demo agents were
    given 53143; the second could not listen and the demo stopped)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def trainer_unavailable() -> str | None:
    """Why the trainer cannot run here (torch missing: the trainer extra is not installed), or None."""
    import importlib.util

    # Found, not imported: torch takes seconds to import and the trainer's own processes do that.
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed here; install gridwatch[trainer]"
    return None


def _gridwatch(*args: str) -> list[str]:
    return [sys.executable, "-m", "gridwatch", *args]


class Cluster:
    """The processes of one demo; ``start`` then ``stop`` (always, even after a failed start)."""

    def __init__(self, directory: str | Path, options: ClusterOptions, progress: Progress | None = None) -> None:
        self.dir = Path(directory)
        self.options = options
        self.progress = progress or (lambda line: None)
        self.agents: dict[str, Child] = {}
        self.trainer: Child | None = None
        self.trainer_note = ""
        self.state: DemoState | None = None

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    def names(self) -> list[str]:
        return [f"node-{i}" for i in range(1, self.options.nodes + 1)]

    def socket_for(self, name: str) -> str:
        return str(self.run_dir / "control" / f"{name}.sock")

    async def start(self) -> DemoState:
        from gridwatch.sshlink.keys import init_keys, make_host_key, trust

        o = self.options
        self.dir.mkdir(parents=True, exist_ok=True)
        self.progress(f"making keys in {self.dir / 'keys'}")
        keys = init_keys(self.dir / "keys", force=True)
        sim = self._sim_devices()
        nodes: list[DemoNode] = []
        names = self.names()
        for index, (name, port) in enumerate(zip(names, free_ports(len(names))), start=1):
            # Each node its own host key, pinned for its own port: the way a real fleet is set up.
            host_key = self.dir / "keys" / "hosts" / f"{name}_host_key"
            trust(keys.known_hosts, "127.0.0.1", port, make_host_key(host_key, comment=f"gridwatch-agent-{name}"),
                  replace=True)
            self.progress(f"starting agent {name} on 127.0.0.1:{port} ({index}/{o.nodes}, {o.gpus} simulated GPUs)")
            argv = _gridwatch(
                "agent", "--node-name", name, "--listen", f"127.0.0.1:{port}",
                "--host-key", str(host_key), "--authorized-viewers", str(keys.authorized_viewers),
                "--authorized-operators", str(keys.authorized_operators),
                "--simulate-gpus", str(o.gpus), "--sim-seed", str(index), "--no-kernel-log",
                "--interval", f"{o.interval:g}", "--scene-dir", str(self.dir / "scenes" / name),
                "--trainer-socket", self.socket_for(name), "--log-level", "INFO",
                # The node's simulated kernel log: the driver's lines for injected faults land here.
                "--kernel-logs", str(kernel_log_path(sim, name)),
            )
            child = spawn(name, argv, self.dir / "logs" / f"{name}.log", env=self._env())
            self.agents[name] = child
            nodes.append(DemoNode(name=name, host="127.0.0.1", port=port, pid=child.pid,
                                  trainer_socket=self.socket_for(name)))
        self.state = DemoState(dir=str(self.dir), pid=os.getpid(), operator_key=str(keys.operator_key),
                               viewer_key=str(keys.viewer_key), known_hosts=str(keys.known_hosts), nodes=nodes,
                               run_dir=str(self.run_dir), started_at=time.time())
        write_state(self.state)
        await self._wait_listening(nodes)
        self.progress(f"{o.nodes} agents up")
        if o.trainer:
            self._start_trainer()
        else:
            self.trainer_note = "trainer off: running agents and console only"
        self.state.trainer_pid = self.trainer.pid if self.trainer else None
        write_state(self.state)
        return self.state

    def _start_trainer(self) -> None:
        why = trainer_unavailable()
        if why:
            self.trainer_note = f"trainer not available ({why}): running agents and console only"
            self.progress(self.trainer_note)
            return
        o = self.options
        self.progress(f"starting the trainer across {o.nodes} nodes (one worker per node) in {self.run_dir}")
        env = {k: v for k, v in self._env().items() if k != "GRIDWATCH_TRAINER_SOCKET"}
        argv = _gridwatch("train", "--nodes", str(o.nodes), "--steps", str(o.steps), "--run-dir", str(self.run_dir),
                          "--node-names", ",".join(self.names()), *o.trainer_args)
        self.trainer = spawn("trainer", argv, self.dir / "logs" / "trainer.log", env=env)

    @property
    def sim_dir(self) -> Path:
        return self.dir / "sim"

    def _sim_devices(self) -> Path:
        """The private directory where each node's agent tells its trainer what its simulated GPUs suffer."""
        sim = self.sim_dir
        sim.mkdir(mode=0o700, parents=True, exist_ok=True)
        if sim.is_symlink() or sim.stat().st_uid != os.geteuid():
            raise ClusterError(f"{sim} is not this user's directory; remove it and start again")
        sim.chmod(0o700)
        for name in self.names():
            for path in (state_path(sim, name), kernel_log_path(sim, name)):
                path.unlink(missing_ok=True)  # a new demo starts healthy
            fd = os.open(kernel_log_path(sim, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.close(fd)
        return sim

    def _env(self) -> dict[str, str]:
        """The demo's environment, plus where simulated device faults are shared (agents and trainer alike)."""
        env = dict(os.environ)
        if self.options.faults_hurt:
            env[SIM_DEVICES_ENV] = str(self.sim_dir.resolve())
        else:
            env.pop(SIM_DEVICES_ENV, None)
        return env

    async def _wait_listening(self, nodes: list[DemoNode]) -> None:
        deadline = time.monotonic() + self.options.ready_timeout
        waiting = list(nodes)
        while waiting:
            for node in list(waiting):
                child = self.agents[node.name]
                if not child.alive():
                    raise ClusterError(f"agent {node.name} exited at start (code {child.proc.returncode}): "
                                       f"{child.log_tail(2) or 'no output'}")
                try:
                    _, writer = await asyncio.open_connection(node.host, node.port)
                except OSError:
                    continue
                writer.close()
                waiting.remove(node)
            if waiting and time.monotonic() > deadline:
                raise ClusterError(f"agents {', '.join(n.name for n in waiting)} not listening after "
                                   f"{self.options.ready_timeout:g} s; see {self.dir / 'logs'}")
            if waiting:
                await asyncio.sleep(0.1)

    def respawn_agent(self, name: str) -> bool:
        """Start a dead agent again on its port (a repaired node coming back); False if it is alive."""
        child = self.agents.get(name)
        if child is None or child.alive():
            return False
        self.agents[name] = spawn(name, child.argv, child.log_path, env=child.env)
        if self.state is not None:
            node = self.state.node(name)
            if node is not None:
                node.pid = self.agents[name].pid
            write_state(self.state)
        return True

    def children(self) -> list[Child]:
        return [*self.agents.values(), *([self.trainer] if self.trainer else [])]

    def stop(self) -> None:
        """Stop every process (trainer first, so it does not see its agents vanish), then forget the state."""
        children = self.children()
        if children:
            self.progress(f"stopping {len(children)} processes")
        if self.trainer is not None:
            # SIGINT is the trainer's own way to stop: its nodes keep their newest checkpoint.
            stop_all([self.trainer], grace=10.0, first=signal.SIGINT)
        stop_all(list(self.agents.values()))
        if self.state is not None:
            clear_state(self.state)
        logger.debug("demo cluster in {} stopped", self.dir)
