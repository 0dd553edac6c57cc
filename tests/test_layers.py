"""The layers of DESIGN.md, enforced: who may import whom, read from the source (imports in functions too).

The rules are data (``ROOMS``, ``WIRE``, ``RULES``). Moving a module to another
folder changes only the prefixes in ``ROOMS``; the rules speak of rooms.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agents", "console", "playbooks", "trainer")

# The wire: the modules both ends of a link import. They import nothing of ours but each other.
WIRE: tuple[str, ...] = ("agents.protocol", "agents.xidcatalog", "agents.exitcodes", "trainer.control", "agents.simdevices")

# Where each part of the console lives today. A module matches the longest prefix that names it.
ROOMS: dict[str, tuple[str, ...]] = {
    "wire": WIRE,
    "agents": ("agents",),
    "trainer": ("trainer",),
    "playbooks": ("playbooks",),
    # console/ is split into its rooms: the fleet client and state, the runtime, the TUI, the demo, the cli
    "console-core": ("console", "console.fleet", "console.runtime"),
    "console-tui": ("console.tui",),
    "console-demo": ("console.demo",),
    "console-cli": ("console.cli", "console.__main__"),
}

NODE_FORBIDDEN = ("textual", "rich", "torch")  # a node's install has none of them


@dataclass(frozen=True)
class Rule:
    """Modules in ``rooms`` never import ``forbidden`` (module prefixes or room names), unless ``allowed``."""

    name: str
    says: str  # the rule as DESIGN.md words it, for the failure message
    rooms: tuple[str, ...]
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()


RULES: tuple[Rule, ...] = (
    Rule("wire-stands-alone", "the wire (agents.protocol, the trainer control contract) imports nothing of ours "
         "but the wire", ("wire",), PACKAGES, allowed=("wire",)),
    Rule("agents-stand-alone", "agents/ imports none of console/, playbooks/, trainer/ (the wire excepted)",
         ("agents",), ("console", "playbooks", "trainer"), allowed=("wire",)),
    Rule("node-install-is-light", "a node's install brings neither textual nor torch: agents/ and the wire never "
         "import textual, rich or torch", ("agents", "wire"), NODE_FORBIDDEN),
    Rule("trainer-imports-only-the-wire", "trainer/ imports only the wire from the rest",
         ("trainer",), ("agents", "console", "playbooks"), allowed=("wire",)),
    Rule("playbooks-import-only-the-wire", "playbooks/ imports only the wire from the rest",
         ("playbooks",), ("agents", "console", "trainer"), allowed=("wire",)),
    Rule("console-core-has-no-ui", "inside console/, the fleet client, state and runtime never import textual, "
         "the TUI, the demo or the cli", ("console-core",), ("textual", "console-tui", "console-demo", "console-cli")),
    Rule("tui-sits-below-demo-and-cli", "the TUI (app, screens, widgets) never imports the demo or the cli",
         ("console-tui",), ("console-demo", "console-cli")),
    Rule("demo-sits-below-cli", "the demo never imports the cli", ("console-demo",), ("console-cli",)),
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


def room_of(module: str) -> str | None:
    """The room whose longest prefix names ``module``; None for a module that is not ours."""
    best: tuple[int, str] | None = None
    for room, prefixes in ROOMS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), room)
    return best[1] if best else None


def _matches(module: str, targets: tuple[str, ...]) -> bool:
    room = room_of(module)
    return any(t == room or module == t or module.startswith(t + ".") for t in targets)


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
            # ``from agents import protocol`` imports the module agents.protocol.
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in ours]
            names = subs or [base]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            names = [node.args[0].value]
        found.extend(Import(importer, name, rel, node.lineno) for name in names)
    return found


def scan(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py")) if "__pycache__" not in p.parts]
    ours = {module_name(p, root) for p in files}
    return [imp for p in files for imp in imports_of(p, root, ours)]


def violations(rule: Rule, found: list[Import]) -> list[str]:
    """One line per import that breaks ``rule``: file, line, the import and the rule."""
    out = []
    for imp in found:
        if room_of(imp.importer) not in rule.rooms:
            continue
        if imp.imported == imp.importer or imp.imported.startswith(imp.importer + "."):
            continue
        if _matches(imp.imported, rule.forbidden) and not _matches(imp.imported, rule.allowed):
            out.append(f"{imp.path}:{imp.line}: {imp.importer} imports {imp.imported}: breaks {rule.name!r}: {rule.says}")
    return out


FOUND = scan()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_layer_rule_holds(rule: Rule) -> None:
    broken = violations(rule, FOUND)
    assert not broken, f"{len(broken)} import(s) break the layers of DESIGN.md:\n" + "\n".join(broken)


def test_every_module_has_a_room() -> None:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts]
    assert files and all(room_of(module_name(p, ROOT)) for p in files)
    assert all(room_of(w) == "wire" for w in WIRE)


def test_the_check_sees_imports_inside_functions_and_names_file_line_and_rule(tmp_path: Path) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "console").mkdir()
    (tmp_path / "agents" / "__init__.py").write_text("")
    (tmp_path / "console" / "__init__.py").write_text("")
    (tmp_path / "console" / "cli.py").write_text("X = 1\n")
    (tmp_path / "agents" / "tool.py").write_text(
        '"""A node tool."""\nfrom agents import protocol\n\n\ndef late():\n    from console.cli import X\n'
        '    import torch.nn\n    return X\n')
    (tmp_path / "agents" / "protocol.py").write_text("import msgspec\n")
    found = scan(tmp_path, ("agents", "console"))
    by_rule = {rule.name: violations(rule, found) for rule in RULES}
    assert by_rule["agents-stand-alone"] == [
        "agents/tool.py:6: agents.tool imports console.cli: breaks 'agents-stand-alone': "
        "agents/ imports none of console/, playbooks/, trainer/ (the wire excepted)"]
    assert [v.split(":")[1] for v in by_rule["node-install-is-light"]] == ["7"]
    assert not by_rule["wire-stands-alone"]  # msgspec is not ours; agents.protocol is the wire
