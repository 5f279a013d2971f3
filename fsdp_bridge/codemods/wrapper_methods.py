"""Methods of the wrapped model, for FSDP2: `no_sync` (FB102), `clip_grad_norm_` (FB103),
`summon_full_params` (FB205), `no_sync` used as a value (FB107); `state_dict`/`load_state_dict`
are handed to `state_dict.py`.

FSDP2 modules have no `no_sync()` context: a `with model.no_sync():` on a proven receiver
becomes `set_requires_gradient_sync(False)` before a `try` whose `finally` restores it; a
receiver that may be one (see [Note: which receivers are FSDP modules] in `facts.py`) goes
through `fsdp1_no_sync`, which does the same on FSDP2 modules and calls `no_sync()` on anything
else; any other receiver keeps its line (DDP's `no_sync()` is the usual one there).

`clip_grad_norm_` differs: no torch module but FSDP1's has that method, so a receiver of
unknown kind is flagged as in a file that imports no FSDP class (FB215), not left alone.
"""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.codemods import rules
from fsdp_bridge.codemods.base import IN_PLACE, RUNTIME
from fsdp_bridge.codemods.facts import PROVEN
from fsdp_bridge.codemods.helpers import call_like, code, dotted, parse_expr, parse_stmt, space_comma
from fsdp_bridge.codemods.names import RUNTIME_MODULE, STATE_DICT_METHODS
from fsdp_bridge.codemods.state_dict import UNTRANSLATED_STATICS
from fsdp_bridge.migrate.files import NOT_FSDP1_CLIP


class WrapperMethodRules:
    """FSDP2 translations of the wrapper's methods; mixed into `Fsdp1Codemod`."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self.no_sync_blocks: set[int] = set()  # ids of `model.no_sync()` calls whose block is expanded

    def translate_method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        method = original.func.attr.value
        receiver = dotted(original.func.value)
        if method == "no_sync" and not original.args:
            if id(original) in self.no_sync_blocks or self.receiver(original.func.value) is None:
                return updated  # expanded with its block, or not an FSDP1 model of this file
            self.site(rules.NO_SYNC, RUNTIME, original, f"{code(original.func)}()",
                      f"{self._may_be_fsdp(original.func.value)}: fsdp1_no_sync() toggles "
                      "set_requires_gradient_sync on FSDP2 modules and calls no_sync() on anything else")
            self.need(RUNTIME_MODULE, "fsdp1_no_sync")
            return cst.Call(func=cst.Name("fsdp1_no_sync"), args=[cst.Arg(updated.func.value)])
        if method not in ("clip_grad_norm_", "summon_full_params", *STATE_DICT_METHODS):
            return updated
        kind = self.receiver(original.func.value)
        if method == "clip_grad_norm_":
            return self._clip_grad_norm(original, updated, kind)
        if method == "summon_full_params":
            if kind is not None:
                rule, reason = UNTRANSLATED_STATICS[method]
                self.todo(rule, original, f"{receiver}.summon_full_params(...)", reason)
            return updated
        return self.route_model_state_dict(original, updated, receiver, method, kind)

    def _clip_grad_norm(self, original: cst.Call, updated: cst.Call, kind) -> cst.BaseExpression:
        receiver = code(original.func.value)
        if kind == PROVEN:
            self.site(rules.CLIP_GRAD_NORM, IN_PLACE, original, f"{receiver}.clip_grad_norm_(...)",
                      "torch.nn.utils.clip_grad_norm_ over the parameters (returns a DTensor)")
            self.need("torch")
            params = cst.Arg(parse_expr(f"{receiver}.parameters()"))
            return call_like(parse_expr("torch.nn.utils.clip_grad_norm_"), [params, *updated.args], updated)
        if kind is None:
            # Not an FSDP1 model of this file, yet only FSDP1 modules have this method: the model
            # may be wrapped in another file, so flag it as where no FSDP class is imported.
            self.flag_clip_elsewhere(original, "this file does not wrap (it may be wrapped elsewhere)")
            return updated
        self.site(rules.CLIP_GRAD_NORM, RUNTIME, original, f"{code(original.func)}(...)",
                  f"{self._may_be_fsdp(original.func.value)}: fsdp1_clip_grad_norm_() clips an FSDP2 module's "
                  "parameters with torch.nn.utils (a plain tensor back, as FSDP1's) and calls the method on "
                  "anything else")
        self.need(RUNTIME_MODULE, "fsdp1_clip_grad_norm_")
        return call_like(cst.Name("fsdp1_clip_grad_norm_"), [cst.Arg(updated.func.value), *updated.args], updated)

    def _may_be_fsdp(self, node: cst.BaseExpression) -> str:
        """Why a receiver goes through a runtime helper: it may be an FSDP model, or not."""
        return (f"{code(node)} may hold an FSDP model or another object (it is not proven to be "
                "assigned from FSDP(...) here)")

    def check_method_elsewhere(self, original: cst.Call) -> None:
        """`model.clip_grad_norm_(max_norm)` in a file that does not use the FSDP1 class (it may
        import other FSDP names): the model is wrapped in another file, and fully_shard modules have
        no such method. Not inside `if fsdp_version(model) == 1:`, code that chose its dialect, nor on
        an instance of a class of this file."""
        if (original.func.attr.value == "clip_grad_norm_" and not self.in_version_guard
                and dotted(original.func.value) not in self.built_by_own_classes):
            self.flag_clip_elsewhere(original, "wrapped elsewhere")

    def flag_clip_elsewhere(self, original: cst.Call, why: str) -> None:
        """FB215 on FSDP1's `model.clip_grad_norm_(max_norm)` (not on accelerate's, AMP's...,
        which are named so or take the parameters first)."""
        owner = (dotted(original.func.value) or "").split(".")[-1]
        first = original.args[0].value if original.args else None
        takes_parameters = isinstance(first, cst.Call) and (dotted(first.func) or "").endswith("parameters")
        if not owner or takes_parameters or NOT_FSDP1_CLIP.search(owner):
            return
        self.todo(rules.CLIP_ELSEWHERE, original, f"{code(original.func)}(...)",
                  f"FSDP1's clip_grad_norm_ on a model {why}: fully_shard modules have no such "
                  f"method; use torch.nn.utils.clip_grad_norm_({code(original.func.value)}.parameters(), ...) "
                  "(it returns a DTensor: call .full_tensor() for a plain number)")

    def translate_no_sync_reference(self, original: cst.Attribute, updated: cst.Attribute):
        """`model.no_sync` as a value -> `functools.partial(fsdp1_no_sync, model)` (the receiver
        as for a call: left where it is not an FSDP1 model of this file)."""
        if self.receiver(original.value) is None:
            return updated
        self.site(rules.RUNTIME_HELPER, RUNTIME, original, f"{code(original)} (not called)", "a method reference, not "
                  f"a call; {self._may_be_fsdp(original.value)}: FSDP2 modules have no no_sync, and "
                  "functools.partial(fsdp1_no_sync, ...) gives the context manager for either")
        self.need(RUNTIME_MODULE, "fsdp1_no_sync")
        self.need("functools")
        return cst.Call(func=parse_expr("functools.partial"), args=[
            cst.Arg(cst.Name("fsdp1_no_sync"), comma=space_comma()),
            cst.Arg(updated.value)])

    def note_no_sync_block(self, node: cst.With) -> None:
        """Mark `with model.no_sync():` for expansion where `model` is proven to be the wrapper."""
        for item in node.items:
            call = item.item
            if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
                continue
            if (call.func.attr.value == "no_sync" and not call.args and len(node.items) == 1
                    and self.receiver(call.func.value) == PROVEN and node.asynchronous is None):
                self.no_sync_blocks.add(id(call))

    def no_sync_block_call(self, original: cst.With) -> cst.Call | None:
        """The `model.no_sync()` of a block marked by `note_no_sync_block` (None: not one)."""
        for item in original.items:
            call = item.item
            if isinstance(call, cst.Call) and id(call) in self.no_sync_blocks:
                return call
        return None

    def expand_no_sync_block(self, original: cst.With, updated: cst.With, call: cst.Call):
        receiver = dotted(call.func.value)
        self.site(rules.NO_SYNC, IN_PLACE, original, f"with {receiver}.no_sync():",
                  "set_requires_gradient_sync(False), restored to True in a finally block")
        disable = parse_stmt(f"{receiver}.set_requires_gradient_sync(False)\n")
        restore = parse_stmt(f"{receiver}.set_requires_gradient_sync(True)\n")
        block = cst.Try(
            body=updated.body,
            finalbody=cst.Finally(body=cst.IndentedBlock(body=[restore])),
        )
        return cst.FlattenSentinel([disable.with_changes(leading_lines=updated.leading_lines), block])
