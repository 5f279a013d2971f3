"""`FullyShardedDataParallel(...)` -> native torch FSDP2 `fully_shard` (FB100, FB101, FB110).

A call whose arguments are all literals is translated in place: the settings become
`fully_shard` keywords (mixed precision and CPU offload as FSDP2 policies), a literal wrap policy
becomes a loop of `fully_shard` calls over the matching submodules, children before parents, and
arguments FSDP2 does not take are dropped (their comments move into a TODO), and ignored
parameters given as a `.parameters()` call become `ignored_params`. Any other call keeps
its arguments and goes through `fsdp1_fully_shard`, which translates them when the script runs.
"""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.codemods import fsdp1, rules
from fsdp_bridge.codemods.base import IN_PLACE, RUNTIME
from fsdp_bridge.codemods.helpers import (
    code,
    comments_in,
    dotted,
    fit,
    is_literal,
    lost_comments,
    parse_expr,
    parse_stmt,
    rebuild_args,
    tight_equal,
)
from fsdp_bridge.codemods.mixed_precision import mixed_precision
from fsdp_bridge.codemods.names import FSDP, RUNTIME_MODULE

# FSDP1 arguments FSDP2 does not need; why, for the report.
DROPPED = {
    "backward_prefetch": "FSDP2 always prefetches in backward (set_modules_to_backward_prefetch for custom orders)",
    "forward_prefetch": "FSDP2 has no forward_prefetch flag (set_modules_to_forward_prefetch)",
    "limit_all_gathers": "FSDP2 needs no all-gather rate limiter",
    "use_orig_params": "FSDP2 always exposes the original parameters",
    "device_id": "FSDP2 takes the device from the mesh; call torch.cuda.set_device(local_rank) first on GPUs",
}

# FSDP1 arguments the helper translates when the script runs; what is not known before, for the report.
RUNTIME_ARGUMENTS = {
    "process_group": "FSDP2 takes a DeviceMesh, which the helper builds from the group(s) at run time",
    "ignored_modules": "FSDP2 takes their parameters (ignored_params), and they are no units of the wrap policy: "
                       "the helper collects both from the built model",
    "ignored_states": "whether it holds modules or parameters (FSDP2 takes a set of parameters) is known only "
                      "from the values at run time (only a .parameters() call is known here)",
    "param_init_fn": "FSDP2 has no such argument: the helper materialises meta modules with it, unit by unit",
}

# FSDP1's hybrid strategies: over a 2-D device_mesh, fully_shard on that mesh does the same (HSDP).
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def parameters_iterable(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """The `x.parameters()` call that `value` is, or that `list(...)`, `set(...)` or `tuple(...)`
    collects; None where the value is not known here to hold parameters only (a `.weight` may be
    None or a buffer; a name may hold modules)."""
    if (isinstance(value, cst.Call) and isinstance(value.func, cst.Name)
            and value.func.value in ("list", "set", "tuple") and len(value.args) == 1
            and not value.args[0].keyword and not value.args[0].star):
        value = value.args[0].value
    if (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "parameters"
            and all(arg.keyword is not None and arg.keyword.value == "recurse" for arg in value.args)):
        return value
    return None


class FullyShardRules:
    """The FSDP2 translation of the FSDP1 constructor; mixed into `Fsdp1Codemod`."""

    def translate_constructor(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        args = fsdp1.constructor_arguments(original)
        reasons = self._needs_runtime(original, args)
        if reasons:
            return self._via_runtime(original, updated, reasons)
        return self._in_place(original, updated, args)

    def _needs_runtime(self, call: cst.Call, args) -> list[str]:
        """Why this constructor call cannot be translated at migration time (empty: it can)."""
        if args is None:
            return ["the call passes *args/**kwargs: which FSDP1 arguments it gives is known only at run time"]
        if "module" not in args:
            return ["the module argument is missing"]
        values = {name: arg.value for name, arg in args.items()}
        reasons = []
        resolve = self.fsdp
        for name, why in RUNTIME_ARGUMENTS.items():
            if name in values and not is_literal(values[name], "None"):
                if name == "ignored_states" and parameters_iterable(values[name]) is not None:
                    continue  # fully_shard's ignored_params, see _translate_arg
                reasons.append(f"{name}: {why}")
        if "sync_module_states" in values and not is_literal(values["sync_module_states"], "False"):
            reasons.append("sync_module_states needs a broadcast at run time")
        strategy = fsdp1.strategy(values.get("sharding_strategy"), resolve)
        mesh_given = "device_mesh" in values and not is_literal(values["device_mesh"], "None")
        if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP") and not (strategy in HYBRID and mesh_given):
            reasons.append("sharding_strategy is not a literal FULL_SHARD/SHARD_GRAD_OP, nor a hybrid one over a "
                           "given device_mesh (hybrid without a mesh and NO_SHARD need a 2-D mesh built at run time)")
        if "cpu_offload" in values and fsdp1.cpu_offload(values["cpu_offload"], resolve) is None:
            reasons.append("cpu_offload is not a literal CPUOffload(...)")
        if "mixed_precision" in values and not is_literal(values["mixed_precision"], "None"):
            mp = mixed_precision(values["mixed_precision"], resolve)
            if isinstance(mp, str):
                reasons.append(mp)
        policy = fsdp1.policy(values.get("auto_wrap_policy"), resolve, self.qualified)
        if policy == "runtime":
            reasons.append("auto_wrap_policy is not a literal transformer/ModuleWrapPolicy/lambda policy: its units "
                           "are known only from the policy object at run time")
        elif policy is not None:
            if id(call) not in self.statement_calls or not self.at_statement:
                reasons.append("the call is nested in an expression, so no loop can precede it")
        return reasons

    def _via_runtime(self, original: cst.Call, updated: cst.Call, reasons: list[str]) -> cst.Call:
        self.site(rules.CONSTRUCTOR_AT_RUN_TIME, RUNTIME, original, "FullyShardedDataParallel(...)", "; ".join(reasons))
        self.need(RUNTIME_MODULE, "fsdp1_fully_shard")
        self.drop_import_of(original.func)
        return updated.with_changes(func=cst.Name("fsdp1_fully_shard"))

    def _in_place(self, original: cst.Call, updated: cst.Call, args: dict[str, cst.Arg]) -> cst.Call:
        values = {name: arg.value for name, arg in args.items()}
        resolve = self.fsdp
        kwargs: dict[str, str] = {}  # FSDP2 keyword -> code, for the non-root loop
        new_args, dropped_notes, reasons, moved_comments = [], [], [], []
        by_id = {id(arg): name for name, arg in args.items()}
        policy = fsdp1.policy(values.get("auto_wrap_policy"), resolve, self.qualified)
        module = code(values["module"])
        for old, new in zip(original.args, updated.args):
            name = by_id[id(old)]
            translated = self._translate_arg(name, old.value, new.value, resolve)
            if name == "module" and policy is not None and dotted(old.value) is None:
                module = self._name_the_module(new.value)
                new_args.append(new.with_changes(value=cst.Name(module)))
            elif name == "module":
                new_args.append(new)
            elif translated is None:
                if name in DROPPED and not is_literal(old.value, "None"):
                    reasons.append(f"dropped {name}: {DROPPED[name]}")
                elif name == "sharding_strategy" and fsdp1.strategy(old.value, resolve) in HYBRID:
                    reasons.append("HYBRID_SHARD over the 2-D device_mesh is fully_shard's HSDP on that mesh "
                                   "(replicated over its first dimension, sharded over its second, as FSDP1)")
                elif name == "sharding_strategy":
                    reasons.append("FULL_SHARD is FSDP2's default (the root stays unsharded after forward)")
                comments = comments_in(code(old))
                moved_comments.extend(comments)
                if comments:
                    dropped_notes.append(f"{name}={code(old.value)} ({' '.join(comments)})")
                self.drop_import_of(old.value)
            else:
                keyword, root_code, loop_code = translated
                kwargs[keyword] = loop_code
                new_args.append(new.with_changes(
                    keyword=cst.Name(keyword), value=parse_expr(root_code),
                    equal=new.equal if new.keyword else tight_equal(),
                ))
                self.drop_import_of(old.value)
        if dropped_notes:
            self.todo(rules.DROPPED_COMMENT, original, "dropped FSDP1 arguments", "; ".join(dropped_notes))
        if policy is not None:
            self._insert_loop(module, policy, kwargs)
            reasons.insert(0, f"{policy.what} expanded into a loop of fully_shard calls")
            if "mp_policy" in kwargs:
                # FSDP1 wraps _module_classes_to_ignore (BatchNorm by default) in their own fp32
                # units under a policy; the rewrite does not. Say so rather than change it silently.
                reasons.append("BatchNorm modules, which FSDP1 keeps in fp32 under a wrap policy "
                               "with mixed precision, get the same mp_policy as their parent: "
                               "fully_shard them first with MixedPrecisionPolicy() if the model has any")
        self.site(rules.CONSTRUCTOR_IN_PLACE, IN_PLACE, original, "FullyShardedDataParallel(...)",
                  "; ".join(reasons) or "fully_shard with the same settings")
        self.need(FSDP, "fully_shard")
        self.drop_import_of(original.func)
        result = fit(updated.with_changes(func=cst.Name("fully_shard"), args=rebuild_args(updated.args, new_args)),
                     original)
        self.comment_above(*lost_comments(updated, result, moved_comments))
        return result

    def _translate_arg(self, name, old, new, resolve):
        """(FSDP2 keyword, code for the root, code for other units), or None to drop."""
        if name == "sharding_strategy":
            zero2 = fsdp1.strategy(old, resolve) in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
            return ("reshard_after_forward", "False", "False") if zero2 else None
        if name == "ignored_states":
            ignored = f"set({code(parameters_iterable(new))})"
            return ("ignored_params", ignored, ignored)
        if name == "device_mesh":
            return ("mesh", code(new), code(new))
        if name == "cpu_offload":
            if not fsdp1.cpu_offload(old, resolve):
                return None
            self.need(FSDP, "CPUOffloadPolicy")
            self.need("torch")
            # Pinning host memory needs an accelerator: pin only where one is present.
            policy = "CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())"
            return ("offload_policy", policy, policy)
        if name == "mixed_precision":
            mp = mixed_precision(old, resolve)
            if isinstance(mp, str):  # a literal None
                return None
            self.need(FSDP, "MixedPrecisionPolicy")
            if isinstance(old, cst.Call):
                self.drop_import_of(old.func)
            return ("mp_policy", mp.policy(root=True), mp.policy(root=False))
        if name == "auto_wrap_policy" and not is_literal(old, "None"):
            self.drop_policy_imports(old)
        return None

    def _name_the_module(self, expression: cst.BaseExpression) -> str:
        """Assign a wrapped module written as an expression (`FSDP(nn.Sequential(...), ...)`) to a
        new name before the statement, so that the loop over its units can name it; it is built
        once, as before."""
        name = self.fresh("model")
        self.insert_before(cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(name))], expression)]))
        return name

    def _insert_loop(self, module: str, policy: fsdp1.Policy, kwargs: dict[str, str]) -> None:
        var = self.fresh("submodule")
        extra = "".join(f", {k}={v}" for k, v in kwargs.items())
        loop = parse_stmt(
            f"for {var} in reversed(list({module}.modules())):  # children before parents\n"
            f"    if {var} is not {module} and {policy.cond(var)}:\n"
            f"        fully_shard({var}{extra})\n"
        )
        self.insert_before(loop)
