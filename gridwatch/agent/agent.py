"""The node agent: sample every tick, number frames, fan them out to clients; its parts put together here.

Transport-free: :mod:`gridwatch.sshlink.server` connects it to SSH sessions, tests may
drive it directly. Sampling never waits on a client: frames go into the ring,
and each client's writer reads from the ring at its own pace.

The parts, one job each: :mod:`gridwatch.agent.base` (the state they share and the numbered stream),
:mod:`gridwatch.agent.tick` (sources to one sample and its events), :mod:`gridwatch.agent.clients`
(each client's stream and replies) and :mod:`gridwatch.agent.searches` (log search). Here: a client's
request routed, an action dispatched, the tick run on its schedule and the scheduler's jobs read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from gridwatch.agent.clients import ClientStream, Serving
from gridwatch.agent.jobs import jobs_on_node
from gridwatch.agent.searches import Searching
from gridwatch.agent.tick import Ticking
from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p

JOBS_EARLY_S = 1.0  # the soonest the node's jobs are read again after a read, when something asks for it


class Agent(Ticking, Serving, Searching):
    """Everything one node reports, and the actions it takes."""

    async def run(self) -> None:
        """Tick on a fixed schedule until :meth:`stop`; a slow tick is logged, not stacked; the reader threads end with it."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        overruns, warned_at = 0, -60.0
        jobs = loop.create_task(self._read_jobs()) if self.config.jobs_every > 0 else None
        while not self._stop.is_set():
            try:
                await self.tick_async()
            except Exception:  # a source bug must not stop the heartbeat
                self.log.exception("tick failed")
            next_at += self.config.interval
            delay = next_at - loop.time()
            if delay < 0:
                overruns += 1
                # Once a minute at most: a loaded node must not also flood its own log.
                if loop.time() - warned_at >= 60:
                    self.log.warning("tick overran its interval by {:.0f} ms ({} overruns so far)", -delay * 1000, overruns)
                    warned_at = loop.time()
                next_at = loop.time()
                delay = 0
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
            except TimeoutError:
                pass
        if jobs is not None:
            jobs.cancel()
            await asyncio.gather(jobs, return_exceptions=True)
        await self.stop_readers()

    async def _read_jobs(self) -> None:
        """Which scheduler jobs run here, every ``jobs_every`` seconds, read off the loop (a /proc walk)."""
        while not self._stop.is_set():
            try:
                found = await asyncio.to_thread(jobs_on_node, "/proc", self.config.node_name)
            except Exception:  # noqa: BLE001 - the samples go on without jobs; the log says why
                self.log.exception("reading the node's jobs failed")
                found = []
            jobs = [p.SchedulerJob(scheduler=p.Text(j.scheduler), id=p.Text(j.id), user=p.Text(j.user),
                                   name=p.Text(j.name), nodes=p.Text(j.nodes), pids=len(j.pids), restarts=j.restarts)
                    for j in found]
            if [(j.scheduler, j.id, j.restarts) for j in jobs] != [(j.scheduler, j.id, j.restarts) for j in self.jobs]:
                self.log.info("jobs on the node: {}", ", ".join(
                    f"{j.scheduler} {j.id} ({j.user}{f', restart {j.restarts}' if j.restarts else ''})" for j in jobs)
                    or "none")
            self.jobs = jobs
            self.job_pids = {(j.scheduler, j.id): list(j.pids) for j in found}
            # Woken early when a job's log speaks while no job is known here (a requeued job back), yet at most
            # once every JOBS_EARLY_S: a log with no scheduler job behind it would wake it every tick.
            early = min(JOBS_EARLY_S, self.config.jobs_every)
            self.jobs_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), early)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.jobs_wake.wait(), self.config.jobs_every - early)

    def stop(self) -> None:
        self._stop.set()
        self.jobs_wake.set()
        for client in self.clients:
            client.closed = True
            client.wake.set()

    # ---------------------------------------------------------------- requests

    def handle_request(self, client: ClientStream, line: bytes) -> Awaitable[None] | None:
        """Act on one line a client sent; returns a coroutine for slow work (actions, searches)."""
        try:
            frame = p.decode_client_frame(line)
        except p.FrameError as exc:
            client.reply(self.reply_frame(p.Error(code=p.Text(exc.code), message=p.Text(str(exc)))))
            return None
        if isinstance(frame, p.Subscribe):
            client.logs = frame.logs
            client.mode, client.every = frame.mode, max(frame.every, 0.0)
            refused = self.watcher.set(id(client), frame.watches)
            if refused:
                client.reply(self.reply_frame(p.Error(code=p.Text("bad_watch"), message=p.Text("; ".join(refused)))))
            if not client.subscribed:
                client.subscribed = True
                client.cursor = client.last_sent = self.resume_cursor(frame.resume_from)
            client.wake.set()
            return None
        if isinstance(frame, (p.Search, p.Action)):
            # Behind a relay, the console it forwards for: never more than the relay's own role. Taken from an
            # operator's key only (a relay's is one): a viewer could otherwise mint a budget per request.
            relayed = frame.behalf is not None and client.caller.role == "operator"
            caller = client.caller.behind(str(frame.behalf.key), str(frame.behalf.role)) \
                if relayed and frame.behalf is not None else client.caller
        if isinstance(frame, p.Search):
            refusal = self._admit(client, caller, "search")
            if refusal is not None:
                client.reply(self.reply_frame(p.SearchResult(id=frame.id, error=p.Text(refusal.message))))
                return None
            return self._answer(client, self.search(frame, caller.key))
        if isinstance(frame, p.Action):
            # A scene copy is one request: its listing is counted, its chunk reads are not (a 64 MB bundle is
            # 128 of them, and no budget for people's actions should eat the evidence or be eaten by it).
            # Only an operator's: a viewer's read is refused anyway, and pays like any request.
            chunk = frame.action == p.AgentAction.READ_SCENE and "file" in frame.args and caller.role == "operator"
            refusal = self._admit(client, caller, "action", budgeted=not chunk)
            if refusal is not None:
                # Over budget, nothing was done: the code and the wait let the console send it again then.
                over = refusal.retry_after is not None
                client.reply(self.reply_frame(p.ActionResult(
                    id=frame.id, action=frame.action, ok=False, message=p.Text(refusal.message),
                    code=p.Text(p.ResultCode.OVER_BUDGET) if over else None,
                    data={"retry_after_s": refusal.retry_after} if over else {})))
                return None
            return self._answer(client, self.act(caller, frame))
        if isinstance(frame, (p.RelaySubscribe, p.Relayed)):
            client.reply(self.reply_frame(p.Error(code=p.Text("not_a_relay"), message=p.Text(
                "this is a gridwatch agent, not a relay: list it as a node, not under [[relay]]"))))
        return None

    async def act(self, caller: Caller, action: p.Action) -> p.ActionResult:
        """Check the role, run the handler, log who asked and what came of it."""
        name = str(action.action)
        handler = self.actions.get(name)
        if handler is None:
            return p.ActionResult(id=action.id, action=action.action, ok=False, message=p.Text(f"unknown action {name!r}"))
        if caller.role != "operator" and name not in p.VIEWER_ACTIONS:
            self.log.warning("refused action {} from {}: viewer role", name, caller)
            return p.ActionResult(
                id=action.id,
                action=action.action,
                ok=False,
                message=p.Text(f"action {name!r} needs the operator role; this key is a {caller.role}"),
            )
        # A copy's reads come by the hundred, and the console audits the copy: they log at debug.
        level = "DEBUG" if name in p.READ_ACTIONS else "INFO"
        self.log.log(level, "action {} {} by {} because {!r}", name, dict(action.args), caller, str(action.reason))
        try:
            result = await handler(self, caller, action)
        except Exception as exc:  # an action bug is reported to the operator, not fatal to the agent
            self.log.exception("action {} failed", name)
            result = p.ActionResult(id=action.id, action=action.action, ok=False, message=p.Text(f"{name} failed: {exc}"))
        self.log.log(level, "action {} by {}: {} {}", name, caller, "ok" if result.ok else "FAILED", str(result.message))
        # An action that changed nothing (isolating an isolated node) is not news.
        if name not in p.VIEWER_ACTIONS and result.data.get("changed", True) is not False:
            self.event(
                "action",
                f"{name} by {caller.username} ({caller.role}): {'ok' if result.ok else 'failed'}: {result.message}",
                severity="info" if result.ok else "warning",
                action=name,
                by=caller.username,
                reason=str(action.reason),
                ok="true" if result.ok else "false",  # whoever reads the event back never parses the sentence
            )
        return result
