"""``gridwatch playbook``: check playbook files, dry-run one, replay a recorded trace."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gridwatch.playbooks.model import Playbook


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("playbook", help="check, dry-run and replay fault playbooks",
                            description="Fault playbooks: validate them, see what they would do, replay traces.")
    cmds = parser.add_subparsers(dest="playbook_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: (parser.print_help(), EXIT_ERROR)[1])

    check = cmds.add_parser("check", help="validate playbook files; print each error as file:line:column")
    check.add_argument("files", nargs="+", metavar="FILE", help="playbook files or directories")
    check.set_defaults(func=_check)

    lst = cmds.add_parser("list", help="list playbooks (the builtin ones unless --playbooks is given)")
    lst.add_argument("--playbooks", action="append", metavar="PATH", help="a playbook file or directory")
    lst.set_defaults(func=_list)

    dry = cmds.add_parser("dry-run", help="show the plan a playbook makes for a fault, touching nothing")
    dry.add_argument("playbook", help="a builtin playbook's name or a playbook file")
    dry.add_argument("--node", default="node1", help="the node the fault is on (default node1)")
    dry.add_argument("--nodes", type=int, default=8, help="how many nodes the job has (default 8)")
    dry.add_argument("--gpu", type=int, default=0, help="the GPU index of the fault (default 0)")
    dry.add_argument("--event", dest="kind", help="the event kind, if the playbook matches several")
    dry.add_argument("--code", type=int, help="the XID code (default: the playbook's first)")
    dry.add_argument("--value", type=float, help="the metric value for a metric playbook")
    dry.add_argument("--message", default="", help="the event message or log line")
    dry.add_argument("--json", action="store_true", help="one JSON object per planned step")
    dry.set_defaults(func=_dry_run)

    rep = cmds.add_parser("replay", help="replay a recorded trace through the playbooks on its own clock")
    rep.add_argument("trace", help="a trace file (one frame per line, as `gridwatch tail --record` writes), or -")
    rep.add_argument("--playbooks", action="append", metavar="PATH",
                     help="playbook files or directories (default: the builtin playbooks)")
    rep.add_argument("--json", action="store_true", help="one JSON object per planned step")
    rep.set_defaults(func=_replay)


def _quiet_logs() -> None:
    from loguru import logger

    # The command prints its own report; engine logs below warning would only repeat it.
    logger.remove()
    logger.add(sys.stderr, level="WARNING", format="{level}: {message}")


def _load(paths: list[str] | None) -> tuple[Playbook, ...] | None:
    from gridwatch.playbooks.loader import BUILTIN_DIR, load

    result = load(paths or [BUILTIN_DIR])
    for problem in [*map(str, result.errors), *result.unreadable]:
        print(problem, file=sys.stderr)
    if not result.ok:
        print("playbooks not loaded: fix the errors above", file=sys.stderr)
        return None
    return result.playbooks


def _check(args: argparse.Namespace) -> int:
    from gridwatch.playbooks.loader import load, load_builtin, playbook_files, shadowing_errors

    missing = [f for f in args.files if not Path(f).exists()]
    result = load([f for f in args.files if Path(f).exists()])
    # What the console would refuse, refused here too: a shipped playbook's name taken without replaces:.
    shadowed = shadowing_errors(result.playbooks, {pb.name: pb for pb in load_builtin()})
    result = dataclasses.replace(result, errors=(*result.errors, *shadowed)) if shadowed else result
    for error in result.errors:
        print(error)
    for problem in [*(f"{f}: no such file" for f in missing), *result.unreadable]:
        print(problem, file=sys.stderr)
    if missing or result.unreadable:
        return EXIT_ERROR
    if result.errors:
        print(f"{len(result.errors)} error{'s' if len(result.errors) != 1 else ''} "
              f"in {len({e.path for e in result.errors})} file(s)", file=sys.stderr)
        return EXIT_FAILED
    files = playbook_files(args.files)
    print(f"ok: {len(result.playbooks)} playbook{'s' if len(result.playbooks) != 1 else ''} in {len(files)} file(s)")
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    playbooks = _load(args.playbooks)
    if playbooks is None:
        return EXIT_ERROR
    for pb in playbooks:
        steps = " -> ".join(s.action + ("?" if s.confirm else "") for s in pb.plan)
        if pb.blame_plan:  # every path that can act is shown, the records' plan too
            steps += "; on blame: " + " -> ".join(s.action + ("?" if s.confirm else "") for s in pb.blame_plan)
        print(f"{pb.name:<22} {pb.severity:<8} {pb.scope:<4} {pb.kind:<28} {steps}")
    return EXIT_OK


def _dry_run(args: argparse.Namespace) -> int:
    _quiet_logs()
    from gridwatch.playbooks.replay import replay
    from gridwatch.playbooks.report import json_lines, plan_text
    from gridwatch.playbooks.synth import Scenario, scenario_lines

    if Path(args.playbook).is_file():
        playbooks = _load([args.playbook])
    else:
        playbooks = _load(None)
        if playbooks is not None:
            playbooks = tuple(p for p in playbooks if p.name == args.playbook)
            if not playbooks:
                print(f"no builtin playbook named {args.playbook!r}; see `gridwatch playbook list`", file=sys.stderr)
                return EXIT_ERROR
    if playbooks is None:
        return EXIT_ERROR
    if args.nodes < 1:
        print("--nodes must be at least 1", file=sys.stderr)
        return EXIT_ERROR
    names = tuple(f"node{i}" for i in range(1, args.nodes + 1))
    names = names if args.node in names else (args.node, *names[1:])
    lines: list[bytes] = []
    for pb in playbooks:
        lines += scenario_lines(pb, Scenario(nodes=names, node=args.node, gpu=args.gpu, kind=args.kind,
                                             code=args.code, value=args.value, message=args.message))
    result = replay(lines, playbooks)
    if args.json:
        print("\n".join(json_lines(result)))
        return EXIT_OK
    print(f"dry run: nothing is touched; {len(names)} simulated nodes, fault on {args.node}")
    for plan in result.plans:
        print("\n".join(plan_text(plan, result.start)))
    if not result.plans:
        print("the playbook did not fire for this fault")
    return EXIT_OK


def _replay(args: argparse.Namespace) -> int:
    _quiet_logs()
    from gridwatch.playbooks.replay import replay
    from gridwatch.playbooks.report import json_lines, replay_text

    playbooks = _load(args.playbooks)
    if playbooks is None:
        return EXIT_ERROR
    try:
        stream = sys.stdin.buffer if args.trace == "-" else open(args.trace, "rb")  # noqa: SIM115
    except OSError as exc:
        print(f"cannot read trace {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    with stream:
        try:
            result = replay(stream, playbooks)
        except OSError as exc:
            print(f"cannot read trace {args.trace}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_ERROR
    if args.json:
        for line in json_lines(result):
            print(line)
        print(f"replayed {result.replayed} frames of {result.stats.lines} lines; {result.stats.describe()}",
              file=sys.stderr)
    else:
        print("\n".join(replay_text(result, args.trace)))
    return EXIT_OK
