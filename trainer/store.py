"""The rendezvous store, run by the launcher on no training node, so that losing any node is survivable.

``python -m trainer.store --port P`` serves a c10d TCPStore and prints the port
it listens on; torchrun agents join it with ``--rdzv-conf is_host=false``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer.store")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    from torch.distributed import TCPStore

    try:
        store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                         multi_tenant=True, timeout=timedelta(seconds=60))
    except Exception as exc:
        print(f"error: cannot serve the rendezvous store on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    print(store.port, flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
