"""Scenes kept where the operator is: each captured bundle copied off its node, checked, capped, private, exported.

Real agents (in this loop, or as processes the tests kill) on loopback SSH, the console's runtime built by
``build_runtime`` as ``gridwatch console`` builds it, a real SQLite incident store and the real CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gridwatch.console.cli import main
from gridwatch.console.runtime.config import ConfigError, load_cluster
from gridwatch.console.runtime.scene_copy import SceneKeeper
from gridwatch.console.runtime.scene_store import MANIFEST, PARTIAL, CopyState, scenes_path_for
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import free_port, spawn_agent, start_agent, stop_agent, wait_until
from tests.support_cli import cluster_toml, gridwatch


def _fleet(keys, spec: str, key: str = "operator") -> Fleet:  # noqa: ANN001
    path = keys.operator_key if key == "operator" else keys.viewer_key
    return Fleet(parse_endpoints(spec), FleetOptions(key_path=str(path), known_hosts=str(keys.known_hosts)))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Reads:
    """The keeper's read over the real fleet, with a test's hand on what comes back."""

    def __init__(self, fleet: Fleet, tamper: Any = None) -> None:
        self.fleet = fleet
        self.tamper = tamper
        self.chunks = 0

    async def __call__(self, node: str, args: dict[str, Any], timeout: float) -> p.ActionResult:
        result = await self.fleet.action(node, p.AgentAction.READ_SCENE, args, reason="test", timeout=timeout)
        if "file" in args:
            self.chunks += 1
        return self.tamper(args, result) if self.tamper is not None else result


@pytest.fixture
async def linked(keys, tmp_path: Path) -> AsyncIterator[tuple[Any, Fleet, Path]]:
    """An agent in this loop with a scene just captured, a fleet linked to it, and the bundle's path."""
    ra = await start_agent(keys, name="node-1", scene_dir=str(tmp_path / "scenes"))
    fleet = _fleet(keys, ra.spec)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 10, "the link")
        captured = await fleet.action("node-1", "capture_scene", {"incident": "inc-1"}, reason="test")
        assert captured.ok, captured.message
        yield ra, fleet, Path(str(captured.data["path"]))
    finally:
        await fleet.stop()
        await stop_agent(ra)


def _manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / MANIFEST).read_text())


# --------------------------------------------------------------------------- the loop


@pytest.mark.timeout(90)
async def test_xid_79_scene_is_in_the_console_before_isolation_and_outlives_the_node(
        keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    scenes = tmp_path / "node-scenes"
    proc = spawn_agent(keys, port, "node-1", "--scene-dir", str(scenes), log=tmp_path / "agent.log")
    db = tmp_path / "incidents.db"
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(f"127.0.0.1:{port}"),
                                           key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                           db_path=str(db), operator="alice", tick_interval=0.1))
    store = runtime.plan_store
    try:
        await runtime.start()
        await wait_until(lambda: len(runtime.engine.live_nodes()) == 1, 30, "the agent process connected")
        fault = await runtime.fleet.action("node-1", "inject_fault", {"kind": "xid", "code": 79, "gpu": 0})
        assert fault.ok, fault.message
        await wait_until(lambda: any(i.playbook == "xid-hardware" for i in store.incidents()), 15, "the incident")
        (inc,) = [i for i in store.incidents() if i.playbook == "xid-hardware"]
        await wait_until(lambda: any(s.step == "isolate_node" and s.state in ("done", "failed")
                                     for s in store.steps(inc.id)), 30, "the isolate step")
        steps = {s.step: s for s in store.steps(inc.id)}
        capture, isolate = steps["capture_scene"], steps["isolate_node"]
        assert capture.state == "done" and isolate.state == "done", (capture.outcome, isolate.outcome)
        # Where the evidence lives, on the node and at the console, is in the step's outcome and the audit log.
        (bundle,) = list((scenes_path_for(db) / inc.id / "node-1").iterdir())
        assert f"console copy whole at {bundle}" in capture.outcome and str(scenes) in capture.outcome
        audit = store.audit_log(inc.id)
        copied = next(i for i, a in enumerate(audit) if a.what == "scene copy from node-1")
        isolating = next(i for i, a in enumerate(audit) if a.what.startswith("isolate_node") and a.phase == "before")
        assert copied < isolating and audit[copied].outcome.startswith("whole at")
        manifest = _manifest(bundle)
        assert manifest["state"] == "whole" and manifest["finished_at"] <= isolate.started_at
        assert {"frames.jsonl", "meta.json"} <= {f["name"] for f in manifest["files"]}
        assert not (bundle / PARTIAL).exists()
        for level in (scenes_path_for(db), bundle.parent.parent, bundle.parent, bundle):
            assert _mode(level) == 0o700, level
        assert all(_mode(f) == 0o600 for f in bundle.iterdir())
    finally:
        await runtime.stop()
        store.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # The node is gone and so is its disk's scene: the console's copy is what the vendor gets.
    shutil.rmtree(scenes)
    out = tmp_path / "ticket.tar.gz"
    assert main(["scene", inc.id, "--db", str(db), "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert "whole" in said.out and said.err == ""
    assert _mode(out) == 0o600
    with tarfile.open(out) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    top = f"{inc.id}/node-1/{bundle.name}"
    kept = json.loads(members[f"{top}/{MANIFEST}"])
    assert kept["files"] and all(_sha(members[f"{top}/{f['name']}"]) == f["sha256"] for f in kept["files"])


async def test_an_operators_capture_is_copied_too_under_the_open_incident_or_its_own_name(
        keys, tmp_path: Path) -> None:
    ra = await start_agent(keys, name="node-1", scene_dir=str(tmp_path / "node-scenes"))
    db = tmp_path / "incidents.db"
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(ra.spec), key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(db), operator="alice",
                                           tick_interval=0.1))
    try:
        await runtime.start()
        await wait_until(lambda: len(runtime.engine.live_nodes()) == 1, 15, "the agent connected")
        # No incident on the node: the copy is kept under the operator's own name, and said where.
        kept = await runtime.node_action("node-1", p.AgentAction.CAPTURE_SCENE, "a look before the reboot")
        assert kept.ok and "console copy whole at" in kept.message, kept.message
        (own,) = [d for d in scenes_path_for(db).iterdir() if d.name.startswith("operator-")]
        (bundle,) = list((own / "node-1").iterdir())
        assert _manifest(bundle)["state"] == "whole" and str(bundle) in kept.message
        audit = [a for a in runtime.plan_store.audit_log() if a.what == "scene copy from node-1"]
        assert audit and audit[-1].outcome.startswith("whole at")
        assert main(["scene", own.name, "--db", str(db), "--out", str(tmp_path / "own.tar.gz")]) == 0
        # With an incident open on the node, the operator's capture is that incident's evidence.
        fault = await runtime.fleet.action("node-1", "inject_fault", {"kind": "xid", "code": 13, "gpu": 0})
        assert fault.ok, fault.message
        await wait_until(lambda: any(i.node == "node-1" for i in runtime.plan_store.incidents()), 15, "an incident")
        (inc,) = [i for i in runtime.plan_store.incidents() if i.node == "node-1"]
        again = await runtime.node_action("node-1", p.AgentAction.CAPTURE_SCENE, "one more look")
        assert again.ok and "console copy whole at" in again.message, again.message
        assert str(scenes_path_for(db) / inc.id / "node-1") in again.message
    finally:
        await runtime.stop()
        runtime.plan_store.close()
        await stop_agent(ra)


# --------------------------------------------------------------------------- the copy


async def test_a_bundle_over_scene_max_keeps_the_smallest_files_and_says_what_was_left_out(
        linked, tmp_path: Path) -> None:
    _, fleet, on_node = linked
    (on_node / "core.bin").write_bytes(os.urandom(300_000))
    reads = Reads(fleet)
    keeper = SceneKeeper(tmp_path / "store", reads, max_bytes=100_000)
    copy = await keeper.keep("node-1", "inc-1", str(on_node))
    assert copy.state is CopyState.CAPPED and copy.left_out == ["core.bin"]
    bundle = tmp_path / "store" / "inc-1" / "node-1" / on_node.name
    manifest = _manifest(bundle)
    assert manifest["state"] == "capped" and manifest["scene_max"] == 100_000
    (left,) = manifest["left_out"]
    assert left["name"] == "core.bin" and left["size"] == 300_000 and "over scene_max" in left["why"]
    assert not (bundle / "core.bin").exists() and not (bundle / PARTIAL).exists()
    for f in manifest["files"]:
        assert _sha((bundle / f["name"]).read_bytes()) == f["sha256"] == _sha((on_node / f["name"]).read_bytes())


async def test_a_corrupted_chunk_is_not_kept_as_if_whole(linked, tmp_path: Path) -> None:
    _, fleet, on_node = linked
    payload = os.urandom(1_500_000)  # three chunks
    (on_node / "core.bin").write_bytes(payload)

    def flip(args: dict[str, Any], result: p.ActionResult) -> p.ActionResult:
        if args.get("file") == "core.bin" and args.get("offset") == 524288 and result.chunk:
            bad = bytes([result.chunk[0] ^ 0xFF]) + result.chunk[1:]
            return msgspec.structs.replace(result, chunk=bad)
        return result

    copy = await SceneKeeper(tmp_path / "store", Reads(fleet, flip), max_bytes=64 * 10**6).keep(
        "node-1", "inc-1", str(on_node))
    assert copy.state is CopyState.FAILED and "core.bin did not match" in copy.why
    bundle = tmp_path / "store" / "inc-1" / "node-1" / on_node.name
    assert sorted(x.name for x in bundle.iterdir() if x.name.startswith(("core", ".core"))) == []
    manifest = _manifest(bundle)
    assert manifest["state"] == "failed" and [f["name"] for f in manifest["failed"]] == ["core.bin"]
    assert manifest["failed"][0]["sha256"] == _sha(payload) != manifest["failed"][0]["got"]
    assert "core.bin" not in {f["name"] for f in manifest["files"]} and manifest["files"]
    partial = json.loads((bundle / PARTIAL).read_text())
    assert partial["state"] == "failed" and [m["name"] for m in partial["missing"]] == ["core.bin"]
    assert "meta.json" in partial["arrived"]


@pytest.mark.timeout(60)
async def test_a_node_that_dies_during_the_copy_leaves_a_partial_bundle_that_says_so(keys, tmp_path: Path) -> None:
    port = free_port()
    scenes = tmp_path / "node-scenes"
    proc = spawn_agent(keys, port, "node-1", "--scene-dir", str(scenes), log=tmp_path / "agent.log")
    fleet = _fleet(keys, f"127.0.0.1:{port}")
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 30, "the agent process connected")
        captured = await fleet.action("node-1", "capture_scene", {"incident": "inc-1"}, reason="test")
        assert captured.ok, captured.message
        on_node = Path(str(captured.data["path"]))
        (on_node / "core.bin").write_bytes(os.urandom(8 * 2**20))  # 16 chunks

        def kill_after_first(args: dict[str, Any], result: p.ActionResult) -> p.ActionResult:
            if args.get("file") == "core.bin" and args.get("offset") == 0:
                proc.send_signal(signal.SIGKILL)
            return result

        keeper = SceneKeeper(tmp_path / "store", Reads(fleet, kill_after_first), max_bytes=64 * 10**6,
                             chunk_timeout=3.0)
        copy = await keeper.keep("node-1", "inc-1", str(on_node))
    finally:
        await fleet.stop()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # The link's own words: the node is gone, or did not answer in time.
    said = ("core.bin: node-1 is not connected", "core.bin: node-1 did not answer read_scene within 3 s")
    assert copy.state is CopyState.PARTIAL and "the copy stopped before it ended" in copy.why
    assert any(s in copy.why for s in said), copy.why
    bundle = tmp_path / "store" / "inc-1" / "node-1" / on_node.name
    partial = json.loads((bundle / PARTIAL).read_text())
    assert partial["state"] == "partial" and partial["why"] == copy.why
    assert {"frames.jsonl", "meta.json"} <= set(partial["arrived"])
    (missing,) = partial["missing"]
    assert missing["name"] == "core.bin" and missing["size"] == 8 * 2**20 and missing["why"] == copy.why
    assert not (bundle / "core.bin").exists() and not (bundle / ".core.bin.part").exists()
    assert _manifest(bundle)["state"] == "partial"


async def test_a_copy_is_not_eaten_by_the_request_budget_and_the_budget_still_holds(keys, tmp_path: Path) -> None:
    ra = await start_agent(keys, name="node-1", scene_dir=str(tmp_path / "scenes"), action_rate=0.01, action_burst=2)
    fleet = _fleet(keys, ra.spec)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 10, "the link")
        captured = await fleet.action("node-1", "capture_scene", {"incident": "inc-1"}, reason="test")  # 1 of 2
        on_node = Path(str(captured.data["path"]))
        (on_node / "core.bin").write_bytes(os.urandom(3 * 2**20))
        reads = Reads(fleet)
        copy = await SceneKeeper(tmp_path / "store", reads, max_bytes=64 * 10**6).keep("node-1", "inc-1",
                                                                                        str(on_node))  # 2 of 2
        assert copy.state is CopyState.WHOLE, copy.line()
        assert reads.chunks >= 6
        refused = await fleet.action("node-1", "ping", {}, reason="test")
        assert not refused.ok and "over its budget" in refused.message
    finally:
        await fleet.stop()
        await stop_agent(ra)


# --------------------------------------------------------------------------- what the agent serves


async def test_the_agent_serves_only_regular_files_inside_its_scene_dir(linked, keys, tmp_path: Path) -> None:
    ra, fleet, on_node = linked
    secret = tmp_path / "secret.txt"
    secret.write_text("not evidence")
    (on_node / "escape").symlink_to(secret)
    (tmp_path / "scenes" / "elsewhere").symlink_to(tmp_path)
    scene = on_node.name

    async def read(**args: Any) -> p.ActionResult:
        return await fleet.action("node-1", "read_scene", args, reason="test", timeout=10)

    for args in ({"scene": "../"}, {"scene": ".."}, {"scene": str(tmp_path)}, {"scene": "elsewhere"},
                 {"scene": scene, "file": "../../secret.txt", "offset": 0, "length": 10},
                 {"scene": scene, "file": str(secret), "offset": 0, "length": 10},
                 {"scene": scene, "file": "escape", "offset": 0, "length": 10},
                 {"scene": "elsewhere", "file": "secret.txt", "offset": 0, "length": 10},
                 {"scene": scene, "file": "meta.json", "offset": -1, "length": 10}):
        answer = await read(**args)
        assert not answer.ok and answer.chunk is None, (args, answer.message)
        assert "refused" in answer.message or "no scene" in answer.message or "must be" in answer.message, args
    listing = await read(scene=scene)
    assert listing.ok and {"name": "escape", "why": "a symbolic link: not served"} in listing.data["listing"]["skipped"]
    assert "escape" not in {f["name"] for f in listing.data["listing"]["files"]}
    good = await read(scene=scene, file="meta.json", offset=0, length=100_000)
    assert good.ok and good.chunk == (on_node / "meta.json").read_bytes()
    viewer = _fleet(keys, ra.spec, key="viewer")
    await viewer.start()
    try:
        await wait_until(lambda: viewer.connected == 1, 10, "the viewer's link")
        refused = await viewer.action("node-1", "read_scene", {"scene": scene, "file": "meta.json", "offset": 0},
                                      reason="test", timeout=10)
        assert not refused.ok and "operator role" in refused.message and refused.chunk is None
    finally:
        await viewer.stop()


# --------------------------------------------------------------------------- config and the CLI


def test_scene_max_flows_from_cluster_toml_and_a_bad_one_is_one_line(tmp_path: Path, keys) -> None:
    options = RuntimeOptions.from_cluster(load_cluster(cluster_toml(tmp_path, keys, 'scene_max = "8MB"\n')))
    assert options.scene_max == 8 * 10**6
    assert RuntimeOptions.from_cluster(load_cluster(cluster_toml(tmp_path, keys))).scene_max == 64 * 10**6
    for bad in ('scene_max = "lots"', "scene_max = 0", "scene_max = true"):
        with pytest.raises(ConfigError) as info:
            load_cluster(cluster_toml(tmp_path, keys, bad + "\n"))
        text = str(info.value)
        assert "scene_max: expected the most of one node's scene" in text and "\n" not in text
    bad_file = cluster_toml(tmp_path, keys, 'scene_max = "lots"\n')
    assert main(["scene", "inc-1", "--cluster", str(bad_file)]) == 2
    out = gridwatch("console", "--headless", "--cluster", str(bad_file), "--duration", "0.1")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "scene_max" in out.stderr
    assert "Traceback" not in out.stderr


def test_scene_cli_says_not_found_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "incidents.db"
    assert main(["scene", "inc-1", "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no scene kept for inc-1 in {scenes_path_for(db)}" in err
    assert main(["scene", "../etc", "--db", str(db)]) == 2
    assert main(["scene", "..", "--db", str(db)]) == 2
    with pytest.raises(SystemExit) as done:
        main(["scene", "--help"])
    assert done.value.code == 0 and "MANIFEST.json" in capsys.readouterr().out


async def test_a_scene_is_copied_whole_through_a_relay(keys, tmp_path: Path) -> None:
    from gridwatch.relay.service import Relay, RelayKeys
    from gridwatch.sshlink.hostlist import Endpoint

    ra = await start_agent(keys, name="node-1", scene_dir=str(tmp_path / "scenes"))
    relay = Relay(name="rack1", nodes=[Endpoint("127.0.0.1", ra.port)], keys=RelayKeys.from_dir(keys.dir),
                  backoff_min=0.05, backoff_max=0.3)
    relay_port = await relay.start("127.0.0.1", 0)
    fleet = Fleet([], FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts)),
                  relays={Endpoint("127.0.0.1", relay_port): [Endpoint("127.0.0.1", ra.port)]})
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1 and fleet.find("node-1") is not None
                         and fleet.find("node-1").role == "operator", 15, "the node through the relay")
        captured = await fleet.action("node-1", "capture_scene", {"incident": "inc-1"}, reason="test")
        assert captured.ok, captured.message
        on_node = Path(str(captured.data["path"]))
        payload = os.urandom(2 * 2**20 + 7)
        (on_node / "core.bin").write_bytes(payload)
        copy = await SceneKeeper(tmp_path / "store", Reads(fleet), max_bytes=64 * 10**6).keep(
            "node-1", "inc-1", str(on_node))
        assert copy.state is CopyState.WHOLE, copy.line()
        assert (tmp_path / "store" / "inc-1" / "node-1" / on_node.name / "core.bin").read_bytes() == payload
    finally:
        await fleet.stop()
        await relay.close()
        await stop_agent(ra)


@pytest.mark.timeout(60)
async def test_a_console_that_cannot_keep_the_scene_still_isolates_and_says_so(keys, tmp_path: Path) -> None:
    ra = await start_agent(keys, name="node-1", scene_dir=str(tmp_path / "scenes"))
    db = tmp_path / "incidents.db"
    scenes_path_for(db).write_text("a file where the scene store should be")
    runtime = build_runtime(RuntimeOptions(endpoints=parse_endpoints(ra.spec), key_path=str(keys.operator_key),
                                           known_hosts=str(keys.known_hosts), db_path=str(db), operator="alice",
                                           tick_interval=0.1))
    store = runtime.plan_store
    try:
        await runtime.start()
        await wait_until(lambda: len(runtime.engine.live_nodes()) == 1, 20, "the node")
        ra.agent.event("xid", "GPU has fallen off the bus", severity="critical", gpu=0, code=79)
        await wait_until(lambda: any(i.playbook == "xid-hardware" for i in store.incidents()), 10, "the incident")
        (inc,) = [i for i in store.incidents() if i.playbook == "xid-hardware"]
        await wait_until(lambda: any(s.step == "isolate_node" and s.state in ("done", "failed")
                                     for s in store.steps(inc.id)), 20, "the isolate step")
        steps = {s.step: s for s in store.steps(inc.id)}
        assert steps["capture_scene"].state == "done" and steps["isolate_node"].state == "done"
        assert "console copy not_copied: the console could not keep it" in steps["capture_scene"].outcome
        assert ra.agent.isolated
    finally:
        await runtime.stop()
        store.close()
        await stop_agent(ra)


async def test_a_copy_that_takes_too_long_stops_and_says_the_rest_stays_on_the_node(linked, tmp_path: Path) -> None:
    _, fleet, on_node = linked
    (on_node / "core.bin").write_bytes(os.urandom(8 * 2**20))
    now = [0.0]
    reads = Reads(fleet)

    def slow(args: dict[str, Any], result: p.ActionResult) -> p.ActionResult:
        now[0] += 5.0 if args.get("file") == "core.bin" else 0.0  # each chunk of the big file "takes" 5 s
        return result

    reads.tamper = slow
    copy = await SceneKeeper(tmp_path / "store", reads, max_bytes=64 * 10**6, time_limit=12.0,
                             monotonic=lambda: now[0]).keep("node-1", "inc-1", str(on_node))
    assert copy.state is CopyState.PARTIAL and "took longer than 12 s, the rest stays on the node" in copy.why
    bundle = tmp_path / "store" / "inc-1" / "node-1" / on_node.name
    partial = json.loads((bundle / PARTIAL).read_text())
    assert [m["name"] for m in partial["missing"]] == ["core.bin"] and "meta.json" in partial["arrived"]


async def test_the_export_names_a_kept_file_that_no_longer_matches_its_checksum(
        linked, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, fleet, on_node = linked
    db = tmp_path / "incidents.db"
    copy = await SceneKeeper(scenes_path_for(db), Reads(fleet), max_bytes=64 * 10**6).keep("node-1", "inc-1",
                                                                                           str(on_node))
    assert copy.state is CopyState.WHOLE and copy.where is not None
    (copy.where / "meta.json").write_text("{}")  # changed on the console's disk since
    out = tmp_path / "t.tar.gz"
    assert main(["scene", "inc-1", "--db", str(db), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{on_node.name}/meta.json no longer matches its sha256" in err


async def test_a_repeated_capture_step_still_names_its_bundle_across_an_agent_restart(keys, tmp_path: Path) -> None:
    # A console finishing a plan another left half-done repeats the step: the agent answers with the first
    # outcome, and where its scene is, so that console copies the scene too.
    state, scenes = tmp_path / "node-1.state.json", tmp_path / "scenes"
    ra = await start_agent(keys, name="node-1", state_file=str(state), scene_dir=str(scenes))
    fleet = _fleet(keys, ra.spec)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 10, "the link")
        first = await fleet.action("node-1", "capture_scene", {"incident": "inc-1"}, reason="t", fence=7, key="inc-1/0")
        assert first.ok and first.data["path"]
        await fleet.stop()
        await stop_agent(ra)
        ra = await start_agent(keys, name="node-1", state_file=str(state), scene_dir=str(scenes))
        fleet = _fleet(keys, ra.spec)
        await fleet.start()
        await wait_until(lambda: fleet.connected == 1, 10, "the link after the restart")
        again = await fleet.action("node-1", "capture_scene", {"incident": "inc-1"}, reason="t", fence=8, key="inc-1/0")
        assert again.ok and again.data.get("repeat") is True and again.data["path"] == first.data["path"]
        assert len(list(scenes.iterdir())) == 1
        copy = await SceneKeeper(tmp_path / "store", Reads(fleet), max_bytes=64 * 10**6).keep(
            "node-1", "inc-1", str(again.data["path"]))
        assert copy.state is CopyState.WHOLE, copy.line()
    finally:
        await fleet.stop()
        await stop_agent(ra)
