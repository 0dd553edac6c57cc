"""Frames an agent sends a console (hello, samples and their summaries, events, log lines, answers), and their base.

Every frame carries ``v`` (protocol version), ``type``, ``seq``, ``ts`` and ``node``. What a trainer
reports rides in a sample as :class:`TrainerStatus`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

import msgspec

from gridwatch.wire.readings import (
    AgentStats,
    GpuInfo,
    GpuSample,
    HostSample,
    NicSample,
    SchedulerJob,
    StackFingerprint,
)
from gridwatch.wire.text import Text

PROTOCOL_VERSION = 1


class TrainerPhase(StrEnum):
    """What a trainer is doing, as it reports it; msgspec refuses a phase not named here."""

    STARTING = "starting"
    TRAINING = "training"
    PAUSED = "paused"
    CHECKPOINTING = "checkpointing"
    RESTARTING = "restarting"  # loading a checkpoint
    REFORMING = "re-forming"  # the group is re-made after a member left
    JOINING = "joining"  # a new member waits for the group that takes it in
    LEFT = "left"
    DONE = "done"
    GONE = "gone"  # the agent's word for a trainer that stopped answering its socket
    UNKNOWN = "unknown"


# Here beside Event, not with the readings: it carries the trainer's recent events, and msgspec
# resolves that annotation in the module the class is defined in.
class TrainerStatus(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """What the local trainer reports over its control socket, relayed as-is."""

    job: Text | None = None
    phase: TrainerPhase = TrainerPhase.UNKNOWN
    step: int | None = None
    epoch: int | None = None
    loss: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    rank_step_times: dict[Text, float] = {}  # rank (as string) -> seconds of last step
    stragglers: list[int] = []
    membership: list[Text] = []  # node names in the current rendezvous
    world_size: int | None = None
    checkpoints: dict[Text, int] = {}  # tier ("0", "1", "2") -> newest step in that tier
    pid: int | None = None
    node: Text | None = None  # the node name this trainer serves (its control socket)
    rank: int | None = None
    paused: bool = False
    # The job's own log this status was read from (a Megatron, Hugging Face, Lightning... job gridwatch did not
    # write: its progress lines); None when gridwatch's trainer reported it over its control socket. Such a job
    # cannot leave a node in place: the scheduler moves it (requeue_job).
    read_from: Text | None = None
    # Recent trainer events (nan_loss, loss_spike, straggler, checkpoint...), oldest
    # first, bounded; ``seq`` numbers them per trainer so a relay sends each once.
    events: list[Event] = []


class Frame(msgspec.Struct, tag_field="type", kw_only=True, gc=False):
    # gc=False here and on every struct a frame holds: frames are trees of JSON values, never
    # cycles, and a console keeping the newest frame of 12,500 nodes would otherwise hand the
    # cyclic collector a million objects to walk on every full collection.
    v: int = PROTOCOL_VERSION
    seq: int = 0
    ts: float = 0.0
    node: Text = Text("")


class Hello(Frame, tag="hello"):
    agent_version: Text = Text("")
    # A new value each time the agent process starts: a console that sees it
    # change knows the seq numbering restarted, whatever the numbers say.
    boot_id: Text = Text("")
    role: Text = Text("viewer")  # what the key this client used is allowed
    interval: float = 1.0
    first_seq: int = 0  # oldest seq still in the agent's buffer
    last_seq: int = 0
    gpus: list[GpuInfo] = []
    simulated: bool = False
    isolated: bool = False
    stack: StackFingerprint = msgspec.field(default_factory=StackFingerprint)
    notes: list[Text] = []  # e.g. "no NVIDIA driver: running without GPUs"
    # True from a relay (``gridwatch relay``), never from an agent: the stream that follows
    # carries other nodes' frames inside Relayed frames, not this node's own.
    relay: bool = False


class Sample(Frame, tag="sample"):
    gpus: list[GpuSample] = []
    host: HostSample = msgspec.field(default_factory=HostSample)
    agent: AgentStats = msgspec.field(default_factory=AgentStats)
    trainer: TrainerStatus | None = None
    isolated: bool = False
    # The agent's patrol: None when none runs, [] when every check passes,
    # else the failing checks' names (the reasons come in patrol_failed events).
    patrol_failing: list[Text] | None = None
    jobs: list[SchedulerJob] = []  # the scheduler's jobs on the node (Slurm, Kubernetes), read on the node


class StreamMode(StrEnum):
    """What a subscriber gets for each tick: the whole sample, or the few values the fleet view shows."""

    FULL = "full"
    SUMMARY = "summary"


# ok | lost | hung, and words to come: as long as a word may be here; that it is one word (a-z, _) is checked
# once per frame by state_word_refused (a pattern in the decoder costs a regex call per GPU per frame).
GpuStateWord = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]


class GpuBrief(msgspec.Struct, array_like=True, gc=False):
    """One GPU in a summary, as a JSON array: what the heatmap, the fleet table and GPU health read.

    Rounded: whole %, °C, W and MB say all a fleet view shows. ``None`` is N/A, as in a sample.
    """

    index: int
    util: int | None = None
    temp_c: int | None = None
    power_w: int | None = None
    mem_used_mb: int | None = None
    mem_total_mb: int | None = None
    # A word (a-z, _) checked once a frame by the decoder (state_word_refused; no per-GPU text hook); a state no
    # console knows still decodes.
    state: GpuStateWord = "ok"
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    throttle: tuple[Text, ...] = ()  # a tuple: the empty one is shared, not a new list per GPU per frame


def _rounded(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _state_word(state: str) -> str:
    """A GPU state as the summary's decoder accepts it (a word of lower-case letters); anything else reads "unknown"."""
    return state if _STATE_WORD.fullmatch(state) else "unknown"


_STATE_WORD = re.compile("[a-z_]{1,32}")
# The GPU state words seen valid so far: each new one is matched once (bounded, so a node cannot grow it).
_WORDS_SEEN: set[str] = {"ok", "lost", "hung", "unknown"}
_WORDS_SEEN_MAX = 256


def state_word_refused(gpus: list[GpuBrief]) -> str | None:
    """The first GPU state in a summary that is not a word of ``a-z`` and ``_`` (a decoder refuses the frame); None."""
    seen = _WORDS_SEEN
    for gpu in gpus:
        state = gpu.state
        if state in seen:
            continue
        if not _STATE_WORD.fullmatch(state):
            return state
        if len(seen) < _WORDS_SEEN_MAX:
            seen.add(state)
    return None


def gpu_brief(gpu: GpuSample) -> GpuBrief:
    """A GPU's sample cut to its summary."""
    return GpuBrief(
        gpu.index, _rounded(gpu.util), _rounded(gpu.temp_c), _rounded(gpu.power_w), _rounded(gpu.mem_used_mb),
        _rounded(gpu.mem_total_mb), _state_word(gpu.state), gpu.ecc_sbe, gpu.ecc_dbe, gpu.remapped_rows_pending,
        gpu.remapped_rows_failed, tuple(gpu.throttle),
    )


class Summary(Frame, tag="summary"):
    """A sample cut to what the fleet view shows: it takes the sample's seq, for subscribers in summary mode.

    ``after`` is the seq of the frame this subscriber was sent before this one: the
    samples between were folded into this summary on purpose (``every``), not lost.
    ``every`` is how many seconds apart this subscriber's summaries come.
    """

    gpus: list[GpuBrief] = []
    cpu_percent: int | None = None
    mem_used_mb: int | None = None
    mem_total_mb: int | None = None
    rx_bps: float | None = None  # summed over the node's NICs and InfiniBand / RoCE HCA ports
    tx_bps: float | None = None
    nic_errors: int | None = None  # rx + tx errors summed over the node's NICs
    trainer: TrainerStatus | None = None  # job, phase, step, loss, step time and checkpoints only
    isolated: bool = False
    patrol_failing: list[Text] | None = None
    after: int = 0
    every: float = 0.0
    # The trainer's membership (node names in its rendezvous), in the first summary a subscriber gets and
    # whenever it changed since; None: as in the last one. At 12,500 nodes the list is ~200 KB, so it is
    # not repeated in every summary, yet the engine needs it to blame only a member of the job.
    members: list[Text] | None = None
    jobs: list[SchedulerJob] = []  # as in the sample: a few bytes, and none at all on a node without jobs

    def as_sample(self) -> Sample:
        """The summary read as a sample: what it does not carry is N/A (NICs as one summed entry)."""
        nics = [] if self.rx_bps is None else [NicSample(
            name=Text("all"), rx_bps=self.rx_bps, tx_bps=self.tx_bps or 0.0, rx_errors=self.nic_errors or 0)]
        host = HostSample(cpu_percent=self.cpu_percent, mem_used_mb=self.mem_used_mb, mem_total_mb=self.mem_total_mb, nics=nics)
        gpus = [GpuSample(index=g.index, util=g.util, temp_c=g.temp_c, power_w=g.power_w, mem_used_mb=g.mem_used_mb,
                          mem_total_mb=g.mem_total_mb, state=g.state, ecc_sbe=g.ecc_sbe, ecc_dbe=g.ecc_dbe,
                          remapped_rows_pending=g.remapped_rows_pending, remapped_rows_failed=g.remapped_rows_failed,
                          throttle=list(g.throttle)) for g in self.gpus]
        return Sample(gpus=gpus, host=host, trainer=self.trainer, isolated=self.isolated, jobs=self.jobs,
                      patrol_failing=self.patrol_failing, seq=self.seq, ts=self.ts, node=self.node, v=self.v)


def summarize(sample: Sample) -> Summary:
    """The summary of one sample, seq and time included."""
    host = sample.host
    trainer = sample.trainer
    if trainer is not None:
        trainer = TrainerStatus(job=trainer.job, phase=trainer.phase, step=trainer.step, loss=trainer.loss,
                                step_time_s=trainer.step_time_s, checkpoints=trainer.checkpoints,
                                world_size=trainer.world_size, paused=trainer.paused, read_from=trainer.read_from)
    nics = host.nics
    # RX/TX count the HCA ports too: RDMA traffic passes no NIC's counters (console/fleet/metrics.host_traffic).
    ports = [p for p in host.ib if p.rx_bps is not None or p.tx_bps is not None]
    moving = bool(nics or ports)
    return Summary(
        gpus=[gpu_brief(g) for g in sample.gpus], cpu_percent=_rounded(host.cpu_percent),
        mem_used_mb=_rounded(host.mem_used_mb), mem_total_mb=_rounded(host.mem_total_mb),
        rx_bps=float(round(sum(n.rx_bps for n in nics) + sum(p.rx_bps or 0.0 for p in ports))) if moving else None,
        tx_bps=float(round(sum(n.tx_bps for n in nics) + sum(p.tx_bps or 0.0 for p in ports))) if moving else None,
        nic_errors=sum(n.rx_errors + n.tx_errors for n in nics) if nics else None,
        trainer=trainer, isolated=sample.isolated, patrol_failing=sample.patrol_failing,
        members=list(sample.trainer.membership) if sample.trainer is not None else None, jobs=sample.jobs,
        seq=sample.seq, ts=sample.ts, node=sample.node, v=sample.v,
    )


# An event's detail: the node's time the fault began (epoch seconds), when the event is told later than
# that (a trainer reported gone only after its grace). The console measures detection from it.
FAULT_AT = "fault_at"


def fault_time(event: Event) -> float:
    """When the fault behind ``event`` began on the node's clock: its ``fault_at`` detail when it holds a
    time no later than the event's own, else the event's time."""
    try:
        at = float(str(event.details.get(FAULT_AT, "")))
    except ValueError:
        return event.ts
    return at if 0 < at <= event.ts else event.ts


class Event(Frame, tag="event"):
    """Something happened: an XID, an ECC error, an NCCL timeout, an action taken.

    ``kind`` is one of the names in :data:`EVENT_KINDS` (others may appear from
    newer agents and must be shown, not rejected).
    """

    kind: Text
    severity: Text = Text("warning")  # info | warning | error | critical
    message: Text = Text("")
    gpu: int | None = None
    code: int | None = None  # XID code, for kind == "xid"
    source: Text = Text("")  # nvml | log:/var/log/kern.log | trainer | sim | agent
    details: dict[Text, Text] = {}  # free-form, as text: pci_bus_id, rank, path ...
    # For kind == "xid": NVIDIA's resolution of the code, one of XidResolution's names. Text, not the
    # enum, so a name a newer catalogue adds still decodes; empty from agents older than the field.
    resolution: Text = Text("")

    def __post_init__(self) -> None:
        # An XID without a resolution (an older agent's, or one built without it) gets the
        # catalogue's, so playbooks decide alike whoever made the event.
        if self.kind == "xid" and self.code is not None and not self.resolution:
            from gridwatch.wire.xid import xid_resolution  # the catalogue imports the protocol, which imports this

            self.resolution = Text(xid_resolution(self.code))


class LogLine(Frame, tag="log"):
    """A raw log line, sent only to clients that subscribed to logs."""

    source: Text
    line: Text
    line_ts: float = 0.0


class ActionResult(Frame, tag="action_result"):
    id: Text
    action: Text
    ok: bool
    message: Text = Text("")
    data: dict[Text, Any] = {}
    # A ResultCode's value (wire/kinds.py). Text, not the enum, so a code a newer agent adds still decodes here.
    code: Text | None = None
    # Bytes a read answers with (a scene file's chunk, wire/scenes.py): base64 in the line, never cleaned as text.
    chunk: bytes | None = None


class SearchResult(Frame, tag="search_result"):
    id: Text
    lines: list[LogLine] = []
    done: bool = True
    truncated: bool = False
    error: Text | None = None  # e.g. a pattern that is not a valid regex


class Gap(Frame, tag="gap"):
    """Frames ``from_seq``..``to_seq`` are gone (buffer overrun or a slow client)."""

    from_seq: int
    to_seq: int
    reason: Text = Text("")


class Error(Frame, tag="error"):
    code: Text  # bad_frame | unknown_type | forbidden | unknown_action | too_large | ...
    message: Text = Text("")

