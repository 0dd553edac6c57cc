"""Paging through Alertmanager: alerts arrive with their labels, group, re-send while firing, resolve, survive an outage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gridwatch.playbooks.clock import ManualClock, SystemClock
from gridwatch.playbooks.notify import Alertmanager, AlertmanagerHealth, DefaultNotifier
from gridwatch.playbooks.plans import Incident, PlannedStep
from tests.alertmanager_server import Alertmanager as AlertmanagerServer
from tests.alertmanager_server import running_alertmanager
from tests.conftest import free_port, wait_until


@pytest.fixture
def am(tmp_path: Path) -> Iterator[AlertmanagerServer]:
    with running_alertmanager(tmp_path / "am") as server:
        if server is None:
            pytest.skip("prometheus-alertmanager cannot start here")
        yield server


def _incident(iid: str, node: str = "node-3", opened: float = 0.0) -> Incident:
    return Incident(id=iid, playbook="xid-hardware", kind="xid", severity="critical", scope="node", node=node,
                    summary="GPU has fallen off the bus (XID 79)", opened_at=opened, last_seen_at=opened, job="llm")


def _step(iid: str) -> PlannedStep:
    return PlannedStep(id=f"{iid}/0", incident=iid, playbook="xid-hardware", index=0, step="notify",
                       target="node-3", at=1.0, timeout=5.0)


def _by_incident(server: AlertmanagerServer) -> dict[str, dict]:
    return {a["labels"]["incident"]: a for a in server.alerts()}


async def test_notify_arrives_groups_and_resolves(am: AlertmanagerServer) -> None:
    clock = SystemClock()
    sink = Alertmanager(am.url, clock, labels={"cluster": "a100-east"})
    notifier = DefaultNotifier(alertmanager=sink)
    try:
        now = clock.now()
        first, second = _incident("xid-hardware:node-3:1", opened=now), _incident("xid-hardware:node-3:2", opened=now)
        outcome = await notifier.notify(_step(first.id), first, "node-3 isolated", False)
        assert outcome == "shown on the console; queued for Alertmanager"
        # A second notify of the same incident updates its one alert; node text arrives cleaned.
        await notifier.notify(_step(first.id), first, "node-3 drained\x1b[31m", True)
        await wait_until(lambda: first.id in _by_incident(am), 10, "the alert in Alertmanager")
        alert = _by_incident(am)[first.id]
        assert alert["labels"] == {"alertname": "xid-hardware", "node": "node-3", "severity": "critical",
                                   "incident": first.id, "job": "llm", "cluster": "a100-east"}
        await wait_until(lambda: _by_incident(am)[first.id]["annotations"]["summary"] == "node-3 drained[31m", 10,
                         "the second notify's summary")
        assert "GPU has fallen off the bus" in _by_incident(am)[first.id]["annotations"]["description"]
        assert len(am.alerts()) == 1

        await notifier.notify(_step(second.id), second, "node-3 again", False)
        await wait_until(lambda: len(am.alerts()) == 2, 10, "the second incident's alert")
        # The route groups by node: two incidents on node-3 are one group of two alerts.
        groups = [g for g in am.groups() if g["alerts"]]
        assert len(groups) == 1 and groups[0]["labels"] == {"node": "node-3"}
        assert {a["labels"]["incident"] for a in groups[0]["alerts"]} == {first.id, second.id}

        sink.resolve(first.id)
        await wait_until(lambda: set(_by_incident(am)) == {second.id}, 10, "the resolved alert to leave")
        assert sink.alert(first.id) is None  # delivered as resolved: nothing more to send for it
        assert sink.status.health is AlertmanagerHealth.OK and sink.status.failures == 0
    finally:
        await sink.close()


async def test_unreachable_alertmanager_keeps_and_retries(tmp_path: Path) -> None:
    port = free_port()
    clock = ManualClock(2_000_000_000.0)
    said: list[str | None] = []
    sink = Alertmanager(f"http://127.0.0.1:{port}/", clock, timeout=2.0, retry_every=5.0, poll_s=0.05,
                        on_trouble=said.append)
    incident = _incident("xid-hardware:node-3:9", opened=clock.now())
    try:
        sink.fire(incident, "node-3 isolated")  # returns at once: the sender task posts it
        await wait_until(lambda: sink.status.failures >= 1, 10, "the first failed post")
        assert sink.status.health is AlertmanagerHealth.FAILING
        assert sink.status.queued == 1 and sink.status.dropped == 0
        assert len(said) == 1 and said[0] is not None and "cannot be reached" in said[0] and "\n" not in said[0]
        # Backing off: nothing is due again before retry_every has passed on the clock.
        assert sink.due(clock.now()) == [] and sink.status.failures == 1
        with running_alertmanager(tmp_path / "am", port=port) as server:
            if server is None:
                pytest.skip("prometheus-alertmanager cannot start here")
            clock.advance(6.0)
            await wait_until(lambda: sink.status.health is AlertmanagerHealth.OK, 10, "delivery after the outage")
            # The alert's own time is the console's clock (2033 here); Alertmanager lists it as sent.
            assert [a["labels"]["incident"] for a in server.alerts()] == [incident.id]
            assert said[-1] is None and sink.status.queued == 0 and sink.status.failures == 1
    finally:
        await sink.close()


async def test_firing_alerts_resend_on_the_clock_and_the_queue_is_bounded() -> None:
    clock = ManualClock(1_000.0)
    posts: list[list[dict]] = []

    def post(url: str, body: bytes, timeout: float) -> int:
        posts.append(json.loads(body))
        return 200

    sink = Alertmanager("http://alertmanager:9093", clock, post=post, resend_every=60.0, queue_max=3,
                        background=False)
    sink.fire(_incident("a", opened=1_000.0), "one")
    assert await sink.flush() and len(posts) == 1
    assert posts[0][0]["startsAt"] == "1970-01-01T00:16:40.000Z"
    assert posts[0][0]["endsAt"] > posts[0][0]["startsAt"]  # holds for a few re-sends, then ends by itself
    assert sink.due(clock.advance(59.0)) == []
    assert [a.incident for a in sink.due(clock.advance(1.0))] == ["a"]  # Alertmanager hears it every minute
    await sink.flush()
    sink.resolve("a")
    await sink.flush()
    assert posts[-1][0]["endsAt"] == "1970-01-01T00:17:40.000Z"  # ended when resolved
    assert sink.due(clock.advance(600.0)) == []  # resolved and delivered: never re-sent
    for name in "bcdef":
        sink.fire(_incident(name), name)
    assert sink.status.dropped == 2 and [a.incident for a in sink.due(clock.now())] == ["d", "e", "f"]
    await sink.close()


def test_a_bad_alertmanager_url_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^'alertmanager:9093' is not an Alertmanager address"):
        Alertmanager("alertmanager:9093")


async def test_an_incident_from_a_real_agent_pages_and_resolves(am: AlertmanagerServer, agent, keys,
                                                                tmp_path: Path) -> None:
    from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
    from gridwatch.sshlink.hostlist import parse_endpoints

    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(agent.spec), key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(tmp_path / "i.db"),
                                           tick_interval=0.1, alertmanager=am.url))
    store = runtime.plan_store
    try:
        await runtime.start()
        await wait_until(lambda: runtime.store.by_name("node-1") is not None
                         and runtime.store.by_name("node-1").link == "connected", 15, "the agent connected")
        # XID 13 is the application's fault: the shipped xid-application playbook only notifies.
        result = await runtime.fleet.action("node-1", "inject_fault", {"kind": "xid", "code": 13, "gpu": 1})
        assert result.ok, result.message
        await wait_until(lambda: any(i.playbook == "xid-application" for i in store.incidents()), 15, "the incident")
        (rec,) = [i for i in store.incidents() if i.playbook == "xid-application"]
        await wait_until(lambda: rec.id in _by_incident(am), 15, "the alert in Alertmanager")
        labels = _by_incident(am)[rec.id]["labels"]
        assert labels == {"alertname": "xid-application", "node": "node-1", "severity": "warning",
                          "incident": rec.id} | ({"job": labels["job"]} if "job" in labels else {})
        runtime.resolve(rec.id, "the job was fixed", who="alice")
        await wait_until(lambda: rec.id not in _by_incident(am), 15, "the alert resolved in Alertmanager")
    finally:
        await runtime.stop()
        store.close()


def test_cluster_toml_and_the_flag_take_alertmanager_and_refuse_a_bad_url(keys, tmp_path: Path) -> None:
    import subprocess
    import sys

    from gridwatch.console.runtime.config import ConfigError, load_cluster
    from gridwatch.console.runtime.wiring import RuntimeOptions

    base = (f'nodes = "127.0.0.1:{free_port()}"\nkey = "{keys.operator_key}"\n'
            f'known_hosts = "{keys.known_hosts}"\ndb = "incidents.db"\n')
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(base + 'alertmanager = "http://am.example:9093/"\n')
    bad.write_text(base + 'alertmanager = "am.example:9093"\n')
    assert RuntimeOptions.from_cluster(load_cluster(good)).alertmanager == "http://am.example:9093"
    with pytest.raises(ConfigError, match=r"alertmanager: expected an http\(s\) URL of Alertmanager"):
        load_cluster(bad)
    for args in (["console", "--headless", "--cluster", str(bad)],
                 ["console", "--headless", "--cluster", str(good), "--alertmanager", "ftp://am"],
                 ["demo", "--headless", "--alertmanager", "am:9093"]):
        res = subprocess.run([sys.executable, "-m", "gridwatch", *args, "--duration", "0.1"],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.strip().count("\n") == 0 and "alertmanager" in res.stderr and "Traceback" not in res.stderr


async def test_a_server_answering_200_with_a_web_page_is_not_a_delivery() -> None:
    """Something else at Alertmanager's address (a proxy's login page, a web UI) answers 200 with HTML:
    the alerts are kept and retried, and the status says why."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b"<html><body>Please log in</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clock = ManualClock(2_000_000_000.0)
    sink = Alertmanager(f"http://127.0.0.1:{server.server_address[1]}", clock, timeout=2.0, poll_s=0.05)
    try:
        sink.fire(_incident("xid-hardware:node-3:9", opened=clock.now()), "node-3 isolated")
        await wait_until(lambda: sink.status.failures >= 1, 10, "the post judged")
        assert sink.status.sent == 0 and sink.status.queued == 1
        assert "not as Alertmanager does" in sink.status.last_error
    finally:
        await sink.close()
        server.shutdown()
        server.server_close()
