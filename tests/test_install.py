"""Installs that fit their machine: a node's install has no textual or torch, and the units the README shows ship and verify."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from gridwatch.console.cli import build_parser
from tests.conftest import ROOT, free_port, wait_until_sync

UNITS = ROOT / "deploy" / "systemd"
HEAVY = ("textual", "rich", "torch")

# Runs the command line as a node would: any import of textual, rich or torch fails, as it
# would where they are not installed, and every attempt is printed at exit (even one caught).
_AS_A_NODE = textwrap.dedent(
    """
    import atexit, sys
    tried = []
    class NotOnANode:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {heavy!r}:
                tried.append(name)
                raise ImportError(f"{{name}} is not installed on a node")
    sys.meta_path.insert(0, NotOnANode())
    atexit.register(lambda: print("heavy imports:", sorted(set(tried)), file=sys.stderr, flush=True))
    from gridwatch.console.cli import main
    sys.argv[0] = "gridwatch"
    sys.exit(main(sys.argv[1:]))
    """
).format(heavy=set(HEAVY))


def _as_a_node(*args: str) -> list[str]:
    return [sys.executable, "-c", _AS_A_NODE, *args]


def _heavy_imports(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("heavy imports:")]
    assert lines, f"the check did not run:\n{stderr[-2000:]}"
    return lines[-1]


def test_agent_help_imports_neither_textual_nor_torch() -> None:
    out = subprocess.run(_as_a_node("agent", "--help"), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--simulate-gpus" in out.stdout
    assert _heavy_imports(out.stderr) == "heavy imports: []"


def test_a_running_agent_imports_neither_textual_nor_torch(keys, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("")
    metrics = free_port()
    cmd = _as_a_node(
        "agent", "--node-name", "n1", "--listen", f"127.0.0.1:{free_port()}", "--host-key", str(keys.host_key),
        "--authorized-viewers", str(keys.authorized_viewers), "--authorized-operators", str(keys.authorized_operators),
        "--simulate-gpus", "2", "--interval", "0.1", "--no-kernel-log", "--log", str(log),
        "--metrics-listen", f"127.0.0.1:{metrics}", "--trainer-socket", str(tmp_path / "trainer.sock"),
        "--scene-dir", str(tmp_path / "scenes"),
    )
    out_path = tmp_path / "agent.out"
    with out_path.open("w") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        import urllib.request

        def scraped() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=2) as r:
                    return b'gridwatch_agent_source_success{node="n1",source="simulated_gpus"} 1.0' in r.read()
            except OSError:
                return False

        wait_until_sync(scraped, timeout=30, what="the agent's /metrics with its sources")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    text = out_path.read_text()
    assert _heavy_imports(text) == "heavy imports: []", text[-3000:]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_a_nodes_install_has_no_textual_or_torch_and_the_extras_bring_them() -> None:
    project = _pyproject()["project"]
    base = _names(project["dependencies"])
    assert not base & set(HEAVY), f"pip install gridwatch would pull {sorted(base & set(HEAVY))}"
    assert {"asyncssh", "msgspec", "psutil", "nvidia-ml-py", "prometheus-client", "loguru"} <= base
    extras = {name: _names(reqs) for name, reqs in project["optional-dependencies"].items()}
    assert {"textual", "rich"} <= extras["console"]
    # py-spy beside torch: the agent dumps the trainer's Python stacks into a scene with it (optional there).
    assert extras["trainer"] == {"torch", "py-spy"}
    assert project["scripts"]["gridwatch"] == "gridwatch.console.cli:main"


def test_the_makefile_installs_everything_as_before() -> None:
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(r"pip install .*-e '\.\[([a-z,]+)\]'", makefile)
    assert found, "make install installs the package, editable, with its extras"
    extras = set(_pyproject()["project"]["optional-dependencies"])
    assert set(found.group(1).split(",")) == extras, "make install must bring every extra"


# ---------------------------------------------------------------------------------------------- systemd units


def _unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=True, delimiters=("=",), comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(path.read_text(), source=str(path))
    return parser


@pytest.mark.parametrize(("name", "command"), [("gridwatch-agent.service", ["agent"]),
                                                ("gridwatch-console.service", ["console", "--headless"]),
                                                ("gridwatch-relay.service", ["relay"])])
def test_each_unit_parses_and_runs_a_real_gridwatch_command(name: str, command: list[str]) -> None:
    unit = _unit(UNITS / name)
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == "/opt/gridwatch/bin/gridwatch" and argv[1:1 + len(command)] == command
    args = build_parser().parse_args(argv[1:])  # every flag the unit passes exists
    assert args.func is not None
    assert service["Restart"] == "always" and service["NoNewPrivileges"] == "yes" and service["User"] == "gridwatch"
    assert service["ProtectSystem"] == "strict" and "StateDirectory" in service
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.parametrize("name", ["gridwatch-agent.service", "gridwatch-console.service", "gridwatch-relay.service"])
def test_the_readme_shows_the_shipped_unit_exactly(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    at = readme.index(f"/etc/systemd/system/{name}")
    block = re.search(r"```ini\n(.*?)```", readme[at:], re.S)
    assert block is not None, f"no ini block after {name} in the README"
    shown = textwrap.dedent(block.group(1))
    assert shown == (UNITS / name).read_text(), f"README's copy of {name} differs from deploy/systemd/{name}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (Debian: systemd)")
@pytest.mark.parametrize("name", ["gridwatch-agent.service", "gridwatch-console.service", "gridwatch-relay.service"])
def test_systemd_analyze_verifies_each_unit(name: str, tmp_path: Path) -> None:
    # verify insists that ExecStart's program exists: point it at this checkout's gridwatch.
    gridwatch = Path(sys.executable).with_name("gridwatch")
    if not gridwatch.exists():
        pytest.skip(f"{gridwatch} is not installed (pip install -e .)")
    text = (UNITS / name).read_text().replace("/opt/gridwatch/bin/gridwatch", str(gridwatch))
    (tmp_path / name).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and sections too, and says so on stderr: both must be clean.
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
