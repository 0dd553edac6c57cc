"""The agent's tick: its sources read, each behind its guard, into one sample and its events.

An XID two sources report is one event; an isolated node's trainer found back in the job is told to leave
again; a job gridwatch did not write gives its step from its own log.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec

from gridwatch.agent.base import AgentBase
from gridwatch.agent.logs import PROGRESS_FRESH_S, LogEntry
from gridwatch.agent.sources import GuardedSource, Outcome
from gridwatch.agent.sources.ib.source import IbReading
from gridwatch.agent.sources.logs import LogsSource
from gridwatch.agent.watch import watch_text
from gridwatch.wire import protocol as p

# NVML and the kernel log report one XID each; within this many seconds on one GPU they are one event.
XID_FOLD_S = 10.0
# An isolated node's trainer found in the job again is told to leave at most this often.
KEEP_OUT_S = 5.0
# The phases of a trainer that is a member of the job (or about to be): an isolated node's must leave.
IN_THE_JOB: frozenset[str] = frozenset({p.TrainerPhase.STARTING, p.TrainerPhase.TRAINING, p.TrainerPhase.PAUSED,
                                        p.TrainerPhase.CHECKPOINTING, p.TrainerPhase.RESTARTING,
                                        p.TrainerPhase.REFORMING, p.TrainerPhase.JOINING})


class Ticking(AgentBase):
    """The tick: sources to one sample and its events, published."""

    def sources(self) -> list[GuardedSource]:
        """The sources a tick reads (GPUs, host, logs, trainer), each behind its guard.

        A guard is made once per source object; one assigned later (a trainer
        link attached after start) gets its own on the next tick.
        """
        guards: list[GuardedSource] = []
        for slot in ("gpus", "host", "tailer", "trainer", "infiniband"):
            obj = getattr(self, slot)
            if obj is None:
                self._guards.pop(slot, None)
                continue
            held = self._guards.get(slot)
            if held is None or held[0] is not obj:
                source = LogsSource(obj) if slot == "tailer" else obj
                held = (obj, GuardedSource(source, self.config.source_timeout, self._monotonic))
                self._guards[slot] = held
            guards.append(held[1])
        return guards

    async def stop_readers(self) -> None:
        """End the threads the sources are read in, each once its read in hand answers (at most the deadline).

        :meth:`run` ends with this, so that no reader thread outlives the agent
        (one hung past the deadline is left to its daemon thread).
        """
        await asyncio.gather(self._readers.stop(self.config.source_timeout),
                             *(guard.stop_reading() for _, guard in self._guards.values()))

    def close_sources(self) -> None:
        """Close what the sources hold open (NVML, log files); a source still hung at its deadline is left alone."""
        busy = self._readers.close(self.config.source_timeout)
        for _, guard in self._guards.values():
            if guard in busy:
                self.log.warning("source {} left open: a read is still hung in it", guard.name)
                continue
            guard.close()
        self._guards.clear()
        self._footprint.close()

    def tick(self) -> None:
        """Read every source once, inline and without deadlines, and publish: for callers that drive an agent by hand."""
        t0 = time.perf_counter()
        guards = self.sources()
        self._publish_tick(guards, [g.read_now() for g in guards], t0)

    async def tick_async(self) -> None:
        """One tick of :meth:`run`: every source read once, each within its deadline, then published.

        The blocking ones (NVML, the host, logs, sysfs) are read in one shared thread
        (:class:`gridwatch.agent.sources.batch.BatchedReads`), the rest inline: one
        hand-off to a thread and back a tick, not one per source.
        """
        t0 = time.perf_counter()
        guards = self.sources()
        blocking = [g for g in guards if g.blocking]
        if blocking:
            read = iter(await self._readers.read(blocking))
            outcomes = [next(read) if g.blocking else g.read_now() for g in guards]
        else:  # nothing to wait for (simulated GPUs, a trainer link)
            outcomes = [g.read_now() for g in guards]
        self._publish_tick(guards, outcomes, t0)

    def _told_already(self, ev: p.Event) -> bool:
        """An XID another source of this node reported moments ago (NVML's event and the driver's kernel log
        line are one fault): one event, not two; the second is counted on the agent, not sent."""
        if ev.kind != "xid" or ev.code is None:
            return False
        gpu = ev.gpu if ev.gpu is not None else self._gpu_at(str(ev.details.get("pci_bus_id", "")))
        now, source = time.monotonic(), str(ev.source)
        seen = self._xids_told.get((gpu, ev.code))
        if seen is not None and seen[1] != source and now - seen[0] <= XID_FOLD_S:
            self.folded_xids += 1
            self.log.debug("XID {} on gpu {} from {} folded into the one {} reported", ev.code, gpu, source, seen[1])
            return True
        if len(self._xids_told) > 4096:  # bounded: old entries fold nothing
            self._xids_told = {k: v for k, v in self._xids_told.items() if now - v[0] <= XID_FOLD_S}
        self._xids_told[(gpu, ev.code)] = (now, source)
        return False

    def _gpu_at(self, bus: str) -> int | None:
        """The index of the GPU at PCI address ``bus`` (as the kernel names it), None when unknown."""
        if not bus:
            return None
        from gridwatch.agent.sources.pci import pci_key

        key = pci_key(bus)
        return next((i.index for i in self.gpu_info if pci_key(str(i.pci_bus_id or "")) == key), None)

    def _status_from_log(self) -> p.TrainerStatus | None:
        """A job gridwatch did not write, as its own log tells it (step, loss, step time): what the console's
        training view, goodput and recovery read; named after the scheduler's job on the node when there is one."""
        found = self.tailer.job_progress() if self.tailer is not None else None
        if found is None:
            return None
        path, job = found
        assert self.tailer is not None
        if self.jobs:
            head = self.jobs[0]
            name = self.log_job_names[path] = head.job_name()
            life = (str(head.scheduler), str(head.id), head.restarts)
            kept = self.log_lives.get(path)
            if kept is None or kept[0] != life:
                # A new life of the job (requeued: its restart count grew): what the log said before is the old
                # life's. The first life seen counts from the log's start.
                self.log_lives[path] = (life, 0.0 if kept is None else self.tailer.now())
        else:
            # Its processes gone (requeued, ended) while its log is still fresh: the same job, not a new one
            # named after the file. Its next life may be starting: the jobs are read again now.
            name = self.log_job_names.get(path) or os.path.basename(path)
            if path in self.log_job_names:
                self.jobs_wake.set()  # a scheduler's job, left while its log is fresh: only until the log goes stale
        since = self.log_lives[path][1] if path in self.log_lives else 0.0
        if job.ts < since:
            # Requeued and started again, not printed yet: no step to report (the old life's would read as this
            # one's, and the console would call the job recovered before it trained a step).
            return p.TrainerStatus(job=p.Text(name), phase=p.TrainerPhase.STARTING, read_from=p.Text(path))
        return p.TrainerStatus(job=p.Text(name), phase=p.TrainerPhase.TRAINING, step=job.step, loss=job.loss,
                               step_time_s=job.step_time_s, tokens_per_s=job.tokens_per_s, read_from=p.Text(path))

    def _keep_out(self, status: p.TrainerStatus) -> None:
        """The node is isolated and its trainer is (back) in the job: one torchrun restarted, or one that was
        not listening when the node was isolated. It is told to leave again, at most every KEEP_OUT_S."""
        if status.phase not in IN_THE_JOB or self.trainer is None or self.trainer.leaving:
            return  # leaving already (told when the node was isolated): not told again
        if self.trainer.told_to_leave_within(KEEP_OUT_S):
            # Being told now, or a moment ago (here, or by the isolation itself, whose leave may still be unanswered
            # or have timed out and still be acted on): a second leave would make the job re-form twice.
            return
        self.log.warning("the node is isolated and its trainer is {} again: told to leave the job", str(status.phase))
        self.event("trainer_kept_out", f"the node is isolated; its trainer ({status.phase}) was told to leave the job",
                   severity="warning")
        task = asyncio.get_running_loop().create_task(self.trainer.control("leave", {}))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _publish_tick(self, guards: list[GuardedSource], outcomes: list[Outcome], t0: float) -> None:
        """One sample from what the sources said, then their events; a source that failed is N/A in it."""
        gpu_samples: list[p.GpuSample] = []
        host = p.HostSample()
        ib_ports: list[p.IbPortSample] = []
        trainer_status = None
        events: list[p.Event] = []
        lines: list[LogEntry] = []
        for guard, outcome in zip(guards, outcomes):
            events.extend(outcome.events)
            reading = outcome.reading
            if reading is None:
                if guard.source is self.gpus:  # the GPUs are still there, their readings are not
                    gpu_samples = [p.GpuSample(index=info.index) for info in self.gpu_info]
                continue
            if reading.gpus is not None:
                gpu_samples = reading.gpus
            if reading.host is not None:
                host = reading.host
            if isinstance(reading, IbReading):
                ib_ports = reading.ib
            if reading.trainer is not None:
                trainer_status = reading.trainer
            events.extend(reading.events)
            lines.extend(reading.lines)
        host.ib = ib_ports  # read by their own source, shown beside the host's NICs
        if trainer_status is not None:
            self._trainer_seen_at = time.monotonic()
        elif self.tailer is not None and time.monotonic() - self._trainer_seen_at > PROGRESS_FRESH_S:
            # Only for a job with no trainer of gridwatch's: a trainer of ours that died is not "training"
            # because of the lines it printed before.
            trainer_status = self._status_from_log()
        if trainer_status is not None and self.isolated and trainer_status.read_from is None:
            self._keep_out(trainer_status)
        if lines:
            self._send_log_lines(lines)
        stats = self._own_stats()
        patrol_failing = None
        if self.patrol is not None and getattr(self.patrol, "last", None) is not None:
            patrol_failing = [p.Text(name) for name in sorted(self.patrol.failing)]
        sample = p.Sample(gpus=[_for_the_wire(g) for g in gpu_samples], host=host, agent=stats,
                          trainer=trainer_status, isolated=self.isolated, patrol_failing=patrol_failing, jobs=self.jobs)
        self.publish(sample)
        self._keep_summary(p.summarize(sample))
        if self.watcher:
            self._report_watches(gpu_samples, sample.ts)
        for ev in events:
            if self._told_already(ev):
                continue
            self.publish(ev)
            if self.metrics is not None:
                self.metrics.record_event(ev)
        if self.metrics is not None:
            self.metrics.update(str(self.node), self.gpu_info, gpu_samples, host, stats)
            self.metrics.record_sources([g.health() for g in guards])
        self._tick_ms = (time.perf_counter() - t0) * 1000

    def _own_stats(self) -> p.AgentStats:
        """The agent's own footprint and counters, as this tick's sample carries them."""
        return p.AgentStats(
            cpu_percent=self._footprint.cpu_percent(),
            rss_mb=self._footprint.rss_mb(),
            clients=len(self.clients),
            dropped_frames=self.dropped_frames,
            dropped_replies=self.dropped_replies,
            refused_requests=self.refused_requests,
            tick_ms=self._tick_ms,
        )

    def _keep_summary(self, summary: p.Summary) -> None:
        self._summaries[summary.seq] = summary
        self._summary_seqs.append(summary.seq)
        first = self.ring.first_seq
        while self._summary_seqs and self._summary_seqs[0] < first:
            self._summaries.pop(self._summary_seqs.popleft(), None)

    def _report_watches(self, gpus: list[p.GpuSample], now: float) -> None:
        """An event per condition that began (its window full) or stopped holding on a GPU."""
        for change in self.watcher.evaluate(gpus, now):
            w = change.watch
            value = "N/A" if change.value is None else f"{change.value:g}"
            text = watch_text(w)
            if change.held:
                self.event("condition_held", f"{text} holds on gpu {change.gpu} ({w.metric} = {value}, "
                           f"held {now - change.since:.0f} s)", "warning", gpu=change.gpu, playbook=str(w.name),
                           condition=text, value=value, held_s=f"{now - change.since:.0f}")
            else:
                self.event("condition_cleared", f"{text} no longer holds on gpu {change.gpu} ({w.metric} = {value})",
                           "info", gpu=change.gpu, playbook=str(w.name), condition=text, value=value)

    def _send_log_lines(self, lines: list[tuple[str, str, float]]) -> None:
        subscribers = [c for c in self.clients if c.logs]
        if not subscribers:
            return
        for source, line, ts in lines:
            data = self.reply_frame(p.LogLine(source=p.Text(source), line=p.Text(line), line_ts=ts))
            for client in subscribers:
                client.reply(data)


def _for_the_wire(gpu: p.GpuSample) -> p.GpuSample:
    """The GPU's sample as frames carry it: per-link NVLink rates stay on /metrics."""
    if not gpu.nvlink_link_tx_bps and not gpu.nvlink_link_rx_bps:
        return gpu
    return msgspec.structs.replace(gpu, nvlink_link_tx_bps=[], nvlink_link_rx_bps=[])
