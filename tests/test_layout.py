"""The codebase's shape as contracts: no import cycles, small files, one declared drafter
interface, and a repository that stands alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "understudy"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports when it is imported: module-level statements only
    (imports inside functions and `if TYPE_CHECKING:` blocks run later or never)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(sub, ast.Import):
                names = [alias.name for alias in sub.names]
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = package.split(".")[: len(package.split(".")) - sub.level + 1]
                    base = ".".join([*anchor, base]) if base else ".".join(anchor)
                names = [base] + [f"{base}.{alias.name}" for alias in sub.names]
            else:
                continue
            # importing a.b.c first imports the packages a and a.b: their __init__ runs too
            ancestors = {
                ".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 1)
            }
            found |= {n for n in {*names, *ancestors} if n in modules and n != me}
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): module_level_imports(f, modules) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def is_package_import(module: str, imported: str) -> bool:
    """`understudy.x.y` importing its own package `understudy.x` (its __init__) is how
    Python loads it, not a cycle of ours."""
    return module.startswith(imported + ".")


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    graph = {m: {i for i in deps if not is_package_import(m, i)} for m, deps in graph.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a graph with a cycle is reported with its path."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: module_name(p))
def test_no_source_file_is_over_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_every_registered_drafter_is_a_drafter() -> None:
    """The engine calls every hook unconditionally: each method's class must inherit the
    declared interface (drafters/base.py), whose defaults cover what it does not do."""
    from understudy.drafters import DRAFTERS, Drafter

    assert set(DRAFTERS) >= {"draft", "ngram", "suffix", "hybrid", "eagle"}
    for method, cls in DRAFTERS.items():
        assert issubclass(cls, Drafter), method
        assert cls.propose is not Drafter.propose, f"{method} does not propose"
        assert cls.from_models.__func__ is not Drafter.from_models.__func__, method


def test_the_engine_does_not_probe_drafters() -> None:
    """No getattr/hasattr in the loop and the builder: hooks are declared, never probed."""
    for name in ("engine/engine.py", "engine/builder.py", "policy/planner.py"):
        source = (PACKAGE / name).read_text()
        assert "getattr(" not in source and "hasattr(" not in source, name


def test_the_repository_stands_alone() -> None:
    """Nothing in the code, tests or docs points to design notes outside the repository."""
    outside = tuple(f"{name}.md" for name in ("DESIGN", "FACTS", "STYLE"))  # notes kept elsewhere
    paths = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]
    paths += [*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md"]
    me = Path(__file__).resolve()
    offenders = [
        str(p.relative_to(ROOT))
        for p in paths
        if p.resolve() != me and any(name in p.read_text() for name in outside)
    ]
    assert offenders == []


def imports_anywhere(source: str) -> set[str]:
    """Every module a source imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def foreign_to_kernels(source: str) -> set[str]:
    """The package modules a kernels/ source imports from outside kernels/ and the cache."""
    return {
        m
        for m in imports_anywhere(source)
        if m.startswith("understudy.")
        and not m.startswith(("understudy.kernels", "understudy.cache"))
    }


def test_kernels_know_nothing_of_the_layers_above() -> None:
    """kernels/ takes plain tensors and sizes: it imports nothing of models/ (or anything
    else of the package but the cache root); whoever installs kernels into layers lives above
    (models/fused.py)."""
    for path in sorted((PACKAGE / "kernels").glob("*.py")):
        assert not foreign_to_kernels(path.read_text()), path.name
    late = "def f():\n    from understudy.models.moe import MLP\n"  # the check sees it
    assert foreign_to_kernels(late) == {"understudy.models.moe", "understudy.models.moe.MLP"}
