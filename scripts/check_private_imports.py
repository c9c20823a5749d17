"""List every place where a module uses a private name of another project module.

A private name starts with one underscore (dunders do not count). Reported: ``from mod import
_name`` and ``mod._name`` (also ``getattr``/``setattr``/``monkeypatch.setattr(mod, "_name")``)
where ``mod`` is a module of the project (``src/``, ``benchmarks/``, ``scripts/``, ``tests/``)
and ``_name`` is not itself a module, and importing a private module (``pkg._module``) from
outside the tree that holds it. Usage: ``python3 scripts/check_private_imports.py [DIR ...]``
(default: the four trees); exit code 1 when anything is found.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "benchmarks", "scripts", "tests")


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_names() -> dict[str, str]:
    """Dotted name -> tree of every project module (``src/`` files as the ``nmprune`` package,
    the other trees' files by their stem, as their ``sys.path`` imports name them)."""
    names = {}
    for path in (ROOT / "src").rglob("*.py"):
        parts = path.relative_to(ROOT / "src").with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = "src"
    for tree in TREES[1:]:
        for path in (ROOT / tree).glob("*.py"):
            names.setdefault(path.stem, tree)
    return names


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT / "src").with_suffix("").parts if path.is_relative_to(ROOT / "src") else (path.stem,)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def findings(path: Path, modules: dict[str, str]) -> list[str]:
    """The private uses in the file ``path``, one line each, in line order."""
    tree_name = path.relative_to(ROOT).parts[0]
    here = module_of(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> project module it refers to
    out: list[tuple[int, str]] = []

    def report(node: ast.AST, what: str) -> None:
        out.append((node.lineno, f"{path.relative_to(ROOT)}:{node.lineno}: {what}"))

    def use_module(node: ast.AST, mod: str) -> None:
        if any(private(p) for p in mod.split(".")) and modules[mod] != tree_name:
            report(node, f"imports the private module {mod}")

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    use_module(node, a.name)
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base not in modules:
                continue
            use_module(node, base)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    use_module(node, sub)
                    aliases[a.asname or a.name] = sub
                elif private(a.name):
                    report(node, f"imports {a.name} from {base}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod = aliases.get(node.value.id)
            if mod and private(node.attr) and f"{mod}.{node.attr}" not in modules:
                report(node, f"uses {mod}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            target, attr = node.args[0], node.args[1]
            if (isinstance(target, ast.Name) and target.id in aliases and isinstance(attr, ast.Constant)
                    and isinstance(attr.value, str) and private(attr.value)):
                report(node, f"uses {aliases[target.id]}.{attr.value}")
    return [line for _, line in sorted(out)]


def main(argv: list[str]) -> int:
    modules = module_names()
    trees = argv or list(TREES)
    found = [line for t in trees for path in sorted((ROOT / t).rglob("*.py")) for line in findings(path, modules)]
    print("\n".join(found + [f"{len(found)} private use(s) across modules in {', '.join(trees)}"]))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
