"""Imports only point down the layer diagram in DESIGN.md; this walks every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hora"

BASE = {"hora.errors", "hora.config", "hora.knobs", "hora._util"}
CORE = {"hora.core.frontend", "hora.core.op", "hora.core.data.aligned", "hora.core.data.packing",
        "hora.core.engine.context", "hora.core.engine.set_queries"}
"""What of the core the adapters, elastic and ``hora`` itself may import: the front-end, the op
vocabulary, the host-memory helpers and the process's context; never the engine's, the lane's
or the data path's machinery."""
ALLOWED: dict[str, set[str]] = {
    "hora._util": BASE,
    "hora.errors": set(),
    "hora.config": {"hora.errors", "hora.knobs"},
    "hora.knobs": set(),
    "hora.collectives": BASE | {"hora.collectives"},
    "hora.rendezvous": BASE | {"hora.rendezvous"},
    "hora.timeline": BASE | {"hora.timeline"},
    "hora.transports": BASE | {"hora.transports", "hora.collectives.comm", "hora.rendezvous"},
    # the core's subpackages, bottom up (each one's __init__ docstring says what it owns):
    # op <- data <- lane <- engine <- frontend, and autotune <- engine
    "hora.core": BASE,
    "hora.core.op": BASE | {"hora.collectives.ops"},
    "hora.core.data": BASE | {"hora.core.op", "hora.collectives", "hora.transports",
                              "hora.rendezvous", "hora.timeline"},
    "hora.core.lane": BASE | {"hora.core.op", "hora.core.data", "hora.collectives.ops",
                              "hora.transports"},
    "hora.core.autotune": BASE | {"hora.core.op", "hora.collectives.ops", "hora.transports.base"},
    "hora.core.engine": BASE | {"hora.core.op", "hora.core.data", "hora.core.lane",
                                "hora.core.autotune", "hora.collectives", "hora.transports",
                                "hora.rendezvous", "hora.timeline"},
    "hora.core.frontend": BASE | {"hora.core.op", "hora.core.data", "hora.core.lane",
                                  "hora.core.engine", "hora.collectives"},
    "hora.runner": BASE | {"hora.runner", "hora.rendezvous", "hora.timeline"},
    # hora.spark.run: launcher-side like hora.runner (the tasks start ranks; never the engine)
    "hora.spark": BASE | {"hora.spark", "hora.runner", "hora.rendezvous"},
    # the Spark Estimators' rank side (what each rank runs, never the driver) uses the adapters
    "hora.spark.torch.remote": BASE | {"hora.spark", "hora.torch"},
    "hora.spark.keras.remote": BASE | {"hora.spark", "hora.keras", "hora.tensorflow"},
    # hora.ray: launcher-side like hora.runner (the driver; the actors run the user's function)
    "hora.ray": BASE | {"hora.ray", "hora.runner", "hora.rendezvous"},
    # elastic's worker side: states and the loop, above the core, below the adapters
    "hora.elastic": BASE | CORE | {"hora.elastic", "hora.rendezvous"},
    "hora.torch": BASE | CORE | {"hora.torch", "hora.collectives.ops", "hora.elastic",
                          "hora"},
    "hora.tensorflow": BASE | CORE | {"hora.tensorflow", "hora.collectives.ops",
                               "hora.elastic", "hora"},
    "hora.jax": BASE | CORE | {"hora.jax", "hora.collectives.ops", "hora.elastic", "hora"},
    "hora.keras": BASE | {"hora.keras", "hora.tensorflow", "hora.elastic", "hora"},
    # hora.run (Horovod's horovod.run) imports the launcher's Python API lazily, on first call.
    "hora": BASE | CORE | {"hora.collectives.ops", "hora.runner.api", "hora.elastic"},
}


def _layer(module: str) -> str:
    best = ""
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import sub`` imports the module ``pkg.sub`` where there is one
            subs = [f"{node.module}.{a.name}" for a in node.names
                    if _is_module(f"{node.module}.{a.name}")]
            found += [(node.lineno, t) for t in subs] if len(subs) == len(node.names) else [
                (node.lineno, node.module)]
    return [(line, name) for line, name in found if name == "hora" or name.startswith("hora.")]


def _allowed(target: str, allowed: set[str]) -> bool:
    """``"hora"`` allows the package's own top-level modules (``hora._basics``), not every layer."""
    return any(target == a or (_layer(target) == "hora" if a == "hora" else
                               target.startswith(a + ".")) for a in allowed)


def test_no_upward_imports() -> None:
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        layer = _layer(module)
        assert layer, f"{module} belongs to no layer; add it to ALLOWED in {__file__}"
        for line, target in _imports(path):
            if _layer(target) == layer or _allowed(target, ALLOWED[layer]):
                continue
            problems.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} ({layer}) "
                            f"imports {target}")
    assert not problems, "upward or sideways imports:\n" + "\n".join(problems)


def test_runner_never_imports_the_engine() -> None:
    for path in (ROOT / "runner").rglob("*.py"):
        for _, target in _imports(path):
            assert not target.startswith(("hora.core", "hora.torch", "hora.tensorflow",
                                          "hora.keras", "hora.transports")), (
                f"{path} imports {target}")


def test_the_launcher_loads_neither_the_engine_nor_numpy() -> None:
    """`import hora` is lazy (PEP 562), so `hora run` starts without the engine's imports."""
    import subprocess
    import sys

    code = ("import sys, hora.runner.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('hora.core', 'numpy', "
            "'hora.transports', 'hora.numpy_api'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", out


def _edges() -> dict[str, set[str]]:
    """module -> the hora modules it imports (``from pkg import sub`` is an edge to ``sub``)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names
                        if f"{node.module}.{a.name}" in paths]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            graph[module] |= {t for t in targets if t in paths and t != module}
    return graph


def test_no_import_cycles() -> None:
    """No module imports itself back through others (late and TYPE_CHECKING imports count)."""
    graph = _edges()
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph[module]):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


MAX_LINES = 450
"""Modules of one concept stay small (issue 18's target)."""

TO_SPLIT = {  # over the limit when the limit came in; each may only shrink until it is split
}


def test_modules_stay_small() -> None:
    grown = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        limit = TO_SPLIT.get(rel, MAX_LINES)
        if lines > limit:
            grown.append(f"hora/{rel}: {lines} lines (limit {limit})")
    assert not grown, "split these modules by concept:\n" + "\n".join(grown)
