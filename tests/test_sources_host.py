"""Host source: real psutil readings, rates from counter deltas, PSI where the kernel has it."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from gridwatch.agent.sources.host import HostSource

Counters = namedtuple("Counters", "bytes_sent bytes_recv packets_sent packets_recv errin errout dropin dropout")


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


def test_nic_rates_are_bytes_per_second_over_the_injected_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = {"eth0": Counters(1_000, 2_000, 0, 0, 0, 0, 0, 0)}
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False: dict(counters))
    clock = Clock()
    host = HostSource(clock=clock)
    counters["eth0"] = Counters(1_000 + 20_000_000, 2_000 + 10_000_000, 0, 0, 3, 1, 7, 0)
    clock.t += 2.0
    (nic,) = host.sample().nics
    assert (nic.name, nic.tx_bps, nic.rx_bps) == ("eth0", 10_000_000, 5_000_000)
    assert (nic.rx_errors, nic.tx_errors, nic.rx_drops) == (3, 1, 7)
    counters["eth0"] = Counters(5, 5, 0, 0, 3, 1, 7, 0)  # reset by a driver reload
    clock.t += 1.0
    (nic,) = host.sample().nics
    assert nic.tx_bps == 0 and nic.rx_bps == 0


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
