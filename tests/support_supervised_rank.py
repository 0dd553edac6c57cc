"""One rank of a two-rank loop of the user's own under Supervised (gloo, on this machine), for tests/test_supervised_ranks.py.

Run as ``python -m tests.support_supervised_rank RANK DIR``; rank 0 serves DIR/node.sock; each rank writes what it saw to
DIR/rankN.json when its loop ends.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from gridwatch.trainer import Supervised


def main() -> None:
    rank, root = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2)
    saves: list[int] = []
    loads: list[int] = []
    steps: list[int] = []
    sup = Supervised(save=saves.append, load=loads.append, socket=str(root / "node.sock"), node=f"node-{rank + 1}",
                     serve=rank == 0)
    with sup:
        step = 0
        while step < 1_000_000:
            step += 1
            todo = sup.step(step, 1.0 / step)
            steps.append(step)
            if todo.leave:
                break
            step = todo.step
            time.sleep(0.002)  # a step takes time, as a real one does
    (root / f"rank{rank}.json").write_text(json.dumps({"saves": saves, "loads": loads, "steps": steps,
                                                      "phase": str(sup.phase)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
