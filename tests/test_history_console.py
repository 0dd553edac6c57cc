"""The node's history in the console: the node view shows it, and a node a history rule keeps out is not returned by itself."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from gridwatch.console.fleet.state import ManualClock, StateStore
from gridwatch.console.runtime.core import ConsoleRuntime
from gridwatch.console.runtime.incidents import StoreIncidents
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import NodeScreen
from gridwatch.playbooks.store import IncidentStore
from tests.support_app import SIZE, RecordingFleet, shown, wait_for
from tests.support_frames import T0, fill_fleet

DATA = Path(__file__).parent / "data" / "history"
HOLD = "remediated 3 times within 7d: not returned to service by itself"


def _runtime(tmp_path: Path, fleet: RecordingFleet, hold: bool = False) -> ConsoleRuntime:
    db = tmp_path / "incidents.db"
    shutil.copy(DATA / "incidents-schema2.db", db)  # node2: two XID 119 on GPU 3, each reset; node3: an XID 13
    if hold:
        IncidentStore(db).close()
        raw = sqlite3.connect(db)
        raw.execute("INSERT INTO history (at, kind, node, incident, what, verdict, reason) VALUES"
                    " (?, 'decision', 'node2', 'xid-reset-gpu:node2/gpu3:1700001800', 'remediations', 'hold', ?)",
                    (T0 + 4000, HOLD))  # after the return to service the file holds
        raw.commit()
        raw.close()
    store = StateStore(ManualClock(T0 + 3600))
    fill_fleet(store, ["node1", "node2", "node3"])
    for node in list(store.nodes.values()):
        store.set_link(node.key, node.link, role="operator")
    return ConsoleRuntime(store, fleet=fleet, incidents=StoreIncidents(IncidentStore(":memory:", store.clock)),
                          plan_store=IncidentStore(db, store.clock))


async def test_the_node_view_shows_history_mtbi_and_lemon(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path, RecordingFleet(), hold=True)
    app = GridwatchApp(runtime, tick_seconds=3600, start_runtime=False)
    try:
        async with app.run_test(size=SIZE) as pilot:
            app.open_node("node2")
            await wait_for(pilot, lambda: shown(app, NodeScreen))
            pane = app.screen.query_one("#node-history")
            text = str(pane.render())
            assert pane.display
            assert "history  lemon " in text and "MTBI 30m" in text and "2 incidents, 2 remediated" in text
            assert text.count("xid 119") == 2 and "gpu 3" in text and "reset_gpu done" in text
            assert f"KEPT OUT: node2 stays out of service: {HOLD}" in text
            app.open_node("node1")  # no incident recorded there: no pane
            await wait_for(pilot, lambda: shown(app, NodeScreen) and app.screen.node_name == "node1")
            assert not app.screen.query_one("#node-history").display
    finally:
        runtime.plan_store.close()


async def test_return_to_service_is_refused_in_one_line_unless_forced_and_both_are_audited(tmp_path: Path) -> None:
    fleet = RecordingFleet()
    runtime = _runtime(tmp_path, fleet, hold=True)
    try:
        refused = await runtime.node_action("node2", "unisolate", "looks fine", who="bob")
        assert not refused.ok and refused.message == (f"node2 stays out of service: {HOLD}; force the return once "
                                                      "it has been looked at")
        assert fleet.actions == []
        forced = await runtime.node_action("node2", "unisolate", "GPU swapped, burn-in passed", who="alice", force=True)
        assert forced.ok and fleet.actions == [("node2", "unisolate", "GPU swapped, burn-in passed")]
        audit = [(a.who, a.what, a.outcome) for a in runtime.plan_store.audit_log()]
        assert ("bob", "unisolate on node2", f"refused: {refused.message}") in audit
        assert ("alice", "force unisolate on node2", f"overrides: {refused.message}") in audit
        assert (await runtime.node_action("node3", "unisolate", "never held")).ok  # no rule keeps node3 out
    finally:
        runtime.plan_store.close()
