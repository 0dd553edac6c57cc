"""When a job hangs, read every rank's collective record through its agent and name the rank that holds it up.

A hang in a collective is reported by every rank that waits, never by the one
that is stuck; and the waiting ranks give up (their progress deadline, NCCL's
watchdog) within seconds, taking their records with them. So the records are
read as soon as a hang is suspected: the job's training step standing still
for ``after`` seconds, a watchdog timeout, a rank's report that its
generation's collective failed, a worker's progress deadline, a trainer that
stopped answering. Every live node of the job is asked at once
(``dump_collectives``, bounded by ``timeout``), the records are matched
(gridwatch.playbooks.blame_collectives) and a verdict that names a culprit goes to the
engine, which acts on that node rather than on the reporters.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from loguru import logger

from gridwatch.playbooks.blame_collectives import BlameReason, CollectiveVerdict, Culprit, blame
from gridwatch.wire.control import CollectiveRecord
from gridwatch.wire.protocol import AgentAction, Event, Frame, LogLine, text_dec_hook, text_enc_hook
from gridwatch.wire.ras import RasReport, decode_report

if TYPE_CHECKING:
    from gridwatch.console.runtime.core import ConsoleRuntime

# Events that say a collective may hang: the watchdog's timeout, a trainer that stopped answering.
HANG_EVENTS: frozenset[str] = frozenset({"nccl_timeout", "nccl_error", "trainer_exit"})
# A waiting rank's own report that its generation's collective failed (trainer/modes.py): the
# first word of a hang under the membership coordinator, seconds before the frozen trainer is
# reported gone, and read then, a plan that isolates comes before a plain one would.
GENERATION_FAILED = ("membership", "warning")
# The worker's progress deadline (trainer/worker.py) and PyTorch's watchdog, as log lines.
_HANG_LINE = re.compile(r"no progress for [\d.]+ s|[Cc]aught collective operation timeout|Timeout at NCCL work")
RECENT = 32  # verdicts kept for the console and the benchmark
_record_decoder = msgspec.json.Decoder(CollectiveRecord, dec_hook=text_dec_hook)


def decode_record(raw: object) -> CollectiveRecord:
    """The record a ``dump_collectives`` result carries (its ``data["record"]``), typed; raises if it does not decode.

    Through JSON and the decoder of node text: the record's Text fields need its
    hook (a plain decode refuses every one of them), and are cleaned on the way.
    """
    return _record_decoder.decode(msgspec.json.encode(raw, enc_hook=text_enc_hook))


@dataclass(slots=True)
class _Progress:
    step: int
    since: float  # console time the step was first seen
    blamed: bool = False  # this stall already has a verdict naming a culprit
    told_none: bool = False  # the log already said this stall's records name no culprit (read again, said once)


@dataclass
class HangWatch:
    """Suspects hangs, gathers the records of the job's nodes and hands the verdict to the engine."""

    runtime: ConsoleRuntime
    after: float = 3.0  # seconds a job's step may stand still before its records are read
    timeout: float = 4.0  # every node's answer within this (a frozen trainer takes the agent's 2 s to refuse)
    every: float = 1.0  # at most one read per job this often while it stays stuck
    min_wait_s: float = 0.5  # a rank waits in a collective at least this long before it counts as waiting
    verdicts: deque[tuple[str, CollectiveVerdict]] = field(default_factory=lambda: deque(maxlen=RECENT))
    _progress: dict[str, _Progress] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)  # job -> when its records were last read
    _busy: set[str] = field(default_factory=set)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def on_frame(self, node: str, frame: Frame) -> None:
        """A frame just observed: a watchdog line, a progress deadline or a silent trainer is a suspected hang."""
        if isinstance(frame, Event) and str(frame.kind) in HANG_EVENTS:
            self.suspect(self._job_of(node), f"{frame.kind} on {node}")
        elif isinstance(frame, Event) and (str(frame.kind), str(frame.severity)) == GENERATION_FAILED:
            self.suspect(self._job_of(node), f"a generation failed on {node}")
        elif isinstance(frame, LogLine) and _HANG_LINE.search(str(frame.line)):
            self.suspect(self._job_of(node), f"a hang line on {node}")

    def tick(self, now: float) -> None:
        """A job whose step stood still ``after`` seconds is suspected (again every ``every`` until blamed)."""
        engine = self.runtime.engine
        if engine is None:
            return
        steps: dict[str, int] = {}
        for n in engine.nodes.values():
            if n.trainer_step is not None and not n.out and not n.lost:
                steps[n.job] = max(steps.get(n.job, n.trainer_step), n.trainer_step)
        for job, step in steps.items():
            seen = self._progress.get(job)
            if seen is None or seen.step != step:
                self._progress[job] = _Progress(step, now)
            elif not seen.blamed and now - seen.since >= self.after:
                self.suspect(job, f"no training step past {step} for {now - seen.since:.0f} s")

    def suspect(self, job: str, why: str) -> None:
        """Read the job's records now, unless a read is under way or was made less than ``every`` ago."""
        if self.runtime.engine is None or self.runtime.fleet is None or job in self._busy:
            return
        now = self.runtime.engine.clock.now()
        if now - self._last.get(job, float("-inf")) < self.every:
            return
        self._last[job] = now
        self._busy.add(job)
        task = asyncio.get_running_loop().create_task(self._judge(job, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _judge(self, job: str, why: str) -> None:
        try:
            verdict = await self.gather(job, why)
        except Exception:  # noqa: BLE001 - a failed read never stops the console; the log says why
            logger.exception("reading the collective records of job {!r} failed", job)
            return
        finally:
            self._busy.discard(job)
        seen = self._progress.get(job)
        if verdict is None or not verdict.culprits:
            if seen is None or not seen.told_none:
                logger.info("collective records of job {!r} ({}) name no culprit: {}", job, why,
                            verdict.summary if verdict is not None else "no rank waits in a collective")
            if seen is not None:
                seen.told_none = True
            return
        if seen is not None:
            seen.blamed = True
        self.verdicts.append((job, verdict))
        for node in verdict.nodes:
            logger.bind(node=node).warning("collective records ({}): {}", why, verdict.summary)
        self.runtime.blamed(job, verdict)

    async def gather(self, job: str, why: str = "asked") -> CollectiveVerdict | None:
        """Every live node of ``job`` asked for its record at once; the verdict over what came back in time."""
        engine, fleet = self.runtime.engine, self.runtime.fleet
        assert engine is not None and fleet is not None
        nodes = engine.live_nodes(job)

        async def one(node: str) -> CollectiveRecord | None:
            try:
                result = await fleet.action(node, AgentAction.DUMP_COLLECTIVES, {}, reason=f"which rank is stuck: {why}",
                                            timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - that node simply did not answer
                logger.bind(node=node).debug("dump_collectives failed: {}", exc)
                return None
            raw = result.data.get("record") if result.ok else None
            if raw is None:
                return None  # its trainer did not answer: frozen or gone, which blame counts
            try:
                return decode_record(raw)
            except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as exc:
                logger.bind(node=node).warning("a collective record that does not decode: {}", exc)
                return None

        got, ras_answers = await asyncio.gather(asyncio.gather(*(one(n) for n in nodes)), self._ras(nodes, why))
        # NCCL's RAS service first where it names dead or missing ranks: it sees every process of the job.
        ras_verdict = ras_blame(ras_answers, len(nodes))
        if ras_verdict is not None:
            return ras_verdict
        # Keyed as the trainers name their group's members; a node that gave nothing, by its agent's name.
        records = {str(r.node) if r is not None and r.node else n: r for n, r in zip(nodes, got, strict=True)}
        return blame(records, self.min_wait_s)

    async def _ras(self, nodes: list[str], why: str) -> dict[str, tuple[RasReport, list[str]]]:
        """Each node's RAS report with the addresses the node answers to; nodes without RAS are left out."""
        fleet = self.runtime.fleet
        assert fleet is not None

        async def one(node: str) -> tuple[RasReport, list[str]] | None:
            try:
                result = await fleet.action(node, AgentAction.RAS_STATUS, {"timeout": max(self.timeout - 1.0, 0.5)},
                                            reason=f"which rank is stuck: {why}", timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - that node simply did not answer
                logger.bind(node=node).debug("ras_status failed: {}", exc)
                return None
            if not result.ok or result.data.get("report") is None:
                return None  # no RAS on that node (no NCCL 2.24+ job), or turned off
            try:
                report = decode_report(result.data["report"])
            except (msgspec.ValidationError, msgspec.DecodeError, TypeError) as exc:
                logger.bind(node=node).warning("a RAS report that does not decode: {}", exc)
                return None
            addresses = [str(a) for a in result.data.get("addresses") or [] if isinstance(a, str)]
            return report, addresses

        got = await asyncio.gather(*(one(n) for n in nodes))
        return {n: r for n, r in zip(nodes, got, strict=True) if r is not None}

    def _job_of(self, node: str) -> str:
        engine = self.runtime.engine
        state = engine.nodes.get(node) if engine is not None else None
        return state.job if state is not None else ""

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def ras_blame(answers: dict[str, tuple[RasReport, list[str]]], world: int) -> CollectiveVerdict | None:
    """A verdict from the nodes' RAS reports: the nodes whose ranks RAS calls dead or missing; None when none does.

    RAS names a host by its address; a node is the one whose agent answers to
    that address (or name). A host no node answers to is named as RAS gives it.
    """
    where: dict[str, str] = {}
    for node, (_, addresses) in answers.items():
        where[node] = node
        for addr in addresses:
            where.setdefault(addr, node)
    culprits: list[Culprit] = []
    said: list[str] = []
    asked = ""
    for node, (report, _) in sorted(answers.items()):
        found = report.culprits()
        if not found:
            continue
        asked = asked or node
        for r in found:
            culprit_node = where.get(r.node, r.node) if r.node else ""
            if not culprit_node:
                continue
            if any(c.node == culprit_node and c.rank == (r.rank if r.rank is not None else -1) for c in culprits):
                continue
            culprits.append(Culprit(rank=r.rank if r.rank is not None else -1, node=culprit_node,
                                    reason=BlameReason.NO_ANSWER))
            who = f"rank {r.rank}" if r.rank is not None else "a process"
            said.append(f"{who} (pid {r.pid} on {r.node}) {r.state}" if r.pid is not None else f"{who} {r.state}")
        if culprits:
            break  # one node's report is the whole job's view
    if not culprits:
        return None
    nodes = list(dict.fromkeys(c.node for c in culprits))
    summary = f"NCCL RAS (asked on {asked}) reports {'; '.join(said[:8])}: blaming {', '.join(nodes)}"
    return CollectiveVerdict(pg="nccl-ras", seq=0, op="", world=world, culprits=culprits, summary=summary)
