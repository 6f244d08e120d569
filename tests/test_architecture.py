"""The package's architecture, checked statically on every module's source (``ast``; the
imports inside functions and under ``TYPE_CHECKING`` count too):

- stages import one way: a module imports only from its own stage or an earlier one in
  :data:`STAGES` (cli -> pipeline -> serve -> vllm_plugin -> hydrate -> artifacts ->
  encode -> facts -> ingest -> the shared contracts, model and prompt format), the order
  the README and the stage packages state, and no import cycle exists between modules;
- Prefect only in ``flows/`` and ``tasks/``: no ``inferscale`` module imports it, nor
  ``flows`` or ``tasks``;
- vLLM only in the plugin and the server, its KV-connector API only in the plugin's
  compat module;
- every ``inferscale`` import names a module that exists and a name it defines;
- package ``__init__`` files import nothing (importing a stage runs nothing else), and no
  module is much over 400 lines.

And the benchmarks and the tests around the library:

- ``benchmarks/`` imports only the library's public API: the shared modules of
  :data:`STAGES` ``[0]``, the modules a stage package's docstring lists, and
  ``storage_schemas``; no name that starts with an underscore; never ``flows``, ``tasks``
  or anything of ``tests/``. Every import of it resolves; its shared code
  (``benchmarks/lib``, ``benchmarks/datasets``) imports no measurement module; its
  packages are empty and its modules small too;
- the library's tests import no benchmark module; a benchmark's test,
  ``tests/benchmarks/<path>/test_<name>.py``, imports only ``benchmarks.<path>.<name>``
  of the benchmarks; no test module imports another test module, or a ``conftest``
  (shared fixtures live in conftest files, shared code in helper modules).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "inferscale"

# Earliest first; a module may import from its own stage and the stages before it. The
# first holds what every stage shares: the contracts, the settings, the serving model
# (checkpoints, fingerprints) and the prompt format (memory lines, fact token ids).
STAGES: list[tuple[str, ...]] = [
    ("inferscale", "inferscale.types", "inferscale.kv_quant", "inferscale.settings",
     "inferscale.models", "inferscale.compose"),
    ("inferscale.ingest",),
    ("inferscale.facts",),
    ("inferscale.encode",),
    ("inferscale.artifacts",),
    ("inferscale.hydrate",),
    ("inferscale.vllm_plugin",),
    ("inferscale.serve",),
    ("inferscale.pipeline",),
    ("inferscale.cli",),
]
# The data flow's stages, in the order the README's diagram and the packages' docstrings
# ("Stage N, ...") give them.
DATA_STAGES = ["ingest", "facts", "encode", "artifacts", "hydrate", "vllm_plugin", "serve"]
MAX_LINES = 420


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
BENCHMARKS = {module_name(p): p for p in sorted((REPO / "benchmarks").rglob("*.py"))}
TESTS = sorted((REPO / "tests").rglob("*.py"))


def stage_of(module: str) -> int:
    best, rank = -1, None
    for i, names in enumerate(STAGES):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, rank = len(name), i
    assert rank is not None, f"{module} belongs to no stage: add it to STAGES"
    return rank


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every import in the file, at any depth: (line, module, imported names)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                package = module_name(path).split(".")[:-1 if path.name != "__init__.py" else None]
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base, [a.name for a in node.names]))
    return found


def internal_targets(module: str, names: list[str]) -> list[str]:
    """The inferscale modules an import runs: the module itself, or its submodules named
    in ``from module import name``."""
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    return subs or [module]


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for _, target, names in imports(path):
            if target.split(".")[0] == "inferscale":
                edges[mod].update(t for t in internal_targets(target, names) if t != mod)
    return edges


def test_every_inferscale_import_resolves():
    def defined(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        return names

    problems = []
    for mod, path in MODULES.items():
        for line, target, names in imports(path):
            if target.split(".")[0] != "inferscale":
                continue
            if target not in MODULES:
                problems.append(f"{mod}:{line}: no module {target}")
                continue
            have = defined(MODULES[target])
            problems += [f"{mod}:{line}: {target} defines no {n}" for n in names
                         if n not in have and f"{target}.{n}" not in MODULES]
    assert not problems, "\n".join(problems)


def test_stages_import_one_way():
    backwards = [f"{m} (stage {stage_of(m)}) imports {t} (stage {stage_of(t)})"
                 for m, targets in graph().items() for t in sorted(targets)
                 if stage_of(t) > stage_of(m)]
    assert not backwards, "\n".join(backwards)


def find_cycles(edges: dict[str, set[str]]) -> list[str]:
    """One line per back edge found by a depth-first search: the cycle it closes."""
    done: set[str] = set()
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt in stack:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(edges):
        if node not in done:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(graph())
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_sees_function_level_imports(tmp_path):
    """The parser reads imports inside functions (a cycle hides there most often)."""
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from inferscale.serve import engine\n")
    assert imports(path) == [(2, "inferscale.serve", ["engine"])]
    assert internal_targets("inferscale.serve", ["engine"]) == ["inferscale.serve.engine"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_stages_are_in_the_documented_order():
    assert [names[0].removeprefix("inferscale.") for names in STAGES[1:8]] == DATA_STAGES
    readme = (REPO / "README.md").read_text()
    flow = readme[readme.index("conversation logs (JSONL"):readme.index("**What each fact")]
    assert re.findall(r"^  -> .* (\w+)/$", flow, re.M) == DATA_STAGES  # the diagram
    for n, stage in enumerate(DATA_STAGES, 1):
        doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text()))
        assert doc.startswith(f"Stage {n}, "), (stage, doc[:40])


def test_prefect_only_in_flows_and_tasks():
    offenders = [f"{mod}:{line}: imports {target}"
                 for mod, path in MODULES.items() for line, target, _ in imports(path)
                 if target.split(".")[0] in ("prefect", "flows", "tasks")]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("api, allowed", [
    ("vllm", ("inferscale.vllm_plugin", "inferscale.serve")),
    ("vllm.distributed.kv_transfer", ("inferscale.vllm_plugin.compat",)),
])
def test_vllm_only_in_the_plugin_and_the_server(api, allowed):
    offenders = [f"{mod}:{line}: imports {target}"
                 for mod, path in MODULES.items() for line, target, _ in imports(path)
                 if (target == api or target.startswith(api + "."))
                 and not any(mod == a or mod.startswith(a + ".") for a in allowed)]
    assert not offenders, "\n".join(offenders)


def test_package_inits_import_nothing_and_modules_stay_small():
    for mod, path in {**MODULES, **BENCHMARKS}.items():  # the benchmarks' packages too
        if path.name == "__init__.py":
            assert imports(path) == [], f"{path} imports: a package must stay empty"
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines"


# ------------------------------------------------------------- benchmarks and tests


def public_modules() -> set[str]:
    """The library's public modules: the shared ones (:data:`STAGES` ``[0]``) and those a
    stage package's docstring lists."""
    public = {m for m in STAGES[0] if m != "inferscale"}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        public.update(re.findall(r":mod:`~?(inferscale(?:\.\w+)+)`", doc))
    return public


def targets(module: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """The modules an import names: ``module`` itself, or its submodules named in ``from
    module import name`` (those ``known``)."""
    subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
    return subs or [module]


def test_benchmarks_import_only_the_public_api():
    public = public_modules()
    helpers = {p.stem for p in TESTS}  # tests/ and its helper modules: never imported
    problems = []
    for mod, path in BENCHMARKS.items():
        for line, target, names in imports(path):
            top = target.split(".")[0]
            where = f"{path.relative_to(REPO)}:{line}"
            if top in ("flows", "tasks", "tests") or top in helpers:
                problems.append(f"{where}: imports {target} (not the library)")
            elif top == "inferscale":
                problems += [f"{where}: {t} is not public (no package docstring lists it)"
                             for t in targets(target, names, MODULES) if t not in public]
            if top in ("inferscale", "storage_schemas"):
                problems += [f"{where}: imports {target}.{n} (a private name)"
                             for n in names if n.startswith("_")]
    assert not problems, "\n".join(problems)


def test_every_benchmarks_import_resolves_and_shared_code_imports_no_measurement():
    measurements = {m for m, p in BENCHMARKS.items() if p.parent == REPO / "benchmarks"}
    problems = []
    for mod, path in BENCHMARKS.items():
        for line, target, names in imports(path):
            if target.split(".")[0] != "benchmarks":
                continue
            where = f"{path.relative_to(REPO)}:{line}"
            found = targets(target, names, BENCHMARKS)
            problems += [f"{where}: no module {t}" for t in found if t not in BENCHMARKS]
            if mod.startswith(("benchmarks.lib", "benchmarks.datasets")):
                problems += [f"{where}: shared code imports the measurement {t}"
                             for t in found if t in measurements - {"benchmarks"}]
    assert not problems, "\n".join(problems)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, ``from a import b`` as ``a.b`` too."""
    return [(line, m) for line, target, names in imports(path)
            for m in [target, *(f"{target}.{n}" for n in names)]]


def test_the_librarys_tests_import_no_benchmark_module():
    problems = [f"{path.relative_to(REPO)}:{line}: imports {m}"
                for path in TESTS if REPO / "tests" / "benchmarks" not in path.parents
                for line, m in imported_modules(path) if m.split(".")[0] == "benchmarks"]
    assert not problems, "\n".join(problems)


def test_a_benchmarks_test_imports_only_the_module_it_tests():
    problems = []
    for path in TESTS:
        rel = path.relative_to(REPO / "tests")
        if rel.parts[0] != "benchmarks" or not path.name.startswith("test_"):
            continue
        mirrored = ".".join([*rel.parts[:-1], path.stem.removeprefix("test_")])
        for line, target, names in imports(path):
            if target.split(".")[0] == "benchmarks":
                problems += [f"{rel}:{line}: imports {t}, tests {mirrored}"
                             for t in targets(target, names, BENCHMARKS) if t != mirrored]
    assert not problems, "\n".join(problems)


def test_no_test_module_imports_another_or_a_conftest():
    def is_test(module: str) -> bool:
        last = module.split(".")[-1]
        return last.startswith("test_") or last == "conftest"

    problems = [f"{path.relative_to(REPO)}:{line}: imports {m}"
                for path in TESTS for line, m in imported_modules(path) if is_test(m)]
    assert not problems, "\n".join(problems)


def test_the_rules_see_what_they_check(tmp_path):
    """The public modules come from the docstrings; a private name, a test module and a
    benchmark module are caught where they are imported."""
    public = public_modules()
    assert {"inferscale.facts.table", "inferscale.serve.engine", "inferscale.compose"} <= public
    assert "inferscale.vllm_plugin.kernels.cuda" not in public  # the kernels behind the writer
    path = tmp_path / "test_x.py"
    path.write_text("from tests.serve import test_app\nfrom conftest import s3\n")
    assert [m for _, m in imported_modules(path)] == [
        "tests.serve", "tests.serve.test_app", "conftest", "conftest.s3"]
    assert targets("benchmarks.lib.load", ["plan"], BENCHMARKS) == ["benchmarks.lib.load.plan"]
