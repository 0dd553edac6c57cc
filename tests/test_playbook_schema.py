"""Playbook validation: every error located at file:line:column, and no half-loaded sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridwatch.console.cli import main
from gridwatch.playbooks.loader import BUILTIN_DIR, PlaybookLibrary, load

GOOD = """\
name: my-xid
scope: node
trigger:
  event: xid
  match: {code: [79]}
plan:
  - capture_scene
  - isolate_node
"""


def _check(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    path = tmp_path / "pb.yaml"
    path.write_text(text)
    code = main(["playbook", "check", str(path)])
    return code, capsys.readouterr().out.splitlines()


def test_builtin_playbooks_pass_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["playbook", "check", str(BUILTIN_DIR)]) == 0
    shipped = sum(1 for _ in BUILTIN_DIR.glob("*.yaml"))
    out = capsys.readouterr().out
    assert out.startswith("ok: ") and f"in {shipped} file(s)" in out, out


def test_each_error_is_reported_at_its_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = """\
name: Bad Name
scope: rack
trigger:
  event: xidd
  match:
    code: [79, "x"]
plan:
  - isolate_nod
  - do: drain_node
    scheduler: pbs
  - do: notify
    channel: webhook
guards:
  cooldown: soon
  blast_radius: {max_fraction: 2}
"""
    code, lines = _check(tmp_path, text, capsys)
    assert code == 1
    path = str(tmp_path / "pb.yaml")
    where = [line.split(": ", 1)[0] for line in lines]
    assert where == [f"{path}:{pos}" for pos in
                     ("1:7", "2:8", "4:10", "6:16", "8:5", "10:16", "11:5", "14:13", "15:32")]
    assert "did you mean 'xid'?" in lines[2]
    assert "did you mean 'isolate_node'?" in lines[4]
    assert "webhook needs a url" in lines[6]


def test_yaml_syntax_error_points_at_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _check(tmp_path, "name: x\nplan: [notify\ntrigger: {}\n", capsys)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"{tmp_path / 'pb.yaml'}:3:") and "not valid YAML" in lines[0]


def test_duplicate_and_unknown_keys_and_missing_sections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _check(tmp_path, "name: a\nname: b\nplaybook: x\n", capsys)
    assert code == 1
    text = "\n".join(lines)
    assert ":2:1: playbook: duplicate key 'name'" in text
    assert ":3:1: playbook: unknown key 'playbook'" in text
    assert "missing 'trigger'" in text and "missing 'plan'" in text


def test_metric_and_cause_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = """\
name: hot
scope: node
target: cause
trigger:
  metric: gpu.temprature > 90 for 60s
plan: [notify]
"""
    code, lines = _check(tmp_path, text, capsys)
    assert code == 1
    assert any(":5:11: trigger.metric: unknown metric 'gpu.temprature'" in line for line in lines)
    assert any(":3:9: target: cause" in line for line in lines)


def test_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ok.yaml").write_text(GOOD)
    assert main(["playbook", "check", str(tmp_path / "ok.yaml"), str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00bad")
    assert main(["playbook", "check", str(tmp_path / "bin.yaml")]) == 2


def test_a_bad_reload_keeps_the_last_good_set(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    library = PlaybookLibrary(paths=(str(tmp_path),))
    assert library.reload().ok
    assert [p.name for p in library.playbooks] == ["my-xid"]
    (tmp_path / "b.yaml").write_text(GOOD.replace("my-xid", "second"))
    (tmp_path / "c.yaml").write_text(GOOD.replace("isolate_node", "isolate"))
    result = library.reload()
    assert not result.ok
    assert [p.name for p in library.playbooks] == ["my-xid"]  # b.yaml was fine, but the set is all or nothing
    assert library.last_errors and "c.yaml:8:5" in library.last_errors[0]


def test_names_are_unique_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(GOOD)
    (tmp_path / "b.yaml").write_text(GOOD)
    result = load([tmp_path])
    assert [str(e).split(": ", 1)[1] for e in result.errors] == [
        f"playbook name 'my-xid' is already used at {tmp_path / 'a.yaml'}:1"]


def test_several_documents_in_one_file(tmp_path: Path) -> None:
    (tmp_path / "two.yaml").write_text(GOOD + "---\n" + GOOD.replace("my-xid", "other"))
    result = load([tmp_path / "two.yaml"])
    assert result.ok and [p.name for p in result.playbooks] == ["my-xid", "other"]


def test_persistence_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = """\
name: slow
trigger:
  event: straggler
  count: 5
  within: 1m
  for: 2m
  share: 0.5
plan: [notify]
"""
    code, lines = _check(tmp_path, text, capsys)
    assert code == 1
    assert [line.split(": ", 1)[1] for line in lines[:2]] == [
        "trigger.share needs 'distinct' naming a numbered detail (e.g. step)",
        "trigger.for is longer than 'within': the reports could never span it",
    ]
