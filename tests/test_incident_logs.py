"""The Incidents view's logs key: the incident's nodes around its detection, from real agents, merged, blame marked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.style import Style

from gridwatch.agent.logs import LogTailer
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import IncidentsScreen, LogsScreen
from gridwatch.console.tui.screens.logs import BLAMED_NODE_LINE, RANK_LINE
from gridwatch.console.tui.widgets import TextTable
from gridwatch.playbooks.loader import load_builtin
from gridwatch.playbooks.plans import Incident, Plan
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.conftest import start_agent, stop_agent, wait_until
from tests.support_app import screen_text, shown, wait_for

# Written by us in the format of PyTorch's NCCL watchdog line (ProcessGroupNCCL.cpp), as reported in
# https://github.com/XPixelGroup/BasicSR/issues/737; the times and counts are ours.
WATCHDOG = ("[rank0]:[E1201 03:12:00.159932949 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, "
            "Timeout(ms)=600000) ran for 600030 milliseconds before timing out.")
# Written by us.
BEFORE = "[rank0]: step 800 loss 2.31"
STUCK = "Traceback (most recent call last):"
NAMES_RANK = "[rank1]: still waiting for rank 2 in all_reduce #808"
AFTER = "[rank2]: step 900 loss 2.02"


class StampClock:
    """The time a tailer stamps the lines it reads: set by the test before each line is written."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def test_l_opens_the_incidents_nodes_around_its_detection_with_the_blamed_rank_marked(
        keys, tmp_path: Path, utc: None) -> None:
    detected = time.time() - 3600.0  # an hour ago: the range is absolute, not "the last minutes"
    logs, clocks, agents = {}, {}, []
    for name in ("node-1", "node-2", "node-3"):
        logs[name], clocks[name] = tmp_path / f"{name}.log", StampClock()
        logs[name].write_text("")
        tailer = LogTailer([str(logs[name])], kernel=False, from_start=True, clock=clocks[name])
        agents.append(await start_agent(keys, name=name, gpus=1, tailer=tailer))

    async def write(node: str, offset: float, line: str) -> None:
        clocks[node].now = detected + offset
        with logs[node].open("a") as f:
            f.write(line + "\n")
        tailer = next(a for a in agents if a.agent.config.node_name == node).agent.tailer
        await wait_until(lambda: any(e[1] == line for e in tailer.entries()), 10, f"{node} to read {line!r}")

    for node, offset, line in (("node-1", -900, BEFORE), ("node-2", -120, STUCK), ("node-1", -10, WATCHDOG),
                               ("node-1", 60, NAMES_RANK), ("node-3", 0, "[rank4]: step 808 loss 2.30"),
                               ("node-2", 900, AFTER)):
        await write(node, offset, line)

    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(",".join(a.spec for a in agents)),
                                           key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                           db_path=str(tmp_path / "incidents.db"), read_only=True,
                                           skip_playbooks=tuple(pb.name for pb in load_builtin())))
    # node-1 reported the hang; the incident blames rank 2 on node-2 (node-3 is in neither role).
    incident = Incident(id="nccl-timeout:node-2:1", playbook="nccl-timeout", kind="nccl_timeout", severity="error",
                        scope="job", node="node-2", reporters=["node-1"], opened_at=detected, last_seen_at=detected,
                        summary="rank 2 on node-2 never entered all_reduce #808; 1 rank waits in it")
    runtime.plan_store.save_plan(Plan(incident=incident, steps=[]))
    app = GridwatchApp(runtime, tick_seconds=0.2)
    try:
        async with app.run_test(size=(180, 50)) as pilot:
            await wait_for(pilot, lambda: [n.link for n in runtime.store.nodes.values()] == ["connected"] * 3, 20)
            app.show_view("incidents")
            await wait_for(pilot, lambda: shown(app, IncidentsScreen))
            await wait_for(pilot, lambda: "Logs around it" in screen_text(app))  # the key is in the footer
            await pilot.press("l")
            await wait_for(pilot, lambda: shown(app, LogsScreen))
            table = app.screen.query_one("#logs-table", TextTable)
            await wait_for(pilot, lambda: len(table.rows) == 3 and "2/2 agents answered" in screen_text(app), 20)
            rows = table.row_cells()
            # Both nodes' lines in the five minutes either side, merged by time; the rest left out.
            assert [(r[1][0], r[4][0]) for r in rows] == [("node-2", STUCK), ("node-1", WATCHDOG),
                                                          ("node-1", NAMES_RANK)]
            marks: list[Style | None] = [r[4][1] for r in rows]
            assert marks[0] == BLAMED_NODE_LINE and marks[2] == RANK_LINE
            assert marks[1] not in (BLAMED_NODE_LINE, RANK_LINE)
            text = screen_text(app)
            assert "incident nccl-timeout:node-2:1" in text and "marked: rank 2" in text and "times in UTC" in text
            query = app.screen.query_one("#logs-query").value
            assert query.startswith("node:node-2,node-1 since:") and " until:" in query
            await pilot.press("escape")
            await wait_for(pilot, lambda: shown(app, IncidentsScreen))
    finally:
        for ra in agents:
            await stop_agent(ra)
