"""End to end: the real console against real agents on loopback, in-process and in tmux."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import pytest

from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.console.tui.app import GridwatchApp
from gridwatch.console.tui.screens import FleetScreen, NodeScreen
from gridwatch.console.tui.widgets import GpuHeatmap, TextTable
from gridwatch.sshlink.hostlist import parse_endpoints
from tests.conftest import ROOT, start_agent, stop_agent, wait_until
from tests.support_app import shown

pytestmark = pytest.mark.slow


async def test_the_app_shows_live_agents_and_their_gpus(keys, tmp_path) -> None:
    agents = [await start_agent(keys, name=f"gpu-node-{i}", gpus=2) for i in (1, 2)]
    try:
        options = RuntimeOptions(parse_endpoints(",".join(a.spec for a in agents)), str(keys.operator_key),
                                 str(keys.known_hosts), db_path=str(tmp_path / "incidents.db"))
        app = GridwatchApp(build_runtime(options), tick_seconds=0.1)
        async with app.run_test(size=(160, 50)) as pilot:
            await wait_until(lambda: shown(app, FleetScreen), 15, "the fleet view")
            table = app.screen.query_one("#node-table", TextTable)
            await wait_until(lambda: sorted(table.keys) == ["gpu-node-1", "gpu-node-2"], 15, "both nodes listed")
            heatmap = app.screen.query_one(GpuHeatmap)
            await wait_until(lambda: all(n.values and None not in n.values for n in heatmap.nodes), 15, "GPU cells")
            assert not app.runtime.read_only  # the operator key was granted the operator role
            table.move_to("gpu-node-2")
            await pilot.press("enter")
            await wait_until(lambda: isinstance(app.screen, NodeScreen), 5, "node view")
            gpu_rows = app.screen.query_one("#gpu-table", TextTable)
            await wait_until(lambda: gpu_rows.keys == ["0", "1"], 15, "per-GPU rows")
            await pilot.press("escape")
    finally:
        for a in agents:
            await stop_agent(a)


async def test_a_viewer_key_makes_the_console_read_only(keys, tmp_path) -> None:
    agent = await start_agent(keys, name="viewer-node", gpus=1)
    try:
        options = RuntimeOptions(parse_endpoints(agent.spec), str(keys.viewer_key), str(keys.known_hosts),
                                 db_path=str(tmp_path / "incidents.db"))
        runtime = build_runtime(options)
        app = GridwatchApp(runtime, tick_seconds=0.1)
        async with app.run_test(size=(160, 50)):
            await wait_until(lambda: runtime.store.by_name("viewer-node") is not None
                             and runtime.store.by_name("viewer-node").role == "viewer", 15, "viewer role")
            assert runtime.read_only
            result = await runtime.node_action("viewer-node", "isolate", "test")
            assert not result.ok and "read-only" in result.message
    finally:
        await stop_agent(agent)


def _capture(session: str) -> str:
    out = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True)
    return out.stdout


def _tmux(*args: str) -> None:
    """One tmux invocation: everything in it reaches the console as one burst of input."""
    subprocess.run(["tmux", *args], check=True)


@contextlib.asynccontextmanager
async def console_in_tmux(keys, tmp_path, names: list[str], typed_at_start: tuple[str, ...] = (),  # noqa: ANN001
                          shows: str = "") -> AsyncIterator[str]:
    """Real agents named ``names`` and ``gridwatch console`` in a fresh tmux session, once every node shows.

    ``typed_at_start``: keys sent the moment the session starts, before the console is up; then it is
    ready once ``shows`` is on the screen (and every node is connected).
    """
    agents = [await start_agent(keys, name=name, gpus=2) for name in names]
    session = f"gw-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
    command = " ".join([
        sys.executable, "-m", "gridwatch", "console",
        "--nodes", ",".join(a.spec for a in agents),
        "--key", str(keys.operator_key), "--known-hosts", str(keys.known_hosts),
        "--db", str(tmp_path / "incidents.db"),
    ])
    try:
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", command],
                       check=True, env=env, cwd=ROOT)
        if typed_at_start:
            _tmux("send-keys", "-t", session, *typed_at_start)
        wanted = [shows] if shows else names
        await wait_until(lambda: (s := _capture(session)) and all(n in s for n in wanted)
                         and f"{len(names)}/{len(names)} nodes" in s, 30, "every node, connected, on the tmux screen")
        yield session
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        for a in agents:
            await stop_agent(a)


async def _wait_on_screen(session: str, text: str, what: str) -> str:
    try:
        return await wait_until(lambda: (s := _capture(session)) and text in s and s, 15, what)
    except AssertionError:
        print(_capture(session))
        raise


async def _quit(session: str) -> None:
    _tmux("send-keys", "-t", session, "q")
    await wait_until(lambda: subprocess.run(["tmux", "has-session", "-t", session],
                                            capture_output=True).returncode != 0, 15, "the console to quit")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_gridwatch_console_in_tmux_shows_the_nodes(keys, tmp_path) -> None:
    async with console_in_tmux(keys, tmp_path, ["tmux-node-1", "tmux-node-2"]) as session:
        # A link is up before its first sample is in: the GPUs are counted a redraw later.
        await _wait_on_screen(session, "4 GPUs", "both nodes' GPUs counted in the footer")
        _tmux("send-keys", "-t", session, ":")
        await _wait_on_screen(session, "node NAME", "the command line")
        _tmux("send-keys", "-t", session, "-l", "training")
        _tmux("send-keys", "-t", session, "Enter")
        await _wait_on_screen(session, "no trainer attached", "the training view")
        await _quit(session)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_keys_typed_straight_after_colon_reach_the_command_line_in_order(keys, tmp_path) -> None:
    """As in k9s: ``:logs`` + Enter in one burst, or a paste right after ``:``, runs the command."""
    async with console_in_tmux(keys, tmp_path, ["burst-node-1"]) as session:
        _tmux("send-keys", "-t", session, ":logs", "Enter")
        await _wait_on_screen(session, "gridwatch  logs", "the logs view after one send-keys of ':logs' Enter")
        assert "gridwatch  nodes" not in _capture(session)
        _tmux("send-keys", "-t", session, ":nodes", "Enter")
        await _wait_on_screen(session, "gridwatch  nodes", "the fleet view after ':nodes' Enter")
        # One tmux call: ':', a bracketed paste of the command, Enter, back to back.
        _tmux("set-buffer", "-b", session, "training", ";",
              "send-keys", "-t", session, ":", ";",
              "paste-buffer", "-p", "-d", "-b", session, "-t", session, ";",
              "send-keys", "-t", session, "Enter")
        await _wait_on_screen(session, "no trainer attached", "the training view after ':' + a paste + Enter")
        # A line feed (C-j, or Enter typed before the console took the terminal over) ends the line as Enter does.
        _tmux("send-keys", "-t", session, ":logs", "C-j")
        await _wait_on_screen(session, "gridwatch  logs", "the logs view after ':logs' and a line feed")
        await _quit(session)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_keys_typed_while_the_console_starts_are_not_lost(keys, tmp_path) -> None:
    """``:logs`` + Enter sent with the console's start: the keys wait for the screen, Enter still ends the line."""
    async with console_in_tmux(keys, tmp_path, ["early-node-1"], typed_at_start=(":logs", "Enter"),
                               shows="gridwatch  logs") as session:
        assert "gridwatch  nodes" not in _capture(session)
        await _quit(session)


async def test_headless_console_reports_nodes_and_stops(keys, tmp_path) -> None:
    agent = await start_agent(keys, name="headless-node", gpus=1)
    out = tmp_path / "headless.out"
    try:
        with open(out, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gridwatch", "console", "--headless", "--duration", "30",
                 "--nodes", agent.spec, "--key", str(keys.viewer_key), "--known-hosts", str(keys.known_hosts),
                 "--db", str(tmp_path / "incidents.db")],
                cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
            try:
                await wait_until(lambda: "node headless-node ok" in out.read_text(), 20, "the node reported ok")
                await wait_until(lambda: "summary 1/1 nodes connected" in out.read_text(), 20, "a summary line")
                proc.terminate()
                assert proc.wait(15) == 0  # SIGTERM stops the service cleanly
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    finally:
        await stop_agent(agent)


def test_bad_node_set_is_one_clear_line_and_exit_2(tmp_path) -> None:
    key = tmp_path / "k"
    key.write_text("x")
    done = subprocess.run([sys.executable, "-m", "gridwatch", "console", "--nodes", "node[1-", "--key", str(key),
                           "--known-hosts", str(key)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "unbalanced" in done.stderr and "Traceback" not in done.stderr
