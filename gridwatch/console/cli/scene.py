"""``gridwatch scene``: an incident's scenes, as the console copied them off the nodes, in one .tar.gz for a ticket."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gridwatch.wire.exitcodes import EXIT_ERROR, EXIT_FAILED, EXIT_OK

NAME = "gridwatch scene"

EPILOG = """\
Read from the scene store the console keeps beside its incident database (--db,
else cluster.toml's db, else the console's default): at each capture_scene step
the console copies the node's bundle there before the plan's next step, so a node
that died or was wiped since still has its scene here. It reads the files only:
no console need run.

The tarball holds INCIDENT/<node>/<bundle>/ for every node captured: the files
(frames, logs, stacks, collectives), MANIFEST.json (each file's size and sha256,
what was left out over scene_max and why) and PARTIAL.json where a copy did not
end whole (what arrived, what is missing, why). Each kept file is checked against
its sha256 as it is packed; one that no longer matches is named on stderr.

exit: 0 written; 1 no scene kept for INCIDENT; 2 bad input, or the tarball
cannot be written.
"""


def register(sub: argparse._SubParsersAction) -> None:
    ap = sub.add_parser("scene", help="an incident's scenes from the console's scene store, as one .tar.gz",
                        description="Write the scenes the console copied off the nodes for INCIDENT as one .tar.gz.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("incident", metavar="INCIDENT", help="the incident's id, as the Incidents view shows it (or operator-TIME: an operator's capture outside any)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="PATH", help="the console's incident database: the scene store is beside it")
    where.add_argument("--cluster", metavar="FILE", help="cluster.toml: its db")
    ap.add_argument("--out", metavar="FILE", help="where to write the tarball (default: ./<INCIDENT>.scene.tar.gz)")
    ap.set_defaults(func=_scene)


def _db(args: argparse.Namespace) -> str:
    from gridwatch.console.cli.ui import default_db
    from gridwatch.console.runtime.config import load_cluster

    if args.db:
        return str(args.db)
    if args.cluster:
        return load_cluster(args.cluster).db or default_db()
    return default_db()


def _scene(args: argparse.Namespace) -> int:
    from gridwatch.console.runtime.config import ConfigError
    from gridwatch.console.runtime.scene_store import bundles, export, incident_dir, safe_name, scenes_path_for

    def fail(text: str, code: int = EXIT_ERROR) -> int:
        print(f"{NAME}: {text}", file=sys.stderr)
        return code

    incident = str(args.incident)
    if not incident.strip() or safe_name(incident).strip("_") == "" or "/" in incident:
        return fail(f"{incident!r} is not an incident id (the Incidents view shows them)")
    try:
        db = _db(args)
    except (ConfigError, ValueError) as exc:
        return fail(str(exc))
    root = scenes_path_for(db)
    where = incident_dir(root, incident)
    if not where.is_dir() or where.is_symlink() or not bundles(where):
        return fail(f"no scene kept for {incident} in {root}", EXIT_FAILED)
    out = Path(args.out) if args.out else Path(f"{safe_name(incident)}.scene.tar.gz")
    if out.is_dir():
        return fail(f"--out: {out} is a folder; give a file name")
    try:
        checks = export(where, out, safe_name(incident))
    except OSError as exc:
        return fail(f"cannot write {out}: {exc.strerror or exc}")
    for check in checks:
        said = f"{check.path.relative_to(where)}: {check.state}, {check.files} files, {check.size / 1e6:.1f} MB"
        print(f"{said}: {check.why}" if check.why else said)
        for name in check.changed:
            print(f"{NAME}: {check.path.relative_to(where)}/{name} no longer matches its sha256 in MANIFEST.json",
                  file=sys.stderr)
    print(f"wrote {out}")
    return EXIT_OK
