"""State dicts and FSDP1's static methods, for FSDP2 (FB104, FB107, FB204, FB205, FB207-FB209).

`with FSDP.state_dict_type(model, ...)` blocks go, and the state-dict calls they configure take
`StateDictOptions` instead (`torch.distributed.checkpoint.state_dict`); `FSDP.optim_state_dict`
and friends become DCP calls through runtime helpers that keep FSDP1's return values. A block
that configures calls made elsewhere is kept (FB209): dropping it would change what they save.
Where the options are known only when the script runs, the runtime helpers take them.
"""

from __future__ import annotations

import dataclasses

import libcst as cst
import libcst.matchers as m
from libcst.metadata import GlobalScope, ScopeProvider

from fsdp_bridge.codemods import rules
from fsdp_bridge.codemods.base import IN_PLACE, RUNTIME
from fsdp_bridge.codemods.facts import PROVEN
from fsdp_bridge.codemods.fsdp1 import STATE_DICT_TYPE_PARAMS, Qualified, Resolve, state_dict_config
from fsdp_bridge.codemods.helpers import (
    call_arguments,
    call_like,
    code,
    comments_in,
    dotted,
    keyword_arg,
    leftmost,
    parse_expr,
    unwrap_with,
    with_comments_of,
)
from fsdp_bridge.codemods.names import (
    ATTRIBUTE_BY_NAME,
    DCP,
    FSDP1,
    FSDP1_STATIC_METHODS,
    RUNTIME_MODULE,
    STATE_DICT_METHODS,
    STATE_DICT_TYPE,
    TYPE_CHECKS,
)
from fsdp_bridge.codemods.result_uses import LOAD, SAVE, ResultUse, result_uses

# Static methods of the FSDP1 class we leave alone, with the reason.
UNTRANSLATED_STATICS = {
    "summon_full_params": (rules.SUMMON_FULL_PARAMS, "FSDP2 has no exact equivalent: use unshard()/reshard() "
                           "on each FSDPModule or DTensor.full_tensor(); writeback semantics differ"),
    "set_state_dict_type": (rules.SET_STATE_DICT_TYPE, "FSDP2 has no persistent state-dict mode: pass "
                            "StateDictOptions to get_/set_model_state_dict where the state dict is taken"),
}

# FSDP1 static signatures we translate (arguments past these make the site a TODO).
OPTIM_SIGNATURES = {
    "optim_state_dict": ("model", "optim", "optim_state_dict", "group"),
    "full_optim_state_dict": ("model", "optim", "optim_input", "rank0_only", "group"),
    "optim_state_dict_to_load": ("model", "optim", "optim_state_dict", "is_named_optimizer", "load_directly", "group"),
    "scatter_full_optim_state_dict": ("full_optim_state_dict", "model", "optim_input", "optim", "group"),
    "fsdp_modules": ("module", "root_only"),
}

KEPT = "kept"  # a state_dict_type block left as it was (FB204/FB209)
BROADCAST_LOAD = "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)"
FULL_ON_RANK0 = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
ANY_MODULE = "*"  # see StateDictRules.foreign_contexts


@dataclasses.dataclass(frozen=True)
class Block:
    """What a translated `with FSDP.state_dict_type(model, ...)` block asks of its calls: the
    StateDictOptions code for the model's state dict, an optimizer state dict taken, and one
    loaded (loading differs: FSDP1's rank0_only load is DCP's broadcast_from_rank0)."""

    model: str
    model_options: str
    optim_save_options: str | None  # None: FSDP1's default optimizer config, which the helper applies
    optim_load_options: str
    written: str = ""  # the state_dict_type call as written, for the TODOs left in the block


def _load_options(full: bool, rank0_only: bool) -> str:
    """StateDictOptions code for loading an optimizer state under an FSDP1 config: with
    rank0_only, rank 0 passes the full state and the others None, and FSDP1 broadcasts it."""
    if not full:
        return "StateDictOptions(full_state_dict=False)"
    if rank0_only:
        return "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)"
    return "StateDictOptions(full_state_dict=True)"


def _options(full: bool, offload_to_cpu: bool, rank0_only: bool) -> tuple[str, str | None]:
    """StateDictOptions code for an FSDP1 state-dict config, and what it cannot keep (None: exact).

    DCP offloads a full state dict to the CPU only together with "rank 0 only" (`cpu_offload`
    means both there), so FSDP1's two flags map exactly only when they agree."""
    if not full:
        # Sharded: each rank keeps its own shards, on the CPU with offload_to_cpu.
        return ("StateDictOptions(full_state_dict=False, cpu_offload=True)" if offload_to_cpu
                else "StateDictOptions(full_state_dict=False)"), None
    if offload_to_cpu == rank0_only:
        return ("StateDictOptions(full_state_dict=True, cpu_offload=True)" if rank0_only
                else "StateDictOptions(full_state_dict=True)"), None
    if offload_to_cpu:  # every rank a full copy on the CPU: DCP gives every rank one on the device
        return "StateDictOptions(full_state_dict=True)", (
            "offload_to_cpu=True without rank0_only: DCP offloads a full state dict to the CPU only on "
            "rank 0, so every rank now gets its full copy in device memory; pass "
            "StateDictOptions(full_state_dict=True, cpu_offload=True) if only rank 0 needs it")
    return "StateDictOptions(full_state_dict=True, cpu_offload=True)", (
        "rank0_only=True without offload_to_cpu: DCP gives rank 0 its full state dict on the CPU, "
        "not in device memory")


def _own_state(bound: dict[str, cst.Arg]) -> bool:
    """True for `FSDP.optim_state_dict(model, optim, optim_state_dict=optim.state_dict())`: the
    optimizer's own state dict, which is what FSDP1 reads when the argument is left out."""
    state, optim = bound.get("optim_state_dict"), bound.get("optim")
    value = state.value if state is not None else None
    return (optim is not None and isinstance(value, cst.Call) and not value.args and not comments_in(code(state))
            and isinstance(value.func, cst.Attribute) and value.func.attr.value == "state_dict"
            and dotted(value.func.value) is not None and dotted(value.func.value) == dotted(optim.value))


def _operand(node: cst.BaseExpression) -> str:
    """`node`'s code, parenthesised where `x or {}` would otherwise bind into it."""
    text = code(node)
    return text if isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) else f"({text})"


def _static_on(call: cst.Call, model: str | None) -> bool:
    """True for one of FSDP1's static methods reached through `model` (`model.optim_state_dict(model, optim)`)."""
    func = call.func
    return (isinstance(func, cst.Attribute) and func.attr.value in FSDP1_STATIC_METHODS
            and func.attr.value != "state_dict_type" and model is not None and dotted(func.value) == model)


def _takes_optimizer_state(resolve: Resolve, node: cst.With, model: str) -> bool:
    """True if the block takes an optimizer state dict under its config: `FSDP.optim_state_dict`
    (loading one is exact whatever offload_to_cpu says; full_optim_state_dict has its own flags)."""
    return any(resolve(call.func) == f"{FSDP1}.optim_state_dict"
               or _static_on(call, model) and call.func.attr.value == "optim_state_dict"
               for call in m.findall(node.body, m.Call()))


def _takes_model_state(node: cst.With, model: str) -> bool:
    """True if the block calls `model.state_dict()` (where the state dict lives matters only for
    one taken: a load reads what it is given, wherever offload_to_cpu would have put it)."""
    return any(isinstance(call.func, cst.Attribute) and call.func.attr.value == "state_dict"
               and dotted(call.func.value) == model for call in m.findall(node.body, m.Call()))


def configures_elsewhere(node: cst.With, model: str | None, resolve: Resolve, qualified: Qualified) -> bool:
    """True unless the block's only business with the model is its own state-dict calls.

    `with FSDP.state_dict_type(trainer.model, ...): trainer.save_model()` configures a call
    made elsewhere (inside the library); dropping the context would change what it saves.
    So does a method called on the model or its owner, or either passed to a function.
    """
    if model is None:
        return True
    base, handled = model.split(".")[0], False
    for call in m.findall(node.body, m.Call()):
        func, name = call.func, resolve(call.func) or ""
        if qualified(func) & (TYPE_CHECKS | ATTRIBUTE_BY_NAME):
            continue  # isinstance(model, FSDP), getattr(model, ...): a test reads no state-dict setting
        if isinstance(func, cst.Attribute) and func.attr.value in STATE_DICT_METHODS and dotted(func.value) == model:
            handled = True
            continue
        if name.startswith(FSDP1 + ".") and name != STATE_DICT_TYPE or _static_on(call, model):
            handled = True  # FSDP.optim_state_dict(model, optim) and friends, also as model.optim_state_dict(...)
            continue
        root = leftmost(func) if isinstance(func, cst.Attribute) else None
        if isinstance(root, cst.Name) and root.value == base:
            return True
        for arg in call.args:
            passed = dotted(arg.value)
            if passed is not None and (passed == model or model.startswith(passed + ".")
                                       or passed.startswith(model + ".")):
                return True
    return not handled


class StateDictRules:
    """FSDP2 state-dict translations; mixed into `Fsdp1Codemod`."""

    def __init__(self, context) -> None:
        super().__init__(context)
        # One entry per enclosing `with`: None, KEPT, or a `Block`.
        self.state_dict_blocks: list = []
        # One entry per enclosing `with`: the names it passes to a context manager not torch's
        # (`with checkpoint_context(model):`), which may set a state-dict type for them; ANY_MODULE
        # for a context held in a variable in a file that builds state_dict_type contexts as values.
        self.foreign_contexts: list[set[str]] = []
        self._module: cst.Module | None = None
        self._result_uses: dict[int, ResultUse] | None = None  # read when first needed
        self.unassigned: set[int] = set()  # `state = <torch call>` statements whose name goes
        # `optim.load_state_dict(state)` statements that go, by the id of the statement taking their place
        self.loaded_by_torch: dict[int, cst.SimpleStatementLine] = {}
        self.loaded_directly: set[int] = set()  # `optim.load_state_dict(<torch load>)`: the torch load stays

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self._module, self._result_uses = node, None

    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine):
        updated = super().leave_SimpleStatementLine(original, updated)
        if any(load is original for load in self.loaded_by_torch.values()):
            return cst.RemoveFromParent()  # set_optimizer_state_dict loaded the state already
        if id(original) in self.unassigned:
            load = self.loaded_by_torch.get(id(original))
            updated = updated.with_changes(body=[cst.Expr(updated.body[0].value)])
            return with_comments_of(load, updated) if load is not None else updated
        if id(original) in self.loaded_directly:
            return updated.with_changes(body=[cst.Expr(updated.body[0].value.args[0].value)])
        return updated

    # -- FSDP.<static method>(...) -------------------------------------------------------

    def translate_static_method(self, original: cst.Call, updated: cst.Call, method: str) -> cst.BaseExpression:
        if method in UNTRANSLATED_STATICS:
            rule, reason = UNTRANSLATED_STATICS[method]
            self.todo(rule, original, f"FullyShardedDataParallel.{method}(...)", reason)
            return updated
        if method == "state_dict_type":
            if id(original) in self.state_dict_type_items:
                return updated  # handled as a `with` block, see leave_With
            return self._runtime_call(original, updated, rules.STATE_DICT_TYPE_VALUE, "fsdp1_state_dict_type",
                                      list(updated.args),
                                      "a state_dict_type context used as a value (held, returned or passed on): "
                                      "which state-dict calls it governs is known only when it is entered, so the "
                                      "helper's context tells this file's state-dict calls (also routed) which "
                                      "options to use")
        args = self._static_args(original, updated, method)
        if args is None:
            self.todo(rules.OTHER_FSDP1_USE, original, f"FullyShardedDataParallel.{method}(...)",
                      "no automatic FSDP2 translation for this FSDP1 API (or for these arguments)")
            return updated
        if method == "fsdp_modules":
            return self._fsdp_modules(original, updated, args)
        torch_form, no_torch_form = self._optimizer_torch_form(original, updated, method, args)
        if torch_form is not None:
            return torch_form
        if method == "scatter_full_optim_state_dict":
            return self._runtime_call(original, updated, rules.RUNTIME_HELPER,
                                      "fsdp1_scatter_full_optim_state_dict", args,
                                      "FSDP1 returned rank 0's state scattered, for optim.load_state_dict(); "
                                      "DCP loads it directly (set_optimizer_state_dict, broadcast_from_rank0), so "
                                      "the helper loads it and returns the loaded state for that call")
        if method in ("optim_state_dict", "full_optim_state_dict"):
            # get_optimizer_state_dict shares some tensors with the optimizer (Adam's step); FSDP1
            # returned copies, so the helper copies those.
            why = ("get_optimizer_state_dict shares some tensors with the optimizer (Adam's step) where FSDP1 "
                   f"returned copies: the helper copies those ({no_torch_form})")
            if method == "full_optim_state_dict":
                # FSDP1's default is rank0_only=True: with cpu_offload, DCP gives the full dict on rank 0.
                options = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
            else:
                options, why = self._optim_options(False, why)
            if options is not None:
                args = [*args, self._options_arg(options)]
            return self._runtime_call(original, updated, rules.STATE_DICT, "fsdp1_optim_state_dict", args, why)
        # optim_state_dict_to_load
        options, _ = self._optim_options(True, "")
        if options is not None:
            args = [*args, self._options_arg(options)]
        return self._runtime_call(original, updated, rules.STATE_DICT, "fsdp1_optim_state_dict_to_load", args,
                                  "FSDP1 returned a state for optim.load_state_dict(); DCP loads it directly "
                                  "(set_optimizer_state_dict), so the helper loads it and returns the loaded state "
                                  f"for that call ({no_torch_form})")

    def translate_sharded_optimizer_load(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """`load_sharded_optimizer_state_dict(model_state_dict, key, reader)` -> the runtime helper,
        same arguments (FB108)."""
        self.site(rules.SHARDED_OPTIMIZER_LOAD, RUNTIME, original, f"{code(original.func)}(...)",
                  "torch's function builds FSDP1 ShardedTensors, and the migrated model's optimizer fails at its "
                  "first step with them: fsdp1_load_sharded_optimizer_state_dict() reads the checkpoint into "
                  "DTensors sharded as the model state dict's parameters (torch's function still runs for a "
                  "model left as FSDP1)")
        self.need(RUNTIME_MODULE, "fsdp1_load_sharded_optimizer_state_dict")
        self.drop_import_of(original.func)
        return updated.with_changes(func=cst.Name("fsdp1_load_sharded_optimizer_state_dict"))

    # -- torch's own call where the file shows the helper's differences cannot matter ----------

    def _optimizer_torch_form(self, original: cst.Call, updated: cst.Call, method: str, args: list[cst.Arg]):
        """`(set_/get_optimizer_state_dict(...), "")` for an optimizer static whose result the file
        only loads at once or saves at once (see `result_uses.py`), with options known here;
        `(None, why not)` where the runtime helper is needed."""
        if self._result_uses is None:
            self._result_uses = result_uses(self._module) if self._module is not None else {}
        use = self._result_uses.get(id(original))
        direct = use is not None and use.name is None  # optim.load_state_dict(FSDP.optim_state_dict_to_load(...))
        references = [] if direct else self._references(use) if use is not None else None
        if references is None:
            return None, ("its result is not assigned to a function's local name assigned once, so the file's "
                          "later uses of the state cannot be followed")
        state_name = code(use.name) if use.name else "its result"
        if method in ("optim_state_dict", "full_optim_state_dict"):
            options = FULL_ON_RANK0 if method == "full_optim_state_dict" else self._optim_options(False, "")[0]
            if not (options or "").startswith("StateDictOptions("):
                return None, "its options are known only at run time"
            if use.kind != SAVE or not self._only_saved(references, use.follower):
                return None, (f"{state_name} is used beyond a torch.save(...) in the next statement, so later "
                              "optimizer steps would change a state that shares their tensors")
            return self._dcp_call(original, updated, "get_optimizer_state_dict", args, options), ""
        if method == "scatter_full_optim_state_dict":
            (state, model, optim), options = args, BROADCAST_LOAD
        elif self._current_order(original):
            (model, optim, state), options = args, self._load_options_here(args[0].value)
        else:
            return None, ("the state is passed by position and the first argument is not proven to be the model, "
                          "so the order may be torch 2.0's (optim_state_dict first): the helper tells it by the "
                          "types when the script runs")
        loaded = use.follower.body[0].value.args[0].value if use.kind == LOAD else None
        if not (options or "").startswith("StateDictOptions("):
            return None, "its options are those of a state_dict_type context that may be set at run time"
        if use.kind != LOAD or dotted(optim.value) != use.optimizer or (
                not direct and [id(node) for node in references] != [id(loaded)]):
            return None, (f"{state_name} is not only passed to {dotted(optim.value)}.load_state_dict(...) by "
                          "the next statement")
        if "broadcast_from_rank0=True" in options:  # FSDP1's other ranks pass None; DCP takes a dict
            state = state.with_changes(value=parse_expr(f"{_operand(state.value)} or {{}}"))
        if direct:
            self.loaded_directly.add(id(use.follower))
        else:
            self.unassigned.add(id(use.assignment))
            self.loaded_by_torch[id(use.assignment)] = use.follower
        return self._dcp_call(original, updated, "set_optimizer_state_dict", [model, optim, state], options), ""

    def _references(self, use: ResultUse) -> list[cst.CSTNode] | None:
        """The nodes that read the assigned name, where it is a function's local assigned once."""
        scope = self.get_metadata(ScopeProvider, use.name, None)
        if scope is None or isinstance(scope, GlobalScope):
            return None  # a module-level name may be read from other files
        assignments = list(scope.assignments[use.name.value])
        if len(assignments) != 1:
            return None
        return [reference.node for reference in assignments[0].references]

    def _only_saved(self, references: list[cst.CSTNode], follower: cst.BaseStatement) -> bool:
        """True if every reference is inside the arguments of a `torch.save(...)` in `follower`."""
        inside = {id(name) for call in m.findall(follower, m.Call()) if "torch.save" in self.qualified(call.func)
                  for arg in call.args for name in m.findall(arg, m.Name())}
        return bool(references) and all(id(node) in inside for node in references)

    def _current_order(self, call: cst.Call) -> bool:
        """True unless `optim_state_dict_to_load` may be torch 2.0's (optim_state_dict, model, optim):
        the state passed by keyword, or the first argument proven to be the model."""
        bound = call_arguments(call, OPTIM_SIGNATURES["optim_state_dict_to_load"]) or {}
        state, model = bound.get("optim_state_dict"), bound.get("model")
        return (state is not None and state.keyword is not None) or (model is not None and
                                                                      self.receiver(model.value) == PROVEN)

    def _load_options_here(self, model: cst.BaseExpression) -> str | None:
        """The options of an optimizer load here: the block's, else FSDP1's default (a full state on
        every rank) where no context set at run time may apply."""
        options = self._optim_options(True, "")[0]
        if options is not None or self.current_state_dict_block() is not None:
            return options
        if self.runtime_state_dict_type or self.in_foreign_context(dotted(model)):
            return None
        return "StateDictOptions(full_state_dict=True)"

    def _static_args(self, original: cst.Call, updated: cst.Call, method: str) -> list[cst.Arg] | None:
        """The call's arguments in FSDP1's positional order, or None if it passes any we do not map."""
        signature = OPTIM_SIGNATURES.get(method)
        bound = call_arguments(original, signature) if signature else None
        if bound is None:
            return None
        default = 3 if method.endswith("_load") else 2
        required = {"fsdp_modules": 1, "scatter_full_optim_state_dict": 2}.get(method, default)
        wanted = [*signature[:required]] + (["optim"] if method == "scatter_full_optim_state_dict" else [])
        if method == "fsdp_modules" and "root_only" in bound and code(bound["root_only"].value) != "False":
            wanted.append("root_only")  # fsdp1_fsdp_modules takes it
        defaults = {"root_only": "False", "optim_state_dict": "None", "group": "None", "optim_input": "None",
                    "is_named_optimizer": "False", "load_directly": "False", "rank0_only": "True"}
        if method == "optim_state_dict":
            defaults.pop("optim_state_dict")  # the no-argument form only
            if _own_state(bound):
                bound.pop("optim_state_dict")  # optim.state_dict() passed: what FSDP1 reads when none is
        for name, arg in bound.items():
            if name not in wanted and not (name in defaults and code(arg.value) == defaults[name]):
                return None
        if any(name not in bound for name in wanted):
            return None
        new_by_old = {id(old): new for old, new in zip(original.args, updated.args)}
        # The argument nodes themselves (their line comments with them), made positional but for
        # root_only (last, and clearer by name).
        return [new_by_old[id(bound[name])] if name == "root_only" else
                new_by_old[id(bound[name])].with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT)
                for name in wanted]

    def _fsdp_modules(self, original: cst.Call, updated: cst.Call, args: list[cst.Arg]) -> cst.BaseExpression:
        """`FSDP.fsdp_modules(model)`: the FSDPModules among `model.modules()`, in that order as
        FSDP1's, where no constructor left in the tree builds FSDP1 wrappers; the helper, which
        finds those too (and takes root_only=True), where one may."""
        kept = None if len(args) > 1 else self.fsdp1_still_built()
        if len(args) > 1 or kept is not None:
            why = ("root_only=True keeps the outermost ones, known only from the built model (torch has no such "
                   "list)") if kept is None else f"FSDP1 wrappers may exist: {kept}"
            return self._runtime_call(original, updated, rules.RUNTIME_HELPER, "fsdp1_fsdp_modules", args,
                                      f"fsdp1_fsdp_modules() finds the FSDP2 modules (FSDPModule) and the FSDP1 "
                                      f"wrappers under the module; {why}")
        self.site(rules.RUNTIME_HELPER, IN_PLACE, original, code(original.func) + "(...)",
                  "the FSDPModule instances among the module's modules(), in the same order; no constructor "
                  "left in the migrated tree builds FSDP1 wrappers")
        self.need("torch.distributed.fsdp", "FSDPModule")
        self.drop_import_of(original.func)
        module = args[0].value
        source = code(module)
        if not isinstance(module, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
            source = f"({source})"  # `(a if c else b).modules()`
        unit = next((name for name in ("submodule", "unit") if name not in source), None) or self.fresh("fsdp_module")
        return parse_expr(f"[{unit} for {unit} in {source}.modules() if isinstance({unit}, FSDPModule)]")

    def _runtime_call(self, original, updated, rule: str, helper: str, args: list[cst.Arg], reason: str) -> cst.Call:
        self.site(rule, RUNTIME, original, code(original.func) + "(...)", reason)
        self.need(RUNTIME_MODULE, helper)
        if isinstance(original.func, cst.Attribute):
            self.drop_import_of(original.func)
        return call_like(cst.Name(helper), args, updated)

    def _optim_options(self, load: bool, why: str) -> tuple[str | None, str]:
        """The options an optimizer state-dict call passes (None: none, the helper decides), and
        `why` completed. Only a translated block's options are written out: elsewhere a context
        set at run time (held in a variable, built by a helper of this file or another) may be
        active, and the helper takes its options, or FSDP1's defaults where none is."""
        current = self.current_state_dict_block()
        if current is not None and (load or current.optim_save_options is not None):
            return (current.optim_load_options if load else current.optim_save_options), why
        if current is not None:
            return None, why + ("; the block's optimizer config is full on every rank, offloaded to the CPU "
                                "(FSDP1's default), which DCP has no options for: the helper gathers the state "
                                "on every rank and moves it to the CPU")
        return None, why + ("; outside any state_dict_type block the helper takes the options of an active "
                            "fsdp1_state_dict_type context, else FSDP1's default optimizer config (full on every "
                            "rank, offloaded to the CPU)")

    def _dcp_call(self, original, updated, function: str, args: list[cst.Arg], options: str) -> cst.Call:
        self.site(rules.STATE_DICT, IN_PLACE, original, code(original.func) + "(...)",
                  f"{function} from torch.distributed.checkpoint.state_dict")
        self.need(DCP, function)
        self.drop_import_of(original.func)
        return call_like(cst.Name(function), [*args, self._options_arg(options)], updated)

    def _options_arg(self, options: str) -> cst.Arg:
        """`options=...`, importing StateDictOptions where the code names it (not where a runtime
        helper builds the options)."""
        if options.startswith("StateDictOptions("):
            self.need(DCP, "StateDictOptions")
        return keyword_arg("options", options)

    # -- model.state_dict() / load_state_dict() -------------------------------------------

    def route_model_state_dict(self, original: cst.Call, updated: cst.Call, receiver, method: str, kind):
        """`x.state_dict()` / `x.load_state_dict(sd)` in a file that uses FSDP1 (`kind`: the receiver's)."""
        if self.in_kept_state_dict_block():
            return updated  # the FSDP1 context stays, and with it the calls it configures
        current = self.current_state_dict_block()
        in_block = current is not None and receiver == current.model
        if kind != PROVEN and not in_block and self.in_fsdp2_function:
            return updated  # FSDP2 code already: its state dict is the DTensor one it expects
        if not in_block and kind is None and not self.in_foreign_context(receiver):
            return updated
        return self.model_state_dict(original, updated, receiver, method, kind, current if in_block else None)

    def model_state_dict(self, original, updated, receiver: str, method: str, kind, block) -> cst.BaseExpression:
        if method == "state_dict" and original.args:
            return updated
        args = original.args
        strict = next((a for a in updated.args[1:] if a.keyword and a.keyword.value == "strict"), None)
        options_of_block = block.model_options if block is not None else "StateDictOptions(full_state_dict=True)"
        if method == "load_state_dict" and (
                not args or args[0].keyword or args[0].star or len(args) > 1 + (strict is not None)
                or (strict is not None and not options_of_block.startswith("StateDictOptions("))):
            self.todo(rules.OTHER_FSDP1_USE, original, f"{receiver}.load_state_dict(...)",
                      "only load_state_dict(state_dict) and load_state_dict(state_dict, strict=...) are translated")
            return updated
        # The receiver as rewritten (`m.module` may have become `fsdp1_unwrap(m)`).
        model_arg = cst.Arg(updated.func.value)
        args = [model_arg] if method == "state_dict" else [model_arg, updated.args[0]]
        if strict is not None:  # StateDictOptions takes it: strict=... goes into the options
            options_of_block = f"{options_of_block[:-1]}, strict={code(strict.value)})"
            block = block and dataclasses.replace(block, model_options=options_of_block)
        # The block's own model holds FSDP modules: FSDP1's state_dict_type(model) completes only
        # on one that does (see `_state_dict_context`).
        if block is not None or (kind == PROVEN and not self.runtime_state_dict_type
                                 and not self.in_foreign_context(receiver)):
            # Outside a state_dict_type block FSDP1 gives a full state dict; FSDP2 would give DTensors.
            function = "get_model_state_dict" if method == "state_dict" else "set_model_state_dict"
            return self._dcp_call(original, updated, function, args, options_of_block)
        if strict is not None:
            args.append(strict)
        helper = "fsdp1_state_dict" if method == "state_dict" else "fsdp1_load_state_dict"
        if self.in_foreign_context(receiver):
            why = (f"{receiver} is used inside a context manager (held in a variable, or one that is passed it) that "
                   "may set its state-dict type as fsdp1_state_dict_type does")
        elif kind == PROVEN:
            why = "the model is an FSDP module, but a state_dict_type context held in a variable may set its options"
        else:
            why = (f"{receiver} is not proven to be the wrapped model here (it may be a DDP or plain module, "
                   "whose own state dict stays)")
        reason = f"{helper}() checks for FSDP2 modules at run time: {why}; it uses the options of an active " \
            "fsdp1_state_dict_type context, FSDP1's FULL default otherwise"
        self.site(rules.STATE_DICT, RUNTIME, original, f"{receiver}.{method}(...)", reason)
        self.need(RUNTIME_MODULE, helper)
        return call_like(cst.Name(helper), args, updated)

    # -- with FSDP.state_dict_type(...) blocks -----------------------------------------------

    def todo_context(self) -> str:
        """A TODO left inside a translated `state_dict_type` block loses the context it ran in when
        the block goes: the TODO says which it was."""
        block = self.current_state_dict_block()
        if block is None or not block.written:
            return ""
        return f" (this ran inside `with {block.written}:`, which the migration removed)"

    def current_state_dict_block(self):
        """The innermost enclosing translated state_dict_type block (a `Block`), or None."""
        return next((ctx for ctx in reversed(self.state_dict_blocks) if ctx not in (None, KEPT)), None)

    def in_kept_state_dict_block(self) -> bool:
        return KEPT in self.state_dict_blocks

    def enter_state_dict_block(self, node: cst.With) -> None:
        """Push what a `with` block's state_dict_type item (if any) asks of its state-dict calls."""
        self.state_dict_blocks.append(None)
        self.foreign_contexts.append({
            name for item in node.items if isinstance(item.item, cst.Call) and self._foreign(item.item.func)
            for name in (dotted(arg.value) for arg in item.item.args) if name})
        held = any(isinstance(item.item, (cst.Name, cst.Attribute)) for item in node.items)
        if self.runtime_state_dict_type and held:
            self.foreign_contexts[-1].add(ANY_MODULE)  # `with ctx:` where ctx may be fsdp1_state_dict_type(...)
        for item in node.items:
            call = item.item
            if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
                continue
            if self.fsdp(call.func) == STATE_DICT_TYPE:
                self._with_node = node
                args = call_arguments(call, STATE_DICT_TYPE_PARAMS) or {}
                model = dotted(args["module"].value) if "module" in args else None
                # A kept block is decided first: its configs are not translated (nor flagged as inexact).
                kept = item.asname is not None or configures_elsewhere(node, model, self.fsdp, self.qualified)
                context = None if kept else self._state_dict_context(call)
                self.state_dict_blocks[-1] = KEPT if context is None else context

    def leave_state_dict_block(self):
        self.foreign_contexts.pop()
        return self.state_dict_blocks.pop()

    def _foreign(self, func: cst.BaseExpression) -> bool:
        """True for a context manager that is not torch's, contextlib's or a builtin: a helper of
        this file or another (`with fsdp_checkpoint_context(model):`) may open FSDP1's
        state_dict_type inside, which the migrated helper does as fsdp1_state_dict_type."""
        names = self.qualified_names(func)
        return not any(name.split(".")[0] in ("torch", "contextlib", "builtins") for name in names)

    def in_foreign_context(self, receiver: str | None) -> bool:
        """True inside `with helper(receiver, ...):` (see `_foreign`) or `with ctx:` in a file that holds
        state_dict_type contexts in variables: FSDP1's context there may configure the receiver."""
        return receiver is not None and any(receiver in names or ANY_MODULE in names for names in self.foreign_contexts)

    def _state_dict_context(self, call: cst.Call) -> Block | None:
        """What a state_dict_type call asks of the state-dict calls of its block (None: kept).

        Inside the block, the model's own state-dict calls become `get_/set_model_state_dict`
        whatever the model's receiver kind: torch's `state_dict_type(module)` sets the type on
        each FSDP1 module under `module` and, on leaving, restores the type it found on them;
        under a module holding none it finds none and the restore raises (KeyError: None), so a
        block that ran to its end was given a module holding FSDP modules. DCP's functions take
        FSDP1 and FSDP2 modules alike, for a model built in a file left as FSDP1 too."""
        args = call_arguments(call, STATE_DICT_TYPE_PARAMS)
        if args is None or "state_dict_type" not in args or "module" not in args:
            return None
        kind = self.fsdp(self._config_value(args["state_dict_type"])) or ""
        if kind == "StateDictType.LOCAL_STATE_DICT":
            return None
        model = dotted(args["module"].value)
        if model is None:
            return None
        if kind in ("StateDictType.FULL_STATE_DICT", "StateDictType.SHARDED_STATE_DICT"):
            full = kind == "StateDictType.FULL_STATE_DICT"
            model_arg = args.get("state_dict_config")
            optim_arg = args.get("optim_state_dict_config")
            model_cfg = state_dict_config(self._config_value(model_arg), self.fsdp, False)
            optim_cfg = state_dict_config(self._config_value(optim_arg), self.fsdp, True)
            if model_cfg is not None and optim_cfg is not None:
                (model_options, model_problem), (optim_options, optim_problem) = (
                    _options(full, *model_cfg), _options(full, *optim_cfg))
                if model_problem and _takes_model_state(self._with_node, model) and self.model_state_by_dcp():
                    self.todo(rules.INEXACT_STATE_DICT_OPTIONS, call, "state_dict_config", model_problem)
                if optim_problem and optim_cfg == (True, False):
                    optim_options = None  # FSDP1's default optimizer config: the helper's own default
                elif optim_problem and _takes_optimizer_state(self.fsdp, self._with_node, model):
                    self.todo(rules.INEXACT_STATE_DICT_OPTIONS, call, "optim_state_dict_config", optim_problem)
                return Block(model, model_options, optim_options, _load_options(full, optim_cfg[1]), code(call))
        # Non-literal type or configs: translate when the script runs.
        passed = ", ".join(f"{a.keyword.value}={code(a.value)}" if a.keyword else code(a.value)
                           for a in call.args if a is not args["module"])
        optim = f"fsdp1_state_dict_options({passed}, for_optimizer=True)"
        # (the load helper adapts the optimizer's options to a load)
        return Block(model, f"fsdp1_state_dict_options({passed})", optim, optim, code(call))

    def model_state_by_dcp(self) -> bool:
        """True if the model's own state-dict calls in the block being entered become DCP calls
        (a command whose model answers some blocks itself says which)."""
        return True

    def _config_value(self, arg: cst.Arg | None) -> cst.BaseExpression | None:
        """A type or config argument as written, or the literal a variable passed there holds
        (`cfg = FullStateDictConfig(...)`, `kind = StateDictType.FULL_STATE_DICT`, see
        `literal_value`), so both translate alike."""
        if arg is None:
            return None
        value = self.literal_value(arg.value, any_use=True)
        if value is not None and (self.fsdp(value) or "").startswith("StateDictType."):
            return value  # an enum member: no use of the name can change it
        return self.literal_value(arg.value) or arg.value

    def translate_state_dict_block(self, original: cst.With, updated: cst.With, context):
        """The `with` block left, given what `enter_state_dict_block` pushed for it."""
        index = next((i for i, item in enumerate(original.items) if isinstance(item.item, cst.Call)
                      and self.fsdp(item.item.func) == STATE_DICT_TYPE), None)
        if index is None:
            return updated
        call = original.items[index].item
        if context is KEPT:
            kind = self.fsdp(call.args[1].value) if len(call.args) > 1 else None
            if kind == "StateDictType.LOCAL_STATE_DICT":
                self.todo(rules.LOCAL_STATE_DICT, original, "state_dict_type(LOCAL_STATE_DICT)", "FSDP2 has no local "
                          "(flat-parameter) state dict; use the sharded DTensor state dict")
            else:
                self.todo(rules.STATE_DICT_TYPE_ELSEWHERE, original, "with FSDP.state_dict_type(...)",
                          "the block does more than take this model's state dict (calls made elsewhere "
                          "read the setting, or its arguments cannot be read): pass StateDictOptions to "
                          "get_/set_model_state_dict where the state dict is taken, then remove the block")
            return updated
        status = RUNTIME if "fsdp1_state_dict_options" in context.model_options else IN_PLACE
        self.site(rules.STATE_DICT, status, original, "with FSDP.state_dict_type(...)",
                  "the block's state-dict calls take StateDictOptions instead" + (
                      "; the state-dict type or a config is not a literal (nor a variable assigned once from "
                      "one), so fsdp1_state_dict_options() builds them at run time" if status == RUNTIME else ""))
        if status == RUNTIME:
            self.need(RUNTIME_MODULE, "fsdp1_state_dict_options")
        self.drop_import_of(call.func)
        for arg in call.args[1:]:
            self.drop_import_of(arg.value)
        if len(original.items) > 1:
            items = [it for i, it in enumerate(updated.items) if i != index]
            items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(items=items)
        return unwrap_with(updated)
