"""Diagnostics: FSDP1 uses no rule translates, left as they were under a TODO or reported.

The FB2xx codes (and FB400/FB410) of `--to fsdp2` and `--to yafsdp`: private internals, star
imports, subclasses, partials, `enable_wrap`, exact-class tests, strategy reads, names bound by
a conditional import, library configuration, and functions that already handle both dialects.

A reference to the FSDP1 class that some rule handles is *claimed* when its call, `isinstance`
or class statement is entered; any reference left unclaimed when its name is left gets FB299,
so no use of FSDP1 goes by unreported.
"""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m

from fsdp_bridge.codemods import rules
from fsdp_bridge.codemods.base import INFO
from fsdp_bridge.codemods.facts import FileFacts
from fsdp_bridge.codemods.helpers import code, dotted
from fsdp_bridge.codemods.names import (
    ACCELERATE_PLUGIN,
    DTENSOR_MARKERS,
    FSDP1,
    FSDP1_WRAPPER_ATTRIBUTES,
    FSDP2_MARKERS,
    FSDP2_NAMES,
    HF_CONFIG_CALLS,
    PARTIAL,
    PRIVATE_ATTRIBUTES,
    TYPE_CHECKS,
    fsdp_module,
    fsdp_name,
    is_private_fsdp1,
)

WRAP_FUNCTIONS = ("enable_wrap", "wrap")
# Names of objects that hold settings rather than modules (`fsdp_config`, `strategy`, `args`).
SETTING_OWNER = re.compile(r"config|cfg|conf$|args|arguments|options|opts|settings|strategy|plugin|params|kwargs",
                           re.IGNORECASE)

# What to read instead of the FSDP1 wrapper's process group.
PROCESS_GROUP_HINT = {"process_group": "; the sharding group is the device mesh's (the mesh passed to the "
                                       "new call; mesh.get_group() for its process group)"}

# Wording of the TODOs by target: (the target's name, how a module is sharded there).
TARGET_WORDS = {"FSDP2": ("FSDP2", "call fully_shard on the model"),
                "YaFSDP": ("YaFSDP", "wrap the model with YaFSDP(...) once, naming its units in "
                           "modules_to_wrap_with_names")}


class DiagnosticsRules:
    """TODOs and report-only sites; expects the facts of `FactsMixin`."""

    # Why a read of `.sharding_strategy` no longer means what it did (FB213); set by each command.
    STRATEGY_READ_REASON = ""
    TARGET = "FSDP2"  # the dialect the command writes, for the TODO texts

    @property
    def private_reason(self) -> str:
        return f"private FSDP1 internals have no {self.TARGET} form"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.claimed: set[int] = set()  # ids of FSDP1-class references a handler takes care of

    # -- imports -------------------------------------------------------------------------

    def check_import(self, node: cst.Import | cst.ImportFrom) -> None:
        if isinstance(node, cst.ImportFrom):
            self._check_import_from(node)
            return
        for alias in node.names:
            if is_private_fsdp1(code(alias.name)):
                self.todo(rules.PRIVATE_INTERNALS, node, f"import {code(alias.name)}", self.private_reason)

    def _check_import_from(self, node: cst.ImportFrom) -> None:
        module = code(node.module) if node.module else ""
        if is_private_fsdp1(module) and not node.relative:
            self.todo(rules.PRIVATE_INTERNALS, node, f"from {module} import ...", self.private_reason)
        elif isinstance(node.names, cst.ImportStar) and not node.relative and fsdp_module(module):
            self.todo(rules.STAR_IMPORT, node, f"from {module} import *", "names from a star import cannot be "
                      "resolved, so nothing in this file is translated: import the names you use "
                      "explicitly and run the migration again")
            self.keeps_fsdp1(rules.STAR_IMPORT, node)

    # -- claims: references a rule handles -------------------------------------------------

    def claim(self, node: cst.CSTNode) -> None:
        self.claimed.add(id(node))
        if isinstance(node, cst.Attribute):
            self.claimed.add(id(node.value))

    def claim_call(self, node: cst.Call, name: str, qualified: set[str]) -> None:
        """Claim the FSDP1 references a call's own rule deals with (`name`: its FSDP name)."""
        if name == FSDP1 or name.startswith(FSDP1 + "."):
            self.claim(node.func)
        if qualified & TYPE_CHECKS and len(node.args) == 2:
            classes = node.args[1].value
            for item in [e.value for e in classes.elements] if isinstance(classes, cst.Tuple) else [classes]:
                if self.fsdp(item) == FSDP1:
                    self.claim(item)
        if PARTIAL in qualified and node.args and self.fsdp(node.args[0].value) == FSDP1:
            self.claim(node.args[0].value)
        if name in WRAP_FUNCTIONS:
            for arg in node.args:
                self.claim(arg.value)

    def claim_bases(self, node: cst.ClassDef) -> None:
        for base in node.bases:
            if self.fsdp(base.value) == FSDP1:
                self.claim(base.value)

    # -- references left unclaimed --------------------------------------------------------

    def check_reference(self, node: cst.CSTNode) -> None:
        if self.in_import or id(node) in self.claimed:
            return
        if isinstance(node, cst.Name) and self.ambiguous(node) and not self._only_fsdp2_names(node):
            self.todo(rules.AMBIGUOUS_NAME, node, node.value, "this name is FSDP's or another object depending on "
                      "which import ran (conditional or fallback import): left as it was")
            if FSDP1 in {fsdp_name(q) for q in self.qualified(node)}:
                self.keeps_fsdp1(rules.AMBIGUOUS_NAME, node)
            return
        if self.fsdp(node) == FSDP1:
            self.todo(rules.OTHER_FSDP1_USE, node, code(node), "FullyShardedDataParallel is used in a way "
                      f"the codemod does not translate; {self.TARGET} has no FSDP1 wrapper class to use here")
            self.keeps_fsdp1(rules.OTHER_FSDP1_USE, node)  # e.g. passed on as a class to build wrappers with
            return
        for name in self.qualified(node):
            if is_private_fsdp1(name):
                self.todo(rules.PRIVATE_INTERNALS, node, code(node), self.private_reason)
                return

    def _only_fsdp2_names(self, node: cst.Name) -> bool:
        """True if the FSDP names `node` may be are all FSDP2's (`fully_shard`, `CPUOffloadPolicy`):
        nothing there is translated, so a conditional import of them needs no TODO."""
        shorts = {fsdp_name(q) for q in self.qualified(node)} - {None}
        return bool(shorts) and shorts <= FSDP2_NAMES

    def check_attribute(self, original: cst.Attribute) -> None:
        """An attribute read: an unclaimed reference, a strategy read, or private internals."""
        self.check_reference(original)
        if (original.attr.value == "sharding_strategy" and self.fsdp_file and not self.in_import
                and not self.in_constructor and id(original) not in self.store_targets
                and not self._reads_a_setting(original.value)):
            # In FSDP(..., sharding_strategy=cfg.sharding_strategy) the constructor's translation
            # takes the value; anywhere else the read may no longer mean the same.
            self.todo(rules.STRATEGY_READ, original, f"{code(original)} (a read of an FSDP1 sharding strategy)",
                      self.STRATEGY_READ_REASON)
        wrapper_only = (original.attr.value in FSDP1_WRAPPER_ATTRIBUTES and id(original) not in self.store_targets
                        and (self.guarded_as_fsdp(original.value) or self.receiver(original.value) is not None))
        if ((original.attr.value in PRIVATE_ATTRIBUTES or wrapper_only) and self.uses_fsdp1 and not self.in_import
                and not self.in_version_guard):
            self.todo(rules.PRIVATE_INTERNALS, original, f".{original.attr.value}",
                      f"FSDP1's wrapper internals do not exist in {self.TARGET} (no FSDP1 wrapper, no flat "
                      "parameter)" + PROCESS_GROUP_HINT.get(original.attr.value, ""))

    def check_attribute_by_name(self, call: cst.Call) -> None:
        """`getattr(p, "_is_flat_param", False)`: a private FSDP1 attribute named by a string."""
        name = call.args[1].value if len(call.args) > 1 else None
        if (isinstance(name, cst.SimpleString) and name.evaluated_value in PRIVATE_ATTRIBUTES and self.uses_fsdp1
                and not self.in_version_guard):
            self.todo(rules.PRIVATE_INTERNALS, call, f"{code(call.func)}(..., {name.value})",
                      f"FSDP1's wrapper internals do not exist in {self.TARGET} (no FSDP1 wrapper, no flat "
                      "parameter)")

    def _reads_a_setting(self, owner: cst.BaseExpression) -> bool:
        """True for `cfg.sharding_strategy` and the like: a setting read from a config or a
        strategy object (not known to hold an FSDP1 module), whose meaning the migration keeps."""
        if self.receiver(owner) is not None:
            return False
        name = (dotted(owner) or "").split(".")[-1]
        return SETTING_OWNER.search(name) is not None

    # -- constructs with no translation ---------------------------------------------------

    def flag_subclass(self, original: cst.ClassDef) -> None:
        for base in original.bases:
            if self.fsdp(base.value) == FSDP1:
                self.todo(rules.SUBCLASS, original, f"class {original.name.value}(FullyShardedDataParallel)",
                          f"{self.TARGET} is not FSDP1's wrapper class to subclass; move the overrides "
                          f"onto the model and {TARGET_WORDS[self.TARGET][1]}")
                self.keeps_fsdp1(rules.SUBCLASS, original)

    def flag_wrap_call(self, original: cst.Call, name: str) -> None:
        how = ("call fully_shard on each module after construction, bottom-up," if self.TARGET == "FSDP2"
               else "name the modules in YaFSDP's modules_to_wrap_with_names")
        self.todo(rules.ENABLE_WRAP, original, f"{name}(...)", f"{how} instead of wrap() inside enable_wrap()")
        self.keeps_fsdp1(rules.ENABLE_WRAP, original)

    def is_partial_of_fsdp1(self, original: cst.Call, qualified: set[str]) -> bool:
        return PARTIAL in qualified and bool(original.args) and self.fsdp(original.args[0].value) == FSDP1

    def flag_partial(self, original: cst.Call) -> None:
        self.todo(rules.PARTIAL, original, "partial(FullyShardedDataParallel, ...)", "a partial builds FSDP1 "
                  f"wrappers elsewhere; where it is applied, {TARGET_WORDS[self.TARGET][1]} instead")
        self.keeps_fsdp1(rules.PARTIAL, original)

    def check_exact_class_test(self, node: cst.Comparison) -> bool:
        """`type(x) is FSDP`: FSDP2 gives each sharded module a class of its own, so no exact-class
        test has a translation; flag it (and do not count it as code that builds FSDP1 modules)."""
        operands = [node.left, *(target.comparator for target in node.comparisons)]
        classes = [op for op in operands if self.fsdp(op) == FSDP1]
        exact = any(isinstance(op, cst.Call) and "builtins.type" in self.qualified(op.func)
                    or isinstance(op, cst.Attribute) and op.attr.value == "__class__" for op in operands)
        if not classes or not exact:
            return False
        for op in classes:
            self.claim(op)
        _, class_name, _, _ = self.WRAPPED_CLASS
        self.todo(rules.EXACT_CLASS_TEST, node, f"{code(node)} (an exact-class test)", "the migrated model's class is "
                  f"not FullyShardedDataParallel: test isinstance(x, {class_name}) instead (with "
                  "FullyShardedDataParallel in the tuple while FSDP1 constructors remain)")
        return True

    # -- report only ----------------------------------------------------------------------

    def report_library_config(self, node: cst.Call, qualified: set[str]) -> None:
        """Hugging Face Trainer or accelerate configured to wrap the model in FSDP (FB400)."""
        keywords = {a.keyword.value for a in node.args if a.keyword}
        if qualified & ACCELERATE_PLUGIN or keywords & {"fsdp", "fsdp_config"}:
            self.keeps_fsdp1(rules.LIBRARY_CONFIG, node)  # the library wraps the model, with FSDP1 by default
        if qualified & ACCELERATE_PLUGIN:
            self.site(rules.LIBRARY_CONFIG, INFO, node, "FullyShardedDataParallelPlugin(...)",
                      "FSDP is configured through accelerate: set fsdp_version=2 there "
                      "(`accelerate to-fsdp2` maps HYBRID_SHARD to plain sharding: check the mesh)")
        elif keywords & {"fsdp", "fsdp_config"}:
            self.site(rules.LIBRARY_CONFIG, INFO, node, "TrainingArguments(fsdp=...)",
                      "FSDP is configured through Hugging Face Trainer flags: set "
                      "fsdp_config={'version': 2, ...}; there is no FSDP code to rewrite here")

    def is_library_config(self, qualified: set[str]) -> bool:
        return bool(qualified & (HF_CONFIG_CALLS | ACCELERATE_PLUGIN))

    def speaks_fsdp2(self, node: cst.FunctionDef) -> bool:
        """True if the function names FSDP2 (`fully_shard`, `FSDPModule`...) or DTensor's
        `full_tensor`: the modules it handles are FSDP2's already, and an unproven receiver's
        `state_dict()` there is left as written."""
        if not (self.has_fsdp2 or DTENSOR_MARKERS & self.names_in_file) or not self.may_name_fsdp2(node):
            return False
        facts = FileFacts()
        node.visit(facts)
        return any(self.fsdp(n) in FSDP2_NAMES or (isinstance(n, cst.Name) and n.value in DTENSOR_MARKERS)
                   for n in facts.names)

    def handles_both_dialects(self, node: cst.FunctionDef) -> bool:
        """True (and reported, FB410) if the function already names both FSDP1 and FSDP2."""
        if not (self.has_fsdp2 and self.uses_fsdp1) or not self.may_name_fsdp2(node):
            return False
        facts = FileFacts()
        node.visit(facts)
        names = facts.names
        fsdp1 = any((self.fsdp(n) or "").split(".")[0] == FSDP1 for n in names)
        fsdp2 = any(self.fsdp(n) in FSDP2_NAMES or (isinstance(n, cst.Name) and n.value in FSDP2_MARKERS)
                    for n in names)
        if not (fsdp1 and fsdp2):
            return False
        self.site(rules.DUAL_DIALECT, INFO, node, f"def {node.name.value}(...)", "already handles FSDP1 and "
                  "FSDP2 (both are named here): left as it was")
        if any(self.fsdp(call.func) == FSDP1 for call in m.findall(node, m.Call())):
            self.keeps_fsdp1(rules.DUAL_DIALECT, node)
        return True
