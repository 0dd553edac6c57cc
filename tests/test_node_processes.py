"""The node view's processes pane: each GPU's compute processes from the node's latest full sample."""

from __future__ import annotations

from gridwatch.console.tui.screens import FleetScreen, NodeScreen
from gridwatch.console.tui.screens.node import format_mib, process_cells
from gridwatch.console.tui.widgets import TextTable
from gridwatch.wire.protocol import Text
from gridwatch.wire.readings import GpuProcess
from tests.support_app import EVIL, SIZE, make_app, screen_text, shown, wait_for
from tests.support_frames import make_sample


def test_gpu_memory_reads_in_mib_then_gib() -> None:
    assert [format_mib(v) for v in (None, 0.0, 812.4, 1023.0, 1024.0, 30_720.0)] == [
        "N/A", "0MiB", "812MiB", "1023MiB", "1.0GiB", "30.0GiB"]


def _with_processes(name: str, seq: int):  # noqa: ANN202
    sample = make_sample(name, seq, gpus=2)
    sample.gpus[1].processes = [
        GpuProcess(pid=77, user=Text("alice"), used_mb=512.0, command=Text("python eval.py")),
        GpuProcess(pid=4242, user=Text(EVIL), used_mb=30_720.0, command=Text(EVIL), job=Text("777")),
    ]
    sample.gpus[0].processes = [GpuProcess(pid=9, used_mb=None)]
    return sample


async def test_the_node_view_lists_each_gpus_processes_as_plain_text() -> None:
    app = make_app(["node01", "node02"])
    store = app.runtime.store
    store.apply(_with_processes("node01", 9))
    rows, keys = process_cells(store.by_name("node01"))
    assert keys == ["0/9", "1/4242", "1/77"]  # by GPU, the biggest first
    assert [c[0] for c in rows[1]] == ["1", "4242", EVIL, "777", "30.0GiB", EVIL]
    assert [c[0] for c in rows[0]] == ["0", "9", "N/A", "-", "N/A", "N/A"]
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: shown(app, FleetScreen))
        app.open_node("node01")
        await wait_for(pilot, lambda: shown(app, NodeScreen))
        table = app.screen.query_one("#gpu-procs", TextTable)
        assert table.display and len(table.rows) == 3
        said = screen_text(app)
        assert "GPU MEM" in said and "COMMAND" in said and "python eval.py" in said
        assert "[bold red]EVIL[/]" in said  # shown as the node wrote it, never read as markup
        app.open_node("node02")  # no processes reported: no pane
        await wait_for(pilot, lambda: shown(app, NodeScreen) and app.screen.node_name == "node02")
        await pilot.pause()
        assert not app.screen.query_one("#gpu-procs", TextTable).display


def test_a_node_wide_incident_in_the_history_says_the_node_not_gpu_dash() -> None:
    from gridwatch.console.tui.screens.node import history_text
    from gridwatch.playbooks.history import IncidentLine, TrackRecord

    def line(gpu: int | None) -> IncidentLine:
        return IncidentLine(id="i", at=0.0, node="n", kind="nccl_timeout", playbook="p", severity="error", gpu=gpu,
                            gpu_uuid="", code=None, outcome="restarted", ttr=12.0)

    said = history_text(TrackRecord(node="n", incidents=[line(None), line(3)], total_incidents=2)).plain
    assert "gpu -" not in said and "gpu None" not in said
    assert "the node" in said and "gpu 3" in said
