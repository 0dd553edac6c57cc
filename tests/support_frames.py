"""Synthetic frames as agents send them (hellos, samples, trainer status, patrol events) and a fleet filled with them."""

from __future__ import annotations

from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.wire.protocol import (
    Event,
    GpuInfo,
    GpuSample,
    Hello,
    HostSample,
    NicSample,
    Sample,
    StackFingerprint,
    Text,
    TrainerStatus,
)

T0 = 1_700_000_000.0


def make_hello(name: str, gpus: int = 8, stack: str = "stack-a", role: str = "operator",
               gpu_name: str = "NVIDIA H100 80GB HBM3") -> Hello:
    return Hello(node=Text(name), role=Text(role), interval=1.0, stack=StackFingerprint(hash=Text(stack)),
                 gpus=[GpuInfo(index=i, uuid=Text(f"GPU-{name}-{i}"), name=Text(gpu_name)) for i in range(gpus)])


def make_sample(name: str, seq: int, gpus: int = 8, *, util: float | None = None, temp: float = 60.0,
                trainer: TrainerStatus | None = None, state: str = "ok", isolated: bool = False) -> Sample:
    """Deterministic readings that differ per GPU and per node so heatmaps and sorts have something to show."""
    h = sum(map(ord, name))
    gs = []
    for i in range(gpus):
        u = (h * 7 + i * 13 + seq * 3) % 100 if util is None else util
        gs.append(GpuSample(index=i, util=float(u), temp_c=temp + (h + i) % 15, power_w=300.0 + 20 * i,
                            mem_used_mb=40_000.0 + 1000 * i, mem_total_mb=81_920.0, ecc_sbe=0, ecc_dbe=0,
                            state=Text(state)))
    host = HostSample(cpu_percent=float(20 + seq % 50), mem_used_mb=200_000.0, mem_total_mb=1_000_000.0,
                      nics=[NicSample(name=Text("ib0"), rx_bps=1.2e9 + seq, tx_bps=1.1e9)])
    return Sample(node=Text(name), seq=seq, ts=T0 + seq, gpus=gs, host=host, trainer=trainer, isolated=isolated)


def make_trainer(step: int, ranks: int = 4, straggler: int | None = None) -> TrainerStatus:
    times = {str(r): 0.5 + (1.5 if r == straggler else 0.01 * r) for r in range(ranks)}
    return TrainerStatus(job=Text("llama-8b"), phase=Text("training"), step=step, loss=4.0 / (1 + step / 50),
                         tokens_per_s=123_456.0, step_time_s=0.52, rank_step_times=times,
                         stragglers=[straggler] if straggler is not None else [], world_size=ranks,
                         membership=[Text(f"node{r:02d}") for r in range(ranks)], checkpoints={"0": step - 1})


def fill_fleet(store: StateStore, names: list[str], gpus: int = 8, samples: int = 3) -> None:
    """Hello and a few samples per node, a second of store time between rounds."""
    clock = store.clock
    for name in names:
        store.set_link(name, "connected", role="operator")
        store.apply(make_hello(name, gpus))
    for seq in range(1, samples + 1):
        for name in names:
            store.apply(make_sample(name, seq, gpus))
        if isinstance(clock, ManualClock) and seq < samples:
            clock.advance(1.0)


def patrol_failed(node: str, **reasons: str) -> Event:
    details = {"checks": Text(",".join(sorted(reasons))), **{k: Text(v) for k, v in reasons.items()}}
    return Event(node=Text(node), kind=Text("patrol_failed"), severity=Text("error"),
                 message=Text("patrol: node sub-healthy"), details=details, ts=T0)


def patrol_recovered(node: str) -> Event:
    return Event(node=Text(node), kind=Text("patrol_recovered"), severity=Text("info"),
                 message=Text("patrol: checks pass again"), details={"checks": Text("gpus")}, ts=T0)
