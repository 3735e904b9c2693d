"""The codebase's shape as contracts: no import cycles (lazy imports count), layers that
import one way, small files and functions, one declared drafter interface, and a repository
that stands alone. Each rule has a check that it can fail."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "understudy"
MAX_LINES = 400
MAX_BODY_LINES = 80

# What each layer (a package under src/understudy) must not import: a lower layer never
# reaches up, so each can be read, tested and replaced without the ones above it.
APPLICATIONS = ("server", "cli", "bench")
LIBRARY = (
    "kernels", "models", "verify", "constraints", "policy", "measure", "drafters", "engine", "head"
)  # fmt: skip
LAYERS_ABOVE = {
    "config": LIBRARY,
    "kernels": (
        "models",
        "verify",
        "constraints",
        "policy",
        "measure",
        "drafters",
        "engine",
        "head",
    ),
    "verify": (
        "kernels",
        "models",
        "constraints",
        "policy",
        "measure",
        "drafters",
        "engine",
        "head",
    ),
    "constraints": (
        "kernels",
        "models",
        "verify",
        "policy",
        "measure",
        "drafters",
        "engine",
        "head",
    ),
    "models": ("verify", "constraints", "policy", "measure", "drafters", "engine", "head"),
    "policy": ("drafters", "models", "measure", "engine", "head"),
    "measure": ("drafters", "engine", "head"),  # times models; policy's numbers come from it
    "drafters": ("engine", "head"),
    "engine": ("head",),
    "head": (),
}
MUST_NOT_IMPORT = {layer: (*above, *APPLICATIONS) for layer, above in LAYERS_ABOVE.items()}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str, me: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` that the source of module `me` imports, wherever the statement
    stands: at module level, inside a function (it runs when the function is called), under
    `if TYPE_CHECKING:` (the type checker follows it). Every one is a dependency: a cycle
    through a lazy import is still two modules that cannot be understood apart."""
    package = me if is_package else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        # importing a.b.c first imports the packages a and a.b: their __init__ runs too
        ancestors = {".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 1)}
        found |= {n for n in {*names, *ancestors} if n in modules and n != me}
    return found


def is_package_import(module: str, imported: str) -> bool:
    """`understudy.x.y` importing its own package `understudy.x` (its __init__) is how
    Python loads it, not a cycle of ours."""
    return module.startswith(imported + ".")


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (its own packages left out)."""
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    graph = {}
    for f in files:
        me = module_name(f)
        found = imports_in(f.read_text(), me, f.name == "__init__.py", modules)
        graph[me] = {i for i in found if not is_package_import(me, i)}
    return graph


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


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a graph with a cycle is reported with its path."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_and_under_type_checking_count() -> None:
    """A module that imports another only lazily or only for its types still depends on it:
    all four ways below are found, and a cycle made of them is reported."""
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from understudy.b import B
def f():
    from .c import C
    import understudy.d.e
"""
    modules = {"understudy.a", "understudy.b", "understudy.c", "understudy.d", "understudy.d.e"}
    found = imports_in(source, "understudy.a", False, modules)
    assert found == {"understudy.b", "understudy.c", "understudy.d", "understudy.d.e"}
    back = imports_in("def g():\n    from understudy.a import f\n", "understudy.b", False, modules)
    assert find_cycle({"understudy.a": found, "understudy.b": back}) is not None


def layer(module: str) -> str:
    """`understudy.models.loader` -> "models"; a top-level module is its own layer."""
    return module.split(".")[1] if module.count(".") else module


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) edges where the importer's layer must not import the other's."""
    return {
        (m, i)
        for m, deps in graph.items()
        for i in deps
        if layer(i) in MUST_NOT_IMPORT.get(layer(m), ())
    }


def test_layers_point_one_way() -> None:
    assert sorted(layer_violations(import_graph())) == []


def test_the_layer_rule_can_fail() -> None:
    """A kernel importing a model, a model importing the engine and the engine importing the
    server are each found; the same edges pointing down are not."""
    up = {
        "understudy.kernels.k": {"understudy.models.m"},
        "understudy.models.m": {"understudy.engine.e"},
        "understudy.engine.e": {"understudy.server.s"},
        "understudy.server.s": {"understudy.engine.e", "understudy.models.m"},
    }
    assert layer_violations(up) == {
        ("understudy.kernels.k", "understudy.models.m"),
        ("understudy.models.m", "understudy.engine.e"),
        ("understudy.engine.e", "understudy.server.s"),
    }


def long_functions(source: str, limit: int = MAX_BODY_LINES) -> dict[str, int]:
    """Qualified name -> body lines, for every function (methods, nested ones) whose body is
    over `limit` lines: from its first statement after the docstring to its last line. The
    signature does not count (a command's options may be long), nor does the docstring."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body
                if len(body) > 1 and ast.get_docstring(child) is not None:
                    body = body[1:]
                lines = child.end_lineno - body[0].lineno + 1
                if lines > limit:
                    found[prefix + child.name] = lines
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def all_long_functions() -> dict[str, int]:
    return {
        f"{path.relative_to(PACKAGE).as_posix()}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text()).items()
    }


def test_no_function_body_is_over_80_lines() -> None:
    assert all_long_functions() == {}


def test_the_function_length_rule_can_fail() -> None:
    """81 body lines are found, in a method or a nested function too; 80 are not, however
    long the signature and the docstring."""

    def function(name: str, body_lines: int, indent: str = "") -> str:
        head = f"{indent}def {name}(\n" + "".join(f"{indent}    a{i}: int,\n" for i in range(30))
        doc = f'{indent}    """Doc.\n' + f"{indent}    more\n" * 10 + f'{indent}    """\n'
        return head + f"{indent}) -> None:\n" + doc + f"{indent}    x = 1\n" * body_lines

    assert long_functions(function("short", 80)) == {}
    assert long_functions(function("long", 81)) == {"long": 81}
    method = "class C:\n" + function("m", 81, "    ")
    assert long_functions(method) == {"C.m": 81}
    nested = "def outer():\n" + function("inner", 81, "    ")
    found = long_functions(nested)  # outer's body is all of inner, signature included
    assert set(found) == {"outer", "outer.inner"} and found["outer.inner"] == 81


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
    engine = ("engine.py", "builder.py", "scheduler.py", "round.py", "verdict.py", "start.py")
    for name in (*(f"engine/{n}" for n in engine), "policy/planner.py"):
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
