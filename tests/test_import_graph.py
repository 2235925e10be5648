"""The package's imports run one way: down a declared list of layers, without cycles, and never
into the study harness (top-level and function-level imports alike)."""

import ast
import pathlib

import pdasgd_jax

PACKAGE = "pdasgd_jax"
ROOT = pathlib.Path(pdasgd_jax.__file__).parent

# The package's floors, lowest first: a module may import its own floor and those below, never
# one above. A module belongs to the floor of the longest prefix here that names it
# (``executor`` holds ``executor.events`` too); every module must have a floor.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (floor, tuple(names.split()))
    for floor, names in (
        (
            "ground: pure kernels, optimizers, store and small utilities",
            "errors version choices cache interrupts affinity placement collectives schedules optim stages store "
            "stage_update model_steps kernels local_rounds spmd rundir divergence distributed deprecation delays.fleet",
        ),
        ("data and models", "data models"),
        ("configuration", "config config_checks fleet_checks presets layout"),
        (
            "execution pieces: executor, timing, records",
            "executor round_events lpp replication round_replay delays program_timing calibration eventlog metrics "
            "checkpoint plots compare reporting outcome",
        ),
        ("the experiment", "experiment own_pieces runners.result"),
        ("ways of running", "simulate runtime runners"),
        ("entry points", "train runners.replay bench cli __main__"),
        ("old paths, kept one release", "sync_runner averaging_runner run_result replay_run runtime.runner"),
    )
)
ENTRY_POINTS = next(i for i, (floor, _) in enumerate(LAYERS) if floor == "entry points")
HARNESS = "benchmarks"  # the study beside the package, which no package module may import


def _modules() -> dict[str, pathlib.Path]:
    """Module name -> file, a package named by its ``__init__.py``."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                out.add(submodule if submodule in modules else base)
    return {m for m in out if m in modules and m != name}


def _all_imports(path: pathlib.Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from a.b import c`` as ``a.b``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``module``'s floor (by its longest declared prefix)."""
    if module == PACKAGE:
        return ENTRY_POINTS  # the package's __init__ re-exports from every floor below
    name = module.removeprefix(PACKAGE + ".")
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no floor of LAYERS: add it to the floor it sits on"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import in ``graph`` from a module to one on a higher floor, as readable lines."""
    where = lambda m: f"{m} (floor {layer_of(m)}: {LAYERS[layer_of(m)][0]})"
    return [
        f"{where(a)} imports {where(b)}" for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) > layer_of(a)
    ]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_the_imports_it_should():
    graph = import_graph()
    assert "pdasgd_jax.config" in graph["pdasgd_jax"]  # `from pdasgd_jax.config import Config`
    assert "pdasgd_jax.simulate" in graph["pdasgd_jax.runners.registry"]
    assert "pdasgd_jax.runtime.lifecycle" in graph["pdasgd_jax.runtime"]  # a package counts as its __init__
    assert "pdasgd_jax.runners.result" in graph["pdasgd_jax.simulate.run"]  # `from pdasgd_jax.runners.result import`
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_floor_and_imports_run_downward():
    assert upward_imports({"pdasgd_jax.stages": {"pdasgd_jax.train"}}) == [
        f"pdasgd_jax.stages (floor 0: {LAYERS[0][0]}) imports pdasgd_jax.train (floor 6: {LAYERS[6][0]})"
    ]
    assert layer_of("pdasgd_jax.runtime.queue") == layer_of("pdasgd_jax.runtime") == 5
    assert layer_of("pdasgd_jax") == ENTRY_POINTS == 6
    upward = upward_imports(import_graph())
    assert not upward, "imports that run up the floors:\n" + "\n".join(upward)


def test_nothing_below_the_experiment_reads_the_flat_config():
    """``Config`` is checked at the edge and turned into typed pieces by ``Experiment`` (layout,
    delay model, optimizer, event log path, runtime settings); the floors below it take those
    pieces, never the flat config. Only the configuration floor itself imports it."""
    config, experiment = "pdasgd_jax.config", layer_of("pdasgd_jax.experiment")
    readers = [
        f"{name} (floor {layer_of(name)}: {LAYERS[layer_of(name)][0]})"
        for name, imported in sorted(import_graph().items())
        if config in imported and layer_of(name) < experiment and layer_of(name) != layer_of(config)
    ]
    assert not readers, "below the experiment, reading the flat config:\n" + "\n".join(readers)


def _harness_imports(folder: pathlib.Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT.parent)} imports {name}"
        for path in sorted(folder.rglob("*.py"))
        for name in sorted(_all_imports(path))
        if name == HARNESS or name.startswith(HARNESS + ".")
    ]


def test_no_package_module_imports_the_study_harness():
    offenders = _harness_imports(ROOT)
    assert not offenders, "\n".join(offenders)


def test_the_library_tests_leave_the_harness_to_its_own_tests():
    """``tests/`` tests the library; what tests the study lives in ``benchmarks/tests/``."""
    offenders = _harness_imports(ROOT.parent / "tests")
    assert not offenders, "\n".join(offenders)
