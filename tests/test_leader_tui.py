"""Several consoles, one actor, with an operator's screen among them: it observes, then takes over.

Real etcd (Debian's etcd-server), real agents on loopback SSH with real trainer
control sockets, two headless consoles as real processes, and the TUI console
driven through a Textual pilot in this test's event loop.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from textual.widgets import Input

from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import FleetScreen, IncidentsScreen, NodeScreen
from gridwatch.console.tui.screens.confirm import ConfirmScreen
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import stop_agent, wait_until
from tests.etcd_server import running_etcd
from tests.support_leader import OPERATOR, Job, action_events, console, incidents, plan_steps
from tests.support_loop import agents_beside

SIZE = (200, 45)  # wide enough for the status bar to show the whole role


def screen_text(app: GridwatchApp) -> str:
    """What the terminal shows, as plain text lines."""
    update = app.screen._compositor.render_full_update()
    return "\n".join("".join(strip.text for strip in line) for line in update.strips)


async def _confirm(pilot, app: GridwatchApp, reason: str) -> None:  # noqa: ANN001 - a textual Pilot
    await wait_until(lambda: isinstance(app.screen, ConfirmScreen), 5, "the confirmation dialog")
    app.screen.query_one("#confirm-reason", Input).value = reason
    await pilot.press("enter")


@pytest.mark.timeout(120)
async def test_two_headless_consoles_and_a_tui_one_show_one_xid_79_acted_on_once_then_the_tui_takes_over(
        keys, tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        names = ["node-1", "node-2", "node-3"]
        job = Job(tmp_path, names)
        agents = []
        consoles: list[subprocess.Popen] = []
        try:
            # The agents share this test's event loop with the screen under test: a 2 s tick (a 6 s heartbeat)
            # keeps a loaded machine's stall of that loop from reading as a node lost (and isolated) to the
            # consoles, which are processes of their own and judge silence by the wall clock.
            agents = await agents_beside(keys, job, names, interval=2.0, scenes=tmp_path / "scenes")
            spec = ",".join(a.spec for a in agents)
            dbs = [tmp_path / "a" / "incidents.db", tmp_path / "b" / "incidents.db", tmp_path / "c" / "incidents.db"]
            logs = [tmp_path / "a.log", tmp_path / "b.log"]
            for db in dbs:
                db.parent.mkdir(mode=0o700)
            consoles.append(console(keys, spec, dbs[0], etcd.url, "alice", logs[0]))
            await wait_until(lambda: "leader (token" in logs[0].read_text(), 30, "console a to lead")
            consoles.append(console(keys, spec, dbs[1], etcd.url, "bob", logs[1]))

            # The operator's screen: the same runtime `gridwatch console --etcd URL` builds, observing.
            runtime = build_runtime(RuntimeOptions(
                endpoints=parse_endpoints(spec), key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                db_path=str(dbs[2]), operator="carol", etcd=[etcd.url], campaign=False))
            app = GridwatchApp(runtime)
            async with app.run_test(size=SIZE) as pilot:
                election = runtime.election
                assert election is not None
                await wait_until(lambda: election.standing.leader.startswith("alice@"), 15, "the screen to see alice lead")
                leader = election.standing.leader
                await wait_until(lambda: f"observer; {leader} leads" in screen_text(app), 5, "the role in the status bar")
                await wait_until(lambda: "observer; alice@" in logs[1].read_text(), 30, "console b to observe")
                await wait_until(lambda: all(len(a.agent.clients) == 3 for a in agents), 30, "three consoles connected")
                await wait_until(lambda: all("training: 3 of 3" in log.read_text() for log in logs), 30,
                                 "both headless consoles to see the job train")
                assert "L" in app.screen.active_bindings  # an observer is offered the take-over key

                # An observer acts on nothing, its operator's own node actions included.
                app.open_node("node-1")
                await wait_until(lambda: isinstance(app.screen, NodeScreen), 5, "the node view")
                await pilot.press("i")
                await _confirm(pilot, app, "drill")
                await wait_until(lambda: "failed: observer" in app.note, 5, "the refusal in the status bar")
                assert app.note == f"isolate on node-1: failed: observer: {leader} leads; take over to act"
                assert not agents[0].agent.isolated

                fault = await agents[1].agent.act(OPERATOR, p.Action(id=p.Text("f1"), action=p.Text("inject_fault"),
                                                                     args={"kind": "xid", "gpu": 0, "code": 79}))
                assert fault.ok, fault.message
                await wait_until(lambda: all(incidents(db, "xid-hardware") for db in dbs), 15,
                                 "the incident in all three consoles")
                incident = incidents(dbs[0], "xid-hardware")
                assert len(incident) == 1 and incidents(dbs[1], "xid-hardware") == incidents(dbs[2], "xid-hardware") \
                    == incident
                await wait_until(lambda: plan_steps(dbs[0], "xid-hardware").get("restart_from_checkpoint", ("",))[0]
                                 == "done", 30, "the leader to restart the job")
                # The observers copy the leader's outcomes: the screen shows the plan done too.
                await wait_until(lambda: plan_steps(dbs[2], "xid-hardware").get("restart_from_checkpoint", ("",))[0]
                                 == "done", 10, "the screen to show the restart done")
                assert plan_steps(dbs[2], "xid-hardware")["isolate_node"][0] == "done"
                # One isolation, one restart, in every agent's own record.
                assert len(action_events(agents[1].agent, "isolate")) == 1
                assert len(action_events(agents[0].agent, "restart_from")) == 1
                assert len(action_events(agents[2].agent, "restart_from")) == 1
                assert not action_events(agents[1].agent, "restart_from")
                app.show_view("incidents")
                await wait_until(lambda: isinstance(app.screen, IncidentsScreen) and app.screen.ready, 5,
                                 "the incidents view")
                assert list(app.screen.rows) == incident
                await wait_until(lambda: f"[{incident[0]}]" in screen_text(app), 5, "the incident on the screen")
                assert "xid-hardware" in screen_text(app)

                # The operator takes over: asked first, with a reason; the status bar, the old leader and
                # the audit log all say so.
                old_token = election.standing.token
                await pilot.press("L")
                await _confirm(pilot, app, "alice's console is being drained")
                await wait_until(lambda: app.note.startswith("take over: ") and "asking" not in app.note, 10,
                                 "the take-over's outcome")
                assert election.leading, app.note
                token = election.token
                assert token is not None and old_token is None
                await wait_until(lambda: f"leader (token {token})" in screen_text(app), 5, "the new role shown")
                assert app.note == f"take over: done: leader (token {token}), taken from {leader}"
                await wait_until(lambda: "observer; carol@" in logs[0].read_text(), 15, "console a to observe")
                first = int(next(line for line in logs[0].read_text().splitlines()
                                 if line.startswith("leader (token")).split("token ")[1].rstrip(")"))
                assert token > first
                audit = [e for e in runtime.plan_store.audit_log() if e.what.startswith("take over")]
                assert [(e.who, e.why, e.phase) for e in audit] == [("carol", "alice's console is being drained",
                                                                     "before"), ("carol", "alice's console is being "
                                                                                 "drained", "after")]
                assert f"from {leader}" in audit[-1].what and f"token {token}" in audit[-1].outcome
                assert "L" not in app.screen.active_bindings  # nothing left to take over
                acted = await runtime.node_action("node-1", "ping", "after the take-over")
                assert acted.ok, acted.message  # the leader acts, with its new token
                # No step twice after the takeover either.
                assert len(action_events(agents[1].agent, "isolate")) == 1
                app.exit()
        finally:
            for proc in consoles:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            for ra in agents:
                await ra.agent.trainer.stop()
                await stop_agent(ra)
            job.stop()


async def test_a_console_alone_offers_no_take_over(tmp_path: Path) -> None:
    from gridwatch.console.runtime.core import ConsoleRuntime

    app = GridwatchApp(ConsoleRuntime(), start_runtime=False)
    async with app.run_test(size=SIZE):
        await wait_until(lambda: isinstance(app.screen, FleetScreen) and app.screen.ready, 5, "the fleet view")
        assert "L" not in app.screen.active_bindings and "observer" not in screen_text(app)
        app.run_command("takeover")
        assert app.note == "nothing to take over: this console has no etcd and leads alone"


async def test_demo_with_etcd_leads_and_a_console_attached_with_its_cluster_toml_observes(tmp_path: Path) -> None:
    import asyncio

    from gridwatch.console.demo.cluster import ClusterOptions
    from gridwatch.console.demo.session import DemoOptions, DemoSession
    from gridwatch.console.runtime.config import load_cluster
    from tests.conftest import PYTHON, ROOT

    shown = subprocess.run([PYTHON, "-m", "gridwatch", "demo", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and "--etcd URL" in shown.stdout
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        lines: list[str] = []
        session = DemoSession(DemoOptions(cluster=ClusterOptions(nodes=1, gpus=1, interval=0.5, trainer=False),
                                          directory=str(tmp_path / "demo"), etcd=(etcd.url,)), say=lines.append)
        watching: asyncio.Task[None] | None = None
        try:
            await session.start()
            await session.attach()
            await wait_until(lambda: any("leader (token" in line for line in lines), 15, "the demo's console to lead")
            assert session.runtime is not None and session.runtime.election is not None
            config = load_cluster(session.dir / "cluster.toml")
            assert config.etcd_urls == [etcd.url]
            # What `gridwatch console --cluster DEMO/cluster.toml` builds: it shares the demo's election.
            other = build_runtime(RuntimeOptions.from_cluster(config, db_path=str(tmp_path / "other.db"),
                                                              campaign=False))
            assert other.election is not None and other.election.key == session.runtime.election.key
            watching = asyncio.create_task(other.election.run())
            leader = session.runtime.election.name
            await wait_until(lambda: other.election.standing.leader == leader, 10, "the other console to observe")
            assert other.election.standing.line == f"observer; {leader} leads"
        finally:
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
            await session.close()
