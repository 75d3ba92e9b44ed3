"""The dependency direction of ``relax_gdn``'s packages, read from the source (AST only: no imports).

docs/design/ARCHITECTURE.md's table "Packages of relax_gdn/ and the direction of their
dependencies" lists every package (or top-level module) in order: each imports only from packages
above it, and where its ``imports`` column names them (rather than "everything above"), only from
those. Every import counts, inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "design" / "ARCHITECTURE.md"
TABLE_HEADING = "## Packages of `relax_gdn/` and the direction of their dependencies"


def package_table(text: str) -> list[tuple[str, set[str] | None]]:
    """The table's rows in order: (package, the packages its ``imports`` column names, or None
    when the column says "everything above")."""
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = [re.match(r"\| `([\w.]+?)(?:\.py|/)`", row).group(1) for row in rows]
    table = []
    for name, row in zip(names, rows):
        imports = row.rstrip(" |").rsplit("|", 1)[1]
        if "everything above" in imports:
            table.append((name, None))
            continue
        # each comma-separated entry names a package first (`config.schema`, model.presets, fla, ...)
        entries = {re.split(r"[.\s(]", entry.strip(" `—"), maxsplit=1)[0] for entry in imports.split(",")}
        table.append((name, entries & set(names)))
    return table


def package_of(module: str) -> str | None:
    """``relax_gdn.train.loop`` -> ``train``; ``relax_gdn.errors`` -> ``errors``; None outside."""
    parts = module.split(".")
    return parts[1] if parts[0] == "relax_gdn" and len(parts) > 1 else None


def imported_modules(path: Path, module: str) -> set[str]:
    """Every module ``path`` (the module ``module``) imports, relative imports resolved."""
    found = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found.add(source)
            if source == "relax_gdn":  # from relax_gdn import errors: the names are the packages
                found.update(f"relax_gdn.{alias.name}" for alias in node.names)
    return found


def dependencies(root: Path) -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the files that import it (packages other than its own)."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in sorted((root / "relax_gdn").rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        own = package_of(module)
        if own is None:  # relax_gdn/__init__.py
            continue
        for imported in imported_modules(path, module):
            target = package_of(imported)
            if target is not None and target != own:
                edges.setdefault(own, {}).setdefault(target, set()).add(rel.as_posix())
    return edges


def order_problems(
    table: list[tuple[str, set[str] | None]], edges: dict[str, dict[str, set[str]]]
) -> list[str]:
    position = {name: i for i, (name, _) in enumerate(table)}
    allowed = dict(table)
    problems = [
        f"{package}: not in ARCHITECTURE.md's package table (add its row)"
        for package in sorted(set(edges) | {t for e in edges.values() for t in e})
        if package not in position
    ]
    for package, targets in sorted(edges.items()):
        for target, files in sorted(targets.items()):
            if package not in position or target not in position:
                continue
            if position[target] > position[package]:
                problems.append(
                    f"{package} imports {target}, which the table puts below it ({sorted(files)})"
                )
            elif allowed[package] is not None and target not in allowed[package]:
                problems.append(
                    f"{package} imports {target}, which its row's imports column does not name "
                    f"({sorted(files)})"
                )
    return problems


def test_every_import_follows_the_documented_package_order():
    table = package_table(ARCHITECTURE.read_text(encoding="utf-8"))
    problems = order_problems(table, dependencies(ROOT))
    assert not problems, "imports against docs/design/ARCHITECTURE.md's package order:\n" + "\n".join(
        problems
    )


def test_the_check_finds_an_upward_import_and_one_the_row_does_not_name(tmp_path):
    text = (
        f"{TABLE_HEADING}\n\n| package | holds | imports |\n|---|---|---|\n"
        "| `errors.py` | errors | — |\n| `layout/` | layouts | torch.distributed |\n"
        "| `parallel/` | groups | layout |\n| `train/` | the loop | everything above |\n\n## Next\n"
    )
    table = package_table(text)
    assert table == [("errors", set()), ("layout", set()), ("parallel", {"layout"}), ("train", None)]
    package = tmp_path / "relax_gdn"
    for name, source in {
        "layout/route.py": "from ..parallel import context\n",
        "parallel/context.py": "def f():\n    from relax_gdn.errors import RecipeError\n",
        "train/loop.py": "import relax_gdn.parallel.context\nfrom relax_gdn import errors\n",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(source)
    edges = dependencies(tmp_path)
    assert edges == {
        "layout": {"parallel": {"relax_gdn/layout/route.py"}},
        "parallel": {"errors": {"relax_gdn/parallel/context.py"}},
        "train": {"parallel": {"relax_gdn/train/loop.py"}, "errors": {"relax_gdn/train/loop.py"}},
    }
    assert order_problems(table, edges) == [
        "layout imports parallel, which the table puts below it (['relax_gdn/layout/route.py'])",
        "parallel imports errors, which its row's imports column does not name "
        "(['relax_gdn/parallel/context.py'])",
    ]
