"""What a sample carries: readings of a node's GPUs, host, NICs, HCA ports and agent, and its software stack.

A field the hardware cannot give is ``None`` (shown as N/A), never zero.
"""

from __future__ import annotations

import msgspec

from gridwatch.wire.text import Text


class GpuInfo(msgspec.Struct, gc=False, kw_only=True):
    """Static facts about one GPU (``nvidia-smi -L``)."""

    index: int
    uuid: Text
    name: Text
    pci_bus_id: Text | None = None
    memory_total_mb: float | None = None
    serial: Text | None = None
    driver: Text | None = None  # nvmlSystemGetDriverVersion (dcgm's DCGM_FI_DRIVER_VERSION label)


class GpuProcess(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """One compute process on a GPU (``nvidia-smi --query-compute-apps``): what nvitop lists per GPU.

    In full samples only (the node view's), never in summaries. Node text, cleaned and clipped.
    """

    pid: int
    user: Text = Text("")  # the owner's name (its uid where no name is known); empty: not readable
    used_mb: float | None = None  # GPU memory it holds, MiB; None: not readable (MIG without rights, WDDM)
    command: Text = Text("")  # its command line, clipped to ~120 characters; empty: not readable
    job: Text = Text("")  # the Slurm job id from its cgroup; empty: none known


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
    # The compute processes on it (at most 32), as nvitop shows them; empty where none or not readable.
    processes: list[GpuProcess] = []


class NicSample(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    name: Text
    rx_bps: float = 0.0
    tx_bps: float = 0.0
    rx_errors: int = 0
    tx_errors: int = 0
    rx_drops: int = 0
    tx_drops: int = 0
    up: bool | None = None  # link state and speed: read every 10th tick (the agent's NIC_STATS_EVERY), the rest each tick
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


class SchedulerJob(msgspec.Struct, gc=False, kw_only=True, omit_defaults=True):
    """A scheduler job with processes on the node (gridwatch/agent/jobs.py): what ``squeue`` would show."""

    scheduler: Text  # slurm | kubernetes
    id: Text  # the Slurm job id, or the pod's uid
    user: Text = Text("")
    name: Text = Text("")
    nodes: Text = Text("")  # the job's nodes, as the scheduler writes them (node-[1-3]); empty: not known here
    pids: int = 0  # how many of its processes run on this node
    restarts: int = 0  # Slurm: how often it was requeued (SLURM_RESTART_COUNT); each is a new life of the job

    def job_name(self) -> str:
        """What a trainer status read from this job's log names it (``slurm-42``): one spelling for both ends."""
        return f"{self.scheduler}-{self.id}"


class StackFingerprint(msgspec.Struct, gc=False, kw_only=True):
    """The software a node runs; two nodes of one job should hash the same."""

    driver: Text | None = None
    cuda: Text | None = None
    nccl: Text | None = None
    kernel: Text | None = None
    python: Text | None = None
    packages: dict[Text, Text] = {}
    hash: Text = Text("")

