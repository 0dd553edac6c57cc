"""Several consoles, one actor: an etcd lease elects the console that acts, agents fence the others out.

Real etcd (Debian's etcd-server, started per test), real agents on loopback SSH
with real trainer control sockets (``gridwatch.trainer.control_server``), headless
consoles as real processes (``gridwatch console --headless --etcd URL``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
from pathlib import Path

import msgspec
import pytest

from gridwatch.agent.fencing import refusal
from gridwatch.console.runtime.leader import Election, EtcdClient, Role
from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import PYTHON, ROOT, start_agent, stop_agent, wait_until
from tests.etcd_server import running_etcd
from tests.support_leader import OPERATOR, Job, action_events, console, incidents, plan_steps
from tests.support_loop import agents_beside


async def _send(fleet: Fleet, node: str, action: str, fence: int | None, key: str | None,
                args: dict | None = None) -> p.ActionResult:
    return await fleet.action(node, action, args or {}, reason="test", timeout=10, fence=fence, key=key)


async def test_an_agent_refuses_an_older_fencing_token_and_answers_a_repeated_step_across_a_restart(
        keys, tmp_path: Path) -> None:
    state = tmp_path / "node-1.state.json"
    scenes = tmp_path / "scenes"
    ra = await start_agent(keys, name="node-1", state_file=str(state), scene_dir=str(scenes))
    fleet = Fleet(parse_endpoints(ra.spec), FleetOptions(key_path=str(keys.operator_key),
                                                          known_hosts=str(keys.known_hosts)))
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 10, "the link")
        first = await _send(fleet, "node-1", "capture_scene", 42, "inc-a/0")
        assert first.ok, first.message
        again = await _send(fleet, "node-1", "capture_scene", 42, "inc-a/0")
        assert again.ok and again.message == first.message and again.data.get("repeat") is True
        assert len(list(scenes.iterdir())) == 1  # done once
        old = await _send(fleet, "node-1", "isolate", 41, "inc-b/1")
        assert not old.ok and str(old.message) == refusal(41, 42)
        assert str(old.message).startswith("refused: fencing token 41 is older than 42 (a newer console leads; if etcd")
        assert not ra.agent.isolated
        # A console alone sends no token: not fenced, as before.
        assert (await _send(fleet, "node-1", "ping", None, None)).ok
        await fleet.stop()
        await stop_agent(ra)

        # The agent restarts: it still knows who leads and what it did.
        ra = await start_agent(keys, name="node-1", state_file=str(state), scene_dir=str(scenes))
        fleet = Fleet(parse_endpoints(ra.spec), FleetOptions(key_path=str(keys.operator_key),
                                                              known_hosts=str(keys.known_hosts)))
        await fleet.start()
        await wait_until(lambda: fleet.connected == 1, 10, "the link after the restart")
        assert str((await _send(fleet, "node-1", "isolate", 41, None)).message) == refusal(41, 42)
        repeat = await _send(fleet, "node-1", "capture_scene", 43, "inc-a/0")
        assert repeat.ok and repeat.message == first.message
        assert len(list(scenes.iterdir())) == 1
        assert str((await _send(fleet, "node-1", "isolate", 42, None)).message) == refusal(42, 43)
        assert (os.stat(f"{state}.fencing.json").st_mode & 0o077) == 0
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_one_console_leads_a_standby_takes_over_and_an_unreachable_etcd_steps_the_leader_down(
        tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        a = Election(EtcdClient([etcd.url], timeout=0.5), "c1", "console-a", ttl=2.0)
        b = Election(EtcdClient([etcd.url], timeout=0.5), "c1", "console-b", ttl=2.0)
        lines: list[str] = []
        b.on_change.append(lambda s: lines.append(s.line))
        run_a = asyncio.create_task(a.run())
        await wait_until(lambda: a.leading, 10, "console-a to lead")
        run_b = asyncio.create_task(b.run())
        try:
            await wait_until(lambda: b.standing.leader == "console-a", 10, "console-b to see who leads")
            assert lines[-1] == "observer; console-a leads" and not b.leading
            first = a.token
            assert first is not None and a.standing.line == f"leader (token {first})"
            # console-a stops: its lease is revoked at once, console-b leads with a newer token.
            run_a.cancel()
            await asyncio.gather(run_a, return_exceptions=True)
            await wait_until(lambda: b.leading, 5, "console-b to take over")
            assert b.token is not None and b.token > first and lines[-1] == f"leader (token {b.token})"
            # etcd stops answering: console-b steps down once its lease would have lapsed, and says why.
            etcd.pause()
            await wait_until(lambda: b.standing.role is Role.OBSERVER, 2.0 + 1.0, "console-b to step down")
            await wait_until(lambda: "etcd unreachable" in b.standing.line, 3, "console-b to say why no one acts")
            etcd.unpause()
            await wait_until(lambda: b.leading, 10, "console-b to lead again once etcd answers")
        finally:
            etcd.unpause()
            run_b.cancel()
            await asyncio.gather(run_a, run_b, return_exceptions=True)


class _SlowReads(EtcdClient):
    """etcd whose answer to a read, once :attr:`slow` is set, arrives only after this client's next write (or,
    when none comes, after a loaded etcd's two seconds): what the read says may be old when the console hears it."""

    slow = False
    reading = False

    def __init__(self, endpoints: list[str], timeout: float) -> None:
        super().__init__(endpoints, timeout=timeout)
        self.wrote = threading.Event()

    def get(self, key: str, prefix: bool = False) -> list:
        found = super().get(key, prefix)
        if self.slow:
            self.reading = True
            self.wrote.wait(2.0)
        return found

    def replace(self, key: str, mod_revision: int, value: str, lease: int) -> tuple[bool, int]:
        done = super().replace(key, mod_revision, value, lease)
        self.wrote.set()
        return done


async def test_a_take_over_while_the_console_is_reading_etcd_leads_and_stays_leading(tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        a = Election(EtcdClient([etcd.url], timeout=2.0), "c1", "console-a", ttl=4.0)
        client = _SlowReads([etcd.url], timeout=2.0)
        carol = Election(client, "c1", "console-carol", ttl=4.0, campaign=False)
        runs = [asyncio.create_task(a.run())]
        try:
            await wait_until(lambda: a.leading, 10, "console-a to lead")
            runs.append(asyncio.create_task(carol.run()))
            await wait_until(lambda: carol.standing.leader == "console-a", 10, "carol's console to see who leads")
            # The operator takes over while carol's console is reading the key, which still names console-a.
            client.slow = True
            await wait_until(lambda: client.reading, 10, "carol's console to be reading the leader key")
            await carol.take_over()
            assert carol.leading, carol.standing.line
            token = carol.token
            # Its read, answered late, names the leader it replaced: it must not step this console down.
            client.slow = False
            await wait_until(lambda: not a.leading and a.standing.leader == "console-carol", 10,
                             "console-a to see carol lead")
            assert carol.leading and carol.token == token, carol.standing.line
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)


@pytest.mark.timeout(120)
async def test_kill_9_of_the_leader_mid_plan_the_standby_finishes_it_no_step_twice_and_the_paused_one_is_refused(
        keys, tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        names = ["node-1", "node-2", "node-3"]
        job = Job(tmp_path, names)
        agents = []
        consoles: list[subprocess.Popen] = []
        try:
            agents = await agents_beside(keys, job, names, interval=1.0, scenes=tmp_path / "scenes")
            spec = ",".join(a.spec for a in agents)
            dbs = [tmp_path / "a" / "incidents.db", tmp_path / "b" / "incidents.db"]
            logs = [tmp_path / "a.log", tmp_path / "b.log"]
            for db in dbs:
                db.parent.mkdir(mode=0o700)
            consoles.append(console(keys, spec, dbs[0], etcd.url, "alice", logs[0]))
            await wait_until(lambda: "leader (token" in logs[0].read_text(), 30, "console a to lead")
            consoles.append(console(keys, spec, dbs[1], etcd.url, "bob", logs[1]))
            await wait_until(lambda: "observer; alice@" in logs[1].read_text(), 30, "console b to observe")
            await wait_until(lambda: all(len(a.agent.clients) == 2 for a in agents), 30, "both consoles connected")
            await wait_until(lambda: all("training: 3 of 3" in log.read_text() for log in logs), 30,
                             "both consoles to see the job train")

            # The job re-forms as node-2 leaves: the restart finds no trainer on node-1 and node-3 and is
            # sent again and again; that is when the leader dies.
            job.down("node-1")
            job.down("node-3")
            fault = await agents[1].agent.act(OPERATOR, p.Action(id=p.Text("f1"), action=p.Text("inject_fault"),
                                                                 args={"kind": "xid", "gpu": 0, "code": 79}))
            assert fault.ok, fault.message
            await wait_until(lambda: all(incidents(db, "xid-hardware") for db in dbs), 15, "the incident in both")
            assert incidents(dbs[0], "xid-hardware") == incidents(dbs[1], "xid-hardware")
            await wait_until(lambda: action_events(agents[1].agent, "isolate"), 15, "node-2 isolated")
            await wait_until(lambda: action_events(agents[0].agent, "restart_from", ok=False), 15,
                             "the restart meeting the job re-forming")
            consoles[0].send_signal(signal.SIGKILL)
            consoles[0].wait(10)
            killed_at = asyncio.get_running_loop().time()
            await wait_until(lambda: "leader (token" in logs[1].read_text(), 12, "console b to take over")
            assert asyncio.get_running_loop().time() - killed_at < 10
            for name in ("node-1", "node-3"):
                job.up(name)
            await wait_until(lambda: plan_steps(dbs[1], "xid-hardware").get("restart_from_checkpoint", ("",))[0] == "done",
                             30, "console b to finish the restart")
            steps = plan_steps(dbs[1], "xid-hardware")
            assert steps["capture_scene"][0] == steps["isolate_node"][0] == "done", steps
            # No step twice, in every agent's own record.
            assert len(action_events(agents[1].agent, "isolate")) == 1
            assert len(action_events(agents[1].agent, "capture_scene")) == 1
            assert len(list((tmp_path / "scenes" / "node-2").iterdir())) == 1
            for ra in (agents[0], agents[2]):
                assert len(action_events(ra.agent, "restart_from")) == 1
            assert not action_events(agents[1].agent, "restart_from")
            tokens = [int(line.split("token ")[1].rstrip(")")) for log in logs
                      for line in log.read_text().splitlines() if line.startswith("leader (token")]
            assert len(tokens) == 2 and tokens[1] > tokens[0]

            # SIGSTOP of the leader past its lease: a third console takes over and acts; the stopped one,
            # continued, acts on nothing (an observer refuses even its operator's actions), and a request
            # it had in flight with its old token is refused by the agent.
            consoles[1].send_signal(signal.SIGSTOP)
            third = Election(EtcdClient([etcd.url]), "", "carol@test", ttl=5.0)
            third.key = next(line.split("etcd ")[1].split(":")[0] for line in logs[1].read_text().splitlines()
                             if "| INFO" in line and "etcd /gridwatch/" in line)
            running = asyncio.create_task(third.run())
            fleet = Fleet(parse_endpoints(spec), FleetOptions(key_path=str(keys.operator_key),
                                                              known_hosts=str(keys.known_hosts)))
            await fleet.start()
            try:
                await wait_until(lambda: third.leading, 15, "the third console to lead")
                assert third.token is not None and third.token > tokens[1]
                await wait_until(lambda: fleet.connected == 3, 10, "the third console's links")
                assert (await _send(fleet, "node-3", "capture_scene", third.token, "test/0")).ok
                consoles[1].send_signal(signal.SIGCONT)
                # Asynchronously: the agents answer from this test's event loop.
                told = await asyncio.create_subprocess_exec(
                    PYTHON, "-m", "gridwatch", "node", "isolate", "node-3", "--reason", "test", "--socket",
                    str(dbs[1].with_suffix(".sock")), "--timeout", "20", cwd=ROOT,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                said = (await asyncio.wait_for(told.communicate(), 60))[0].decode()
                assert "observer: " in said and "; take over to act" in said, said
                assert not agents[2].agent.isolated
                late = await _send(fleet, "node-3", "isolate", tokens[1], None)  # the old leader's token
                assert str(late.message) == refusal(tokens[1], third.token)
                assert not agents[2].agent.isolated
                await wait_until(lambda: "observer; carol@test leads" in logs[1].read_text(), 10,
                                 "console b to say who leads now")
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                await fleet.stop()
        finally:
            for proc in consoles:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            for ra in agents:
                await ra.agent.trainer.stop()
                await stop_agent(ra)
            job.stop()


def test_the_etcd_url_reaches_the_runtime_from_cluster_toml_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    from gridwatch.console.runtime.config import ConfigError, parse_cluster
    from gridwatch.console.runtime.wiring import RuntimeOptions

    config = parse_cluster('nodes = "n1:8022"\netcd = "http://10.0.0.1:2379"\ncluster = "train-a"\n',
                           str(tmp_path / "cluster.toml"))
    options = RuntimeOptions.from_cluster(config, key_path="k", known_hosts="kh")
    assert options.etcd == ["http://10.0.0.1:2379"] and options.cluster == "train-a"
    with pytest.raises(ConfigError, match="etcd: expected an http"):
        parse_cluster('nodes = "n1:8022"\netcd = "10.0.0.1:2379"\n', "cluster.toml")
    assert msgspec.json.decode(p.encode(p.Action(id=p.Text("1"), action=p.Text("isolate"))))["fence"] is None
