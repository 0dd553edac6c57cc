"""The processes on each GPU (nvitop's list) read through the fake pynvml and a fake /proc."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from gridwatch.agent.sources.nvml import MAX_PROCESSES, NvmlSource
from gridwatch.wire.readings import GpuProcess, GpuSample
from gridwatch.wire.text import text_dec_hook
from tests import fake_pynvml
from tests.fake_pynvml import FakeGpu

_MIB = 1024 * 1024


def _proc(root: Path, pid: int, uid: int, argv: list[str], cgroup: str = "0::/user.slice\n") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "cgroup").write_text(cgroup)


def _source(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], root: Path) -> NvmlSource:
    fake_pynvml.install(monkeypatch, gpus)
    import pynvml

    pynvml.nvmlInit()
    return NvmlSource(pynvml, proc_root=str(root))


def test_each_gpu_lists_its_processes_with_user_memory_command_and_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    uid = os.getuid()
    _proc(tmp_path, 4242, uid, ["python", "train.py", "--lr", "3e-4"],
          "0::/system.slice/slurmstepd.scope/job_777/step_0/user/task_0\n")
    _proc(tmp_path, 4243, 4_000_000, ["x" * 300])  # no such user: its uid; a long command is clipped
    gpu = FakeGpu(0, processes=[(4242, 30_000 * _MIB), (4243, None)])
    source = _source(monkeypatch, [gpu], tmp_path)
    (s,) = source.sample()
    assert s.procs == 2
    first, second = s.processes
    assert (first.pid, first.used_mb, first.command, first.job) == (4242, 30_000, "python train.py --lr 3e-4", "777")
    assert first.user  # the name where the system knows one, else the uid
    assert (second.user, second.used_mb, second.job) == ("4000000", None, "")
    assert len(second.command) <= 121 and second.command.startswith("xxx")
    assert gpu.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert "nvmlDeviceGetComputeRunningProcesses" not in gpu.calls


def test_proc_is_read_once_per_process_and_a_gone_one_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _proc(tmp_path, 10, 0, ["a"])
    gpu = FakeGpu(0, processes=[(10, _MIB), (11, _MIB)])  # 11 ended between NVML's list and /proc
    source = _source(monkeypatch, [gpu], tmp_path)
    (s,) = source.sample()
    assert [p.pid for p in s.processes] == [10] and s.procs == 2
    (tmp_path / "10" / "cmdline").write_bytes(b"b\0")
    gpu.processes = [(10, 2 * _MIB)]
    (s,) = source.sample()
    assert [(p.command, p.used_mb) for p in s.processes] == [("a", 2.0)]  # cached command, fresh memory
    gpu.processes = [(12, _MIB)]
    _proc(tmp_path, 12, 0, ["c"])
    (s,) = source.sample()
    assert [p.command for p in s.processes] == ["c"]


def test_processes_not_readable_on_one_gpu_never_fail_the_sample(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    v3 = "nvmlDeviceGetComputeRunningProcesses_v3"
    denied = FakeGpu(0, denied={v3})
    unsupported = FakeGpu(1, unsupported={v3, "nvmlDeviceGetComputeRunningProcesses"})
    fine = FakeGpu(2, processes=[(20, _MIB)])
    _proc(tmp_path, 20, 0, ["ok"])
    source = _source(monkeypatch, [denied, unsupported, fine], tmp_path)
    for _ in range(2):
        a, b, c = source.sample()
    assert (a.procs, a.processes, a.util) == (None, [], 97)
    assert (b.procs, b.processes, b.util) == (None, [], 97)
    assert [p.command for p in c.processes] == ["ok"]
    assert unsupported.calls[v3] == 1  # NotSupported is not asked again


def test_a_gpu_lists_at_most_the_cap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for pid in range(100, 140):
        _proc(tmp_path, pid, 0, [f"w{pid}"])
    gpu = FakeGpu(0, processes=[(pid, _MIB) for pid in range(100, 140)])
    (s,) = _source(monkeypatch, [gpu], tmp_path).sample()
    assert s.procs == 40 and len(s.processes) == MAX_PROCESSES


def test_command_text_is_cleaned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _proc(tmp_path, 30, 0, ["evil\x1b]0;title\x07", "\x1b[31mred"])
    (s,) = _source(monkeypatch, [FakeGpu(0, processes=[(30, _MIB)])], tmp_path).sample()
    assert "\x1b" not in s.processes[0].command and "\x07" not in s.processes[0].command


def test_a_sample_without_processes_decodes_and_an_old_frame_still_does() -> None:
    old = msgspec.json.encode({"index": 0, "util": 5.0})
    assert msgspec.json.decode(old, type=GpuSample, dec_hook=text_dec_hook).processes == []
    s = GpuSample(index=0, processes=[GpuProcess(pid=1, user="u", used_mb=2.0, command="c")])
    assert b"processes" not in msgspec.json.encode(GpuSample(index=0))
    assert msgspec.json.decode(msgspec.json.encode(s), type=GpuSample, dec_hook=text_dec_hook) == s


def test_an_event_from_a_handle_of_no_known_gpu_never_says_gpu_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = _source(monkeypatch, [FakeGpu(0)], tmp_path)
    import pynvml

    class Data:
        device = object()  # no GPU of this source
        eventType = pynvml.nvmlEventTypeXidCriticalError  # noqa: N815 - NVML's name
        eventData = 79  # noqa: N815

    event = source._event_from(Data())
    assert event.gpu is None and "None" not in event.message and "on the node" in event.message
