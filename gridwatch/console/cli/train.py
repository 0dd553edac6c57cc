"""``gridwatch train``: run the reference training job on this machine, or print its torchrun command."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import TYPE_CHECKING

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gridwatch.trainer.config import TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run the supervised trainer on N simulated nodes of this machine")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes, one torchrun agent each (default 2)")
    p.add_argument("--steps", type=int, default=300, help="training steps (the LR schedule's horizon)")
    p.add_argument("--run-dir", required=True, help="checkpoints, metrics.jsonl, logs and control sockets go here")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --run-dir")
    p.add_argument("--print-torchrun", action="store_true", help="print the commands for a real cluster instead")
    p.add_argument("--node-names", default="", help="comma-separated node names (default node-1..node-N)")
    p.add_argument("--min-nodes", type=int, default=1, help="the job keeps training down to this many nodes")
    p.add_argument("--membership", choices=("coordinator", "torchrun"), default="coordinator",
                   help="who re-forms the job when nodes leave or join: the coordinator beside the store, in place "
                        "(default), or torchrun's rendezvous, restarting every worker (the baseline)")
    p.add_argument("--rdzv", choices=("tuned", "default"), default="tuned",
                   help="rendezvous timeouts (with --membership torchrun)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per global batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tiers", default="5,20,60", help="checkpoint every N steps for tiers 0,1,2 (default 5,20,60)")
    p.add_argument("--second-dir", default="", help="tier-2 location (default RUN_DIR/shared)")
    p.add_argument("--progress-deadline", type=float, default=15.0, help="seconds without a step before re-forming")
    p.add_argument("--reduce", choices=("exact", "fast"), default="exact")
    p.add_argument("--control-group", default="",
                   help="a group whose members may use the nodes' control sockets too (default: this user and root only)")
    from gridwatch.console.fleet.preflight_gate import add_options

    add_options(p)
    p.set_defaults(func=_run)


def _config(args: argparse.Namespace) -> TrainConfig:  # its import kept lazy for a fast --help
    from gridwatch.trainer.config import TrainConfig

    try:
        tiers = tuple(int(x) for x in args.tiers.split(","))
    except ValueError:
        tiers = ()
    if len(tiers) != 3 or min(tiers) < 0:
        raise ValueError(f"--tiers {args.tiers!r}: give three step counts like 5,20,60")
    if args.nodes < 1 or args.steps < 1:
        raise ValueError("--nodes and --steps must be at least 1")
    if args.dim % args.heads:
        raise ValueError(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    return TrainConfig(
        run_dir=args.run_dir, steps=args.steps, dim=args.dim, layers=args.layers, heads=args.heads,
        seq_len=args.seq_len, micro_batch=args.micro_batch, micro_batches=args.micro_batches, lr=args.lr,
        tier0_every=tiers[0], tier1_every=tiers[1], tier2_every=tiers[2], second_dir=args.second_dir,
        progress_deadline_s=args.progress_deadline, reduce=args.reduce, control_group=args.control_group,
    )


def _run(args: argparse.Namespace) -> int:
    from gridwatch.console.fleet.preflight_gate import GateClosed, run_gate
    from gridwatch.trainer.launch import cluster_command, node_names, prepare, start_local_run

    try:
        cfg = _config(args)
        gate = run_gate(args)
        if gate.ran:
            for node, reasons in gate.left_out.items():
                print(f"left out {node}: {'; '.join(reasons)}", file=sys.stderr)
            print(f"pre-flight passed: {', '.join(gate.names)}")
            args.nodes, args.node_names = len(gate.names), ",".join(gate.names)
        names = node_names(args.nodes, [n.strip() for n in args.node_names.split(",")] if args.node_names else None)
        if args.print_torchrun:
            cfg = prepare(cfg, args.resume, local=False)
            print(cluster_command(cfg, args.nodes, args.min_nodes, membership=args.membership))
            return EXIT_OK
        run = start_local_run(cfg, names, resume=args.resume, min_nodes=args.min_nodes, rdzv=args.rdzv,
                              membership=args.membership)
    except GateClosed as exc:
        print(f"gridwatch train: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"gridwatch train: {exc}", file=sys.stderr)
        return EXIT_ERROR
    # `kill` of this command stops the run cleanly, like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"training {run.cfg.steps} steps on {len(names)} nodes; metrics in {run.metrics_path}, logs in {run.run_dir / 'logs'}")
    shown = 0
    try:
        while run.alive():
            for node in run.take_rejoins():
                print(f"{node} rejoins the run", flush=True)
            step = run.last_step()
            if step >= shown + 10 or (step and not shown):
                print(f"step {step}", flush=True)
                shown = step
            time.sleep(1.0)
        code = run.wait(timeout=30)
    except KeyboardInterrupt:
        print("stopping: the newest checkpoint is kept; continue with --resume", file=sys.stderr)
        run.stop()
        return 130
    if code == 0:
        print(f"done: {run.last_step()} steps")
        return EXIT_OK
    # Whatever the nodes exited with (torchrun passes on a worker's 75 or 76), the command says: it ran, it failed.
    print(f"error: the run stopped at step {run.last_step()} of {run.cfg.steps}; see {run.run_dir / 'logs'}", file=sys.stderr)
    return EXIT_FAILED
