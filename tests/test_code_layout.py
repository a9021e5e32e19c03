"""The code's shape: no import cycle among msrl's modules, and the driver split into files of
under 300 lines each (run, loop, run directory, checkpoints, metrics, outcome)."""

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"msrl": ROOT / "msrl", "msrl.cluster": ROOT / "cluster", "msrl.algorithms": ROOT / "algorithms",
            "msrl.fragments": ROOT / "fragments", "msrl.distribution_policies": ROOT / "distribution_policies"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the msrl modules it imports, anywhere in it (function-level imports too).
    ``from pkg import mod`` is an edge to ``pkg.mod`` only (a package's own lazy imports of its
    submodules are not a cycle)."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for name, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs if subs else ([node.module] if node.module in mods else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in mods]
            else:
                continue
            edges[name].update(t for t in targets if t != name)
    return edges


def _cycles(edges: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_msrl_modules():
    mods = _modules()
    assert _cycles(_imports(mods), sorted(mods)) == []


def test_a_planted_cycle_is_found():
    edges = collections.defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _cycles(edges, ["a", "b", "c", "d"]) == [["a", "b", "c"]]


def test_the_driver_is_split_into_files_under_300_lines():
    for name in ("training", "loop", "rundir", "checkpoints", "metrics", "outcome"):
        lines = (ROOT / "msrl" / "run" / f"{name}.py").read_text().count("\n")
        assert lines < 300, (name, lines)


#: product files allowed past ~600 lines, each because one idea needs it
LONG_MODULES = {"msrl.frontend.tracer": "the supported subset of Python, one visitor"}


def test_no_product_file_is_over_600_lines_but_the_tracer():
    """A file over ~600 lines holds more than one idea; the tracer is the one allowed (one ``ast``
    visitor over the supported subset)."""
    long = {m: f.read_text().count("\n") for m, f in _modules().items() if f.read_text().count("\n") > 620}
    assert set(long) <= set(LONG_MODULES), long


def test_no_two_modules_share_a_name():
    """Every module's name says its room: no two modules of msrl's packages have one file name
    (``frames.py`` twice, ``inference.py`` twice, ``single.py`` twice were)."""
    seen: dict[str, list[str]] = {}
    for module, f in _modules().items():
        if f.name != "__init__.py":
            seen.setdefault(f.name, []).append(module)
    assert {name: ms for name, ms in seen.items() if len(ms) > 1} == {}


def _exception_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class defined in msrl's packages: name -> (module, base names)."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                classes[node.name] = (name, bases)
    return classes


def test_every_public_error_derives_from_msrl_error():
    """``msrl.MsrlError`` is the base of every public error (the CLI classifies errors by it and
    its ``exit_status``, not by names). ``TrainingInterrupted`` is a ``KeyboardInterrupt`` by
    design (Ctrl-C must stay one)."""
    import builtins

    classes = _exception_classes()
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}

    def reaches(name: str, targets: set[str], seen: frozenset = frozenset()) -> bool:
        if name in targets:
            return True
        if name in seen or name not in classes:
            return False
        return any(reaches(b, targets, seen | {name}) for b in classes[name][1])

    errors = {n for n in classes if reaches(n, builtin) and not n.startswith("_")}
    assert len(errors) >= 25  # the check sees them all
    outside = sorted(f"{classes[n][0]}.{n}" for n in errors if not reaches(n, {"MsrlError"}) and n != "TrainingInterrupted")
    assert outside == [], f"errors not derived from msrl.MsrlError: {outside}"


def _compared_constants(node: ast.Compare) -> set:
    """The constants a comparison compares with, alone or in a tuple, list or set."""
    consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
    consts += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set)) for e in c.elts
               if isinstance(e, ast.Constant)]
    return {c.value for c in consts if isinstance(c.value, (str, int, float, bool))}


def test_no_module_outside_fragments_compares_backend_names():
    """What differs between backends lives in their hooks (``msrl.runtime.programs.backends.Backend``): nothing
    outside ``fragments/`` tests a fragment's backend by its name."""
    names = {f.stem for f in PACKAGES["msrl.fragments"].glob("*.py") if f.stem != "__init__"}
    assert {"torch_graph", "cuda_kernel", "cpu_process_group"} <= names
    found = []
    for mod, f in _modules().items():
        if mod.startswith("msrl.fragments"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare) and _compared_constants(node) & set(names):
                found.append(f"{mod}:{node.lineno}")
    assert found == [], f"backend names compared outside fragments/: {found}"


def test_the_runtime_seam_is_held():
    """``msrl/runtime/*`` never imports the config or the job (the driver's side), ``cluster/*``
    never the tracer or the probe (the driver compiles jobs: ``msrl.run.job.compile_job``) nor,
    but ``msrl launch``'s command, anything of the run or the config, and the
    training loop never asks which runtime it has (``isinstance``/``hasattr`` on the job)."""
    edges = _imports(_modules())
    runtime = {m: sorted(t for t in ts if t in ("msrl.config", "msrl.run.job")) for m, ts in edges.items()
               if m.startswith("msrl.runtime")}
    assert {m: ts for m, ts in runtime.items() if ts} == {}
    cluster = {m: sorted(t for t in ts if t in ("msrl.frontend.tracer", "msrl.frontend.probe")) for m, ts in edges.items()
               if m.startswith("msrl.cluster")}
    assert {m: ts for m, ts in cluster.items() if ts} == {}
    # the Ray runtime sits below the run as the local one does: only ``msrl launch``'s command
    # module reads a config; the driver hands RayJob everything else (compiled job, options, hooks)
    above = {m: sorted(t for t in _reach(edges, {m}) if t.startswith(("msrl.run.", "msrl.config")))
             for m in edges if m.startswith("msrl.cluster") and m != "msrl.cluster.launch"}
    assert {m: ts for m, ts in above.items() if ts} == {}
    loop = ast.parse((PACKAGES["msrl"] / "run/loop.py").read_text())
    asks = [n.lineno for n in ast.walk(loop) if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("isinstance", "hasattr")
            and n.args and "job" in ast.unparse(n.args[0])]
    assert asks == []


def test_no_algorithm_imports_another():
    """What algorithms share (networks, samplers, buffers, schedules, losses) lives in
    ``msrl.rl``; an algorithm file never imports another (``sac`` from ``dqn``, ``a2c``
    from ``ppo``), so each reads on its own and changing one cannot change another's meaning."""
    edges = _imports(_modules())
    algorithms = {m for m in edges if m.startswith("msrl.algorithms.")}
    assert len(algorithms) >= 7
    assert {m: sorted(edges[m] & algorithms) for m in algorithms if edges[m] & algorithms} == {}


def test_region_kinds_are_read_from_one_table():
    """Loop, branch, all-reduce and serve regions: node (its sub-graphs, its one-line form), lint,
    codegen and the printer read them from ``msrl.graph.regions.REGIONS``; no ``if`` on a region
    kind is left in those files, and codegen holds a lowering for every kind of the table."""
    from msrl.graph import REGION_KINDS
    from msrl.graph.regions import REGIONS
    from msrl.runtime.programs.codegen import REGION_LOWERING

    assert set(REGIONS) == set(REGION_KINDS) == set(REGION_LOWERING)
    for path in ("msrl/graph/node.py", "msrl/graph/graph.py", "msrl/runtime/programs/codegen.py", "msrl/run/printer.py"):
        tree = ast.parse((ROOT / path).read_text())
        tests = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                 and any(f"NodeKind.{k.name}" in ast.unparse(c) for c in n.comparators for k in REGIONS)
                 and "ALLREDUCE" not in ast.unparse(n)]  # (an allreduce without a body is a comm node)
        assert tests == [], (path, tests)


def test_envs_do_not_import_the_runtime():
    """The library layer (``msrl.envs``) sits below the runtimes: what a native env needs of
    device memory (one host read, host-side blocks, foreign kernel launches a replay repeats) is
    ``msrl.device``, which the runtime plugs into; no env module imports ``msrl.runtime``."""
    edges = _imports(_modules())
    envs = {m for m in edges if m.startswith("msrl.envs")}
    assert len(envs) >= 10
    assert {m: sorted(t for t in edges[m] if t.startswith("msrl.runtime")) for m in envs
            if any(t.startswith("msrl.runtime") for t in edges[m])} == {}
    assert "msrl.device" in edges["msrl.envs.native.base"]
    assert not any(t.startswith("msrl.runtime") for t in edges["msrl.device"]), edges["msrl.device"]


def test_no_learner_subclasses_another_algorithms_learner():
    """Each algorithm's learner is its own: every learner class in its lineage (below
    ``msrl.api.Learner``) is defined in the algorithm's own file, and the shared package
    ``msrl.rl`` holds no learner, so a change to PPO's learner cannot change MA-PPO's or MAPPO's."""
    import importlib
    import inspect

    from msrl.api import Learner
    from msrl.registry import available_algorithms

    borrowed = {}
    for name in available_algorithms():
        module = importlib.import_module(f"msrl.algorithms.{name}")
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, Learner) and cls.__module__ == module.__name__:
                foreign = [c.__qualname__ for c in cls.__mro__[1:]
                           if issubclass(c, Learner) and c is not Learner and c.__module__ != module.__name__]
                if foreign:
                    borrowed[f"{name}.{cls.__qualname__}"] = foreign
    assert borrowed == {}
    for path in (ROOT / "msrl" / "rl").glob("*.py"):
        module = importlib.import_module(f"msrl.rl.{path.stem}" if path.stem != "__init__" else "msrl.rl")
        assert not [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Learner)], path


def test_one_owner_of_the_ray_replica_actors():
    """On Ray, :class:`msrl.cluster.actor_manager.ReplicaGroup` alone starts, calls, waits for,
    watches and kills the replica actors (as RLlib's ``FaultTolerantActorManager``): the job
    (``RayJob``: placement, process group, accounting; its :class:`~msrl.cluster.replacement.Replacements`:
    lost replicas replaced) makes no Ray actor call itself."""
    calls = []
    for module, name in (("ray_runtime.py", "RayJob"), ("replacement.py", "Replacements")):
        tree = ast.parse((PACKAGES["msrl.cluster"] / module).read_text())
        job = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)  # (ray.get of the placement group is placement)
        calls += sorted({f"{module}:{ast.unparse(n.func)}:{n.lineno}" for n in ast.walk(job) if isinstance(n, ast.Call)
                         and isinstance(n.func, ast.Attribute) and (n.func.attr in ("kill", "wait")
                                                                    and ast.unparse(n.func.value) in ("ray", "remote")
                                                                    or n.func.attr == "remote")})
    assert calls == []


def test_both_runtimes_implement_the_one_interface():
    from msrl.cluster.ray_runtime import RayJob
    from msrl.run.job import Job
    from msrl.runtime.interface import JobRuntime

    names = [n for n in dir(JobRuntime) if not n.startswith("_")]
    for cls in (Job, RayJob):
        assert [n for n in names if not hasattr(cls, n) and n not in cls.__init__.__code__.co_names] == [], cls


def _reach(edges: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every msrl module ``start`` imports, directly or through others (function-level imports too)."""
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        for t in edges.get(m, ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_the_graph_package_imports_nothing_above_it():
    """The graph IR and the fragmented graph sit below everything that builds or runs them: the
    graph package reaches only itself and msrl's errors, never the front end, the runtime or
    the run (directly or through another module)."""
    edges = _imports(_modules())
    graph = {m for m in edges if m == "msrl.graph" or m.startswith("msrl.graph.")}
    assert "msrl.graph.fragmented" in graph
    assert sorted(t for t in _reach(edges, graph) if t not in graph) == ["msrl.errors"]


def test_the_runtime_never_reaches_the_front_end_or_the_config():
    """The runtime reads the fragmented graph (``msrl.graph.fragmented``) and runs programs; the
    front end that builds the graph (tracer, probe, partitioner, passes: ``msrl.frontend``) and
    the config schema are the driver's, so no runtime module imports them, directly or through
    another module."""
    edges = _imports(_modules())
    runtime = {m for m in edges if m.startswith("msrl.runtime")}
    reached = _reach(edges, runtime)
    assert "msrl.graph.fragmented" in reached
    assert sorted(t for t in reached if t.startswith(("msrl.frontend", "msrl.config", "msrl.run."))) == []


def test_the_contracts_sit_below_everything_that_runs_them():
    """The modules directly in ``msrl/`` and the ``msrl.api`` package are the contracts (roles,
    specs, errors, the policy model, the registries) and the libraries algorithms share (advantages, normalisation, device reads):
    they reach the graph IR at most, never the front end, the runtime, the config or the run."""
    edges = _imports(_modules())
    top = {m for m, f in _modules().items()
           if f.parent == PACKAGES["msrl"] and f.name != "__init__.py" or m == "msrl.api" or m.startswith("msrl.api.")}
    assert {"msrl.api", "msrl.errors", "msrl.policy", "msrl.registry"} <= top
    above = ("msrl.frontend", "msrl.runtime", "msrl.config", "msrl.run.", "msrl.cluster")
    assert sorted(t for t in _reach(edges, top) if t.startswith(above)) == []


def test_no_module_outside_the_envs_compares_engine_names():
    """What differs between env engines lives in their table (``msrl.envs.engines``), as a
    backend's differences live in its hooks: nothing outside ``msrl/envs/`` compares an
    ``env.engine`` value with an engine's name."""
    from msrl.envs.engines import ENGINES

    assert set(ENGINES) == {"sync", "process", "envpool", "ale_vector"}
    found = []
    for mod, f in _modules().items():
        if mod.startswith("msrl.envs"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare) and "engine" in ast.unparse(node) and _compared_constants(node) & set(ENGINES):
                found.append(f"{mod}:{node.lineno}")
    assert found == [], f"engine names compared outside msrl/envs/: {found}"


def test_setup_installs_every_package():
    """A non-editable install (``pip install .``: the GPU check's) holds every folder of msrl's
    namespace that is a package: ``setup.py`` lists each one."""
    import re

    listed = set(re.findall(r'"(msrl(?:\.[a-z_]+)*)"', (ROOT / "setup.py").read_text().split("package_dir")[0]))
    packages = {m for m, f in _modules().items() if f.name == "__init__.py"}
    assert packages - listed == set()
