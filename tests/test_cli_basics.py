"""The command line an operator meets first: help, version, keys, tail."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import asyncssh
import pytest

from gridwatch.console.cli import build_parser
from tests.conftest import ROOT, free_port, start_agent, stop_agent
from tests.support_cli import run_cli


def _all_commands(parser, prefix=()):
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in action.choices.items():
            yield (*prefix, name)
            yield from _all_commands(sub, (*prefix, name))


def test_every_command_has_help():
    parser = build_parser()
    commands = list(_all_commands(parser))
    assert ("agent",) in commands and ("keys", "init") in commands and ("tail",) in commands
    for cmd in commands:
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*cmd, "--help"])
        assert info.value.code == 0


def test_version():
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("gridwatch ")


def test_keys_init_writes_openssh_files(tmp_path):
    out = run_cli("keys", "init", "--shared-host-key", str(tmp_path / "k"))
    assert out.returncode == 0, out.stderr
    k = tmp_path / "k"
    for name in ("agent_host_key", "viewer_key", "operator_key"):
        assert (k / name).read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        assert (k / f"{name}.pub").read_text().startswith("ssh-ed25519 ")
        assert (k / name).stat().st_mode & 0o077 == 0
    assert (k / "authorized_viewers").read_text() == (k / "viewer_key.pub").read_text()
    assert (k / "authorized_operators").read_text() == (k / "operator_key.pub").read_text()
    pins = [line for line in (k / "known_hosts").read_text().splitlines() if not line.startswith("#")]
    assert [line.split()[:3] for line in pins] == [["*", *(k / "agent_host_key.pub").read_text().split()[:2]]]
    again = run_cli("keys", "init", str(k))
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr


def test_agent_with_a_bad_setting_says_which(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nintervall = 2\n')
    out = run_cli("agent", "--config", str(cfg))
    assert out.returncode == 2 and "unknown setting 'intervall'" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("agent", "--listen", "nowhere")
    assert out.returncode == 2 and "HOST:PORT" in out.stderr


async def test_keys_trust_pins_a_nodes_own_host_key(keys, tmp_path):
    ra = await start_agent(keys)
    try:
        known = tmp_path / "known"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gridwatch", "keys", "trust", ra.spec, "--known-hosts", str(known), "--yes",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        fp = asyncssh.read_public_key(str(keys.host_key) + ".pub").get_fingerprint()
        assert fp in out.decode() and "trusted" in out.decode()
        assert known.read_text().startswith(f"[127.0.0.1]:{ra.port} ssh-ed25519 ")
    finally:
        await stop_agent(ra)


async def test_tail_streams_json_and_records_a_trace(keys, tmp_path):
    ra = await start_agent(keys, interval=0.05)
    trace = tmp_path / "trace.jsonl"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gridwatch", "tail", "--nodes", ra.spec, "--key", str(keys.viewer_key),
            "--known-hosts", str(keys.known_hosts), "--json", "--record", str(trace), "--duration", "3",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        frames = [json.loads(line) for line in out.decode().splitlines()]
        assert frames[0]["type"] == "hello" and frames[0]["node"] == "node-1"
        assert any(f["type"] == "sample" for f in frames)
        assert len(trace.read_text().splitlines()) == len(frames)
    finally:
        await stop_agent(ra)


def test_tail_with_a_missing_key_file_says_so(tmp_path):
    out = run_cli("tail", "--nodes", "127.0.0.1:1", "--key", str(tmp_path / "nope"), "--known-hosts", str(tmp_path / "kh"))
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr


def test_agent_settings_come_from_toml_and_flags_win(tmp_path):
    from gridwatch.agent.config import load

    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text('[agent]\nnode-name = "gpu017"\ninterval = 2.5\nlog = ["/var/log/a.log", "/var/log/b.log"]\nsimulate_gpus = 8\n')
    cfg = load(str(cfg_file), {"interval": 0.5, "listen": "127.0.0.1:9000", "log": None})
    assert cfg.node_name == "gpu017" and cfg.simulate_gpus == 8
    assert cfg.interval == 0.5 and cfg.listen_addr() == ("127.0.0.1", 9000)
    assert cfg.log == ["/var/log/a.log", "/var/log/b.log"]


def test_train_with_settings_it_cannot_use_exits_2():
    out = run_cli("train", "--nodes", "0", "--run-dir", "/nonexistent/run")
    assert out.returncode == 2 and "--nodes and --steps must be at least 1" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("train", "--tiers", "5,20", "--run-dir", "/nonexistent/run")
    assert out.returncode == 2 and "give three step counts" in out.stderr


@pytest.mark.slow
def test_train_whose_run_fails_exits_1_not_the_nodes_code(tmp_path):
    """A node that dies mid-run: the command reports the failure as 1, whatever torchrun exited with."""
    import psutil

    from gridwatch.trainer.launch import last_metric_step
    from tests.conftest import wait_until_sync

    run_dir = tmp_path / "run"
    train = subprocess.Popen(
        [sys.executable, "-m", "gridwatch", "train", "--nodes", "1", "--steps", "100000", "--run-dir", str(run_dir),
         "--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--micro-batch", "4", "--tiers", "2,4,8"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_sync(lambda: last_metric_step(run_dir / "metrics.jsonl") >= 2, 120, "the run's second step")
        nodes = [c for c in psutil.Process(train.pid).children(recursive=True) if "torch.distributed.run" in " ".join(c.cmdline())]
        assert len(nodes) == 1
        for proc in [nodes[0], *nodes[0].children(recursive=True)]:
            proc.kill()
        out, err = train.communicate(timeout=90)
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == 1, err[-2000:]
    assert "error: the run stopped at step" in err and "Traceback" not in err


def test_the_fault_cli_offers_exactly_the_agents_fault_kinds() -> None:
    # The CLI lists them itself so `--help` needs no agent import; they must not drift apart.
    from gridwatch.agent.actions import FAULT_KINDS as AGENT_KINDS
    from gridwatch.console.cli.demo import FAULT_KINDS as CLI_KINDS

    assert sorted(CLI_KINDS) == sorted(AGENT_KINDS)


def test_nothing_reachable_is_exit_2_and_an_abbreviated_flag_is_refused(keys, tmp_path):
    out = run_cli("tail", "--nodes", f"127.0.0.1:{free_port()}", "--key", str(keys.viewer_key),
                  "--known-hosts", str(keys.known_hosts), "--duration", "1")
    assert out.returncode == 2, out.stderr
    # argparse would take "--headles" for --headless and run a whole demo.
    out = run_cli("demo", "--headles", "--duration", "1")
    assert out.returncode == 2 and "unrecognized arguments: --headles" in out.stderr
