"""What a console believes of etcd: it logs in when etcd asks for it, it says so when the leader key is not a
console's, and it ignores step outcomes no leader it saw published. Real etcd (Debian's etcd-server)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gridwatch.console.runtime.leader import Election, EtcdAccess, EtcdClient, EtcdError, _b64, prefix_end
from tests.conftest import wait_until
from tests.etcd_server import running_etcd


def _enable_auth(url: str) -> None:
    """etcd's own set-up for a shared cluster: root, and a user that may read and write /gridwatch/ only."""
    admin = EtcdClient([url])
    for path, body in (
        ("auth/role/add", {"name": "root"}),
        ("auth/user/add", {"name": "root", "password": "root-secret"}),
        ("auth/user/grant", {"user": "root", "role": "root"}),
        ("auth/role/add", {"name": "gridwatch"}),
        ("auth/role/grant", {"name": "gridwatch", "perm": {"key": _b64("/gridwatch/"),
                                                           "range_end": prefix_end("/gridwatch/"),
                                                           "permType": "READWRITE"}}),
        ("auth/user/add", {"name": "gridwatch", "password": "console-secret"}),
        ("auth/user/grant", {"user": "gridwatch", "role": "gridwatch"}),
        ("auth/enable", {}),
    ):
        admin.call(path, body)


async def _stop(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_with_etcd_auth_on_only_a_console_with_its_password_leads(tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        _enable_auth(etcd.url)
        with pytest.raises(EtcdError, match="refused"):
            EtcdClient([etcd.url], timeout=1.0).get("/gridwatch/c1/leader")  # anyone else: refused
        wrong = EtcdClient([etcd.url], timeout=1.0, access=EtcdAccess(user="gridwatch", password="guess"))
        with pytest.raises(EtcdError, match="refused"):
            wrong.get("/gridwatch/c1/leader")
        client = EtcdClient([etcd.url], timeout=1.0, access=EtcdAccess(user="gridwatch", password="console-secret"))
        election = Election(client, "c1", "console-a", ttl=2.0)
        run = asyncio.create_task(election.run())
        try:
            await wait_until(lambda: election.leading, 10, "the console with the password to lead")
            client._token = "stale"  # etcd restarted or the token lapsed: it logs in again, the lead holds
            await wait_until(lambda: client._token != "stale", 5, "the console to log in again")
            assert election.leading
        finally:
            await _stop(run)


async def test_a_leader_key_with_no_lease_is_said_not_obeyed_in_silence(tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        mallory = EtcdClient([etcd.url])
        mallory.put("/gridwatch/c1/leader", "mallory")  # no lease: it never lapses
        election = Election(EtcdClient([etcd.url], timeout=1.0), "c1", "console-a", ttl=2.0)
        run = asyncio.create_task(election.run())
        try:
            await wait_until(lambda: election.standing.suspect, 10, "the console to judge the leader key")
            assert not election.leading
            line = election.standing.line
            assert "has no lease: no gridwatch console wrote it" in line and "etcdctl del /gridwatch/c1/leader" in line
        finally:
            await _stop(run)


async def test_step_outcomes_only_count_from_a_leader_the_console_saw(tmp_path: Path) -> None:
    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        leader = Election(EtcdClient([etcd.url], timeout=1.0), "c1", "console-a", ttl=2.0)
        standby = Election(EtcdClient([etcd.url], timeout=1.0), "c1", "console-b", ttl=2.0)
        runs = [asyncio.create_task(leader.run())]
        try:
            await wait_until(lambda: leader.leading, 10, "console-a to lead")
            runs.append(asyncio.create_task(standby.run()))
            await wait_until(lambda: standby.standing.leader == "console-a", 10, "console-b to see it lead")
            leader.publish_step("xid-hardware:node-1:1", 1, "done", "isolated")
            await leader.flush()
            # A third party with write access fakes "done" for the next plan's capture and isolation.
            fake = json.dumps({"state": "done", "outcome": "done by mallory", "token": 999_999})
            EtcdClient([etcd.url]).put("/gridwatch/c1/steps/xid-hardware:node-2:1/0", fake)
            outcomes = await standby.step_outcomes()
            assert [(o.incident, o.index, o.state) for o in outcomes] == [("xid-hardware:node-1:1", 1, "done")]
            # A deposed leader publishes nothing: the key is no longer the one it won.
            await _stop(runs.pop(0))
            await wait_until(lambda: standby.leading, 10, "console-b to take the lead")
            assert not await asyncio.to_thread(leader.client.put_if, leader.key, leader.fence or 0,
                                               "/gridwatch/c1/steps/late/0", "{}")
        finally:
            await _stop(*runs)


def test_etcd_credentials_come_from_cluster_toml_and_a_password_others_can_read_is_refused(tmp_path: Path) -> None:
    from gridwatch.console.runtime.config import ConfigError, parse_cluster
    from gridwatch.console.runtime.wiring import RuntimeOptions

    secret = tmp_path / "etcd.pass"
    secret.write_text("console-secret\n")
    secret.chmod(0o600)
    text = ('nodes = "n1:8022"\netcd = "https://10.0.0.1:2379"\netcd_user = "gridwatch"\n'
            'etcd_password_file = "etcd.pass"\netcd_ca = "ca.pem"\n')
    config = parse_cluster(text, str(tmp_path / "cluster.toml"))
    access = RuntimeOptions.from_cluster(config, key_path="k", known_hosts="kh").etcd_access
    assert access is not None and (access.user, access.password) == ("gridwatch", "console-secret")
    assert access.ca == str(tmp_path / "ca.pem")
    secret.chmod(0o644)
    with pytest.raises(ValueError, match=r"etcd_password_file: .*etcd.pass may be read by others \(mode 0644\)"):
        RuntimeOptions.from_cluster(config, key_path="k", known_hosts="kh")
    with pytest.raises(ConfigError, match="etcd_password_file: expected a path to a file only its owner can read"):
        parse_cluster('nodes = "n1:8022"\netcd_user = "gridwatch"\n', "cluster.toml")


async def test_after_etcd_is_rebuilt_empty_one_command_lifts_the_next_leaders_token_past_the_agents(
        tmp_path: Path) -> None:
    from gridwatch.agent.fencing import FenceBook
    from tests.support_cli import gridwatch

    with running_etcd(tmp_path / "etcd") as etcd:
        if etcd is None:
            pytest.skip("etcd could not start here (/usr/bin/etcd)")
        book = FenceBook(None)
        book.newest = 28  # what the agents kept from the etcd that was lost
        first = Election(EtcdClient([etcd.url], timeout=1.0), "c1", "console-a", ttl=2.0)
        run = asyncio.create_task(first.run())
        await wait_until(lambda: first.leading, 10, "a console to lead the rebuilt etcd")
        refused = book.admit(first.token)
        assert refused is not None and "gridwatch fencing raise --past 28" in refused
        await _stop(run)
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(f'nodes = "n1:8022"\netcd = "{etcd.url}"\ncluster = "c1"\n')
        done = gridwatch("fencing", "raise", "--past", "28", "--cluster", str(cluster))
        assert done.returncode == 0, done.stderr
        assert "the next leader's token is newer than 28" in done.stdout
        second = Election(EtcdClient([etcd.url], timeout=1.0), "c1", "console-b", ttl=2.0)
        run = asyncio.create_task(second.run())
        try:
            await wait_until(lambda: second.leading, 10, "the next console to lead")
            assert second.token is not None and second.token > 28 and book.admit(second.token) is None
            again = gridwatch("fencing", "raise", "--past", "28", "--cluster", str(cluster))
            assert again.returncode == 0 and "nothing to do" in again.stdout
        finally:
            await _stop(run)
