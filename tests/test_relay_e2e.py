"""A headless console whose nodes all sit behind a relay, as deployed: an XID acted on through it, the relay's death said once.

Real agents on loopback SSH, a real ``gridwatch relay`` process, a real
``gridwatch console --headless --relay ADDRESS=HOSTLIST`` process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gridwatch.sshlink.server import Caller
from gridwatch.wire import protocol as p
from tests.conftest import PYTHON, ROOT, free_port, start_agent, wait_until
from tests.support_leader import incidents
from tests.support_relay import action_events, endpoint, spawn_relay, stop

OPERATOR = Caller(username="test", role="operator", key="SHA256:test")


def _console(keys, relay: str, spec: str, db: Path, log: Path) -> subprocess.Popen:  # noqa: ANN001
    cmd = [PYTHON, "-m", "gridwatch", "console", "--headless", "--relay", f"{relay}={spec}", "--key", str(keys.operator_key),
           "--known-hosts", str(keys.known_hosts), "--db", str(db), "--control-socket", str(db.with_suffix(".sock"))]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.timeout(120)
async def test_an_xid_behind_a_relay_is_isolated_once_and_a_dead_relay_is_one_line(keys, tmp_path: Path) -> None:
    # A heartbeat every 0.5 s (lost after 1.5 s): three agents share this process's loop with the test, and on
    # a loaded machine a shorter one is lost for want of a CPU, which a playbook rightly acts on.
    agents = [await start_agent(keys, name=f"node-{i}", interval=0.5) for i in (1, 2, 3)]
    spec = ",".join(str(endpoint(ra)) for ra in agents)
    port = free_port()
    relay_log, console_log = tmp_path / "relay.log", tmp_path / "console.log"
    relay = spawn_relay(keys, port, spec, relay_log)
    db = tmp_path / "c" / "incidents.db"
    db.parent.mkdir(mode=0o700)
    console: subprocess.Popen | None = None
    try:
        await wait_until(lambda: "listening on 127.0.0.1:" in relay_log.read_text(), 15, "the relay to listen")
        console = _console(keys, f"127.0.0.1:{port}", spec, db, console_log)
        await wait_until(lambda: f"relay 127.0.0.1:{port} up (3 nodes)" in console_log.read_text(), 30, "the relay up")
        # Every node is the relay's: the agents see one client, the relay, not the console.
        await wait_until(lambda: all(len(ra.agent.clients) == 1 for ra in agents), 15, "the relay's links")
        fault = await agents[1].agent.act(OPERATOR, p.Action(id=p.Text("f1"), action=p.Text("inject_fault"),
                                                             args={"kind": "xid", "gpu": 0, "code": 79}))
        assert fault.ok, fault.message
        await wait_until(lambda: action_events(agents[1], "isolate"), 20, "node-2 isolated through the relay")
        assert "incident" in console_log.read_text()
        assert not action_events(agents[0], "isolate") and not action_events(agents[2], "isolate")

        relay.send_signal(signal.SIGKILL)
        relay.wait(10)
        killed = time.monotonic()
        await wait_until(lambda: "(3 nodes behind it)" in console_log.read_text(), 20, "the console to say the relay died")
        # Down for more than three heartbeats (1.5 s) before it comes back: the scenario, not a synchronisation.
        await wait_until(lambda: time.monotonic() - killed > 3.0, 10, "the relay down past three heartbeats")
        said = [line for line in console_log.read_text().splitlines() if "behind it" in line]
        assert len(said) == 1 and f"relay 127.0.0.1:{port}" in said[0], said
        relay = spawn_relay(keys, port, spec, relay_log)
        await wait_until(lambda: console_log.read_text().count(f"relay 127.0.0.1:{port} up (3 nodes)") == 2, 30,
                         "the relay back")
        assert len(action_events(agents[1], "isolate")) == 1  # the fault was acted on once, relay death or not
        # The relay was down far longer than three heartbeats: that was the relay's silence, not its nodes'.
        assert incidents(db, "heartbeat-lost") == []
        text = console_log.read_text()
        # Down once (not at each retry), and its nodes not one by one: the relay's line says it for them.
        assert len([line for line in text.splitlines() if "behind it" in line]) == 1, text
        assert not [line for line in text.splitlines() if line.startswith("node ") and "relay" in line], text
    finally:
        if console is not None:
            console.send_signal(signal.SIGTERM)
            console.wait(20)
        relay.send_signal(signal.SIGTERM)
        relay.wait(10)
        for ra in agents:
            await stop(ra)


def test_the_status_line_names_a_dead_relay_once_for_its_nodes_and_counts_several() -> None:
    from gridwatch.console.fleet.state import StateStore
    from gridwatch.console.runtime.core import ConsoleRuntime
    from gridwatch.sshlink.client import LinkState, NodeLink, RelayStatus
    from gridwatch.sshlink.hostlist import Endpoint

    runtime = ConsoleRuntime(StateStore())

    def relay(host: str, nodes: int, state: LinkState, error: str | None = None) -> RelayStatus:
        carried = {f"n{i}:8022": NodeLink(endpoint=Endpoint(f"n{i}", 8022), name=f"n{i}") for i in range(nodes)}
        return RelayStatus(endpoint=Endpoint(host, 8023), carried=carried, state=state, last_error=error)

    assert runtime.relay_alert == ""
    runtime.on_relay(relay("head1", 500, LinkState.DOWN, "relay head1:8023: connection refused (is the relay running?)"))
    assert runtime.relay_alert == "relay head1:8023: connection refused (is the relay running?) (500 nodes behind it)"
    runtime.on_relay(relay("head2", 1, LinkState.DOWN))
    assert runtime.relay_alert == "2 relays down: head1:8023, head2:8023"
    runtime.on_relay(relay("head1", 500, LinkState.CONNECTED))
    runtime.on_relay(relay("head2", 1, LinkState.CONNECTED))
    assert runtime.relay_alert == ""
