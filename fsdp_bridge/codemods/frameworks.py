"""`--to bridge` in a file that uses a training framework: who builds the FSDP wrapper, and the
framework entry points that put the model on fsdp_bridge's engine.

Swapping a file's `torch.distributed.fsdp` import for ours is right only where the wrappers the
file handles are ours. That holds when the file builds them itself (it calls
`FullyShardedDataParallel(...)` or `fully_shard(...)`), or when the framework that builds them
is switched to fsdp_bridge's route in the same file:

- `from transformers import Trainer` -> `fsdp_bridge.integrations.transformers.Trainer`,
- `from accelerate import Accelerator` -> `fsdp_bridge.integrations.accelerate.Accelerator`
  (both shard with our `fully_shard`, accelerate's FSDP2 path),
- Lightning's `FSDPStrategy` (Trainer's or Fabric's) -> ours, and `strategy="fsdp"` ->
  `strategy="fsdp_bridge"` with `import fsdp_bridge.integrations.lightning` (our FSDP1 wrapper).

Otherwise (the framework is set up in another file, or in a way we cannot rewrite: the old
`pytorch_lightning` package, trl's trainers, a dotted `transformers.Trainer(...)`), the wrappers
stay torch's: the file keeps torch's import under a TODO that says why.
"""

from __future__ import annotations

import dataclasses

import libcst as cst
import libcst.matchers as m
from libcst.helpers import get_full_name_for_node

from fsdp_bridge.codemods.names import ACCELERATE_PLUGIN, HF_CONFIG_CALLS

# An FSDP2 route's models are fsdp_bridge `fully_shard` modules (instances of torch's
# FSDPModule too); an FSDP1 route's are fsdp_bridge's FullyShardedDataParallel.
FSDP2_ROUTE, FSDP1_ROUTE = "FSDP2", "FSDP1"
INTEGRATIONS = "fsdp_bridge.integrations"
LIGHTNING_ROUTE = f"{INTEGRATIONS}.lightning"

_TRAINER = (f"{INTEGRATIONS}.transformers", "Trainer", FSDP2_ROUTE)
_ACCELERATOR = (f"{INTEGRATIONS}.accelerate", "Accelerator", FSDP2_ROUTE)
_STRATEGY = (LIGHTNING_ROUTE, "FSDPStrategy", FSDP1_ROUTE)
_FABRIC_STRATEGY = (LIGHTNING_ROUTE, "FabricFSDPStrategy", FSDP1_ROUTE)
# (module, name) of a framework entry point -> (our module, our name, route)
ENTRY_POINTS = {
    ("transformers", "Trainer"): _TRAINER,
    ("transformers.trainer", "Trainer"): _TRAINER,
    ("accelerate", "Accelerator"): _ACCELERATOR,
    ("accelerate.accelerator", "Accelerator"): _ACCELERATOR,
    ("lightning.pytorch.strategies", "FSDPStrategy"): _STRATEGY,
    ("lightning.pytorch.strategies.fsdp", "FSDPStrategy"): _STRATEGY,
    ("lightning.fabric.strategies", "FSDPStrategy"): _FABRIC_STRATEGY,
    ("lightning.fabric.strategies.fsdp", "FSDPStrategy"): _FABRIC_STRATEGY,
}
ROUTE_OF_OURS = {f"{INTEGRATIONS}.transformers": FSDP2_ROUTE, f"{INTEGRATIONS}.accelerate": FSDP2_ROUTE,
                 LIGHTNING_ROUTE: FSDP1_ROUTE}
LIGHTNING_FSDP, OUR_STRATEGY = "fsdp", "fsdp_bridge"
# Wrappers a file builds itself (qualified names' last part, from the mirrored modules).
CONSTRUCTORS = frozenset({"FullyShardedDataParallel", "fully_shard", "YaFSDP"})
MIRRORED_ROOTS = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp", "ya_fsdp", "zeta",
                  "torchacc")


@dataclasses.dataclass
class Owner:
    """Who builds the wrappers a framework file handles, as read from the file."""

    builds_itself: bool = False  # the file calls a wrapper's constructor
    routes: set = dataclasses.field(default_factory=set)  # routes its entry points take (ours)
    blockers: list = dataclasses.field(default_factory=list)  # why an entry point stays the framework's
    noted: bool = False  # the TODO on the kept imports was written

    @property
    def keeps_torch(self) -> bool:
        """Whether the file's torch FSDP imports must stay torch's."""
        return not self.builds_itself and (bool(self.blockers) or not self.routes)

    def why_torch(self) -> str:
        kept = "this file's torch FSDP imports are kept"
        if self.blockers:
            return f"{'; '.join(self.blockers)}: the framework wraps the model in torch's FSDP, so {kept}"
        return ("the model this file handles is wrapped by a framework (HF Trainer, accelerate or Lightning) set "
                f"up in another file, in torch's FSDP unless that file is migrated to fsdp_bridge's route "
                f"(fsdp_bridge.integrations): {kept}; swap them once the route is ours")


def _ends_in(qualified: str, names) -> bool:
    return any(qualified.startswith(root + ".") for root in MIRRORED_ROOTS) and qualified.rsplit(".", 1)[-1] in names


def read_owner(module: cst.Module, qualified) -> Owner:
    """The Owner of a framework file; `qualified(node)` gives a node's qualified names."""
    owner = Owner()
    for call in m.findall(module, m.Call()):
        if any(_ends_in(q, CONSTRUCTORS) for q in qualified(call.func)):
            owner.builds_itself = True
        _read_strategy_argument(call, module, owner)
        _read_fsdp_version(call, qualified(call.func), owner)
        name = get_full_name_for_node(call.func) or ""
        if name in ("transformers.Trainer", "accelerate.Accelerator") or name.endswith(".FSDPStrategy"):
            owner.blockers.append(f"{name}(...) is not rewritten (import the class by name to have it "
                                  "rewritten to fsdp_bridge's route)")
    for imp in m.findall(module, m.ImportFrom()):
        _read_import(imp, owner)
    return owner


def _read_import(imp: cst.ImportFrom, owner: Owner) -> None:
    if imp.module is None or imp.relative or isinstance(imp.names, cst.ImportStar):
        return
    source = get_full_name_for_node(imp.module) or ""
    names = [get_full_name_for_node(alias.name) or "" for alias in imp.names]
    top = source.split(".")[0]
    if source in ROUTE_OF_OURS:
        owner.routes.add(ROUTE_OF_OURS[source])
    for name in names:
        if (source, name) in ENTRY_POINTS:
            owner.routes.add(ENTRY_POINTS[(source, name)][2])
        elif top == "trl" and name.endswith("Trainer"):
            owner.blockers.append(f"trl's {name} builds torch's FSDP through its own Trainer (use "
                                  f"class My{name}(BridgeTrainerMixin, {name}) from "
                                  "fsdp_bridge.integrations.transformers)")
        elif top == "pytorch_lightning" and name in ("FSDPStrategy", "Trainer"):
            owner.blockers.append(f"pytorch_lightning's {name}: fsdp_bridge's strategy is one of "
                                  "lightning.pytorch (import lightning.pytorch instead)")


def _literal_version(node: cst.BaseExpression | None):
    """The int a version argument or `{"version": N}` entry holds, None when not a literal."""
    if isinstance(node, cst.Integer):
        return int(node.value)
    return None


def _read_fsdp_version(call: cst.Call, names: set, owner: Owner) -> None:
    """Our Trainer and Accelerator run accelerate's FSDP2 path only: a config that says FSDP1
    (accelerate's plugin defaults to it; transformers' fsdp_config to FSDP2) stays torch's."""
    kwargs = {arg.keyword.value: arg.value for arg in call.args if arg.keyword is not None}
    if any(arg.star == "**" for arg in call.args):
        return  # the version may be in the splatted dict: not read from the file
    if names & ACCELERATE_PLUGIN:
        version = _literal_version(kwargs.get("fsdp_version"))
        if version != 2 and not (version is None and "fsdp_version" in kwargs):
            owner.blockers.append("FullyShardedDataParallelPlugin(...) without fsdp_version=2 configures "
                                  "accelerate's FSDP1, which fsdp_bridge's Accelerator does not run")
    elif names & HF_CONFIG_CALLS and isinstance(kwargs.get("fsdp_config"), cst.Dict):
        for element in kwargs["fsdp_config"].elements:
            key = getattr(element, "key", None)
            if (isinstance(key, cst.SimpleString) and key.evaluated_value == "version"
                    and _literal_version(element.value) not in (None, 2)):
                owner.blockers.append("fsdp_config version 1 configures the Trainer's FSDP1, which "
                                      "fsdp_bridge's Trainer does not run (it runs version 2)")


def _read_strategy_argument(call: cst.Call, module: cst.Module, owner: Owner) -> None:
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value != "strategy" or not isinstance(arg.value, cst.SimpleString):
            continue
        value = arg.value.evaluated_value
        if value == OUR_STRATEGY:
            owner.routes.add(FSDP1_ROUTE)
        elif value == LIGHTNING_FSDP and _imports_lightning(module):
            owner.routes.add(FSDP1_ROUTE)
        elif value == LIGHTNING_FSDP:
            owner.blockers.append(f"strategy={value!r} outside the lightning package (pytorch_lightning?): "
                                  "fsdp_bridge's strategy is one of lightning.pytorch")
        elif isinstance(value, str) and "fsdp" in value:
            owner.blockers.append(f"strategy={value!r} has no fsdp_bridge counterpart (use strategy="
                                  f"{OUR_STRATEGY!r} with its arguments instead)")


def _imports_lightning(module: cst.Module) -> bool:
    """`lightning` itself, not the old `pytorch_lightning` (our strategy is lightning.pytorch's)."""
    for imp in m.findall(module, m.Import() | m.ImportFrom()):
        if isinstance(imp, cst.ImportFrom):
            modules = [get_full_name_for_node(imp.module) or ""] if imp.module is not None else []
        else:
            modules = [get_full_name_for_node(alias.name) or "" for alias in imp.names]
        if any(name.split(".")[0] == "lightning" for name in modules):
            return True
    return False


def entry_point_import(imp: cst.ImportFrom) -> tuple[cst.ImportFrom, list[cst.SimpleStatementLine], list[str]]:
    """`imp` without the entry points it imports, the import statements of ours to add above it,
    and what was rewritten (for the report). Unchanged when it imports none; replaced by our
    import when it imports nothing else."""
    if imp.module is None or imp.relative or isinstance(imp.names, cst.ImportStar):
        return imp, [], []
    source = get_full_name_for_node(imp.module) or ""
    kept, ours, rewritten = [], [], []
    for alias in imp.names:
        name = get_full_name_for_node(alias.name) or ""
        target = ENTRY_POINTS.get((source, name))
        if target is None:
            kept.append(alias)
            continue
        module, our_name, _ = target
        bound = alias.asname.name.value if alias.asname is not None else name
        named = our_name if bound == our_name else f"{our_name} as {bound}"
        ours.append(cst.parse_statement(f"from {module} import {named}\n"))
        rewritten.append(f"{source}.{name} -> {module}.{our_name}")
    if not rewritten:
        return imp, [], []
    if not kept:
        return ours[0].body[0], ours[1:], rewritten
    kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return imp.with_changes(names=kept), ours, rewritten


def our_strategy(value: cst.SimpleString) -> cst.SimpleString:
    """`"fsdp"` -> `"fsdp_bridge"`, in the same quotes."""
    quote = value.quote
    return value.with_changes(value=f"{value.prefix}{quote}{OUR_STRATEGY}{quote}")
