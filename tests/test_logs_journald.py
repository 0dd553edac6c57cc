"""The journal reader: journalctl followed as a child, records become lines and events, a restart resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gridwatch.agent.config import ConfigError, load
from gridwatch.agent.logs import LogTailer, journal_argv
from tests.conftest import wait_until_sync

# Records in journalctl's --output=json shape (field names from systemd.journal-fields(7); values written
# by us). The second MESSAGE is a byte array, as journald sends one that holds a control byte.
_XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
RECORDS: list[dict[str, Any]] = [
    {
        "__CURSOR": "s=739ad463348b4ceca5a9e69c95a3c93f;i=1;b=6c7c6013a8674b2da7ff39c3b2a15cbb;m=1;t=5e4b2d9d3d4c8;x=1",
        "__REALTIME_TIMESTAMP": "1700000000000000",
        "_TRANSPORT": "kernel",
        "PRIORITY": "4",
        "SYSLOG_IDENTIFIER": "kernel",
        "MESSAGE": _XID,
    },
    {
        "__CURSOR": "s=739ad463348b4ceca5a9e69c95a3c93f;i=2;b=6c7c6013a8674b2da7ff39c3b2a15cbb;m=2;t=5e4b2d9d3d4c9;x=2",
        "_TRANSPORT": "kernel",
        "MESSAGE": list(b"\x1b[31mEDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#2_DIMM#0\xff"),
    },
    {
        "__CURSOR": "s=739ad463348b4ceca5a9e69c95a3c93f;i=3;b=6c7c6013a8674b2da7ff39c3b2a15cbb;m=3;t=5e4b2d9d3d4ca;x=3",
        "_TRANSPORT": "stdout",
        "_SYSTEMD_UNIT": "nvidia-fabricmanager.service",
        "SYSLOG_IDENTIFIER": "nv-fabricmanager",
        "MESSAGE": "detected number of NVSwitches don't match with any supported system topology, aborting fabric manager",
    },
]

# A stand-in for journalctl on a machine whose journal is empty: prints the records after
# --after-cursor (all of them with --lines=0, as if they arrived after it started), then follows.
FAKE = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_JOURNAL_ARGV"], "a") as fh:
    fh.write(json.dumps(args) + "\\n")
records = json.load(open(os.environ["FAKE_JOURNAL_RECORDS"]))
after = next((a.split("=", 1)[1] for a in args if a.startswith("--after-cursor=")), None)
if after is not None:
    cursors = [r["__CURSOR"] for r in records]
    records = records[cursors.index(after) + 1:] if after in cursors else records
for r in records:
    sys.stdout.write(json.dumps(r) + "\\n")
sys.stdout.write('{{"__CURSOR": "broken\\n')  # a record cut short: skipped
sys.stdout.write("\\n")
sys.stdout.flush()
while True:
    time.sleep(3600)
"""


@pytest.fixture
def fake_journalctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "journalctl"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    (tmp_path / "records.json").write_text(json.dumps(RECORDS))
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_JOURNAL_ARGV", str(tmp_path / "argv.jsonl"))
    monkeypatch.setenv("FAKE_JOURNAL_RECORDS", str(tmp_path / "records.json"))
    return tmp_path


def _argvs(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "argv.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _poll_until(tailer: LogTailer, count: int) -> tuple[list[tuple[str, str, float]], list[object]]:
    entries: list[tuple[str, str, float]] = []
    events: list[object] = []

    def enough() -> bool:
        more, evs = tailer.poll()
        entries.extend(more)
        events.extend(evs)
        return len(entries) >= count

    wait_until_sync(enough, timeout=10, what=f"{count} journal lines")
    return entries, events


def test_kernel_and_unit_records_become_clean_lines_and_events(fake_journalctl: Path) -> None:
    cursor = fake_journalctl / "journal.cursor"
    tailer = LogTailer(kernel=False, journal=["kernel", "nvidia-fabricmanager.service"], journal_cursor=str(cursor))
    try:
        assert "journal" in tailer.sources
        entries, events = _poll_until(tailer, 3)
    finally:
        tailer.close()
    assert [(source, line) for source, line, _ in entries][0] == ("journal:kernel", _XID)
    edac = entries[1][1]
    assert "\x1b" not in edac and edac.startswith("[31mEDAC MC0: 1 UE") and "\ufffd" in edac
    assert entries[2][0] == "journal:nvidia-fabricmanager.service"
    kinds = [(e.kind, e.severity, e.source) for e in events]  # type: ignore[attr-defined]
    assert kinds == [
        ("xid", "critical", "log:journal:kernel"),
        ("edac_memory", "critical", "log:journal:kernel"),
        ("fabric_manager", "error", "log:journal:nvidia-fabricmanager.service"),
    ]
    # The argv is fixed: no shell, the matches OR-ed, nothing from a record in it.
    assert _argvs(fake_journalctl)[0] == [
        "--follow", "--output=json", "--all", "--quiet", "--lines=0",
        "_TRANSPORT=kernel", "+", "_SYSTEMD_UNIT=nvidia-fabricmanager.service",
    ]
    assert cursor.read_text().strip() == RECORDS[-1]["__CURSOR"]
    assert cursor.stat().st_mode & 0o777 == 0o600


def test_a_restarted_reader_resumes_after_its_cursor_and_kills_its_child(fake_journalctl: Path) -> None:
    cursor = fake_journalctl / "journal.cursor"
    cursor.write_text(RECORDS[0]["__CURSOR"] + "\n")
    tailer = LogTailer(kernel=False, journal=["kernel"], journal_cursor=str(cursor))
    journal = tailer._journal
    assert journal is not None and journal.proc is not None
    child = journal.proc
    try:
        entries, _ = _poll_until(tailer, 2)
    finally:
        tailer.close()
    assert [line for _, line, _ in entries][0].startswith("[31mEDAC")  # the first record is not read again
    assert f"--after-cursor={RECORDS[0]['__CURSOR']}" in _argvs(fake_journalctl)[0]
    assert child.poll() is not None  # closing the tailer ended journalctl


def test_journal_kernel_replaces_kmsg_so_no_line_comes_twice(fake_journalctl: Path, tmp_path: Path) -> None:
    kern = tmp_path / "kern.log"
    kern.write_text("")
    tailer = LogTailer(kernel_paths=[str(kern)], journal=["kernel"], journal_cursor=str(tmp_path / "c"))
    try:
        assert tailer.sources == ["journal"]
    finally:
        tailer.close()


def test_missing_journalctl_is_logged_not_raised(tmp_path: Path) -> None:
    tailer = LogTailer(kernel=False, journal=["kernel"], journalctl=str(tmp_path / "no-such-journalctl"))
    try:
        assert tailer.sources == []
        assert tailer.poll() == ([], [])
    finally:
        tailer.close()


def test_sources_are_checked_by_the_config_and_by_the_argv(tmp_path: Path) -> None:
    bad = tmp_path / "agent.toml"
    bad.write_text('journal = ["kernal"]\n')
    with pytest.raises(ConfigError, match=r"journal: expected a list of strings \(\"kernel\" or systemd unit names"):
        load(str(bad), {})
    bad.write_text('journal = ["--since=yesterday"]\n')
    with pytest.raises(ConfigError, match="journal"):
        load(str(bad), {})
    with pytest.raises(ValueError, match="neither 'kernel' nor a unit name"):
        journal_argv(["-k"], None)
    good = tmp_path / "good.toml"
    good.write_text('journal = ["kernel", "nvidia-fabricmanager.service"]\n')
    assert load(str(good), {}).journal == ["kernel", "nvidia-fabricmanager.service"]


def test_the_real_journalctl_when_this_machine_has_a_journal(tmp_path: Path) -> None:
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        pytest.skip("journalctl is not installed here")
    probe = subprocess.run([journalctl, "--quiet", "--lines=1", "--output=json"], capture_output=True, timeout=10)
    if not probe.stdout.strip():
        pytest.skip("no journal is readable on this machine (no systemd-journald runs here)")
    cursor = tmp_path / "cursor"
    tailer = LogTailer(kernel=False, journal=["kernel"], journal_cursor=str(cursor))
    try:
        assert "journal" in tailer.sources
        tailer.poll()  # follows from now; nothing is required to arrive
    finally:
        tailer.close()
