"""Simulated GPUs: deterministic for a seed, plausible under load, and faults that show."""

from __future__ import annotations

import pytest

from gridwatch.agent.sources.simulated import HANG_TICKS, SimulatedGpus


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _run(seed: int, ticks: int) -> list:
    clock = Clock()
    gpus = SimulatedGpus(8, seed=seed, clock=clock)
    out = []
    for _ in range(ticks):
        out.append(gpus.sample())
        clock.t += 1.0
    return [gpus.info(), out]


def test_same_seed_same_readings_and_another_seed_differs() -> None:
    assert _run(42, 20) == _run(42, 20)
    assert _run(42, 20) != _run(43, 20)


def test_readings_look_like_an_h100_under_training_load() -> None:
    clock = Clock()
    gpus = SimulatedGpus(8, seed=1, clock=clock)
    readings = []
    for _ in range(200):
        readings += gpus.sample()
        clock.t += 1.0
    utils = sorted(s.util for s in readings)
    assert utils[len(utils) // 2] >= 93  # busy most of the time ...
    assert utils[0] < 90  # ... with the odd dip
    assert all(55 <= s.temp_c <= 76 for s in readings)
    busy = [s for s in readings if s.util >= 90]
    assert all(500 <= s.power_w <= 700 for s in busy)
    assert all(60_000 < s.mem_used_mb < s.mem_total_mb for s in readings)
    gpu0 = [s.energy_j for s in readings if s.index == 0]
    assert gpu0 == sorted(gpu0) and gpu0[-1] > gpu0[0]
    assert all(s.ecc_dbe == 0 and s.throttle == [] and s.state == "ok" for s in readings)
    assert len({i.uuid for i in gpus.info()}) == 8 and len({i.pci_bus_id for i in gpus.info()}) == 8


def test_thermal_fault_shows_over_90c_a_throttle_reason_and_lower_clocks() -> None:
    gpus = SimulatedGpus(2, seed=3)
    before = gpus.sample()[1]
    assert gpus.inject("thermal", 1) == "GPU 1: thermal throttling"
    hot = gpus.sample()
    assert hot[1].temp_c > 90 and "hw_thermal" in hot[1].throttle
    assert hot[1].sm_clock_mhz < before.sm_clock_mhz
    assert hot[0].temp_c < 80 and hot[0].throttle == []
    assert [(e.kind, e.gpu) for e in gpus.poll_events()] == [("thermal", 1)]
    gpus.clear_faults()
    assert gpus.sample()[1].temp_c < 80


def test_fell_off_bus_reads_na_everywhere_and_emits_xid_79() -> None:
    gpus = SimulatedGpus(2, seed=3)
    gpus.inject("fell-off-bus", 0)
    lost = gpus.sample()[0]
    assert lost.state == "lost" and lost.util is None and lost.power_w is None and lost.energy_j is None
    events = gpus.poll_events()
    assert sorted((e.kind, e.code) for e in events) == [("fell_off_bus", None), ("xid", 79)]
    gpus.inject("xid", 0, 79)  # already lost: nothing new to say
    assert gpus.poll_events() == []


def test_xid_ecc_and_hang_faults() -> None:
    gpus = SimulatedGpus(4, seed=5)
    gpus.inject("xid", 2, 13)
    gpus.inject("ecc_dbe", 3)
    (xid, dbe) = gpus.poll_events()
    assert (xid.kind, xid.code, xid.gpu, xid.severity) == ("xid", 13, 2, "warning")
    assert (dbe.kind, dbe.gpu, dbe.severity) == ("ecc_dbe", 3, "critical")
    assert gpus.sample()[3].ecc_dbe == 1
    gpus.inject("hang", 1)
    readings = [gpus.sample()[1] for _ in range(HANG_TICKS + 2)]
    assert all(r.util == 100 for r in readings) and len({r.power_w for r in readings}) == 1
    assert [e.kind for e in gpus.poll_events()] == ["gpu_hang"]
    assert readings[-1].state == "hung"


@pytest.mark.parametrize(
    ("kind", "gpu", "code", "message"),
    [("melt", 0, None, "unknown fault 'melt'"), ("thermal", 9, None, "no GPU 9"), ("xid", 0, None, "needs a code")],
)
def test_bad_injections_say_what_is_wrong(kind: str, gpu: int, code: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimulatedGpus(2).inject(kind, gpu, code)
