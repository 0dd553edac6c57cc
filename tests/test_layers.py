"""The layers of DESIGN.md (drawn in docs/architecture.md), enforced as folder rules: who may import whom,
read from the source (imports in functions too).

A module's room is its folder under ``gridwatch/``: ``wire``, ``sshlink``, ``agent``, ``relay``,
``trainer``, ``playbooks``, and inside ``console/`` each folder (``console/fleet``, ``console/tui``...).
Moving a module between folders changes its room; the rules below speak of rooms and never need a list
of modules.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gridwatch"
THIRD_PARTY = ("textual", "rich", "torch")
NODE_FORBIDDEN = THIRD_PARTY  # a node's install has none of them
CONSOLE_CORE = ("console/fleet", "console/runtime")


@dataclass(frozen=True)
class Rule:
    """Modules in ``rooms`` import nothing of ours outside ``allowed`` (their own room always), nor ``forbidden``."""

    name: str
    says: str  # the rule as DESIGN.md words it, for the failure message
    rooms: tuple[str, ...]
    allowed: tuple[str, ...] | None = None  # None: any of our rooms
    forbidden: tuple[str, ...] = ()  # third-party top-level names or rooms


RULES: tuple[Rule, ...] = (
    Rule("wire-stands-alone", "wire/ imports nothing of ours", ("wire",), allowed=()),
    Rule("sshlink-imports-only-the-wire", "the SSH layer imports only the wire", ("sshlink",), allowed=("wire",)),
    Rule("agent-imports-wire-and-sshlink", "agent/ imports only the wire and the SSH layer",
         ("agent",), allowed=("wire", "sshlink")),
    Rule("relay-imports-wire-and-sshlink", "relay/ imports only the wire and the SSH layer, never the agent's "
         "internals nor the console's", ("relay",), allowed=("wire", "sshlink")),
    Rule("node-install-is-light", "a node's install brings neither textual nor torch: agent/, relay/, the SSH "
         "layer and the wire never import textual, rich or torch", ("agent", "relay", "sshlink", "wire"),
         forbidden=NODE_FORBIDDEN),
    Rule("trainer-imports-only-the-wire", "trainer/ imports only the wire from the rest", ("trainer",),
         allowed=("wire",)),
    Rule("playbooks-import-only-the-wire", "playbooks/ imports only the wire from the rest", ("playbooks",),
         allowed=("wire",)),
    Rule("console-core-has-no-ui", "inside console/, fleet and runtime never import textual, the TUI, the demo "
         "or the cli, nor the agent, the relay or the trainer", CONSOLE_CORE,
         allowed=("wire", "sshlink", "playbooks", *CONSOLE_CORE), forbidden=THIRD_PARTY),
    Rule("tui-sits-below-demo-and-cli", "the TUI (app, screens, widgets) never imports the demo or the cli",
         ("console/tui",), allowed=("wire", "sshlink", "playbooks", *CONSOLE_CORE, "console/tui")),
    Rule("demo-sits-below-cli", "the demo never imports the cli (nor the agent's internals)", ("console/demo",),
         allowed=("wire", "sshlink", "playbooks", "trainer", *CONSOLE_CORE, "console/tui")),
    Rule("cli-never-imports-agent-internals", "the console's cli imports the agent only through the wire and "
         "the SSH layer", ("console/cli",), allowed=("wire", "sshlink", "playbooks", "trainer", "relay",
                                                      *CONSOLE_CORE, "console/tui", "console/demo")),
)


@dataclass(frozen=True)
class Import:
    """One import statement (or import_module call with a literal name) in our source."""

    importer: str
    imported: str
    path: str
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str, root: Path = ROOT) -> str | None:
    """The room of one of our modules: its folder under gridwatch/ (console/ split by its folders); None if not ours."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1 or not (root / PACKAGE / parts[1]).is_dir():
        return PACKAGE  # gridwatch/__init__.py and __main__.py sit above the rooms
    if parts[1] == "console":
        if len(parts) > 2 and (root / PACKAGE / "console" / parts[2]).is_dir():
            return f"console/{parts[2]}"
        return "console"
    return parts[1]


def imports_of(path: Path, root: Path, ours: set[str]) -> list[Import]:
    """Every import in ``path``, wherever it sits (module level, functions, TYPE_CHECKING blocks)."""
    importer = module_name(path, root)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(root))
    found: list[Import] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from gridwatch.wire import protocol`` imports the module gridwatch.wire.protocol.
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in ours]
            names = subs or [base]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            names = [node.args[0].value]
        found.extend(Import(importer, name, rel, node.lineno) for name in names)
    return found


def scan(root: Path = ROOT) -> list[Import]:
    files = [p for p in sorted((root / PACKAGE).rglob("*.py")) if "__pycache__" not in p.parts]
    ours = {module_name(p, root) for p in files}
    return [imp for p in files for imp in imports_of(p, root, ours)]


def violations(rule: Rule, found: list[Import], root: Path = ROOT) -> list[str]:
    """One line per import that breaks ``rule``: file, line, the import and the rule."""
    out = []
    for imp in found:
        mine = room_of(imp.importer, root)
        if mine not in rule.rooms:
            continue
        theirs = room_of(imp.imported, root)
        top = imp.imported.split(".")[0]
        if theirs is None:
            bad = top in rule.forbidden
        else:
            bad = theirs != mine and rule.allowed is not None and theirs not in rule.allowed
        if bad:
            out.append(f"{imp.path}:{imp.line}: {imp.importer} imports {imp.imported}: breaks {rule.name!r}: {rule.says}")
    return out


FOUND = scan()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_layer_rule_holds(rule: Rule) -> None:
    broken = violations(rule, FOUND)
    assert not broken, f"{len(broken)} import(s) break the layers of DESIGN.md:\n" + "\n".join(broken)


def test_every_room_has_a_rule_and_the_map_names_it() -> None:
    rooms = {room_of(module_name(p, ROOT)) for p in (ROOT / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts}
    ruled = {r for rule in RULES for r in rule.rooms}
    # The package's own __init__ and __main__ (and console/'s __init__) sit above every room.
    unruled = rooms - ruled - {PACKAGE, "console"}
    assert not unruled, f"rooms without a rule: {sorted(unruled)}"
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"{r}/" in page for r in ruled), "docs/architecture.md draws every room"


def test_the_check_sees_imports_inside_functions_and_names_file_line_and_rule(tmp_path: Path) -> None:
    for folder in ("gridwatch", "gridwatch/agent", "gridwatch/wire", "gridwatch/console", "gridwatch/console/cli"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "gridwatch/console/cli/main.py").write_text("X = 1\n")
    (tmp_path / "gridwatch/agent/tool.py").write_text(
        '"""A node tool."""\nfrom gridwatch.wire import protocol\n\n\ndef late():\n'
        '    from gridwatch.console.cli.main import X\n    import torch.nn\n    return X\n')
    (tmp_path / "gridwatch/wire/protocol.py").write_text("import msgspec\n")
    found = scan(tmp_path)
    by_rule = {rule.name: violations(rule, found, tmp_path) for rule in RULES}
    assert by_rule["agent-imports-wire-and-sshlink"] == [
        "gridwatch/agent/tool.py:6: gridwatch.agent.tool imports gridwatch.console.cli.main: breaks "
        "'agent-imports-wire-and-sshlink': agent/ imports only the wire and the SSH layer"]
    assert [v.split(":")[1] for v in by_rule["node-install-is-light"]] == ["7"]
    assert not by_rule["wire-stands-alone"]  # msgspec is not ours
