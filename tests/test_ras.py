"""NCCL's RAS service asked which ranks are dead or missing: the client, the agent action, and the hang verdict.

The server here is a stand-in speaking RAS's protocol with reports built from
NCCL's own format strings (tests/data/ras/SOURCE.md): no NCCL 2.24 GPU job can
run on this machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from gridwatch.agent import ras
from gridwatch.console.runtime.hangs import HangWatch
from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from gridwatch.wire.control import CollectiveState
from gridwatch.wire.ras import decode_report
from tests.conftest import free_port, start_agent, stop_agent, wait_until
from tests.support_blame import NODES, make_engine, make_record

DATA = Path(__file__).parent / "data" / "ras"
DEAD = (DATA / "dead_rank.txt").read_text()
HEALTHY = (DATA / "healthy.txt").read_text()

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def rasd(report: str) -> Serve:
    """RAS's side of the exchange: the handshake, then the report for STATUS, then close."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await reader.readline()
        assert hello.startswith(b"CLIENT PROTOCOL ")
        writer.write(b"SERVER PROTOCOL 2\n")
        cmd = await reader.readline()
        assert cmd.strip() in (b"STATUS", b"VERBOSE STATUS")
        writer.write(report.encode())
        await writer.drain()
        writer.close()

    return serve


@asynccontextmanager
async def fake_server(handler: Serve) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_the_report_names_the_dead_process_and_the_missing_rank_with_host_and_pid() -> None:
    async with fake_server(rasd(DEAD)) as addr:
        report = await ras.status(addr, timeout=3)
    assert report is not None and report.complete
    assert report.version.startswith("NCCL version 2.24.3")
    assert [(r.state, r.pid, r.node) for r in report.processes] == [(ras.RasState.DEAD, 4242, "127.0.0.3")]
    (comm,) = report.communicators
    assert (comm.label, comm.hash, comm.problem) == ("#0-0", "9e2b1c4f0a6d3e57", "INCOMPLETE")
    assert [(r.rank, r.pid, r.node, r.gpu, r.state) for r in comm.ranks] == [(2, 4242, "127.0.0.3", "0", "missing")]
    assert report.errors == ["DEAD", "#0-0 (9e2b1c4f0a6d3e57) INCOMPLETE"] and report.warnings == ["TIMEOUT"]
    assert report.blamed_nodes == ["127.0.0.3"]


async def test_a_healthy_job_blames_nobody() -> None:
    async with fake_server(rasd(HEALTHY)) as addr:
        report = await ras.status(addr, timeout=3)
    assert report is not None and report.culprits() == [] and report.errors == []


async def test_nothing_listening_means_no_ras_here() -> None:
    assert await ras.status(f"127.0.0.1:{free_port()}", timeout=2) is None


async def test_garbage_and_a_server_that_never_answers_are_one_sentence_not_a_crash() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(b"HTTP/1.1 400 Bad Request\x1b[31m\r\n")
        writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads until the client gives up

    async with fake_server(garbage) as addr:
        with pytest.raises(ras.RasUnavailable, match="not NCCL's RAS") as exc:
            await ras.status(addr, timeout=2)
        assert "\x1b" not in str(exc.value)
    async with fake_server(silent) as addr:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ras.RasUnavailable, match="did not answer within 0.5 s"):
            await ras.status(addr, timeout=0.5)
        assert loop.time() - started < 2.0


async def test_a_cut_reply_is_parsed_as_far_as_it_goes_and_marked_incomplete() -> None:
    cut = DEAD[: DEAD.index("#0-0")]

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(b"SERVER PROTOCOL 2\n")
        await reader.readline()
        writer.write(cut.encode())
        await writer.drain()
        await reader.read()  # never finishes the report

    async with fake_server(stalls) as addr:
        report = await ras.status(addr, timeout=1.0)
    assert report is not None and not report.complete
    assert [r.pid for r in report.processes] == [4242] and report.communicators == []
    async with fake_server(rasd(DEAD + "x" * 200_000)) as addr:
        big = await ras.status(addr, timeout=3, max_reply=4096)
    assert big is not None and not big.complete and big.blamed_nodes == ["127.0.0.3"]


def test_garbage_text_parses_to_an_empty_report() -> None:
    report = ras.parse("Errors\n======\n\n#zz (nothex) INCOMPLETE\n  Rank x -- GPU\n\x00\x1b[2J\n" * 3)
    assert report.culprits() == [] and all("\x1b" not in line for line in report.text)


async def test_the_agent_answers_ras_status_over_ssh_and_a_viewer_may_ask(keys) -> None:
    async with fake_server(rasd(DEAD)) as addr:
        ra = await start_agent(keys, ras=addr)
        off = await start_agent(keys, name="node-2", ras="")
        hello: set[str] = set()
        fleet = Fleet(parse_endpoints(f"{ra.spec},{off.spec}"),
                      FleetOptions(key_path=str(keys.viewer_key), known_hosts=str(keys.known_hosts)),
                      on_frame=lambda link, f: hello.add(str(f.node)) if isinstance(f, p.Hello) else None)
        await fleet.start()
        try:
            await wait_until(lambda: hello >= {"node-1", "node-2"}, what="both agents connected")
            res = await fleet.action("node-1", "ras_status", {}, timeout=10)
            assert res.ok, res.message
            report = decode_report(res.data["report"])
            assert report.blamed_nodes == ["127.0.0.3"] and "127.0.0.3" in res.message
            assert isinstance(res.data["addresses"], list) and res.data["addresses"]
            res = await fleet.action("node-2", "ras_status", {}, timeout=10)
            assert not res.ok and "turned off" in res.message
        finally:
            await fleet.stop()
            await stop_agent(ra)
            await stop_agent(off)


@dataclass
class _Fleet:
    """The fleet HangWatch asks: records from the fixtures, RAS through the real client against the fake server."""

    addr: str
    asked: list[tuple[str, str]] = field(default_factory=list)
    behind: str | None = None  # a node whose record stops at collective 40: the records alone can tell

    async def action(self, node: str, name: str, args: dict[str, Any], reason: str = "",
                     timeout: float = 5.0) -> Any:
        self.asked.append((node, name))
        if name == "dump_collectives":  # every rank waits in the same collective: the records cannot tell
            rec = (make_record(node, 40, CollectiveState.COMPLETED) if node == self.behind
                   else make_record(node, 41, CollectiveState.STARTED))
            return SimpleNamespace(ok=True, data={"record": msgspec.to_builtins(rec, enc_hook=p.text_enc_hook)})
        report = await ras.status(self.addr, timeout=2)
        addresses = {"node-1": ["127.0.0.1"], "node-2": ["127.0.0.2"], "node-3": ["127.0.0.3"]}[node]
        return SimpleNamespace(ok=report is not None,
                               data={"report": msgspec.to_builtins(report), "addresses": addresses})


async def test_hangwatch_blames_the_node_ras_names_where_the_records_cannot_tell() -> None:
    engine, _ = make_engine()
    blamed: list[Any] = []
    async with fake_server(rasd(DEAD)) as addr:
        fleet = _Fleet(addr)
        runtime = SimpleNamespace(engine=engine, fleet=fleet, blamed=lambda job, v: blamed.append((job, v)))
        watch = HangWatch(runtime)  # type: ignore[arg-type]
        verdict = await watch.gather("run", "test")
    assert verdict is not None and verdict.nodes == ["node-3"], verdict
    assert "RAS" in verdict.summary and "pid 4242" in verdict.summary
    assert {n for n, a in fleet.asked if a == "ras_status"} == set(NODES)


async def test_hangwatch_falls_back_to_the_records_when_ras_blames_nobody() -> None:
    engine, _ = make_engine()
    async with fake_server(rasd(HEALTHY)) as addr:
        fleet = _Fleet(addr, behind="node-2")
        runtime = SimpleNamespace(engine=engine, fleet=fleet, blamed=lambda job, v: None)
        verdict = await HangWatch(runtime).gather("run", "test")  # type: ignore[arg-type]
    # RAS was asked of every node and named nobody: the verdict is the records', which name the rank behind.
    assert {n for n, a in fleet.asked if a == "ras_status"} == set(NODES)
    assert verdict is not None and verdict.nodes == ["node-2"], verdict
    assert not verdict.summary.startswith("NCCL RAS") and "never entered" in verdict.summary, verdict.summary
