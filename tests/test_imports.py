"""Imports between files form no circle, and flow one way between the packages:
sapp_hook -> profiler -> solver -> simulator -> basics; basics, solver and simulator never import torch.

Every import statement counts, wherever it sits: at module level, inside a function, or under
`if TYPE_CHECKING:`. A function-local import only delays the circle to the first call, and a type-only
one still ties the two files together for a reader: neither can be understood without the other.
Imports by name through `importlib` (the lazy attributes of `sapp_hook` and `profiler`) are not
statements and are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sapp_hook", "profiler", "solver", "simulator", "basics")
# The packages each package may import besides itself.
ALLOWED = {
    "basics": set(),
    "simulator": {"basics"},
    "solver": {"simulator", "basics"},
    "profiler": {"solver", "simulator", "basics"},
    "sapp_hook": {"profiler", "solver", "simulator", "basics"},
}
NO_TORCH = ("basics", "solver", "simulator")
CLI = "sapp_hook.cli"  # owns the terminal: only the entry point imports it
ENTRY_POINTS = ("sapp_hook.__main__",)


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def file_imports(path: Path, module: str, modules: set[str]) -> tuple[set[str], set[str]]:
    """(the modules of `modules` the file's import statements name, the top-level package of everything
    they import). `from X import Y` names the module X.Y where there is one, else X."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets, top_level = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            top_level.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per dot past the first
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            top_level.add(base.split(".")[0])
            targets.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            )
    return {target for target in targets if target in modules and target != module}, top_level


def import_graph(root: Path, packages: tuple[str, ...]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the modules of `packages` it imports, module -> the top-level packages it imports)."""
    modules = module_files(root, packages)
    edges, top_level = {}, {}
    for module, path in modules.items():
        edges[module], top_level[module] = file_imports(path, module, set(modules))
    return edges, top_level


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def direction_errors(edges: dict[str, set[str]], top_level: dict[str, set[str]]) -> list[str]:
    """Each import that breaks the packages' direction, imports torch where it may not, or imports
    the CLI from the library."""
    errors = []
    for module, names in sorted(top_level.items()):
        package = module.split(".")[0]
        for name in sorted(names & set(PACKAGES) - {package} - ALLOWED[package]):
            errors.append(f"{module} imports {name}")
        if package in NO_TORCH and "torch" in names:
            errors.append(f"{module} imports torch")
        in_cli = module == CLI or module.startswith(CLI + ".")
        if not in_cli and module not in ENTRY_POINTS:
            errors.extend(
                f"{module} imports {target}"
                for target in sorted(edges[module])
                if target == CLI or target.startswith(CLI + ".")
            )
    return errors


def test_no_file_imports_itself_round_a_circle():
    edges, _ = import_graph(ROOT, PACKAGES)
    assert len(edges) > 50  # every module was found
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_packages_import_one_way_the_planning_core_never_torch_and_the_library_never_the_cli():
    assert direction_errors(*import_graph(ROOT, PACKAGES)) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_finds_a_circle_through_a_function_local_or_type_only_import(tmp_path):
    clean = _tree(
        tmp_path / "clean",
        {
            "pkg/__init__.py": "from pkg.a import f\n",
            "pkg/a.py": "from pkg import b\n\ndef f():\n    return b.g()\n",
            "pkg/b.py": "def g():\n    return 1\n",
        },
    )
    assert find_cycle(import_graph(clean, ("pkg",))[0]) is None
    local = _tree(
        tmp_path / "local",
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import g\n",
            "pkg/b.py": "def g():\n    from pkg.a import h\n    return h\n",
        },
    )
    assert find_cycle(import_graph(local, ("pkg",))[0]) == ["pkg.a", "pkg.b", "pkg.a"]
    typed = _tree(
        tmp_path / "typed",
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from . import b\n",
            "pkg/sub/__init__.py": "",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n",
            "pkg/sub/c.py": "from ..a import x\n",
        },
    )
    assert find_cycle(import_graph(typed, ("pkg",))[0]) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    # a package's __init__ that imports its own module, which imports a name from the package
    through_init = _tree(
        tmp_path / "init", {"pkg/__init__.py": "from pkg.a import f\n", "pkg/a.py": "from pkg import g\n"}
    )
    assert find_cycle(import_graph(through_init, ("pkg",))[0]) == ["pkg", "pkg.a", "pkg"]


def test_the_check_finds_imports_against_the_direction_and_torch(tmp_path):
    root = _tree(
        tmp_path,
        {
            "simulator/__init__.py": "",
            "simulator/a.py": "def f():\n    import solver.b\n",
            "solver/__init__.py": "",
            "solver/b.py": "import torch.nn\nfrom simulator import a\n",
            "profiler/__init__.py": "import torch\nfrom sapp_hook import x\n",
            "sapp_hook/__init__.py": "import profiler, solver, simulator, torch\n",
            "sapp_hook/__main__.py": "from sapp_hook.cli import main\n",
            "sapp_hook/cli/__init__.py": "from sapp_hook.cli.report import line\n",
            "sapp_hook/cli/report.py": "from sapp_hook import tune\n",
            "sapp_hook/tune.py": "def f():\n    from .cli.report import line\n",
        },
    )
    assert direction_errors(*import_graph(root, PACKAGES)) == [
        "profiler imports sapp_hook",
        "sapp_hook.tune imports sapp_hook.cli.report",
        "simulator.a imports solver",
        "solver.b imports torch",
    ]


MAX_LINES = 600  # a file a reader takes in at one sitting


def test_no_library_file_is_over_600_lines():
    long = {
        name: n
        for name, path in module_files(ROOT, PACKAGES).items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


MAX_MODULES = 12  # a folder a reader scans at a glance; past it, the seams its imports show make subpackages


def test_no_library_folder_is_a_flat_bag():
    crowded = {}
    for package in PACKAGES:
        for folder in [ROOT / package, *(ROOT / package).rglob("*/")]:
            modules = [path for path in folder.glob("*.py") if path.name != "__init__.py"]
            if len(modules) > MAX_MODULES:
                crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert crowded == {}
