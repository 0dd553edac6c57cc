"""How the all-reduce test's pairs are judged, from injected figures (no timing): outliers against the run, not cries of wolf."""

from __future__ import annotations

from itertools import combinations

from gridwatch.console.fleet.preflight import CommReport, NodeReport, PreflightOptions, PreflightReport, judge_comm
from gridwatch.wire import protocol as p


def _run(
    figures: dict[str, float],
    world: int,
    errors: dict[str, str] | None = None,
    options: PreflightOptions | None = None,
    rank_errors: dict[int, str] | None = None,
    silent: tuple[int, ...] = (),
) -> tuple[PreflightReport, CommReport]:
    """Each rank reports its own pairs ("i-j" -> GB/s) and pair errors, as the all-reduce worker does."""
    names = [chr(ord("a") + i) for i in range(world)]
    report = PreflightReport(nodes=[NodeReport(name=n, endpoint=f"127.0.0.1:{i}") for i, n in enumerate(names)])
    results = []
    for rank in range(world):
        if rank in silent:
            results.append(p.ActionResult(id=p.Text("x"), action=p.Text("preflight"), ok=False, message=p.Text("timed out"), data={}))
            continue
        mine = {k: v for k, v in figures.items() if str(rank) in k.split("-")}
        errs = {k: v for k, v in (errors or {}).items() if str(rank) in k.split("-")}
        data = {"rank": rank, "world": world, "backend": "gloo", "world_busbw_gbps": 1.0, "pairs": mine, "pair_errors": errs}
        if rank_errors and rank in rank_errors:
            data["error"] = rank_errors[rank]
        results.append(p.ActionResult(id=p.Text("x"), action=p.Text("preflight"), ok=True, data={"comm": {**data, "ok": True, "detail": ""}}))
    comm = judge_comm(report, names, results, options or PreflightOptions())
    return report, comm


def _mesh(world: int, value: float, **override: float) -> dict[str, float]:
    figures = {f"{i}-{j}": value for i, j in combinations(range(world), 2)}
    figures.update({k.replace("_", "-"): v for k, v in override.items()})
    return figures


def test_a_loaded_healthy_run_with_every_pair_slow_is_a_warning_not_a_failure() -> None:
    figures = {"0-1": 0.9, "0-2": 1.1, "1-2": 1.0}  # a tenth of what the fabric should do, evenly
    report, comm = _run(figures, 3, options=PreflightOptions(min_busbw_gbps=10.0))
    assert report.failed == {}
    assert comm.slow_pairs == [] and comm.failed_pairs == []
    assert comm.median_gbps == 1.0 and comm.expected_gbps == 10.0
    assert comm.pairs == {"a~b": 0.9, "a~c": 1.1, "b~c": 1.0}
    assert len(comm.warnings) == 1
    warning = comm.warnings[0]
    assert warning.startswith("every pair is slow: median 1 GB/s, expected 10 GB/s")
    assert "the fabric or the host is slow" in warning
    assert warning in report.notes
    check = report.nodes[0].checks["comm"]
    assert check.ok and check.values["median_gbps"] == 1.0 and check.values["expected_gbps"] == 10.0
    assert "warning: every pair is slow" in check.detail


def test_jitter_of_a_loaded_host_fails_nobody() -> None:
    # Under load the figures spread (here 2.5x) but no pair stands out by 1/k of the run.
    figures = {"0-1": 1.0, "0-2": 0.4, "0-3": 0.7, "1-2": 0.9, "1-3": 0.5, "2-3": 0.8}
    report, comm = _run(figures, 4)
    assert report.failed == {} and comm.slow_pairs == [] and comm.warnings == []


def test_one_slow_pair_names_the_pair_but_fails_neither_end() -> None:
    # The reported case: one pair several times under the others, on a healthy loaded 3-node cluster.
    figures = {"0-1": 2.5, "0-2": 10.0, "1-2": 9.0}
    report, comm = _run(figures, 3)
    assert comm.slow_pairs == ["a~b"] and comm.suspect_pairs == ["a~b"]
    assert report.failed == {}
    assert comm.reference_gbps == 10.0
    assert any(n.startswith("pair a~b is slow (2.5 GB/s against the run's 10)") for n in report.notes)


def test_a_node_slow_with_every_peer_fails_alone() -> None:
    # Half the pairs of a 4-node mesh are the bad node's: the plain median of pairs (3.0) would not see it.
    figures = _mesh(4, 5.0, **{"0_3": 1.0, "1_3": 1.0, "2_3": 1.0})
    report, comm = _run(figures, 4)
    assert comm.slow_pairs == ["a~d", "b~d", "c~d"]
    assert report.passed_nodes == ["a", "b", "c"]
    assert report.failed == {"d": ["comm: slow or failing with every peer (a~d, b~d, c~d)"]}
    assert comm.warnings == []


def test_the_node_in_most_slow_pairs_is_blamed() -> None:
    figures = _mesh(4, 5.0, **{"0_3": 1.0, "1_3": 1.0})
    report, comm = _run(figures, 4)
    assert comm.slow_pairs == ["a~d", "b~d"] and comm.suspect_pairs == []
    assert report.passed_nodes == ["a", "b", "c"]
    assert report.failed == {"d": ["comm: slow pair with a (1 GB/s against the run's 5); slow pair with b (1 GB/s against the run's 5)"]}


def test_a_pair_that_meets_the_expectation_is_not_slow() -> None:
    figures = _mesh(4, 50.0, **{"0_3": 12.0, "1_3": 12.0, "2_3": 12.0})
    report, comm = _run(figures, 4, options=PreflightOptions(min_busbw_gbps=10.0))
    assert report.failed == {} and comm.slow_pairs == [] and comm.warnings == []


def test_a_slow_node_in_a_slow_run_still_fails_and_the_run_warns() -> None:
    figures = _mesh(4, 1.0, **{"0_3": 0.2, "1_3": 0.2, "2_3": 0.2})
    report, comm = _run(figures, 4, options=PreflightOptions(min_busbw_gbps=10.0))
    assert list(report.failed) == ["d"]
    assert comm.warnings and comm.warnings[0].startswith("every pair is slow: median 0.6 GB/s, expected 10 GB/s")


def test_a_failed_pair_fails_both_ends_whatever_the_figures() -> None:
    figures = {"0-1": 5.0, "0-2": 5.0}
    report, comm = _run(figures, 3, errors={"1-2": "connection reset"})
    assert comm.failed_pairs == ["b~c"]
    assert report.passed_nodes == ["a"]
    assert report.failed == {"b": ["comm: slow or failing pair with c"], "c": ["comm: slow or failing pair with b"]}


def test_a_rank_that_errs_or_does_not_answer_fails() -> None:
    report, _ = _run(_mesh(3, 5.0), 3, rank_errors={1: "gloo: connect timed out"}, silent=(2,))
    assert report.failed == {"b": ["comm: gloo: connect timed out"], "c": ["comm: timed out"]}
    assert report.passed_nodes == ["a"]


def test_two_nodes_count_only_failures_and_a_broken_link() -> None:
    # One pair: nothing to compare with. Under the expectation is a warning; under a tenth of it, broken.
    report, comm = _run({"0-1": 0.01}, 2)
    assert report.failed == {} and comm.slow_pairs == [] and comm.warnings == []
    report, comm = _run({"0-1": 4.0}, 2, options=PreflightOptions(min_busbw_gbps=10.0))
    assert report.failed == {} and comm.failed_pairs == []
    assert comm.warnings[0].startswith("every pair is slow: median 4 GB/s, expected 10 GB/s")
    report, comm = _run({"0-1": 0.5}, 2, options=PreflightOptions(min_busbw_gbps=10.0))
    assert comm.failed_pairs == ["a~b"] and comm.warnings == []
    assert report.failed == {"a": ["comm: slow or failing with every peer (a~b)"], "b": ["comm: slow or failing with every peer (a~b)"]}
    report, comm = _run({}, 2, errors={"0-1": "connection refused"})
    assert sorted(report.failed) == ["a", "b"]


def test_the_figures_survive_the_json_report() -> None:
    report, _ = _run({"0-1": 0.9, "0-2": 1.1, "1-2": 1.0}, 3, options=PreflightOptions(min_busbw_gbps=10.0))
    back = PreflightReport.from_json(report.to_json())
    assert back.comm is None  # judge_comm returns the comm report; the caller stores it
    report.comm = _run({"0-1": 2.5, "0-2": 10.0, "1-2": 9.0}, 3)[1]
    back = PreflightReport.from_json(report.to_json())
    assert back.comm is not None
    assert back.comm.suspect_pairs == ["a~b"] and back.comm.reference_gbps == 10.0 and back.comm.median_gbps == 9.0
    assert back.comm.warnings == report.comm.warnings
