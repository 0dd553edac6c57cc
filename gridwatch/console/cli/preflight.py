"""``gridwatch preflight``: check every node before a launch, print a table, exit 0/1/2."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, TextIO

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

BAR_WIDTH = 24


def register(sub: argparse._SubParsersAction) -> None:
    from gridwatch.console.cli.commands import add_target_options

    ap = sub.add_parser(
        "preflight",
        help="check GPUs, stack, network, storage, clocks and all-reduce on every node",
        description="Ask every agent to run its pre-flight checks, in parallel, and print one row per node "
        "and one column per check, with each failure explained in one line. The software stack is compared "
        "with the majority (or --baseline FILE), clocks with the fleet's median, and a short all-reduce "
        "(gloo on CPU, nccl on GPU) names slow or failing pairs. Exit 0: all pass; 1: a node failed; "
        "2: could not run.",
    )
    add_target_options(ap)
    ap.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    ap.add_argument("--baseline", metavar="FILE", help="stack fingerprint (JSON) every node must match")
    ap.add_argument("--save-baseline", metavar="FILE", help="write the stack the nodes were judged against to FILE")
    ap.add_argument("--gpus", type=int, metavar="N", help="GPUs every node must have")
    ap.add_argument("--no-comm", action="store_true", help="skip the all-reduce test")
    ap.add_argument("--comm-port", type=int, default=29499, metavar="PORT", help="rendezvous port on the first node (default 29499)")
    ap.add_argument("--comm-mb", type=float, default=1.0, metavar="MB", help="all-reduce tensor size (default 1 MB, at most 67; needs an operator key)")
    ap.add_argument("--slow-pair", type=float, default=0.3, metavar="FRACTION", help="a pair under this share of the run's reference (the median of each node's best pair) is slow, named and, with every pair of one node slow, that node fails (default 0.3)")
    ap.add_argument("--min-busbw", type=float, default=0.0, metavar="GBPS", help="the bus bandwidth expected: a run whose median pair is under it is a warning with figures, and a pair is slow only when under it too")
    ap.add_argument("--checkpoint-gb", type=float, default=0.0, metavar="GB", help="free space each checkpoint path needs")
    ap.add_argument("--write-test-mb", type=float, default=16.0, metavar="MB", help="size of the write test (default 16, at most 64 with an operator key; 0: none)")
    ap.add_argument("--min-write-mbps", type=float, default=0.0, metavar="MBPS", help="slowest acceptable checkpoint write")
    ap.add_argument("--nic-speed", type=float, metavar="MBPS", help="speed every configured NIC must run at")
    ap.add_argument("--max-clock-offset", type=float, default=0.5, metavar="S", help="largest clock offset from the fleet median")
    ap.add_argument("--timeout", type=float, default=120.0, metavar="S", help="how long to wait for a node's checks")
    ap.set_defaults(func=_preflight)


def options_from_args(args: argparse.Namespace) -> Any:
    """PreflightOptions from the parsed flags; ValueError with a one-line reason."""
    from gridwatch.console.fleet.preflight import PreflightOptions, load_baseline

    if args.gpus is not None and args.gpus < 0:
        raise ValueError(f"--gpus must be 0 or more, got {args.gpus}")
    for flag in ("comm_mb", "checkpoint_gb", "write_test_mb", "min_write_mbps", "min_busbw", "max_clock_offset"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must not be negative")
    if not 0 <= args.slow_pair <= 1:
        raise ValueError(f"--slow-pair must be between 0 and 1, got {args.slow_pair}")
    from gridwatch.wire.preflight import MAX_COMM_BYTES, MAX_WRITE_TEST_MB

    if args.write_test_mb > MAX_WRITE_TEST_MB:
        raise ValueError(f"--write-test-mb must be at most {MAX_WRITE_TEST_MB:g} (agents cap the write test there)")
    if args.comm_mb * 1e6 > MAX_COMM_BYTES:
        raise ValueError(f"--comm-mb must be at most {MAX_COMM_BYTES / 1e6:g} (agents refuse larger all-reduce tests)")
    if not 0 < args.comm_port < 65536:
        raise ValueError(f"--comm-port must be a TCP port, got {args.comm_port}")
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    options = PreflightOptions(
        gpus=args.gpus,
        comm=not args.no_comm,
        max_clock_offset_s=args.max_clock_offset,
        checkpoint_gb=args.checkpoint_gb,
        write_test_mb=args.write_test_mb,
        min_write_mbps=args.min_write_mbps,
        nic_speed_mbps=args.nic_speed,
        comm_port=args.comm_port,
        comm_size_bytes=max(int(args.comm_mb * 1e6), 4),
        min_busbw_gbps=args.min_busbw,
        slow_pair_fraction=args.slow_pair,
        action_timeout=args.timeout,
    )
    if args.baseline:
        options.baseline = load_baseline(args.baseline)
        options.baseline_name = f"baseline {args.baseline}"
    return options


def progress_bar(stream: TextIO) -> Any:
    """A progress callback drawing ``[####....] 3/8 nodes`` on a terminal, silent otherwise."""

    def draw(done: int, total: int) -> None:
        if not stream.isatty():
            return
        filled = BAR_WIDTH * done // max(total, 1)
        stream.write(f"\rpreflight [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} nodes")
        if done == total:
            stream.write("\n")
        stream.flush()

    return draw


def render_table(report: Any) -> str:
    """One row per node, one column per check, then one line per failure."""
    from gridwatch.console.fleet.preflight import CHECK_COLUMNS

    header = ["NODE", *(c.upper() for c in CHECK_COLUMNS), "RESULT"]
    rows = []
    for node in report.nodes:
        if not node.reachable:
            cells = ["-"] * len(CHECK_COLUMNS)
            verdict = "UNREACHABLE"
        else:
            cells = [("ok" if node.checks[c].ok else "FAIL") if c in node.checks else "-" for c in CHECK_COLUMNS]
            verdict = "PASS" if node.ok else "FAIL"
        rows.append([node.name, *cells, verdict])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    failed = report.failed
    if failed:
        lines.append("")
        lines.append("failures:")
        for name, reasons in failed.items():
            for reason in reasons:
                lines.append(f"  {name}  {reason}")
    comm = report.comm
    if comm is not None:
        lines.append("")
        if comm.skipped:
            lines.append(f"all-reduce: skipped: {comm.skipped}")
        else:
            pairs = ", ".join(f"{k} {v:g}" for k, v in comm.pairs.items())
            lines.append(
                f"all-reduce over {len(comm.nodes)} nodes ({comm.backend}): {comm.world_busbw_gbps} GB/s bus bandwidth"
                + (f"; pairs GB/s: {pairs}" if pairs else "")
            )
            if comm.slow_pairs or comm.failed_pairs:
                lines.append(f"slow pairs: {', '.join(comm.slow_pairs) or 'none'}; failed pairs: {', '.join(comm.failed_pairs) or 'none'}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(f"{len(report.passed_nodes)} of {len(report.nodes)} nodes passed (stack judged against the {report.baseline})")
    return "\n".join(lines)


def exit_code(report: Any) -> int:
    if report.reachable == 0:
        return EXIT_ERROR
    return EXIT_OK if report.ok else EXIT_FAILED


def _preflight(args: argparse.Namespace) -> int:
    from gridwatch.console.cli.commands import resolve_targets
    from gridwatch.console.fleet.preflight import majority_stack, run_preflight_async, save_baseline

    try:
        endpoints, key, known = resolve_targets(args, relayed=True)
        options = options_from_args(args)
    except ValueError as exc:
        print(f"gridwatch preflight: {exc}", file=sys.stderr)
        return EXIT_ERROR
    options.on_progress = progress_bar(sys.stderr)
    try:
        report = asyncio.run(run_preflight_async(endpoints, key, known, options))
    except RuntimeError as exc:
        print(f"gridwatch preflight: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(render_table(report))
    if report.reachable == 0:
        print("gridwatch preflight: no node could be reached", file=sys.stderr)
    if args.save_baseline:
        fp = options.baseline
        if fp is None:
            fp, _ = majority_stack([_fingerprint(n) for n in report.nodes if _fingerprint(n) is not None])
        if fp is None:
            print("gridwatch preflight: no stack to save as a baseline", file=sys.stderr)
            return EXIT_ERROR
        try:
            save_baseline(fp, args.save_baseline)
        except OSError as exc:
            print(f"gridwatch preflight: cannot write {args.save_baseline}: {exc.strerror}", file=sys.stderr)
            return EXIT_ERROR
    return exit_code(report)


def _fingerprint(node: Any) -> Any:
    import msgspec

    from gridwatch.console.fleet.preflight import to_fingerprint

    check = node.checks.get("stack")
    if check is None or "fingerprint" not in check.values:
        return None
    try:
        return to_fingerprint(check.values["fingerprint"])
    except msgspec.ValidationError:
        return None
