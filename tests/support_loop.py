"""A stand-in training job on real trainer control sockets, real agents relaying them, and the console runtime over them."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.trainer.control_server import ControlServer
from gridwatch.wire import protocol as p
from gridwatch.wire.control import decode_request
from tests.conftest import start_agent, stop_agent


class LeavingServer(ControlServer):
    """A node's trainer: told to leave, the others stop serving before it answers (the job re-forms at once)."""

    def __init__(self, path: str, status, node: str, on_leave) -> None:  # noqa: ANN001
        super().__init__(path, status, node=node)
        self.on_leave = on_leave

    def answer(self, line: bytes):  # noqa: ANN201 - a ControlReply
        try:
            leaving = decode_request(line).cmd == "leave"
        except ValueError:
            leaving = False
        if leaving:
            self.on_leave()
        return super().answer(line)


class FakeJob:
    """Three nodes' trainers as their control sockets show them: one step for the job, servers that can go away."""

    def __init__(self, tmp_path: Path, names: list[str]) -> None:
        self.step = 40
        self.names = names
        self.paths = {n: str(tmp_path / f"{n}.sock") for n in names}
        self.servers: dict[str, ControlServer] = {}
        self.left = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._gone: set[str] = set()  # members that left: told to leave again, they are no longer in the job

    def status(self) -> p.TrainerStatus:
        return p.TrainerStatus(job=p.Text("run"), phase=p.Text("training"), step=self.step,
                               checkpoints={p.Text("0"): 35}, world_size=len(self.names))

    def up(self, name: str) -> None:
        server = LeavingServer(self.paths[name], self.status, name, lambda: self._leave(name))
        server.start()
        self.servers[name] = server
        with self._lock:
            self._gone.discard(name)  # back in the job: its next leave re-forms it again

    def _leave(self, name: str) -> None:
        # In the socket server's thread: the others stop serving before the leaving node answers. Only a
        # member's leave re-forms the job: the agent tells an isolated node's trainer to leave again when it
        # still answers as training (this stand-in keeps answering), and a real job does not re-form for that.
        with self._lock:  # a second leave answers only once the first one's re-formation has begun
            if name in self._gone:
                return
            self._gone.add(name)
            for other in [n for n in self.servers if n != name]:
                self.down(other)
        self.loop.call_soon_threadsafe(self.left.set)

    def down(self, name: str) -> None:
        # A leave answered in a socket server's thread and the test may take the same node down at once:
        # whichever comes second finds it gone already.
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()


async def agents_beside(keys, job, names: list[str] | None = None, interval: float = 0.1,  # noqa: ANN001
                        scenes: Path | None = None) -> list:
    """A real agent per node of ``job`` (a stand-in job: ``up(name)``, ``paths``), each relaying that
    node's trainer control socket; scenes kept under ``scenes/<node>`` when given."""
    from gridwatch.agent.trainer_link import TrainerLink

    agents = []
    for name in names if names is not None else job.names:
        job.up(name)
        extra = {"scene_dir": str(scenes / name)} if scenes is not None else {}
        ra = await start_agent(keys, name=name, gpus=2, interval=interval, **extra)
        ra.agent.trainer = TrainerLink(job.paths[name], interval=0.05)
        ra.agent.trainer.start()
        agents.append(ra)
    return agents


async def stop_beside(runtime, agents: list, job, sim: asyncio.Task | None) -> None:  # noqa: ANN001
    """Undo :func:`agents_beside` and :func:`runtime_over`: the stand-in job's task, the runtime, agents, sockets, store."""
    if sim is not None:
        sim.cancel()
        await asyncio.gather(sim, return_exceptions=True)
    await runtime.stop()
    for ra in agents:
        await ra.agent.trainer.stop()
        await stop_agent(ra)
    for server in list(job.servers.values()):
        server.stop()
    runtime.plan_store.close()


def runtime_over(agents: list, keys, db: Path):  # noqa: ANN001, ANN201 - a ConsoleRuntime as `gridwatch console` builds it
    """The console's runtime over ``agents``, built by ``build_runtime`` as the console builds it."""
    return build_runtime(RuntimeOptions(endpoints=parse_endpoints(",".join(a.spec for a in agents)),
                                        key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                        db_path=str(db), operator="alice", tick_interval=0.1))
