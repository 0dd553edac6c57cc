"""The all-reduce check: real gloo on loopback through two agents, and how slow pairs are blamed."""

from __future__ import annotations

from gridwatch.console.fleet.preflight import NodeReport, PreflightOptions, PreflightReport, judge_comm, run_preflight_async
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import free_port, start_agent, stop_agent


async def test_allreduce_runs_for_real_between_two_agents(keys) -> None:
    agents = [await start_agent(keys, name=f"node-{i}", interval=0.5, kernel_log=False) for i in (1, 2)]
    try:
        options = PreflightOptions(
            comm=True, comm_port=free_port(), comm_size_bytes=64 * 1024, comm_iters=2, comm_timeout_s=60.0,
            write_test_mb=0.0, net_sample_s=0.05,
        )
        endpoints = parse_endpoints(",".join(ra.spec for ra in agents))
        report = await run_preflight_async(endpoints, str(keys.operator_key), str(keys.known_hosts), options)
    finally:
        for ra in agents:
            await stop_agent(ra)
    assert report.failed == {}, report.failed
    assert report.comm is not None and report.comm.backend == "gloo"
    assert list(report.comm.pairs) == ["node-1~node-2"] and report.comm.pairs["node-1~node-2"] > 0
    for name in ("node-1", "node-2"):
        node = report.node(name)
        assert node is not None and node.checks["comm"].ok
        assert "GB/s bus bandwidth over 2 nodes (gloo)" in node.checks["comm"].detail


def _result(rank: int, pairs: dict[str, float], errors: dict[str, str] | None = None) -> p.ActionResult:
    data = {"rank": rank, "world": 3, "backend": "gloo", "world_busbw_gbps": 1.0, "pairs": pairs, "pair_errors": errors or {}}
    return p.ActionResult(id=p.Text("x"), action=p.Text("preflight"), ok=True, data={"comm": {**data, "ok": True, "detail": ""}})


def _report(names: list[str]) -> PreflightReport:
    return PreflightReport(nodes=[NodeReport(name=n, endpoint=f"127.0.0.1:{i}") for i, n in enumerate(names)])


def test_node_slow_with_every_peer_is_named_alone() -> None:
    names = ["a", "b", "c"]
    report = _report(names)
    results = [
        _result(0, {"0-1": 10.0, "0-2": 2.0}),
        _result(1, {"0-1": 10.0, "1-2": 2.5}),
        _result(2, {"0-2": 2.0, "1-2": 2.5}),
    ]
    comm = judge_comm(report, names, results, PreflightOptions())
    assert comm.slow_pairs == ["a~c", "b~c"]
    assert report.passed_nodes == ["a", "b"]
    assert report.failed == {"c": ["comm: slow or failing with every peer (a~c, b~c)"]}


def test_one_failing_pair_names_both_ends() -> None:
    names = ["a", "b", "c", "d"]
    report = _report(names)
    good = {"0-1": 5.0, "0-2": 5.0, "0-3": 5.0, "1-2": 5.0, "1-3": 5.0, "2-3": 5.0}
    results = [_result(i, {k: v for k, v in good.items() if str(i) in k.split("-")}) for i in range(4)]
    results[1] = _result(1, {"0-1": 5.0, "1-2": 5.0}, errors={"1-3": "connection reset"})
    comm = judge_comm(report, names, results, PreflightOptions())
    assert comm.failed_pairs == ["b~d"]
    assert report.passed_nodes == ["a", "c"]
    assert report.failed["b"] == ["comm: slow or failing pair with d"]
    assert report.failed["d"] == ["comm: slow or failing pair with b"]
