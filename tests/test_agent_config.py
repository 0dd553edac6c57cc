"""agent.toml and the agent's flags: one typed struct; a bad value is one line naming the file, the key and what it takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gridwatch.agent.config import AgentConfig, ConfigError, load
from tests.conftest import ROOT


def _agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridwatch", "agent", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


# What the issue found, each as an operator would write it, and the words the one-line answer must hold.
BAD_FILES = [
    ('interval = "fast"', "interval: expected a number from 0.05 to 3600", "'fast'"),
    ("listen = 8022", "listen: expected a non-empty string (HOST:PORT)", "got 8022"),
    ('log = "/var/log/x.log"', "log: expected a list of strings", 'write ["/var/log/x.log"]'),
    ("interval = nan", "interval: expected a number from 0.05 to 3600", "got nan"),
    ("interval = 1e-9", "interval: expected a number from 0.05 to 3600", "got 1e-09"),
    ("interval = inf", "interval: expected a number from 0.05 to 3600", "got inf"),
    ("[agent]\nsimulate_gpus = 2.5", "simulate_gpus: expected a whole number from 0 to 1024", "got 2.5"),
    ("[agent]\nkernel_log = 1", "kernel_log: expected true or false", "got 1"),
    ('[agent]\nmetrics_listen = "0.0.0.0:99999"', "metrics_listen: expected HOST:PORT", "'0.0.0.0:99999'"),
    ("[agent]\naction_rate = -1.0", "action_rate: expected a number above 0", "got -1.0"),
    ("[agent]\nintervall = 2", "unknown setting 'intervall'", "did you mean 'interval'?"),
    ('nodes = "n[1-4]"\n[agent]\ninterval = 1', "unknown setting 'nodes'", "known settings:"),
    ("[agent]\nsource_timeout = 0", "source_timeout: expected a number above 0 up to 60", "got 0"),
]


@pytest.mark.parametrize(("text", "says", "shows"), BAD_FILES, ids=[t for t, _, _ in BAD_FILES])
def test_a_bad_setting_in_the_file_is_one_line_and_exit_2(tmp_path: Path, text: str, says: str, shows: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load(str(config), {})
    message = str(info.value)
    assert message.startswith(f"{config}: ") and says in message and shows in message, message
    assert "\n" not in message


def test_the_command_prints_that_line_and_nothing_else(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\ninterval = "fast"\n')
    out = _agent("--config", str(config))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"gridwatch agent: {config}: interval: expected a number from 0.05 to 3600 (seconds between samples), got 'fast'"
    ]
    out = _agent("--config", str(tmp_path / "missing.toml"))
    assert out.returncode == 2 and "cannot read config" in out.stderr and "Traceback" not in out.stderr


def test_flags_are_checked_the_same_way_and_named_as_flags(tmp_path: Path) -> None:
    out = _agent("--interval", "nan")
    assert out.returncode == 2 and out.stderr.strip() == (
        "gridwatch agent: --interval: expected a number from 0.05 to 3600 (seconds between samples), got nan"
    )
    out = _agent("--simulate-gpus", "-1")
    assert out.returncode == 2 and "--simulate-gpus: expected a whole number from 0 to 1024, got -1" in out.stderr
    with pytest.raises(ConfigError, match=r"^--listen: expected HOST:PORT"):
        load(None, {"listen": "nowhere"})


def test_a_good_file_is_one_typed_struct_and_flags_win(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        '[agent]\nnode-name = "gpu017"\ninterval = 2\nlog = ["/var/log/a.log"]\nsimulate_gpus = 8\n'
        'metrics_listen = "0.0.0.0:9400"\npatrol_interval = 300\nsource_timeout = 0.5\n'
    )
    cfg = load(str(config), {"interval": 0.5, "listen": "127.0.0.1:9000", "log": None, "kernel_log": None})
    assert isinstance(cfg, AgentConfig)
    assert (cfg.node_name, cfg.simulate_gpus, cfg.log, cfg.kernel_log) == ("gpu017", 8, ["/var/log/a.log"], True)
    assert cfg.interval == 0.5 and isinstance(cfg.interval, float)  # the flag, over the file's 2
    assert cfg.listen_addr() == ("127.0.0.1", 9000) and cfg.metrics_addr() == ("0.0.0.0", 9400)
    assert cfg.source_timeout == 0.5 and cfg.patrol_interval == 300


def test_a_patrol_under_a_second_is_refused_but_zero_is_off(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("patrol_interval = 0.001\n")
    with pytest.raises(ConfigError, match=r"patrol_interval: expected 0 \(no patrol\) or at least 1 second"):
        load(str(config), {})
    config.write_text("patrol_interval = 0\n")
    assert load(str(config), {}).patrol_interval == 0
