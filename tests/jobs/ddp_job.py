"""A plain PyTorch DDP job, as a user writes one: it imports nothing of gridwatch.

One task per node under ``srun`` (Slurm's SLURM_PROCID / SLURM_NTASKS give the rank and world size; the
first node of the job hosts the process group), gloo, a tiny randomly initialised model, ``torch.save``
every CKPT_EVERY iterations by rank 0 (written, then renamed), resume from the newest checkpoint, and
Megatron-LM's progress line for every iteration. Requeued, it starts over from its newest checkpoint.

    srun python ddp_job.py WORKDIR [SECONDS_PER_ITERATION] [CKPT_EVERY]

Each line it prints starts with the wall time it was printed at, so a benchmark can read when it started
and when it trained again without a clock of its own. Every rank also writes its own log,
WORKDIR/logs/NODE.log (a restart line, then the progress line of each iteration, as a rank's log on a
node's disk), which the node's agent tails.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def say(text: str) -> None:
    print(f"{time.time():.3f} {text}", flush=True)


work = Path(sys.argv[1])
pace = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
every = int(sys.argv[3]) if len(sys.argv) > 3 else 50
rank = int(os.environ.get("SLURM_PROCID", "0"))
world = int(os.environ.get("SLURM_NTASKS", "1"))
node = os.environ.get("SLURMD_NODENAME", "local")
say(f"start rank {rank}/{world} on {node} restart={os.environ.get('SLURM_RESTART_COUNT', '0')}")

import torch  # noqa: E402 - after the start line: the import is part of the job's own start-up
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

# All of this job's tasks run on one host here (several slurmd on loopback); on a cluster MASTER_ADDR is the
# first node of SLURM_JOB_NODELIST. The port is the job's own, so a requeued job never meets its last life.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000
                                         + 7 * int(os.environ.get("SLURM_RESTART_COUNT", "0"))))
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
checkpoint = work / "checkpoint.pt"
iteration = 0
if checkpoint.exists():
    state = torch.load(checkpoint, weights_only=True)  # tensors and ints only: nothing in it is executed
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    iteration = int(state["iteration"])
say(f"rank {rank} resumes from iteration {iteration}")
(work / "logs").mkdir(parents=True, exist_ok=True)
own = (work / "logs" / f"{node}.log").open("a", buffering=1)
own.write(f"restart {os.environ.get('SLURM_RESTART_COUNT', '0')}: rank {rank} on {node} resumes from iteration "
          f"{iteration}\n")
total = 1_000_000
generator = torch.Generator().manual_seed(rank)
while iteration < total:
    t0 = time.time()
    x = torch.randn(16, 32, generator=generator)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()  # DDP's all-reduce: every rank steps together, or none does
    optimizer.step()
    iteration += 1
    progress = (f"iteration {iteration:8d}/{total:8d} | consumed samples: {iteration * 16 * world:12d} | "
                f"elapsed time per iteration (ms): {(time.time() - t0) * 1000:.1f} | learning rate: 1.000000E-02 | "
                f"global batch size: {16 * world:5d} | lm loss: {loss.item():.6E} | loss scale: 1.0 |")
    own.write(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] {progress}\n")
    if rank == 0:
        say(progress)
        if iteration % every == 0:
            partial = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "iteration": iteration}, partial)
            partial.replace(checkpoint)
    time.sleep(pace)
