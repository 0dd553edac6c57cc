"""HCA ports: read from real sysfs trees, judged between samples, exported as node_exporter does, shown, acted on."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
from pathlib import Path

import msgspec
import pytest

from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig, ConfigError, load
from gridwatch.agent.metrics import MetricsExporter
from gridwatch.agent.sources.ib.judge import IbJudge, IbThresholds
from gridwatch.agent.sources.ib.ports import IbPort, Unreadable
from gridwatch.agent.sources.ib.simulated import SimulatedHcas
from gridwatch.agent.sources.ib.source import IbSource, open_ib_source
from gridwatch.agent.sources.ib.sysfs import SysfsPorts, parse_id_name, parse_rate
from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent, wait_until
from tests.support_stream import make_fleet, of_type

DATA = Path(__file__).parent / "data" / "sysfs"  # real trees; where each comes from: SOURCE.md there
H100 = DATA / "gpud-h100"
NODE_EXPORTER = DATA / "node_exporter" / "infiniband"


class Clock:
    """Seconds that a test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tree(tmp_path: Path) -> Path:
    """A writable copy of the real H100 tree."""
    root = tmp_path / "infiniband"
    shutil.copytree(H100, root)
    return root


def write(root: Path, rel: str, text: str | bytes) -> None:
    path = root / "mlx5_0" / "ports" / "1" / rel
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def bump(root: Path, rel: str, by: int, device: str = "mlx5_0") -> None:
    path = root / device / "ports" / "1" / rel
    path.write_text(str(int(path.read_text()) + by))


def source(root: Path, clock: Clock, **thresholds: float) -> IbSource:
    return IbSource(SysfsPorts(str(root)), IbJudge(IbThresholds(**thresholds), clock=clock, wall=clock))  # type: ignore[arg-type]


def kinds(events: list[p.Event]) -> list[str]:
    return [str(e.kind) for e in events]


# ---------------------------------------------------------------- reading real trees


def test_an_h100_node_reads_eight_ndr_ports_and_a_roce_bond() -> None:
    ports, bad = SysfsPorts(str(H100)).read_ports()
    assert bad == []
    assert [p_.device for p_ in ports] == ["mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8",
                                           "mlx5_9", "mlx5_bond_0"]
    first = ports[0]
    assert (first.state_id, first.state, first.phys_state_id, first.phys_state) == (4, "ACTIVE", 5, "LinkUp")
    assert first.rate_gbps == 400.0 and first.link_layer == "InfiniBand"
    assert first.counter("port_rcv_data") is not None and first.counter("rnr_nak_retry_err") is not None
    assert len(first.counters) == 21 and len(first.hw_counters) == 26
    bond = ports[-1]
    assert bond.link_layer == "Ethernet" and bond.rate_gbps == 200.0  # RoCE


def test_the_wire_sample_carries_only_non_zero_errors_and_names_a_pinned_counter() -> None:
    reading = IbSource(SysfsPorts(str(H100))).read()
    assert reading.events == []  # the first reading is the baseline
    mlx5_1 = next(s for s in reading.ib if s.device == "mlx5_1")
    # mlx5_1's link_downed reads 255 in this real tree: the 8-bit counter is pinned and cannot count on.
    assert mlx5_1.errors["link_downed"] == 255 and "link_downed" in mlx5_1.saturated
    assert all(v > 0 for s in reading.ib for v in s.errors.values())
    # A healthy port is small on the wire: eight of them stay far under the 3.5 KB of a sample.
    encoder = msgspec.json.Encoder(enc_hook=p.text_enc_hook)
    assert sum(len(encoder.encode(s)) for s in reading.ib) < 2500


def test_counters_a_device_does_not_keep_are_na_not_garbage() -> None:
    """i40iw (iWARP) answers "N/A (no PMA)" in every counter file: N/A, and no event about it."""
    reading = IbSource(SysfsPorts(str(NODE_EXPORTER))).read()
    i40iw = next(s for s in reading.ib if s.device == "i40iw0")
    assert reading.events == [] and i40iw.errors == {} and i40iw.state == "ACTIVE" and i40iw.rate_gbps == 10.0


@pytest.mark.parametrize("text, gbps", [("400 Gb/sec (4X NDR)", 400.0), ("2.5 Gb/sec (1X SDR)", 2.5),
                                        ("200 Gb/sec (2X NDR)", 200.0), ("10 Gb/sec (4X)", 10.0), ("fast", None)])
def test_rates_as_sysfs_writes_them(text: str, gbps: float | None) -> None:
    assert parse_rate(text) == gbps


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("node_infiniband_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_match_node_exporter_on_its_own_fixture() -> None:
    """node_exporter's expected output for this tree (its e2e-output.txt, kept beside the tree)."""
    metrics = MetricsExporter()
    metrics.infiniband = IbSource(SysfsPorts(str(NODE_EXPORTER)))
    metrics.infiniband.read()
    ours = _samples(metrics.render().decode())
    theirs = _samples((DATA / "node_exporter" / "e2e-output-infiniband.txt").read_text())
    assert {k: ours.get(k) for k in theirs} == theirs
    assert set(ours) == set(theirs)  # and nothing they leave out (the i40iw's N/A counters)


def test_metrics_of_an_h100_carry_hw_counters_and_bytes_not_words() -> None:
    metrics = MetricsExporter()
    metrics.infiniband = IbSource(SysfsPorts(str(H100)))
    metrics.infiniband.read()
    ours = _samples(metrics.render().decode())
    words = int((H100 / "mlx5_0/ports/1/counters/port_rcv_data").read_text())
    assert ours['node_infiniband_port_data_received_bytes_total{device="mlx5_0",port="1"}'] == words * 4
    assert ours['node_infiniband_link_downed_total{device="mlx5_1",port="1"}'] == 255
    assert ours['node_infiniband_rate_bytes_per_second{device="mlx5_0",port="1"}'] == 50e9
    assert 'node_infiniband_rnr_nak_retry_packets_received_total{device="mlx5_0",port="1"}' in ours


# ---------------------------------------------------------------- judging


def test_any_link_downed_increment_is_fatal_and_names_the_port(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    src.read()
    clock.now += 1
    bump(root, "counters/link_downed", 1)
    reading = src.read()
    assert kinds(reading.events) == ["ib_link_down"]
    ev = reading.events[0]
    assert ev.severity == "critical"
    assert {k: ev.details[k] for k in ("device", "port", "counter", "delta", "link_layer")} == {
        "device": "mlx5_0", "port": "1", "counter": "link_downed", "delta": "1", "link_layer": "InfiniBand"}
    assert next(s for s in reading.ib if s.device == "mlx5_0").deltas == {"link_downed": 1}


def test_a_port_leaving_active_is_an_event_and_coming_back_is_another(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    src.read()
    clock.now += 1
    write(root, "state", "1: DOWN")
    write(root, "phys_state", "2: Polling")
    down = src.read()
    assert kinds(down.events) == ["ib_link_down"] and "DOWN (Polling)" in down.events[0].message
    assert down.ib[0].state == "DOWN" and down.ib[0].phys_state == "Polling"
    clock.now += 1
    assert src.read().events == []  # still down: not news again
    clock.now += 1
    write(root, "state", "4: ACTIVE")
    assert kinds(src.read().events) == ["ib_link_up"]


def test_error_rate_over_the_threshold_is_degraded_once_per_streak(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock, error_rate=10.0)
    src.read()
    clock.now += 2
    bump(root, "counters/symbol_error", 10)  # 5/s: under
    assert src.read().events == []
    clock.now += 2
    bump(root, "counters/symbol_error", 60)  # 30/s
    bump(root, "hw_counters/rnr_nak_retry_err", 3)
    reading = src.read()
    assert kinds(reading.events) == ["ib_errors"]
    ev = reading.events[0]
    assert ev.severity == "warning" and ev.details["counter"] == "symbol_error" and ev.details["delta"] == "60"
    assert ev.details["rate"] == "30" and "rnr_nak_retry_err +3" in ev.message
    clock.now += 2
    bump(root, "counters/symbol_error", 60)
    assert src.read().events == []  # the same streak
    clock.now += 2
    assert src.read().events == []  # quiet again
    clock.now += 2
    bump(root, "counters/symbol_error", 60)
    assert kinds(src.read().events) == ["ib_errors"]  # a new streak


def test_unchanged_error_counters_are_judged_from_the_last_reading_as_a_full_walk_would(tmp_path: Path) -> None:
    """A port whose error counters did not move since the last reading is judged from memory: the same
    errors and pinned counters travel, no delta, and the next move is a delta (and news) as before."""
    root, clock = tree(tmp_path), Clock()
    write(root, "counters/symbol_error", "7")
    write(root, "counters/link_error_recovery", "255")  # 8 bits: pinned
    src = source(root, clock, error_rate=10.0)
    first = src.read().ib[0]
    assert first.errors["symbol_error"] == 7 and "link_error_recovery" in first.saturated
    for _ in range(3):  # traffic moves, errors do not
        clock.now += 1
        bump(root, "counters/port_rcv_data", 1000)
        reading = src.read()
        port = reading.ib[0]
        assert (port.errors, port.saturated, port.deltas) == (first.errors, first.saturated, {})
        assert reading.events == [] and port.rx_bps == 4000.0
        port.errors[p.Text("symbol_error")] = 0  # a sample is the wire's: changing it changes nothing judged
    clock.now += 1
    bump(root, "counters/symbol_error", 40)
    reading = src.read()
    assert reading.ib[0].deltas == {"symbol_error": 40} and reading.ib[0].errors["symbol_error"] == 47
    assert kinds(reading.events) == ["ib_errors"]
    clock.now += 1
    quiet = src.read()
    assert quiet.ib[0].deltas == {} and quiet.ib[0].errors["symbol_error"] == 47 and quiet.events == []
    clock.now += 1
    bump(root, "counters/link_downed", 1)  # an error counter too: news the same tick, from memory or not
    assert kinds(src.read().events) == ["ib_link_down"]
    clock.now += 1
    bump(root, "counters/symbol_error", 40)
    assert kinds(src.read().events) == ["ib_errors"]  # quiet in between: a new streak


def test_traffic_is_bytes_per_second_from_four_byte_words(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    src.read()
    clock.now += 2
    bump(root, "counters/port_rcv_data", 1000)
    bump(root, "counters/port_xmit_data", 500)
    port = src.read().ib[0]
    assert (port.rx_bps, port.tx_bps) == (2000.0, 1000.0)


def test_a_cleared_counter_is_a_new_baseline_not_a_huge_negative_delta(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    write(root, "counters/symbol_error", "40000")
    write(root, "counters/port_rcv_data", "123456789")
    src = source(root, clock, error_rate=100.0)
    src.read()
    clock.now += 1
    write(root, "counters/symbol_error", "3")  # perfquery -R: cleared, then 3 more
    write(root, "counters/port_rcv_data", "10")
    reading = src.read()
    assert reading.events == [] and reading.ib[0].deltas == {"symbol_error": 3}
    assert reading.ib[0].rx_bps == 40.0


def _flap_states(src: IbSource, root: Path, clock: Clock, plan: list[tuple[str, float]], step: float = 5.0) -> list[str]:
    """Hold each state for its seconds, reading every ``step`` s; the kinds of every event seen."""
    seen: list[str] = []
    for state, seconds in plan:
        write(root, "state", "4: ACTIVE" if state == "up" else "1: DOWN")
        held = 0.0
        while held < seconds:
            seen += kinds(src.read().events)
            clock.now += step
            held += step
    return seen


def test_a_flap_is_down_25_s_or_more_and_back_three_times_as_gpud_counts(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    long_down = [("down", 30.0), ("up", 60.0)]
    seen = _flap_states(src, root, clock, [("up", 10.0)] + long_down * 2)
    assert "ib_link_flap" not in seen  # two are not yet a flap
    seen = _flap_states(src, root, clock, long_down)
    assert seen.count("ib_link_flap") == 1
    assert "ib_link_flap" not in _flap_states(src, root, clock, [("up", 60.0)])  # reported once


def test_short_dips_are_not_flaps(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    seen = _flap_states(src, root, clock, [("up", 10.0)] + [("down", 20.0), ("up", 30.0)] * 5)
    assert seen.count("ib_link_down") == 5 and seen.count("ib_link_up") == 5 and "ib_link_flap" not in seen


def test_flaps_older_than_the_window_do_not_count(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock, flap_window_s=600.0)
    seen = _flap_states(src, root, clock, [("up", 10.0), ("down", 30.0), ("up", 60.0), ("down", 30.0), ("up", 700.0),
                                           ("down", 30.0), ("up", 10.0)])
    assert "ib_link_flap" not in seen


# ---------------------------------------------------------------- bad input


def test_a_vanished_file_is_an_event_once_and_the_rest_still_reads(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    (root / "mlx5_0/ports/1/rate").unlink()
    reading = src.read()
    assert kinds(reading.events) == ["ib_unreadable"] and "vanished" in reading.events[0].message
    port = reading.ib[0]
    assert port.rate_gbps is None and port.state == "ACTIVE" and len(reading.ib) == 9
    clock.now += 1
    assert src.read().events == []  # once per streak


def test_an_hca_that_leaves_sysfs_is_a_link_down_said_once(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    src.read()
    shutil.rmtree(root / "mlx5_9")
    clock.now += 1
    reading = src.read()
    assert kinds(reading.events) == ["ib_link_down"] and "no longer listed" in reading.events[0].message
    assert reading.events[0].details["device"] == "mlx5_9" and len(reading.ib) == 8
    clock.now += 1
    assert src.read().events == []


@pytest.mark.parametrize("garbage", [b"\x00\xff\xfe", b"banana", b"9" * 5000, b"\x1b[31mACTIVE", b""])
def test_garbage_in_any_file_is_na_and_an_event_never_a_crash(tmp_path: Path, garbage: bytes) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    for rel in ("state", "phys_state", "rate", "counters/link_downed", "hw_counters/out_of_sequence"):
        write(root, rel, garbage)
    reading = src.read()
    assert {e.kind for e in reading.events} == {"ib_unreadable"} and len(reading.events) == 5
    port = reading.ib[0]
    assert port.state is None and port.rate_gbps is None and "link_downed" not in port.errors
    assert all("\x1b" not in e.message for e in reading.events)


def test_random_bytes_in_every_file_never_raise(tmp_path: Path) -> None:
    root, clock = tree(tmp_path), Clock()
    src = source(root, clock)
    rng = random.Random(13)
    files = sorted(f for f in root.rglob("*") if f.is_file())
    for _ in range(12):
        for f in rng.sample(files, 40):
            f.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(12))))
        clock.now += 1
        src.read()  # raises nothing, whatever the files hold


def test_every_real_value_cut_at_every_position_parses_or_is_none() -> None:
    values = {(f.parent.name, f.read_text()) for f in H100.rglob("*") if f.is_file() and f.name in
              ("state", "phys_state", "rate", "link_layer")}
    for _, value in sorted(values):
        for cut in range(len(value) + 1):
            parse_rate(value[:cut])
            parse_id_name(value[:cut])


async def test_a_file_that_blocks_holds_up_this_source_alone(tmp_path: Path) -> None:
    root = tree(tmp_path)
    fifo = root / "mlx5_4/ports/1/state"
    fifo.unlink()
    os.mkfifo(fifo)  # opening it blocks until a writer comes, as a wedged driver read would
    config = AgentConfig(node_name="node-ib", listen="127.0.0.1:0", source_timeout=0.3)
    from gridwatch.agent.sources.simulated import SimulatedGpus

    agent = Agent(config, gpus=SimulatedGpus(2, seed=1), infiniband=IbSource(SysfsPorts(str(root))))
    try:
        await agent.tick_async()
        frames = [p.decode_agent_frame(f) for f in agent.ring.since(0)[0]]
        sample = next(f for f in frames if isinstance(f, p.Sample))
        assert len(sample.gpus) == 2 and sample.host.ib == []
        hung = [f for f in frames if isinstance(f, p.Event) and f.kind == "source_failed"]
        assert len(hung) == 1 and hung[0].details["source"] == "infiniband" and hung[0].details["state"] == "hung"
    finally:
        # Let the hung read finish so its thread ends with the test.
        threading.Thread(target=lambda: open(fifo, "w").close(), daemon=True).start()
        await asyncio.sleep(0)
        agent.close_sources()


class SlowPorts:
    """A real reader's stand-in (so read in its own thread) whose read answers when the test releases it."""

    simulated = False

    def __init__(self) -> None:
        self.release = threading.Event()
        self.answered = threading.Event()

    def read_ports(self) -> tuple[list[IbPort], list[Unreadable]]:
        self.release.wait(30)
        self.answered.set()
        # An unreadable file is logged, from this thread: what logged after its test had ended.
        return [], [Unreadable("/sys/class/infiniband/mlx5_0/ports/1/state", "slow")]


async def test_no_reader_thread_outlives_the_agent_that_started_it(keys) -> None:  # noqa: ANN001
    before = set(threading.enumerate())

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.name.startswith("source-") and t.is_alive()]

    ra = await start_agent(keys, interval=0.05, source_timeout=0.2)
    slow = SlowPorts()
    ra.agent.infiniband = IbSource(slow)
    try:
        await wait_until(lambda: any(g.name == "infiniband" and g.busy for g in ra.agent.sources()),
                         what="the InfiniBand read past its deadline")
        assert [t.name for t in readers()] == ["source-infiniband"]
    finally:
        ra.agent.stop()
        slow.release.set()  # the read in hand answers while the agent stops: waited for, not left to log later
        await stop_agent(ra)
    assert slow.answered.is_set()
    assert readers() == [], "a reader thread is still alive after its agent stopped"


# ---------------------------------------------------------------- config, simulation, wire


def test_thresholds_come_from_agent_toml_with_their_bounds(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\nib_error_rate = 50\nib_flap_down_s = 20\nib_flap_count = 2\n")
    cfg = load(str(path), {})
    assert (cfg.ib_error_rate, cfg.ib_flap_down_s, cfg.ib_flap_count, cfg.ib_root) == (50.0, 20.0, 2,
                                                                                      "/sys/class/infiniband")
    path.write_text("[agent]\nib_error_rate = 0\n")
    with pytest.raises(ConfigError, match="ib_error_rate: expected a number above 0"):
        load(str(path), {})


def test_sim_mode_gets_one_hca_per_gpu_and_real_mode_none_without_devices(tmp_path: Path) -> None:
    sim = open_ib_source(str(tmp_path / "absent"), simulate=2)
    assert sim is not None and sim.simulated
    reading = sim.read()
    assert [(s.device, s.state, s.rate_gbps) for s in reading.ib] == [("mlx5_0", "ACTIVE", 400.0),
                                                                       ("mlx5_1", "ACTIVE", 400.0)]
    assert open_ib_source(str(tmp_path / "absent"), simulate=0) is None
    real = open_ib_source(str(H100), simulate=0)
    assert real is not None and not real.simulated


def test_a_simulated_agent_reads_its_hcas_and_exports_them() -> None:
    from gridwatch.agent.runner import build_agent

    agent = build_agent(AgentConfig(node_name="node-sim", simulate_gpus=2, kernel_log=False,
                                    metrics_listen="127.0.0.1:0"))
    try:
        assert agent.infiniband is not None and agent.infiniband.simulated
        assert agent.metrics is not None and agent.metrics.infiniband is agent.infiniband
        agent.tick()
        sample = next(f for f in map(p.decode_agent_frame, agent.ring.since(0)[0]) if isinstance(f, p.Sample))
        assert [s.device for s in sample.host.ib] == ["mlx5_0", "mlx5_1"]
        assert b'node_infiniband_state_id{device="mlx5_1",port="1"} 4.0' in agent.metrics.render()
    finally:
        agent.close_sources()


def test_simulated_counters_grow_with_traffic_and_errors_on_demand() -> None:
    clock = Clock()
    src = IbSource(SimulatedHcas(2, seed=3, clock=clock), IbJudge(clock=clock, wall=clock))
    src.read()
    clock.now += 1
    ports = src.read().ib
    assert all(30e9 <= (s.rx_bps or 0) <= 45e9 for s in ports)
    src.inject("ib-errors", 1)
    clock.now += 1
    reading = src.read()
    assert kinds(reading.events) == ["ib_errors"] and reading.events[0].details["device"] == "mlx5_1"
    with pytest.raises(ValueError, match="no HCA 9"):
        src.inject("ib-down", 9)


def test_old_frames_without_ports_still_decode() -> None:
    line = b'{"type":"sample","v":1,"seq":1,"ts":1.0,"node":"n","host":{"cpu_percent":3.0}}'
    frame = p.decode_agent_frame(line)
    assert isinstance(frame, p.Sample) and frame.host.ib == []


async def test_an_injected_flap_over_ssh_shows_the_port_down_then_the_flap(keys) -> None:  # noqa: ANN001
    ra = await start_agent(keys, interval=0.05)
    thresholds = IbThresholds(flap_down_s=0.3, flap_count=3)
    assert isinstance(ra.agent, Agent)
    ra.agent.infiniband = IbSource(SimulatedHcas(2, flap_down_s=0.3, flap_count=3), IbJudge(thresholds))
    fleet, frames = make_fleet(ra, keys)
    await fleet.start()
    try:
        await wait_until(lambda: any(s.host.ib for s in of_type(frames, p.Sample)), what="a sample with ports")
        res = await fleet.action("node-1", "inject_fault", {"kind": "ib-flap", "gpu": 1})
        assert res.ok and "mlx5_1" in res.message, res.message

        def port_states() -> list[str | None]:
            return [next(s.state for s in f.host.ib if s.device == "mlx5_1") for f in of_type(frames, p.Sample)
                    if f.host.ib]

        await wait_until(lambda: "DOWN" in port_states(), what="mlx5_1 DOWN in a sample")
        await wait_until(lambda: any(e.kind == "ib_link_flap" for e in of_type(frames, p.Event)), timeout=15,
                         what="the flap event")
        flap = next(e for e in of_type(frames, p.Event) if e.kind == "ib_link_flap")
        assert flap.details["device"] == "mlx5_1" and flap.severity == "critical"
        downs = [e for e in of_type(frames, p.Event) if e.kind == "ib_link_down"]
        assert len(downs) == 3
        await wait_until(lambda: port_states()[-1] == "ACTIVE", what="mlx5_1 back up")
        states = port_states()
        assert states.count("DOWN") >= 3 and states[-1] == "ACTIVE"
        refused = await fleet.action("node-1", "inject_fault", {"kind": "ib-down", "gpu": 7})
        assert not refused.ok and "no HCA 7" in refused.message
    finally:
        await fleet.stop()
        await stop_agent(ra)


# ---------------------------------------------------------------- playbook and node view


def test_the_shipped_playbook_takes_a_downed_link_out_and_only_notifies_on_errors() -> None:
    from gridwatch.playbooks.loader import BUILTIN_DIR
    from gridwatch.playbooks.loader import load as load_playbooks

    result = load_playbooks([BUILTIN_DIR / "ib-link.yaml"])
    assert result.errors == () and result.unreadable == ()
    by_name = {pb.name: pb for pb in result.playbooks}
    assert set(by_name) == {"ib-link-down", "ib-link-degraded"}
    assert [s.action for s in by_name["ib-link-down"].plan] == ["capture_scene", "isolate_node", "drain_node",
                                                                 "requeue_job", "restart_from_checkpoint", "notify"]
    assert [s.action for s in by_name["ib-link-degraded"].plan] == ["notify"]


async def test_the_node_view_shows_a_down_port() -> None:
    from gridwatch.console.tui.screens import NodeScreen
    from tests.support_app import SIZE, make_app, shown, wait_for
    from tests.support_frames import make_sample

    app = make_app(["node01", "node02"])
    store = app.runtime.store
    sample = make_sample("node01", 9)
    sample.host.ib = [
        p.IbPortSample(device=p.Text("mlx5_0"), port=1, state=p.Text("ACTIVE"), phys_state=p.Text("LinkUp"),
                       rate_gbps=400.0, link_layer=p.Text("InfiniBand"), rx_bps=3.8e10, tx_bps=3.7e10),
        p.IbPortSample(device=p.Text("mlx5_1"), port=1, state=p.Text("DOWN"), phys_state=p.Text("Polling"),
                       rate_gbps=400.0, link_layer=p.Text("InfiniBand"), rx_bps=0.0, tx_bps=0.0,
                       errors={p.Text("link_downed"): 4}, deltas={p.Text("link_downed"): 1}),
    ]
    store.apply(sample)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, app.screen.__class__))
        await pilot.press("enter")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        panel = str(app.screen.query_one("#host-panel").render())
        assert "InfiniBand" in panel
        line = next(row for row in panel.splitlines() if row.startswith("mlx5_1/1"))
        assert "DOWN" in line and "link_downed 4 (+1)" in line
        assert "ACTIVE" in next(row for row in panel.splitlines() if row.startswith("mlx5_0/1"))
