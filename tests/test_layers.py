"""The package's architecture, checked: every import inside `fsdp_bridge` goes to the same layer
or a lower one, and no chain of imports comes back to where it started.

Imports inside functions count too: a lazy import is still a dependency, and a circle closed
lazily is still a circle for whoever reads the code.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fsdp_bridge")

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS = (
    ("plan", ("fsdp_bridge.plan",)),
    ("engine", ("fsdp_bridge.engine",)),
    # What every front-end shares: argument tables and errors, auto-wrap policies, devices,
    # process-group topology, the FSDP1 module face, state dicts in torch's forms, the refusal
    # of models that mix dialects, the one atomic file writer (TorchAcc's saves use it too).
    ("front-end kit", ("fsdp_bridge.translation", "fsdp_bridge.policies", "fsdp_bridge.devices",
                       "fsdp_bridge.topology", "fsdp_bridge.wrapper", "fsdp_bridge.state_dicts",
                       "fsdp_bridge.mixed_dialects", "fsdp_bridge.outputs")),
    ("front-ends", ("fsdp_bridge.fsdp", "fsdp_bridge.ya_fsdp", "fsdp_bridge.zeta",
                    "fsdp_bridge.torchacc")),
    # Built on the front-ends: checkpoints, the equivalence harness, migration, measurement,
    # the training frameworks' routes onto them.
    ("tools", ("fsdp_bridge.checkpoint", "fsdp_bridge.harness", "fsdp_bridge.migrate",
               "fsdp_bridge.codemods", "fsdp_bridge.memory", "fsdp_bridge.explanation",
               "fsdp_bridge.explain_cli", "fsdp_bridge.checkpoint_cli", "fsdp_bridge.bench",
               "fsdp_bridge.tiny", "fsdp_bridge.demo", "fsdp_bridge.examples",
               "fsdp_bridge.extras", "fsdp_bridge.progress", "fsdp_bridge.text",
               "fsdp_bridge.integrations")),
    ("command line", ("fsdp_bridge.cli", "fsdp_bridge.__main__", "fsdp_bridge")),
)


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")]
    name = relative.replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _modules() -> dict[str, str]:
    found = {}
    for directory, _, files in os.walk(ROOT):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                found[_module_name(path)] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The fsdp_bridge modules one import statement reaches (a name imported from a package
    that is itself a module counts as that module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "fsdp_bridge"]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "fsdp_bridge":
        return []
    reached = []
    for alias in node.names:
        child = f"{target}.{alias.name}"
        reached.append(child if child in known else target)
    return reached


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        is_package = path.endswith("__init__.py")
        for node in ast.walk(tree):
            for target in _imported(node, name, is_package, set(modules)):
                if target != name:
                    graph[name].add(target)
    return graph


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_goes_to_the_same_layer_or_below():
    upward = []
    for module, targets in import_graph().items():
        for target in targets:
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    graph = import_graph()
    # A package's __init__ re-exporting its own modules is not a circle of design; an import
    # of the package back from one of those modules is.
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_engine_imports_only_the_plan():
    outside = sorted(f"{module} imports {target}" for module, targets in import_graph().items()
                     if layer_of(module) == 1 for target in targets if layer_of(target) > 1)
    assert not outside, outside


def test_every_layer_entry_names_a_module():
    # The table stays true to the package: an entry for a module that is gone is an error.
    modules = set(_modules())
    stale = [prefix for _, prefixes in LAYERS for prefix in prefixes
             if not any(m == prefix or m.startswith(prefix + ".") for m in modules)]
    assert not stale, stale


def test_the_rule_can_fail():
    # The checks above see what they claim to: a made-up upward import and circle are caught.
    assert layer_of("fsdp_bridge.engine.runtime") < layer_of("fsdp_bridge.checkpoint.api")
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert "fsdp_bridge.engine.runtime" in import_graph()["fsdp_bridge.engine"]
