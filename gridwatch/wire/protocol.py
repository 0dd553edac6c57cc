"""The wire protocol between node agents and consoles: newline-delimited JSON frames.

Both ends import this module. Every frame carries ``v`` (protocol version),
``type``, ``seq``, ``ts`` and ``node``. Text that a node supplies is typed
:class:`Text` and is cleaned of control characters and escape sequences when a
frame is decoded, so nothing a node sends can reach a terminal as a command.
A field the hardware cannot give is ``None`` (shown as N/A), never zero.
"""

from __future__ import annotations

import re
import time
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, get_args

import msgspec

PROTOCOL_VERSION = 1
SUBSYSTEM = "gridwatch"
AGENT_VERSION = "0.1.0"  # the software version a Hello names (agents and relays)
# The version a Hello names when no agent sent it: the console read the node from Prometheus. Such a node
# is shown and its faults are told, but nothing takes it out on a metric exporter's word alone.
HEARSAY_VERSION = "prometheus"
# A frame longer than this is refused whole rather than buffered: it is either
# a bug or hostile, and one node must not make the console hold megabytes.
MAX_FRAME_BYTES = 1 << 20
# Log lines are clipped on the node so that one 1 MB line cannot crowd out frames.
MAX_LINE_CHARS = 4096

# Also dropped: every Unicode format character (category Cf: bidi controls, zero-width
# space/joiners, LRM/RLM, word joiner, invisible operators, BOM, soft hyphen, tag
# characters) and the other invisible ones (combining grapheme joiner, Hangul fillers,
# variation selectors), so "node\u200b-1" or "node\U000e0041-1" cannot pose as "node-1".
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    "\u115f\u1160\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufe00-\ufe0f"
    "\ufeff\uffa0\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f\U000e0100-\U000e01ef]"
)
_WHITESPACE_CONTROL = re.compile(r"[\t\n\r\u2028\u2029]")
class Severity(StrEnum):
    """How bad an event is, mildest first: what playbooks rank and the Logs view filters by."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


SEVERITIES: tuple[str, ...] = tuple(s.value for s in Severity)


def severity_rank(severity: str) -> int:
    """Higher is worse; a severity this version does not know ranks below every known one."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


# A node is stale ("heartbeat lost") after this many of its sampling intervals without
# a frame: one definition for the fleet, the state store and the playbooks' default.
STALE_AFTER_INTERVALS = 3.0
# Deeper than any frame we send; a deeper one is refused before anything recurses on it.
MAX_NESTING = 32


if TYPE_CHECKING:
    # To the type checker Text is a plain str. The class exists so the decoder can find
    # every field (and dict key) a node fills and clean it; the strings our own code puts
    # into a frame are trusted, and a nominal subtype would reject every str literal used
    # as a dict key (dict keys are invariant) without checking anything about cleaning.
    Text: TypeAlias = str
else:

    class Text(str):
        """A string that came from a node: cleaned on decode, rendered as plain text."""

        __slots__ = ()


def clean_text(value: str, limit: int = MAX_LINE_CHARS) -> str:
    """Drop control characters (ESC, C1, bidi overrides, zero-width and other invisible ones) and clip to ``limit``.

    Removing ESC alone defuses every ANSI/OSC sequence: what remains (``[31m``)
    is harmless printable text, kept so an operator can see something was there.
    """
    if len(value) <= limit and value.isascii() and value.isprintable():
        return value  # printable ASCII holds no control character: nothing to drop
    if len(value) > limit:
        value = value[:limit] + "…"
    value = _WHITESPACE_CONTROL.sub(" ", value)
    return _CONTROL.sub("", value)


# --------------------------------------------------------------------------- data


class GpuInfo(msgspec.Struct, gc=False, kw_only=True):
    """Static facts about one GPU (``nvidia-smi -L``)."""

    index: int
    uuid: Text
    name: Text
    pci_bus_id: Text | None = None
    memory_total_mb: float | None = None
    serial: Text | None = None
    driver: Text | None = None  # nvmlSystemGetDriverVersion (dcgm's DCGM_FI_DRIVER_VERSION label)


class GpuSample(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """One reading of one GPU. ``None`` means N/A: not supported or not readable."""

    index: int
    util: float | None = None  # nvmlDeviceGetUtilizationRates().gpu, %
    mem_util: float | None = None  # nvmlDeviceGetUtilizationRates().memory, %
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    energy_j: float | None = None  # total since driver load
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    pcie_tx_kbs: float | None = None
    pcie_rx_kbs: float | None = None
    pcie_replay: int | None = None
    ecc_sbe: int | None = None  # volatile single-bit (corrected)
    ecc_dbe: int | None = None  # volatile double-bit (uncorrected)
    retired_pages: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    throttle: list[Text] = []  # active clock-throttle reasons, by name
    nvlink_errors: int | None = None
    procs: int | None = None  # compute processes holding the GPU
    state: Text = Text("ok")  # ok | lost (fell off the bus) | hung
    mem_temp_c: float | None = None  # NVML_FI_DEV_MEMORY_TEMP (HBM)
    enc_util: float | None = None  # nvmlDeviceGetEncoderUtilization, %
    dec_util: float | None = None  # nvmlDeviceGetDecoderUtilization, %
    mem_reserved_mb: float | None = None  # nvmlDeviceGetMemoryInfo_v2().reserved
    remapped_rows_correctable: int | None = None  # nvmlDeviceGetRemappedRows, rows
    remapped_rows_uncorrectable: int | None = None
    nvlink_bytes: float | None = None  # NVLink raw tx+rx bytes over all links since driver load
    vgpu_license_status: int | None = None  # 1 licensed vGPU guest, 0 otherwise (dcgm's value)
    # GPU Performance Monitoring (NVML GPM, Hopper and later): averages over the last tick.
    gr_engine_active: float | None = None  # ratio 0-1 (dcgm PROF_GR_ENGINE_ACTIVE)
    sm_active: float | None = None  # ratio 0-1
    sm_occupancy: float | None = None  # ratio 0-1
    tensor_active: float | None = None  # ratio 0-1, any tensor pipe
    dram_active: float | None = None  # ratio 0-1
    pcie_tx_bps: float | None = None  # bytes/s, headers and payload
    pcie_rx_bps: float | None = None
    nvlink_tx_bps: float | None = None  # bytes/s, all links
    nvlink_rx_bps: float | None = None
    # Per link, index = link id. For /metrics only: the agent leaves them out of the frames it sends
    # (18 links x 2 are 40 % of an 8-GPU sample, and no view shows them).
    nvlink_link_tx_bps: list[float | None] = []
    nvlink_link_rx_bps: list[float | None] = []


class NicSample(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    name: Text
    rx_bps: float = 0.0
    tx_bps: float = 0.0
    rx_errors: int = 0
    tx_errors: int = 0
    rx_drops: int = 0
    tx_drops: int = 0
    up: bool | None = None
    speed_mbps: float | None = None


class IbPortSample(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """One InfiniBand / RoCE HCA port (``ibstat``; ``/sys/class/infiniband/<device>/ports/<port>``).

    Only error counters that are not zero travel (``errors``), and only those that grew since the
    last sample (``deltas``): a healthy port costs a few dozen bytes. Every counter is on /metrics.
    """

    device: Text  # mlx5_0
    port: int
    state: Text | None = None  # ACTIVE | DOWN | INIT | ARMED | ACTIVE_DEFER
    phys_state: Text | None = None  # LinkUp | Polling | Disabled | ...
    rate_gbps: float | None = None  # 400 for "400 Gb/sec (4X NDR)"
    link_layer: Text | None = None  # InfiniBand | Ethernet (RoCE)
    rx_bps: float | None = None  # bytes/s, from port_rcv_data (counted in 4-byte words)
    tx_bps: float | None = None
    errors: dict[Text, int] = {}  # error counter -> value, non-zero ones only
    deltas: dict[Text, int] = {}  # error counter -> growth since the last sample, non-zero ones only
    saturated: list[Text] = []  # counters pinned at their maximum: they can no longer show news


class HostSample(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    cpu_percent: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    load1: float | None = None
    load5: float | None = None
    load15: float | None = None
    nics: list[NicSample] = []
    disk_read_bps: float | None = None
    disk_write_bps: float | None = None
    psi_cpu: float | None = None  # /proc/pressure/cpu some avg10
    psi_memory: float | None = None
    psi_io: float | None = None
    ib: list[IbPortSample] = []  # HCA ports; empty on a node without InfiniBand / RoCE


class AgentStats(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """The agent's own footprint, so the console can show that it is cheap."""

    cpu_percent: float | None = None
    rss_mb: float | None = None
    clients: int = 0
    dropped_frames: int = 0
    dropped_replies: int = 0  # replies a session that stopped reading never got (it was told, then closed)
    refused_requests: int = 0  # actions and searches refused for a key over its budget
    tick_ms: float | None = None


class StackFingerprint(msgspec.Struct, gc=False, kw_only=True):
    """The software a node runs; two nodes of one job should hash the same."""

    driver: Text | None = None
    cuda: Text | None = None
    nccl: Text | None = None
    kernel: Text | None = None
    python: Text | None = None
    packages: dict[Text, Text] = {}
    hash: Text = Text("")


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
    # Recent trainer events (nan_loss, loss_spike, straggler, checkpoint...), oldest
    # first, bounded; ``seq`` numbers them per trainer so a relay sends each once.
    events: list[Event] = []


# ------------------------------------------------------------------ agent → console


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


class StreamMode(StrEnum):
    """What a subscriber gets for each tick: the whole sample, or the few values the fleet view shows."""

    FULL = "full"
    SUMMARY = "summary"


GpuStateWord = Annotated[str, msgspec.Meta(pattern="^[a-z_]{1,32}$")]  # ok | lost | hung, and words to come


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
    # A word checked by the decoder itself (no per-GPU text hook); a state no console knows still decodes.
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
    rx_bps: float | None = None  # summed over the node's NICs
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

    def as_sample(self) -> Sample:
        """The summary read as a sample: what it does not carry is N/A (NICs as one summed entry)."""
        nics = [] if self.rx_bps is None else [NicSample(
            name=Text("all"), rx_bps=self.rx_bps, tx_bps=self.tx_bps or 0.0, rx_errors=self.nic_errors or 0)]
        host = HostSample(cpu_percent=self.cpu_percent, mem_used_mb=self.mem_used_mb, mem_total_mb=self.mem_total_mb, nics=nics)
        gpus = [GpuSample(index=g.index, util=g.util, temp_c=g.temp_c, power_w=g.power_w, mem_used_mb=g.mem_used_mb,
                          mem_total_mb=g.mem_total_mb, state=g.state, ecc_sbe=g.ecc_sbe, ecc_dbe=g.ecc_dbe,
                          remapped_rows_pending=g.remapped_rows_pending, remapped_rows_failed=g.remapped_rows_failed,
                          throttle=list(g.throttle)) for g in self.gpus]
        return Sample(gpus=gpus, host=host, trainer=self.trainer, isolated=self.isolated,
                      patrol_failing=self.patrol_failing, seq=self.seq, ts=self.ts, node=self.node, v=self.v)


def summarize(sample: Sample) -> Summary:
    """The summary of one sample, seq and time included."""
    host = sample.host
    trainer = sample.trainer
    if trainer is not None:
        trainer = TrainerStatus(job=trainer.job, phase=trainer.phase, step=trainer.step, loss=trainer.loss,
                                step_time_s=trainer.step_time_s, checkpoints=trainer.checkpoints,
                                world_size=trainer.world_size, paused=trainer.paused)
    nics = host.nics
    return Summary(
        gpus=[gpu_brief(g) for g in sample.gpus], cpu_percent=_rounded(host.cpu_percent),
        mem_used_mb=_rounded(host.mem_used_mb), mem_total_mb=_rounded(host.mem_total_mb),
        rx_bps=float(round(sum(n.rx_bps for n in nics))) if nics else None,
        tx_bps=float(round(sum(n.tx_bps for n in nics))) if nics else None,
        nic_errors=sum(n.rx_errors + n.tx_errors for n in nics) if nics else None,
        trainer=trainer, isolated=sample.isolated, patrol_failing=sample.patrol_failing,
        members=list(sample.trainer.membership) if sample.trainer is not None else None,
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
            from gridwatch.wire.xid import xid_resolution  # the catalogue imports this module

            self.resolution = Text(xid_resolution(self.code))


class LogLine(Frame, tag="log"):
    """A raw log line, sent only to clients that subscribed to logs."""

    source: Text
    line: Text
    line_ts: float = 0.0


class ResultCode(StrEnum):
    """Why an action failed, where a caller acts on the reason (the message is for people)."""

    TRAINER_ABSENT = "trainer_absent"  # no trainer listens on the node's control socket (yet): retry while it starts


class ActionResult(Frame, tag="action_result"):
    id: Text
    action: Text
    ok: bool
    message: Text = Text("")
    data: dict[Text, Any] = {}
    # A ResultCode's value. Text, not the enum, so a code a newer agent adds still decodes here.
    code: Text | None = None


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


# ------------------------------------------------------------------ console → agent


class Subscribe(Frame, tag="subscribe"):
    """Start (or resume) the stream; ``resume_from`` is the last seq the client has."""

    resume_from: int | None = None
    logs: bool = False  # stream raw log lines too (only for nodes the operator looks at)
    # Sent again on a live stream, these switch it without moving its place (logs too).
    mode: StreamMode = StreamMode.FULL  # an older console asks nothing and gets full samples, as before
    every: float = 0.0  # summary mode: at most one summary this many seconds (0: one per sample)
    watches: list[Watch] = []  # metric conditions the agent evaluates and reports (condition_held / _cleared)


class Watch(msgspec.Struct, gc=False, kw_only=True):
    """A metric condition for the agent to evaluate: ``metric op threshold`` held ``hold`` seconds. Data, never code.

    ``metric`` is one of :data:`WATCH_METRICS`; ``name`` (the playbook's) and the
    condition's text come back in the agent's events so the console knows what held.
    """

    name: Text
    metric: Text
    op: Text  # > >= < <= == !=
    threshold: float
    hold: float = 0.0


# The metrics an agent can evaluate, per GPU: metric name -> the GpuSample field it reads, or
# "throttle:WORD" for "a throttle reason naming WORD is active" (1 or 0). The playbooks' names.
WATCH_METRICS: dict[str, str] = {
    "gpu.temperature": "temp_c",
    "gpu.util": "util",
    "gpu.mem_util": "mem_util",
    "gpu.memory_used": "mem_used_mb",
    "gpu.power": "power_w",
    "gpu.sm_clock": "sm_clock_mhz",
    "gpu.mem_clock": "mem_clock_mhz",
    "gpu.pcie_replay": "pcie_replay",
    "gpu.ecc_sbe": "ecc_sbe",
    "gpu.ecc_dbe": "ecc_dbe",
    "gpu.retired_pages": "retired_pages",
    "gpu.nvlink_errors": "nvlink_errors",
    "gpu.throttle.thermal": "throttle:thermal",
    "gpu.throttle.power": "throttle:power",
}
WATCH_OPS: frozenset[str] = frozenset({">", ">=", "<", "<=", "==", "!="})
MAX_WATCHES = 64  # a console sends its playbooks' conditions: more than this is a bug, refused


class Behalf(msgspec.Struct, gc=False, kw_only=True):
    """Who a relay forwards a request for: the console key it accepted, and that key's role at the relay.

    An agent takes it only to lower what a request may do (the lesser of its caller's role and this one)
    and to budget each console behind a relay on its own; it never raises a caller's rights.
    """

    key: Text
    role: Text


class Action(Frame, tag="action"):
    """An operator action. Who asked is the key the agent accepted (and, behind a relay, ``behalf``)."""

    id: Text
    action: Text
    args: dict[Text, Any] = {}
    reason: Text = Text("")
    # The sending console's fencing token (its etcd lease's revision); None: a console alone, not fenced.
    # An agent refuses an acting request whose token is older than the newest it has seen.
    fence: int | None = None
    # A playbook step's idempotency key ("<incident>/<step index>"): a repeat is answered with the first outcome.
    key: Text | None = None
    behalf: Behalf | None = None  # set by a relay: the console key it forwards this for


class Search(Frame, tag="search"):
    id: Text
    pattern: Text  # a regular expression
    since: float | None = None
    until: float | None = None
    limit: int = 500
    behalf: Behalf | None = None  # set by a relay (see Action.behalf)


# ------------------------------------------------------------------ through a relay
# A relay (``gridwatch relay``, one per few hundred nodes) holds the links to its nodes and sends
# their frames to a console on one link, many to a write: the console pays one message per
# batch instead of one per node. Frames pass through it as each end encoded them (docs/protocol.md).


class RelayNode(msgspec.Struct, gc=False, kw_only=True):
    """One node a console asks a relay to carry, and where the console's copy of its stream stands."""

    endpoint: Text  # host:port, as the relay reaches the agent
    resume_from: int | None = None  # the last seq the console has of it (None: start live)
    read_from_start: bool = False  # the agent restarted: read its new boot from its first frame
    full: bool = False  # full samples (an operator has the node open)
    logs: bool = False


class RelaySubscribe(Frame, tag="relay_subscribe"):
    """Console -> relay, first: carry these nodes, with the stream each should send."""

    nodes: list[RelayNode] = []
    mode: StreamMode = StreamMode.SUMMARY
    every: float = 0.0  # summary mode: at most one summary per node this many seconds
    watches: list[Watch] = []
    # The longest a relay holds a node's frame to send it with others; events, answers and link
    # changes go at once.
    flush: float = 0.5


class Relayed(Frame, tag="relayed"):
    """Either way through a relay: one frame of the node at ``endpoint``, its JSON as that end wrote it."""

    endpoint: Text
    frame: msgspec.Raw


def relayed(endpoint: str, frame: Frame) -> Relayed:
    """``frame`` of (or for) the node at ``endpoint``, wrapped to pass through a relay as it was written."""
    return Relayed(endpoint=Text(endpoint), frame=msgspec.Raw(encode(frame)[:-1]))


class RelayLink(Frame, tag="relay_link"):
    """Relay -> console: the relay's link to one node changed (the words of the console's link states)."""

    endpoint: Text
    state: Text  # connecting, connected, stale, down, refused
    error: Text | None = None
    role: Text | None = None  # what the relay's key may do on that node


AgentFrame = Hello | Sample | Summary | Event | LogLine | ActionResult | SearchResult | Gap | Error | Relayed | RelayLink
ClientFrame = Subscribe | Action | Search | RelaySubscribe | Relayed
AnyFrame = AgentFrame | ClientFrame

FRAME_TYPES: frozenset[str] = frozenset(
    t.__struct_config__.tag for t in get_args(AnyFrame)
)

EVENT_KINDS: frozenset[str] = frozenset(
    {
        "xid",
        "ecc_sbe",
        "ecc_dbe",
        "row_remap_failure",
        "nvlink_error",
        "fell_off_bus",
        "gpu_hang",
        "thermal",
        "power_throttle",
        "nccl_error",
        "nccl_timeout",
        "traceback",
        "oom",
        "nan_loss",
        "cuda_error",
        "worker_failed",
        "loss_spike",
        "straggler",
        "trainer_exit",
        "trainer_left",
        "trainer_kept_out",  # an isolated node's trainer found in the job again, told to leave
        "trainer_restarted",
        "trainer_hang",
        "membership",
        "checkpoint",
        "isolated",
        "unisolated",
        "action",
        "patrol_failed",
        "patrol_recovered",
        "fault_injected",
        "source_failed",
        "source_recovered",
        # HCA ports (gridwatch/agent/sources/ib/).
        "ib_link_down",  # a port left ACTIVE, or its link_downed counter grew
        "ib_link_up",
        "ib_link_flap",  # down 25 s or more and back, three times (gpud's rule)
        "ib_errors",  # an error counter grows faster than the configured rate
        "ib_unreadable",  # a sysfs file of a port vanished or holds garbage
        # From the kernel and driver log (agents/detectors/kernel.py).
        "gsp_error",
        "nvswitch_sxid",
        "fabric_manager",
        "gpu_init_failure",
        "peermem_error",
        "nic_link_down",
        "pcie_aer",
        "edac_memory",
        "hung_task",
        "soft_lockup",
        "oom_killer",
        "kernel_panic",
        "disk_io_error",
        # A metric condition a console asked the agent to watch (Subscribe.watches).
        "condition_held",
        "condition_cleared",
    }
)

ACTIONS: frozenset[str] = frozenset(
    {
        "inject_fault",
        "clear_faults",
        "isolate",
        "unisolate",
        "reset_gpu",
        "checkpoint_now",
        "pause",
        "resume",
        "leave",
        "restart_from",
        "capture_scene",
        "preflight",
        "ping",
        "dump_collectives",
        "ras_status",
    }
)
# Actions a viewer may send: they read, they change nothing (a viewer's collective dump is shorter).
VIEWER_ACTIONS: frozenset[str] = frozenset({"ping", "preflight", "dump_collectives", "ras_status"})


# ------------------------------------------------------------------- encode/decode


class FrameError(ValueError):
    """A line that is not a frame we can use; ``code`` says why in one word."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# Short node text repeats in every frame (node names, GPU states, job and phase names): each is
# cleaned once and the same Text returned after. Bounded, so unique strings cannot grow it.
_TEXT_SEEN: dict[str, Any] = {}
_TEXT_SEEN_CHARS = 64
_TEXT_SEEN_MAX = 16_384


def text_dec_hook(type_: type, obj: Any) -> Any:
    """msgspec ``dec_hook`` that cleans every :class:`Text` field; for any decoder of node text.

    Every dict a node fills is keyed by :class:`Text` too, so keys pass through here as well.
    """
    if type_ is Text:
        cached = _TEXT_SEEN.get(obj) if isinstance(obj, str) else None
        if cached is not None:
            return cached
        if not isinstance(obj, str):
            raise msgspec.ValidationError(f"expected a string, got {type(obj).__name__}")
        text = Text(clean_text(obj))
        if len(obj) <= _TEXT_SEEN_CHARS and len(_TEXT_SEEN) < _TEXT_SEEN_MAX:
            _TEXT_SEEN[obj] = text
        return text
    raise NotImplementedError(f"unsupported type {type_!r}")


class _Envelope(msgspec.Struct):
    type: str = ""
    v: int = PROTOCOL_VERSION


def text_enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook`` that writes :class:`Text` as a plain string."""
    if isinstance(obj, str):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.json.Encoder(enc_hook=text_enc_hook)
_envelope = msgspec.json.Decoder(_Envelope)
_agent_decoder = msgspec.json.Decoder(AgentFrame, dec_hook=text_dec_hook)
_client_decoder = msgspec.json.Decoder(ClientFrame, dec_hook=text_dec_hook)
_any_decoder = msgspec.json.Decoder(AnyFrame, dec_hook=text_dec_hook)


def encode(frame: Frame) -> bytes:
    """One frame as one line of JSON, newline included."""
    return _encoder.encode(frame) + b"\n"


def _decode(line: bytes | str, decoder: msgspec.json.Decoder) -> Frame:
    if isinstance(line, str):
        line = line.encode("utf-8", "replace")
    if len(line) > MAX_FRAME_BYTES:
        raise FrameError("too_large", f"frame of {len(line)} bytes exceeds {MAX_FRAME_BYTES}")
    line = line.strip()
    if not line:
        raise FrameError("bad_frame", "empty line")
    try:
        return _decode_checked(line, decoder)
    except RecursionError:
        # JSON nested hundreds deep: refused like any bad frame, never a crash of the reader.
        raise FrameError("bad_frame", "a frame nested too deep") from None


def _decode_checked(line: bytes, decoder: msgspec.json.Decoder) -> Frame:
    try:
        frame: Frame = decoder.decode(line)
        # Free-form payloads are not typed field by field, so they are cleaned here.
        if isinstance(frame, ActionResult):
            frame.data = clean_any(frame.data)
        elif isinstance(frame, Action):
            frame.args = clean_any(frame.args)
    except msgspec.ValidationError as exc:
        try:
            env = _envelope.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise FrameError("bad_frame", f"not a frame: {clean_text(str(exc), 200)}") from None
        if env.type not in FRAME_TYPES:
            raise FrameError("unknown_type", f"unknown frame type {clean_text(env.type, 40)!r}") from None
        raise FrameError("bad_frame", f"invalid {clean_text(env.type, 40)} frame: {clean_text(str(exc), 200)}") from None
    except msgspec.DecodeError as exc:
        raise FrameError("bad_frame", f"malformed JSON: {clean_text(str(exc), 200)}") from None
    return frame


def clean_any(value: Any, depth: int = 0) -> Any:
    """Clean every string (keys included) inside a decoded JSON value.

    Raises :class:`FrameError` (``bad_frame``) past :data:`MAX_NESTING` levels.
    """
    if isinstance(value, str):
        return Text(clean_text(value))
    if isinstance(value, (dict, list)) and depth >= MAX_NESTING:
        raise FrameError("bad_frame", f"a frame nested deeper than {MAX_NESTING} levels")
    if isinstance(value, dict):
        return {Text(clean_text(str(k), 200)): clean_any(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_any(v, depth + 1) for v in value]
    return value


def as_builtins(obj: Any) -> Any:
    """Decoded frame data as plain builtins: frame text is a str subclass, which ``msgspec.convert`` refuses."""
    if isinstance(obj, dict):
        return {str(k): as_builtins(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_builtins(v) for v in obj]
    if isinstance(obj, str):
        return str(obj)
    return obj


def decode_agent_frame(line: bytes | str) -> Frame:
    """Decode a line an agent sent. Raises :class:`FrameError` with a one-line reason.

    A frame from a newer protocol version is decoded as far as we understand it
    (unknown fields are ignored); the caller may note the version once.
    """
    return _decode(line, _agent_decoder)


def decode_client_frame(line: bytes | str) -> Frame:
    """Decode a line a console sent to an agent."""
    return _decode(line, _client_decoder)


def decode_any_frame(line: bytes | str) -> Frame:
    """Decode any frame (used when replaying recorded traces)."""
    return _decode(line, _any_decoder)


def now() -> float:
    return time.time()
