"""A training job gridwatch did not write, as a Slurm batch job runs one: it imports nothing of gridwatch.

Each task (``srun``, one per node) steps in time with the others through a shared folder: it resumes from the
newest checkpoint there, prints Megatron-LM's progress line for every iteration into its node's log, and the
first task writes a checkpoint every 10 iterations (write, then rename). Requeued, it starts over from the
newest checkpoint: what a real job does, without the minute a real one spends importing torch.

    srun python3 plain_loop.py WORKDIR [SECONDS_PER_ITERATION]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

work = Path(sys.argv[1])
pace = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
node = os.environ.get("SLURMD_NODENAME", "local")
rank = int(os.environ.get("SLURM_PROCID", "0"))
restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
checkpoint = work / "checkpoint.json"
try:
    start = int(json.loads(checkpoint.read_text())["iteration"])
except (OSError, ValueError, KeyError):
    start = 0
log = (work / "logs").joinpath(f"{node}.log")
log.parent.mkdir(parents=True, exist_ok=True)
total = 100000
with log.open("a", buffering=1) as out:
    out.write(f"restart {restarts}: rank {rank} on {node} resumes from iteration {start}\n")
    iteration = start
    loss = 4.0
    while iteration < total:
        t0 = time.time()
        time.sleep(pace)
        iteration += 1
        loss = max(0.5, loss * 0.999)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        out.write(f" [{stamp}] iteration {iteration:8d}/{total:8d} | consumed samples: {iteration * 16:12d} | "
                  f"elapsed time per iteration (ms): {(time.time() - t0) * 1000:.1f} | learning rate: 1.000000E-04 | "
                  f"global batch size:    16 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.000 |\n")
        if rank == 0 and iteration % 10 == 0:
            partial = checkpoint.with_suffix(".tmp")
            partial.write_text(json.dumps({"iteration": iteration}))
            partial.replace(checkpoint)
