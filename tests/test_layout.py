"""The repository's layout, read from the file system (no jax program runs here).

1. ``train/`` uses only zshard's public names: every ``import zshard.X``, ``from zshard import
   X``, ``from zshard.X import ...`` and attribute ``zshard.X`` in its modules names an entry of
   ``zshard.__all__`` (a public submodule such as ``zshard.distributed`` may be used inside).
2. No import cycle among ``train/``'s modules, function-local imports included.
3. Every module of ``zshard/`` and ``train/`` is listed, grouped by room, in the README's layout
   block and in docs/design.md section 1, and neither lists a module that is not there.
4. No module of ``zshard/`` or ``train/`` is over 500 lines.
5. zshard's rooms (each subpackage, and each module directly in ``zshard/``) import each other
   without a cycle, function-local imports included, and at most 12 modules stand directly in ``zshard/``;
   docs/design.md section 1 lists the rooms from the ground up (each after the rooms it imports).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import zshard

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def _modules(package: str) -> dict[str, Path]:
    """``{"train.bench.peers": path}`` for every ``.py`` file of a package (``__init__`` as the package)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _zshard_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, "zshard.X...")`` for every use of zshard in a module: imports and attributes of the package."""
    aliases, uses = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "zshard" or a.name.startswith("zshard."):
                    if a.name != "zshard":
                        uses.append((node.lineno, a.name))
                    if a.asname is None or a.name == "zshard":
                        aliases.add(a.asname or "zshard")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "zshard":
            if node.module == "zshard":
                uses += [(node.lineno, f"zshard.{a.name}") for a in node.names]
            else:
                uses.append((node.lineno, node.module))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.append((node.lineno, f"zshard.{node.attr}"))
    return uses


def test_train_uses_only_zshard_public_names():
    public = set(zshard.__all__)
    bad = []
    for name, path in _modules("train").items():
        for line, use in _zshard_uses(ast.parse(path.read_text(), str(path))):
            if use.split(".")[1] not in public:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {use}")
    assert not bad, "train/ uses names outside zshard.__all__ (export them in zshard/__init__.py or do without):\n" + "\n".join(bad)


def test_the_public_names_check_sees_every_kind_of_use():
    code = ("import zshard\nimport zshard.mesh\nfrom zshard import init\nfrom zshard.units import path_str\n"
            "from zshard.distributed import initialize\nzshard.step.default_prefetch()\nzshard.distributed.initialize()\n")
    uses = [u for _, u in _zshard_uses(ast.parse(code))]
    # (`import zshard.mesh` also binds the name zshard, whose attributes count too)
    assert sorted(uses) == sorted(["zshard.mesh", "zshard.init", "zshard.units", "zshard.distributed", "zshard.step",
                                   "zshard.distributed"])


def _train_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``train`` modules a module imports anywhere in it (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return out


def test_no_import_cycle_in_train():
    modules = _modules("train")
    graph = {name: _train_imports(path, modules) - {name} for name, path in modules.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            cycle = stack[stack.index(name):] + [name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        stack.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def _block(text: str, heading: str) -> str:
    """The first fenced code block after ``heading``."""
    start = text.index(heading)
    a = text.index("```", start)
    return text[text.index("\n", a) + 1 : text.index("```", a + 3)]


def _listed_compact(block: str) -> set[str]:
    """README style: a line starting ``zshard/`` or ``train/`` opens that package; ``name.py``
    tokens are its modules, ``sub/ (a.py b.py)`` those of a subpackage."""
    out, package = set(), None
    for line in block.splitlines():
        if line and not line[0].isspace():
            package = line.split()[0].rstrip("/") if line.split()[0] in ("zshard/", "train/") else None
        if package is None:
            continue
        for sub, names in re.findall(r"\b(\w+)/ \(([^)]*)\)", line):
            out |= {f"{package}/{sub}/{n}" for n in re.findall(r"\b\w+\.py\b", names)}
        line = re.sub(r"\b\w+/ \([^)]*\)", "", line)
        out |= {f"{package}/{n}" for n in re.findall(r"(?<![\w/.])\w+\.py\b", line)}
    return out


def _listed_paths(block: str) -> set[str]:
    """design.md style: full paths, ``zshard/checkpoint/layout.py``."""
    return set(re.findall(r"\b(?:zshard|train)/(?:\w+/)*\w+\.py\b", block))


def _on_disk() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in ("zshard", "train") for p in (ROOT / pkg).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


@pytest.mark.parametrize("doc,heading,parse", [("README.md", "## Layout", _listed_compact),
                                               ("docs/design.md", "## 1. Layers and files", _listed_paths)],
                         ids=["readme", "design"])
def test_every_module_is_listed_by_room(doc, heading, parse):
    listed, disk = parse(_block((ROOT / doc).read_text(), heading)), _on_disk()
    assert not disk - listed, f"{doc}: modules not listed under '{heading}': {sorted(disk - listed)}"
    assert not listed - disk, f"{doc}: listed under '{heading}' but not on disk: {sorted(listed - disk)}"


def test_the_layout_parsers_read_both_styles():
    block = "zshard/   policy   mesh.py (the mesh) units.py\n          host     checkpoint/ (layout.py a.py) launch.py\nmeshes/  x.py\n"
    assert _listed_compact(block) == {"zshard/mesh.py", "zshard/units.py", "zshard/checkpoint/layout.py",
                                      "zshard/checkpoint/a.py", "zshard/launch.py"}
    assert _listed_paths("  zshard/checkpoint/layout.py  x\n  train/bench/run.py\n") == {"zshard/checkpoint/layout.py",
                                                                                         "train/bench/run.py"}


@pytest.mark.parametrize("package", ["zshard", "train"])
def test_no_module_over_500_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in _modules(package).values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"{package}/ modules over {MAX_LINES} lines: {long}"


MAX_TOP_MODULES = 12  # modules directly in zshard/, __init__.py counted


def _room(module: str) -> str:
    """zshard's room of a module: its subpackage (``zshard.wire.quant`` -> ``zshard.wire``), or the module
    itself when it stands directly in ``zshard/`` (``zshard.gpu``; ``zshard`` is the package's face)."""
    return ".".join(module.split(".")[:2])


def _room_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{room: rooms it imports}`` over every import of its modules (top level or inside functions)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "zshard"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "zshard":
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                # `from zshard import gpu` imports the module zshard.gpu; `from zshard import init`, the package's face
                deps |= subs if len(subs) == len(node.names) else {node.module}
        graph.setdefault(_room(name), set()).update(_room(d) for d in deps)
    return {room: deps - {room} for room, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    done, stack = set(), []

    def visit(node):
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in done:
            return None
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if found := visit(dep):
                return found
        stack.pop()
        done.add(node)
        return None

    return next((c for node in sorted(graph) if (c := visit(node))), None)


def test_no_import_cycle_among_zshard_rooms():
    graph = _room_graph(_modules("zshard"))
    assert {"zshard.wire", "zshard.programs", "zshard.gpu", "zshard"} <= set(graph), sorted(graph)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle among zshard's rooms: " + " -> ".join(cycle)


def test_the_room_check_sees_every_kind_of_import(tmp_path):
    files = {"__init__.py": "from zshard import gpu\nfrom zshard.wire.quant import Quant\n",
             "gpu.py": "import jax\n",
             "wire/quant.py": "def f():\n    from zshard.mesh.axes import vary  # a function-local import\n",
             "wire/collectives.py": "from zshard.wire import quant\n",
             "mesh/axes.py": "import zshard.gpu\nfrom zshard import init\n"}
    modules = {}
    for rel, code in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        modules[".".join(["zshard", *Path(rel).with_suffix("").parts]).removesuffix(".__init__")] = path
    graph = _room_graph(modules)
    assert graph == {"zshard": {"zshard.gpu", "zshard.wire"}, "zshard.gpu": set(), "zshard.wire": {"zshard.mesh"},
                     "zshard.mesh": {"zshard.gpu", "zshard"}}
    assert _cycle(graph) == ["zshard", "zshard.wire", "zshard.mesh", "zshard"]
    assert _cycle({**graph, "zshard.mesh": {"zshard.gpu"}}) is None


def test_at_most_twelve_modules_directly_in_zshard():
    top = sorted(p.name for p in (ROOT / "zshard").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in zshard/ (at most {MAX_TOP_MODULES}; give them a room): {top}"


def test_design_lists_the_rooms_from_the_ground_up():
    # docs/design.md section 1 lists zshard's rooms so that each imports only rooms listed before it
    order = []
    for path in re.findall(r"\bzshard/(?:\w+/)*\w+\.py\b", _block((ROOT / "docs/design.md").read_text(), "## 1. Layers and files")):
        room = _room(path.removesuffix(".py").replace("/", "."))
        if room not in order:
            order.append(room)
    graph = _room_graph(_modules("zshard"))
    late = {room: sorted(d for d in deps if d != "zshard" and d not in order[: order.index(room)])
            for room, deps in graph.items() if room in order}
    late = {room: deps for room, deps in late.items() if deps}
    assert not late, f"docs/design.md section 1: rooms listed before the rooms they import: {late}"
