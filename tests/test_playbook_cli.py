"""``gridwatch playbook dry-run`` and the default notifier's real channels (loopback webhook, a command)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from gridwatch.console.cli import main
from gridwatch.playbooks.notify import DefaultNotifier
from gridwatch.playbooks.plans import Incident, PlannedStep
from tests.support_cli import run_cli


def test_dry_run_prints_targets_and_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbook", "dry-run", "xid-hardware", "--node", "node3", "--nodes", "4", "--code", "79"]) == 0
    out = capsys.readouterr().out
    assert "nothing is touched" in out and "xid 79 on node3" in out
    assert "isolate_node             node3" in out
    assert "job (node1, node2, node4)" in out


def test_dry_run_of_the_nccl_storm_acts_on_the_silent_node(capsys: pytest.CaptureFixture[str]) -> None:
    # The storm settles for 30 s before the plan is made.
    assert main(["playbook", "dry-run", "nccl-timeout", "--node", "node5", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["target"] for r in rows if r["step"] == "isolate_node"} == {"node5"}
    assert rows[0]["offset"] == 31.0 and rows[0]["at"] - rows[0]["offset"] == 1_000_000.0


def test_dry_run_of_an_unknown_playbook(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbook", "dry-run", "no-such"]) == 2
    assert "no builtin playbook named 'no-such'" in capsys.readouterr().err


def test_dry_run_of_a_playbook_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hot.yaml"
    path.write_text("name: hot\nscope: gpu\ntrigger: {metric: gpu.power > 700 for 10s}\nplan: [notify]\n")
    assert main(["playbook", "dry-run", str(path), "--gpu", "5"]) == 0
    assert "gpu.power = 701 on node1 gpu 5" in capsys.readouterr().out


def test_list_shows_the_builtin_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbook", "list"]) == 0
    out = capsys.readouterr().out
    assert "xid-application" in out and "isolate_node" not in out.split("xid-application")[1].splitlines()[0]


def _incident() -> Incident:
    return Incident(id="i1", playbook="hw", kind="xid", severity="critical", scope="node", node="node3",
                    opened_at=1.0, last_seen_at=1.0, summary="xid 79")


async def test_webhook_posts_json_to_the_url() -> None:
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    step = PlannedStep(id="i1/0", incident="i1", playbook="hw", index=0, step="notify", target="node3", at=1.0,
                       channel="webhook", url=f"http://127.0.0.1:{server.server_port}/hook", timeout=5.0)
    try:
        assert await DefaultNotifier().notify(step, _incident(), "node3 isolated", False) == "webhook answered 204"
    finally:
        thread.join(timeout=5)
        server.server_close()
    assert received == [{"incident": "i1", "playbook": "hw", "node": "node3", "severity": "critical",
                         "escalation": False, "message": "node3 isolated"}]


async def test_command_channel_passes_each_argument_whole(tmp_path: Path) -> None:
    out = tmp_path / "args.json"
    script = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    step = PlannedStep(id="i1/0", incident="i1", playbook="hw", index=0, step="notify", target="node3", at=1.0,
                       channel="command", command=[sys.executable, "-c", script, str(out), "{node}", "{message}"],
                       timeout=30.0)
    hostile = "x; touch pwned $(id)"
    assert await DefaultNotifier().notify(step, _incident(), hostile, False) == f"{sys.executable} exited 0"
    assert json.loads(out.read_text()) == [str(out), "node3", hostile]
    assert not (tmp_path / "pwned").exists()


def test_check_refuses_a_playbook_that_takes_a_shipped_name_without_replaces(tmp_path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: xid-hardware\ntrigger: {event: xid}\nplan: [notify]\n")
    out = run_cli("playbook", "check", str(mine))
    assert out.returncode == 1 and "add 'replaces: xid-hardware'" in out.stdout
    mine.write_text("name: xid-hardware\nreplaces: xid-hardware\ntrigger: {event: xid}\nplan: [notify]\n")
    assert run_cli("playbook", "check", str(mine)).returncode == 0


def test_list_shows_every_path_that_acts_the_records_plan_too() -> None:
    out = run_cli("playbook", "list")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("trainer-unresponsive"))
    assert "on blame: capture_scene -> isolate_node -> notify" in line
