"""The job's store and membership coordinator, run on no training node, so that losing any node is survivable.

``python -m gridwatch.trainer.store --port P --min-nodes M --max-nodes N`` serves a c10d
TCPStore, prints the port it listens on, and decides the job's generations
(:mod:`gridwatch.trainer.membership`) until stopped. Workers find it through
``GRIDWATCH_STORE=HOST:PORT``. With ``--no-coordinator`` it is only a store
(for torchrun agents joining it with ``--rdzv-conf is_host=false``).

The store is unauthenticated, so it listens only on ``--host``: the socket is
bound here and handed to TCPStore (``master_listen_fd``), which on its own
would listen on every interface.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

from loguru import logger


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` only (port 0: any free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gridwatch.trainer.store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--min-nodes", type=int, default=1, help="the job trains while at least this many nodes are in it")
    parser.add_argument("--max-nodes", type=int, default=1 << 16, help="nodes the job takes at most")
    parser.add_argument("--first-window", type=float, default=10.0,
                        help="seconds the first generation waits for more than --min-nodes (ends early at --max-nodes)")
    parser.add_argument("--no-coordinator", action="store_true", help="serve the store only")
    args = parser.parse_args(argv)
    from torch.distributed import TCPStore

    try:
        listener = listen(args.host, args.port)
        port = listener.getsockname()[1]
        store = TCPStore(args.host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=timedelta(seconds=60), master_listen_fd=listener.detach())
    except Exception as exc:
        first = str(exc).strip().splitlines()
        print(f"error: cannot serve the store on {args.host}:{args.port}: {first[0] if first else exc}", file=sys.stderr)
        return 2
    print(store.port, flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if not args.no_coordinator:
        from gridwatch.trainer.membership import Coordinator

        client = TCPStore(args.host, store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        coordinator = Coordinator(client, time.monotonic, min_nodes=args.min_nodes, max_nodes=args.max_nodes,
                                  first_window=args.first_window)
        threading.Thread(target=coordinator.run, args=(done,), name="coordinator", daemon=True).start()
        logger.info("store on {}:{}; coordinating {}..{} nodes", args.host, store.port, args.min_nodes, args.max_nodes)
    done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
