"""The checkpoint writer process: writes, copies and prunes checkpoints from the snapshot arenas it is handed.

Started by the checkpointer (``python -m gridwatch.trainer.checkpoint_writer
FD``) with one end of a socket pair. Serialising the tensors, hashing and file
I/O happen here, in a process of its own, so they never hold the training
process's GIL; it runs at a lower CPU priority than the training, and dies
with the thread that started it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import warnings
from pathlib import Path

import torch

from gridwatch.trainer.checkpoint import copy_checkpoint, prune, write_checkpoint
from gridwatch.trainer.checkpoint_arena import Arena
from gridwatch.trainer.checkpoint_wire import Copy, Ping, Register, Reply, Request, Write, one_line, receive_request, send

# The training thread comes first on a busy node; the writer takes what is left over.
NICE = 10
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    # A trainer that is killed must not leave a writer holding gigabytes of arenas behind it.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(0)


def handle(req: Request, fds: list[int], arenas: dict[int, Arena]) -> Reply:
    """Carry out one request; any failure is the reply's one-line ``error``, never the end of this process."""
    try:
        if isinstance(req, Register):
            if len(fds) != 1:
                return Reply(error="arena registered without its descriptor")
            old = arenas.pop(req.arena, None)
            if old is not None:
                old.close()
            arenas[req.arena] = Arena.attach(fds.pop(), req.layout)
            return Reply()
        if isinstance(req, Write):
            for gone in set(arenas) - set(req.arenas) - {req.arena}:
                arenas.pop(gone).close()
            arena = arenas.get(req.arena)
            if arena is None:
                return Reply(error=f"snapshot arena {req.arena} is not known to the writer")
            path = write_checkpoint(Path(req.root), arena.tensors, req.manifest)
            return Reply(path=str(path), pruned=len(prune(Path(req.root), req.keep)))
        if isinstance(req, Copy):
            path = copy_checkpoint(Path(req.source), Path(req.root), req.tier, note=req.note)
            return Reply(path=str(path), pruned=len(prune(Path(req.root), req.keep)))
        if isinstance(req, Ping):
            return Reply()
        return Reply(error=f"unknown request {type(req).__name__}")
    except BaseException as exc:  # DCP raises CheckpointException, a BaseException
        return Reply(error=one_line(exc))
    finally:
        for fd in fds:
            os.close(fd)


def serve(sock: socket.socket) -> None:
    """Answer requests one at a time until the trainer closes its end."""
    arenas: dict[int, Arena] = {}
    while True:
        try:
            req, fds = receive_request(sock)
        except (ConnectionError, OSError):
            return
        if req is None:
            return
        send(sock, handle(req, fds, arenas))


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    _die_with_parent(parent)
    # Ctrl-C reaches the whole process group; the trainer decides when its writer stops, not the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # DCP warns that it saves in one process: that is the intent here.
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    try:
        os.nice(NICE)
    except OSError:
        pass
    torch.set_num_threads(1)
    serve(socket.socket(fileno=fd))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
