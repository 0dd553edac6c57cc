"""Which log may say what: kernel and driver faults (the kinds that take a node out) only from the kernel's
own log; an application log, or one another local user can write, reports at most application faults."""

from __future__ import annotations

import os
from pathlib import Path

from gridwatch.agent.logs import LogTailer
from tests.support_hardening import as_nobody, as_root

# From NVIDIA's XID documentation (docs.nvidia.com/deploy/xid-errors), as the driver prints it.
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
# From a NCCL issue (github.com/NVIDIA/nccl/issues/626): an application fault, from any log.
NCCL_WARN = "node-1:1234:1301 [0] NCCL INFO transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<43210> with error 12, opcode 0, len 0, vendor err 129"


def _kinds(tailer: LogTailer) -> list[str]:
    return [str(e.kind) for e in tailer.poll()[1]]


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")


def test_an_application_log_that_quotes_a_driver_line_reports_no_hardware_fault(tmp_path: Path) -> None:
    train = tmp_path / "train.log"
    train.write_text("")
    tailer = LogTailer([str(train)], kernel=False)
    _append(train, XID_79)  # the job printed it (user code and data): not the driver's word
    _append(train, NCCL_WARN)
    assert _kinds(tailer) == ["nccl_error"]
    assert tailer.quoted == 1


def test_the_kernels_own_log_file_reports_the_xid(tmp_path: Path) -> None:
    kern = tmp_path / "kern.log"
    kern.write_text("")
    kern.chmod(0o640)
    tailer = LogTailer([], kernel=False, kernel_files=[str(kern)])
    _append(kern, f"Dec  2 01:00:00 node-1 kernel: {XID_79}")
    assert _kinds(tailer) == ["xid"]


@as_root
def test_a_log_every_local_user_can_write_is_not_read(open_dir: Path) -> None:
    shared = open_dir / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    kern = shared / "kern.log"
    kern.write_text("")
    kern.chmod(0o666)
    tailer = LogTailer([], kernel=False, kernel_files=[str(kern)])

    def write() -> None:
        with open(kern, "a") as f:
            f.write(f"Dec  2 01:00:00 node-1 kernel: {XID_79}\n")

    as_nobody(write)  # another local user forges the driver's line
    assert _kinds(tailer) == []
    assert tailer.kernel_sources() == set()


@as_root
def test_a_symlink_planted_in_a_directory_others_can_write_is_not_followed(open_dir: Path) -> None:
    secret = open_dir / "secret"
    secret.write_text("root only: the token\n")
    secret.chmod(0o600)
    spool = open_dir / "spool"
    spool.mkdir()
    spool.chmod(0o777)
    link = spool / "train.log"

    def plant() -> None:
        os.symlink(secret, link)

    as_nobody(plant)
    tailer = LogTailer([str(link)], kernel=False, from_start=True)
    entries, _ = tailer.poll()
    assert entries == []
    assert tailer.search("token") == []
