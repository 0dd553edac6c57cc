"""Host source: real /proc readings (psutil's figures), rates from counter deltas, PSI where the kernel has it."""

from __future__ import annotations

from pathlib import Path

import psutil

from gridwatch.agent.sources.host import HostSource, nic_links


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def test_real_host_reads_sensible_values() -> None:
    sample = HostSource().sample()
    assert sample.cpu_percent is None or 0 <= sample.cpu_percent <= 100
    assert 0 < sample.mem_used_mb < sample.mem_total_mb
    assert sample.load1 is not None and sample.load1 >= 0
    assert all(nic.name != "lo" for nic in sample.nics)


def _net_dev(root: Path, rows: dict[str, tuple[int, ...]]) -> None:
    """``/proc/net/dev`` as the kernel writes it; each row: rx bytes packets errs drop, tx bytes packets errs drop."""
    head = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
            "carrier compressed\n")
    lines = [f"{name:>6}: {rx[0]} {rx[1]} {rx[2]} {rx[3]} 0 0 0 0 {rx[4]} {rx[5]} {rx[6]} {rx[7]} 0 0 0 0"
             for name, rx in rows.items()]
    (root / "net").mkdir(exist_ok=True)
    (root / "net" / "dev").write_text(head + "\n".join(lines) + "\n")


def test_nic_rates_are_bytes_per_second_over_the_injected_clock(tmp_path: Path) -> None:
    _net_dev(tmp_path, {"lo": (9, 9, 0, 0, 9, 9, 0, 0), "eth0": (2_000, 0, 0, 0, 1_000, 0, 0, 0)})
    clock = Clock()
    host = HostSource(clock=clock, proc=str(tmp_path))
    _net_dev(tmp_path, {"lo": (9, 9, 0, 0, 9, 9, 0, 0), "eth0": (2_000 + 10_000_000, 0, 3, 7, 1_000 + 20_000_000, 0, 1, 0)})
    clock.t += 2.0
    (nic,) = host.sample().nics
    assert (nic.name, nic.tx_bps, nic.rx_bps) == ("eth0", 10_000_000, 5_000_000)
    assert (nic.rx_errors, nic.tx_errors, nic.rx_drops) == (3, 1, 7)
    # Reset by a driver reload: as psutil's nowrap counted it, the totals carry on from where they were and
    # the rate is what was counted since the reset.
    _net_dev(tmp_path, {"eth0": (5, 0, 1, 0, 5, 0, 0, 0)})
    clock.t += 1.0
    (nic,) = host.sample().nics
    assert (nic.tx_bps, nic.rx_bps) == (5, 5)
    assert (nic.rx_errors, nic.tx_errors, nic.rx_drops) == (4, 1, 7)
    _net_dev(tmp_path, {"eth0": (105, 0, 1, 0, 5, 0, 0, 0)})
    clock.t += 1.0
    (nic,) = host.sample().nics
    assert (nic.tx_bps, nic.rx_bps, nic.rx_errors) == (0, 100, 4)


def test_the_host_reads_what_psutil_read() -> None:
    """The figures read from /proc directly are psutil's, field for field (what the agent sent before)."""
    host = HostSource()
    sample = host.sample()
    mem = psutil.virtual_memory()
    assert sample.mem_total_mb == mem.total / 2**20
    assert sample.mem_used_mb is not None and abs(sample.mem_used_mb - (mem.total - mem.available) / 2**20) < 64
    ours = {n.name: (n.rx_errors, n.tx_errors, n.rx_drops, n.tx_drops) for n in sample.nics}
    theirs = {name: (c.errin, c.errout, c.dropin, c.dropout)
              for name, c in psutil.net_io_counters(pernic=True).items() if name != "lo"}
    assert ours.keys() == theirs.keys() and ours == theirs


def test_cpu_percent_is_the_busy_share_of_the_ticks_between_two_readings(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 100 0 100 800 0 0 0 0 0 0\n")
    host = HostSource(proc=str(tmp_path))
    # 300 more ticks, 60 of them idle and 30 waiting on I/O; guest time (counted inside user) left out.
    stat.write_text("cpu  250 10 150 860 30 0 0 0 40 0\ncpu0 250 10 150 860 30 0 0 0 40 0\n")
    assert host.sample().cpu_percent == 70.0
    # No tick of /proc/stat passed between two readings (a tick catching up after a hung source): the last
    # figure stands, not N/A nor 0, and the next reading is measured from the baseline before it.
    assert host.sample().cpu_percent == 70.0
    stat.write_text("cpu  260 10 160 940 30 0 0 0 40 0\ncpu0 260 10 160 940 30 0 0 0 40 0\n")
    assert host.sample().cpu_percent == 20.0
    fresh = HostSource(proc=str(tmp_path))
    assert fresh.sample().cpu_percent is None  # nothing measured yet: N/A


def test_memory_is_total_less_available_and_a_containers_view_falls_back_to_free(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2097152 kB\nMemFree:         524288 kB\nMemAvailable:   1048576 kB\n")
    host = HostSource(proc=str(tmp_path))
    assert (host.sample().mem_total_mb, host.sample().mem_used_mb) == (2048, 1024)
    meminfo.write_text("MemTotal:       2097152 kB\nMemFree:         524288 kB\nMemAvailable:   9999999 kB\n")
    assert host.sample().mem_used_mb == 1536  # MemAvailable above MemTotal (LXC): MemFree, as psutil and free take it
    meminfo.write_text("")
    assert host.sample().mem_total_mb is None


def test_a_held_proc_file_reads_what_is_there_now(tmp_path: Path) -> None:
    from gridwatch.agent.sources.procfs import ProcFile

    path = tmp_path / "loadavg"
    held = ProcFile(str(path))
    assert held.read() is None  # absent: N/A, and looked for again next time
    path.write_text("0.50 0.40 0.30 1/100 42\n")
    assert held.read() == b"0.50 0.40 0.30 1/100 42\n"
    path.write_text("1.25 0.40 0.30 1/100 42\n" + "x" * 200_000)  # rewritten in place, past one read's chunk
    data = held.read()
    assert data is not None and data.startswith(b"1.25") and len(data) == 24 + 200_000
    held.close()


def test_psi_is_read_where_present_and_na_where_not(tmp_path: Path) -> None:
    pressure = tmp_path / "pressure"
    pressure.mkdir()
    (pressure / "cpu").write_text("some avg10=1.25 avg60=0.50 avg300=0.10 total=12345\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (pressure / "io").write_text("some avg10=7.50 avg60=2.00 avg300=1.00 total=999\n")
    sample = HostSource(proc=str(tmp_path)).sample()
    assert (sample.psi_cpu, sample.psi_io, sample.psi_memory) == (1.25, 7.5, None)
    assert HostSource(proc=str(tmp_path / "old-kernel")).sample().psi_cpu is None


def test_disk_rates_count_whole_disks_not_their_partitions_twice(tmp_path: Path) -> None:
    for disk in ("nvme0n1", "sda", "loop0"):
        (tmp_path / "block" / disk).mkdir(parents=True)
    stats = tmp_path / "diskstats"

    def write(sectors_read: int, sectors_written: int) -> None:
        rows = [
            f"259 0 nvme0n1 10 0 {sectors_read} 5 20 0 {sectors_written} 9 0 0 0",
            f"259 1 nvme0n1p1 10 0 {sectors_read} 5 20 0 {sectors_written} 9 0 0 0",
            "8 0 sda 1 0 0 0 1 0 0 0 0 0 0",
            "7 0 loop0 1 0 999999 0 1 0 999999 0 0 0 0",
        ]
        stats.write_text("\n".join(rows) + "\n")

    write(0, 0)
    clock = Clock()
    host = HostSource(clock=clock, proc=str(tmp_path), sys_root=str(tmp_path))
    write(2048, 4096)  # 1 MiB read, 2 MiB written
    clock.t += 2.0
    sample = host.sample()
    assert (sample.disk_read_bps, sample.disk_write_bps) == (512 * 1024, 1024 * 1024)


def test_the_agents_footprint_is_its_cpu_share_of_one_core_over_the_injected_clock(tmp_path: Path) -> None:
    import os

    from gridwatch.agent.footprint import Footprint

    clock, spent = Clock(), [1.0, 0.5]  # user, system seconds

    def times() -> os.times_result:
        return os.times_result((spent[0], spent[1], 0.0, 0.0, 0.0))

    statm = tmp_path / "statm"
    statm.write_text(f"1000 {64 * 2**20 // os.sysconf('SC_PAGE_SIZE')} 10 1 0 20 0\n")
    own = Footprint(monotonic=clock, times=times, statm=str(statm))
    clock.t += 2.0
    spent[0] += 0.2  # 0.25 s of CPU in 2 s: 12.5 % of a core
    spent[1] += 0.05
    assert own.cpu_percent() == 12.5
    assert own.cpu_percent() == 0.0  # no time passed: 0, as psutil said it
    clock.t += 1.0
    spent[0] += 1.5  # threads on two cores at once: more than one core
    assert own.cpu_percent() == 150.0
    assert own.rss_mb() == 64
    statm.unlink()
    own.close()
    assert own.rss_mb() is None


def test_the_agents_footprint_reads_what_psutil_read() -> None:
    from gridwatch.agent.footprint import Footprint

    rss = Footprint().rss_mb()
    assert rss is not None and abs(rss - psutil.Process().memory_info().rss / 2**20) < 8


def _nic(net: Path, name: str, operstate: str, speed: str | None) -> None:
    (net / name).mkdir(parents=True)
    (net / name / "operstate").write_text(operstate + "\n")
    if speed is not None:
        (net / name / "speed").write_text(speed + "\n")


def test_nic_state_and_speed_come_from_sys_class_net(tmp_path: Path) -> None:
    """Laid out as /sys/class/net: a 400G port up, one down (its speed unreadable), a loopback with no operstate of
    its own (unknown: up, as the kernel counts it running), a virtual NIC whose speed the kernel does not know."""
    net = tmp_path / "sys" / "class" / "net"
    _nic(net, "ib0", "up", "400000")
    _nic(net, "eth1", "down", None)
    _nic(net, "lo", "unknown", None)
    _nic(net, "veth9", "up", "-1")
    assert nic_links(net) == {"ib0": (True, 400000.0), "eth1": (False, None), "lo": (True, None),
                              "veth9": (True, None)}
    assert nic_links(tmp_path / "nowhere") == {}
    _net_dev(tmp_path, {"ib0": (1, 0, 0, 0, 1, 0, 0, 0), "eth1": (1, 0, 0, 0, 1, 0, 0, 0)})
    host = HostSource(proc=str(tmp_path), sys_root=str(tmp_path / "sys"))
    assert {n.name: (n.up, n.speed_mbps) for n in host.sample().nics} == {"ib0": (True, 400000.0),
                                                                          "eth1": (False, None)}


def test_nic_links_say_what_psutil_said_on_this_machine() -> None:
    """The files read the same state and speed as psutil's ioctls did (what the agent sent before)."""
    ours = nic_links(Path("/sys/class/net"))
    theirs = {name: (s.isup, float(s.speed) if s.speed > 0 else None) for name, s in psutil.net_if_stats().items()}
    assert ours == theirs
