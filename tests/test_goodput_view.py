"""The training view's goodput bar, driven headless: frames in through the runtime, the breakdown on screen."""

from __future__ import annotations

from gridwatch.console.fleet.goodput import TimeUse
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import FleetScreen, TrainingScreen
from gridwatch.console.tui.screens.training import BAR_WIDTH, bar_cells
from tests.support_app import SIZE, screen_text, shown, trained_runtime, wait_for
from tests.support_frames import T0

FULL_BLOCK = "\u2588"


def test_the_runtime_feeds_the_breakdown_from_the_frames_it_sees() -> None:
    runtime = trained_runtime()
    run = runtime.goodput.breakdown()
    assert run.wall_s == 100.0
    assert run.seconds[TimeUse.PRODUCTIVE] == 80.0
    assert (run.seconds[TimeUse.DETECTION], run.seconds[TimeUse.REFORM], run.seconds[TimeUse.RESTORE]) == (5.0, 5.0, 10.0)
    cells = dict(bar_cells(run))
    assert sum(cells.values()) == BAR_WIDTH and cells[TimeUse.PRODUCTIVE] == 48


async def test_the_training_view_shows_where_the_time_went_as_a_bar_and_names_each_loss() -> None:
    runtime = trained_runtime()
    app = GridwatchApp(runtime, tick_seconds=3600, start_runtime=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.show_view("training")
        await wait_for(pilot, lambda: shown(app, TrainingScreen))
        text = screen_text(app)
        assert "goodput 80.0 % over 100 s" in text
        assert "1m 66.7 %" in text  # the last minute holds the hang and the restore
        bar = next(line for line in text.splitlines() if FULL_BLOCK * 20 in line)
        assert bar.count(FULL_BLOCK) == BAR_WIDTH
        for words in ("productive 80 s (80.0 %)", "detection 5 s (5.0 %)", "re-forming 5 s (5.0 %)",
                      "restore 10 s (10.0 %)", "MTTD 5.0 s", "MTTR 21.0 s", "1 incidents"):
            assert words in text, words
        # The job's name is node text: shown literally in the head, never as markup.
        assert "[bold red]EVIL[/]" in text


def test_the_demo_summary_json_carries_the_breakdown_each_incidents_cost_and_mttd_mttr_mtbf() -> None:
    import msgspec

    from gridwatch.console.demo.summary import IncidentFacts, render, summarize, with_goodput

    runtime = trained_runtime()
    facts = [IncidentFacts(id="inc-1", node="node01", kind="hang", playbook="trainer-unresponsive",
                           detected_at=T0 + 65, actions=["restart_from_checkpoint"], acted_until=T0 + 70)]
    summary = with_goodput(summarize([], facts, [], T0, T0 + 100), runtime)
    data = msgspec.json.decode(msgspec.json.encode(summary))
    gb = data["goodput_breakdown"]
    assert gb["wall_s"] == 100.0 and gb["goodput"] == 0.8
    assert sum(gb["seconds"].values()) == 100.0
    assert set(gb["seconds"]) == {u.value for u in TimeUse}
    assert set(gb["windows"]) == {"1m", "5m", "15m"}
    assert abs(sum(gb["windows"]["1m"]["seconds"].values()) - 60.0) < 0.6
    (row,) = data["incidents"]
    # Detection 5 s, re-forming 5 s, restore 10 s, on the job's 2 GPUs; no step was done twice.
    assert row["steps_lost"] == 0 and abs(row["gpu_hours_lost"] - 2 * 20 / 3600) < 1e-4
    assert (data["mttd_s"], data["mttr_s"], data["mtbf_s"]) == (5.0, 21.0, 100.0)
    # One definition each: the run's goodput, its steps lost and the incident's times are the console's,
    # the same the incident store and /metrics give, not a second count of the summary's own.
    assert data["goodput"] == gb["goodput"] and data["steps_lost"] == row["steps_lost"]
    (span,) = runtime.incident_spans()
    assert (row["detected_s"], row["recovered_s"]) == (round(span.detected_at - span.fault_at, 3),
                                                       round(span.recovered_at - span.fault_at, 3))
    assert (data["detect_median_s"], data["recover_median_s"]) == (row["detected_s"], row["recovered_s"])
    assert any(line.startswith("where the time went (100 s, goodput 80.0 %)") for line in render(summary))
