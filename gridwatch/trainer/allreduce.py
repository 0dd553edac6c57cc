"""A short all-reduce test across nodes: whole-world and full-mesh pairwise bus bandwidth.

Run as ``python -m gridwatch.trainer.allreduce --master-addr A --master-port P --rank R --world N``
on every node (the agent's pre-flight starts it); each rank prints one JSON line
with what it measured. Bus bandwidth follows nccl-tests: for an all-reduce of
``S`` bytes over ``n`` ranks in ``t`` seconds it is ``S / t * 2 (n - 1) / n``,
with ``t`` the fastest of ``--iters`` rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from itertools import combinations
from typing import Any


@dataclass
class AllReduceResult:
    """What one rank measured; ``pairs`` maps ``"i-j"`` to GB/s or to an error."""

    rank: int
    world: int
    backend: str
    size_bytes: int
    world_busbw_gbps: float | None = None
    pairs: dict[str, float] = field(default_factory=dict)
    pair_errors: dict[str, str] = field(default_factory=dict)
    error: str | None = None


def bus_bandwidth_gbps(size_bytes: int, ranks: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of one all-reduce, in GB/s (10^9 bytes)."""
    if seconds <= 0 or ranks < 2:
        return 0.0
    return size_bytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def pair_name(a: int, b: int) -> str:
    return f"{min(a, b)}-{max(a, b)}"


def run(
    master_addr: str, master_port: int, rank: int, world: int, size_bytes: int, iters: int, timeout_s: float, pairs: bool = True
) -> AllReduceResult:
    """Join the group, time the whole world, then every pair in turn (all ranks step together)."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    result = AllReduceResult(rank=rank, world=world, backend=backend, size_bytes=size_bytes)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    numel = max(size_bytes // 4, 1)
    tensor = torch.ones(numel, dtype=torch.float32, device=device)

    def timed(group: Any, ranks: int) -> float:
        dist.all_reduce(tensor, group=group)  # warm-up: connection set-up is not bandwidth
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        # The fastest round, not the mean: a busy CPU only ever slows a round down,
        # while a bad link is slow every round.
        for _ in range(iters):
            t0 = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return bus_bandwidth_gbps(numel * 4, ranks, best)

    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as exc:  # the reason goes back to the console as one line
        result.error = f"could not join the group at {master_addr}:{master_port}: {_one_line(exc)}"
        return result
    try:
        result.world_busbw_gbps = round(timed(None, world), 4)
        # Every rank creates every group, in the same order, as torch.distributed requires.
        groups = {pair: dist.new_group(list(pair)) for pair in combinations(range(world), 2)} if world > 2 and pairs else {}
        for pair, group in groups.items():
            if rank in pair:
                try:
                    result.pairs[pair_name(*pair)] = round(timed(group, 2), 4)
                except Exception as exc:  # one bad pair is named; the rest still run
                    result.pair_errors[pair_name(*pair)] = _one_line(exc)
            dist.barrier()  # pairs take turns so each measures the link alone
        if world == 2:
            result.pairs[pair_name(0, 1)] = result.world_busbw_gbps
    except Exception as exc:
        result.error = f"all-reduce failed: {_one_line(exc)}"
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group cannot always be torn down cleanly; the process ends anyway
            pass
    return result


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gridwatch.trainer.allreduce", description="All-reduce bandwidth test (one rank).")
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--size-bytes", type=int, default=1 << 20)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--no-pairs", action="store_true", help="only the whole-world all-reduce, no pairwise mesh")
    args = ap.parse_args(argv)
    if not 0 <= args.rank < args.world or args.world < 2:
        print(json.dumps({"error": f"rank {args.rank} of world {args.world} makes no test (need 0 <= rank < world, world >= 2)"}))
        return 2
    res = run(args.master_addr, args.master_port, args.rank, args.world, args.size_bytes, args.iters, args.timeout, not args.no_pairs)
    sys.stdout.write(json.dumps(asdict(res)) + "\n")
    return 0 if res.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
