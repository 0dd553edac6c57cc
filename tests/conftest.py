"""Shared test fixtures: keys, real agents on loopback, waiting on conditions."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gridwatch.console.demo.cluster import free_ports

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# The helpers that test modules share live in tests/support_*.py; their asserts say what failed as the tests' own do.
pytest.register_assert_rewrite(*sorted(f"tests.{p.stem}" for p in Path(__file__).parent.glob("support_*.py")))


def free_port() -> int:
    return free_ports(1)[0]  # several at once: free_ports, or two may be the same


# The files that take longest (`--durations`, 2 cores), run first: `make test` gives each of its workers a
# whole file at a time in collection order, and in alphabetical order these come last, one worker still on
# them long after the others ran out of files. Longest first, the workers end within a file of each other.
SLOWEST_FIRST = (
    "test_slurm_e2e.py", "test_trainer_e2e.py", "test_fault_effects.py", "test_blame_e2e.py", "test_console_app.py",
    "test_chaos_drill.py", "test_loop.py", "test_trainer_checkpoint_writer.py", "test_hardening_trainer.py",
    "test_blame_runtime.py", "test_types.py", "test_requeue_slurm.py", "test_prometheus_fleet.py", "test_demo.py",
    "test_scheduler_slurm.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# GRIDWATCH_TEST_WAITS=1 prints how long each wait took (`pytest -s`): where a slow test spends its time.
_SHOW_WAITS = os.environ.get("GRIDWATCH_TEST_WAITS") == "1"


def _waited(what: str, started: float) -> None:
    if _SHOW_WAITS:
        print(f"\n[wait] {time.monotonic() - started:6.2f} s  {what}", flush=True)


async def wait_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    """Poll ``cond`` until it is truthy; fail the test with ``what`` after ``timeout``."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        value = cond()
        if value:
            _waited(what, started)
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_until_async(cond: Callable[[], Awaitable[object]], timeout: float = 10.0, what: str = "condition") -> object:
    """``wait_until`` for a condition that must itself await (a request over a session, a connect attempt)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        value = await cond()
        if value:
            _waited(what, started)
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def wait_until_sync(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    started = time.monotonic()
    deadline = started + timeout
    while True:
        value = cond()
        if value:
            _waited(what, started)
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="session", autouse=True)
def _tier0_cleanup():
    """Interrupted test runs keep their RAM tier for a resume (a finished run removes its own); the suite gives it back at the end."""
    from gridwatch.trainer.config import tier0_base
    from gridwatch.trainer.private import remove_private_dir

    bases = {b for b in (tier0_base(), Path("/dev/shm")) if b is not None and b.is_dir()}
    before = {p for b in bases for p in b.glob("gw-*")}
    yield
    for path in {p for b in bases for p in b.glob("gw-*")} - before:
        remove_private_dir(path)  # only this user's: another user's directory is not ours to remove


@pytest.fixture(autouse=True)
def _loguru_sinks_of_this_test_only() -> Iterator[None]:
    """A CLI called in-process adds a stderr sink bound to that test's captured stream; left behind, a later
    test's log line goes to a closed stream and loguru prints an error into that test's stderr."""
    from loguru import logger

    def sinks() -> set[int]:
        # loguru lists its sinks only here, and replaces the dict on every add: read it afresh each time.
        return set(logger._core.handlers)  # type: ignore[attr-defined]

    before = sinks()
    yield
    for sink_id in sinks() - before:
        try:
            logger.remove(sink_id)
        except ValueError:
            pass  # removed by the test itself meanwhile


@pytest.fixture
def keys(tmp_path: Path):
    # One host key for every test agent, chosen explicitly: tests start many agents on
    # fresh ports and pin them all with one '*' line. Deployments give each node its own.
    from gridwatch.sshlink.keys import init_keys

    return init_keys(tmp_path / "keys", shared_host_key=True)


@dataclass
class RunningAgent:
    agent: object
    port: int
    acceptor: object
    task: asyncio.Task

    @property
    def spec(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_agent(keys, name: str = "node-1", gpus: int = 2, interval: float = 0.1, tailer: object = None, **cfg) -> RunningAgent:
    """A real agent, in this event loop, serving SSH on a loopback port."""
    from gridwatch.agent.agent import Agent
    from gridwatch.agent.config import AgentConfig
    from gridwatch.agent.server import serve
    from gridwatch.agent.sources.simulated import SimulatedGpus

    config = AgentConfig(
        node_name=name,
        listen="127.0.0.1:0",
        host_key=str(keys.host_key),
        authorized_viewers=str(keys.authorized_viewers),
        authorized_operators=str(keys.authorized_operators),
        interval=interval,
        **cfg,
    )
    agent = Agent(config, gpus=SimulatedGpus(gpus, seed=1) if gpus else None, tailer=tailer)
    acceptor = await serve(agent, "127.0.0.1", 0)
    port = acceptor.sockets[0].getsockname()[1]
    task = asyncio.create_task(agent.run())
    return RunningAgent(agent, port, acceptor, task)


async def stop_agent(ra: RunningAgent) -> None:
    ra.agent.stop()
    ra.acceptor.close()
    await ra.task


@pytest.fixture
async def agent(keys) -> AsyncIterator[RunningAgent]:
    ra = await start_agent(keys)
    yield ra
    await stop_agent(ra)


def spawn_agent(keys, port: int, name: str = "node-1", *extra: str, log: Path | None = None) -> subprocess.Popen:
    """A real agent process (``gridwatch agent``) for tests that kill it."""
    cmd = [
        PYTHON, "-m", "gridwatch", "agent",
        "--node-name", name,
        "--listen", f"127.0.0.1:{port}",
        "--host-key", str(keys.host_key),
        "--authorized-viewers", str(keys.authorized_viewers),
        "--authorized-operators", str(keys.authorized_operators),
        "--simulate-gpus", "2",
        "--interval", "0.2",
        "--no-kernel-log",
        *extra,
    ]
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory another local user may reach (tmp_path's parents are closed to others)."""
    d = Path(tempfile.mkdtemp(prefix="gw-test-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a tests.slurm_cluster.SlurmCluster
    """The run's one real Slurm (scripts/slurm-cluster.sh), started on first use; skips, saying why, where it cannot."""
    from tests.slurm_cluster import missing, shared

    why = missing()
    if why is not None:
        pytest.skip(f"no Slurm here: {why}")
    try:
        return shared(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as exc:
        pytest.skip(f"Slurm would not start here: {exc}")


@pytest.fixture
def slurm(slurm_cluster, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """Every node back in the pool, no job left, and `scontrol` run by the code under test pointed at it."""
    slurm_cluster.reset()
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    yield slurm_cluster
    slurm_cluster.cancel_jobs()
