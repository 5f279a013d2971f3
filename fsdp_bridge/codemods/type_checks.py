"""Type checks and annotations: `isinstance(x, FSDP)` and `model: FSDP` name the new class.

Each command says what the FSDP1 class becomes in its `WRAPPED_CLASS` (module, class, rule code,
reason). Whether a check may be narrowed to the new class alone is decided over the whole tree
(see [Note: what the tree keeps of FSDP1] in `base.py`).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fsdp_bridge.codemods.base import FILE_FACTS_KEY, IN_PLACE, INFO
from fsdp_bridge.codemods.helpers import code, space_comma
from fsdp_bridge.codemods.names import FSDP1


class TypeCheckRules:
    """`isinstance`/`issubclass` and annotations naming the FSDP1 class."""

    # What `isinstance(x, FSDP)` becomes: (module, class, rule, reason); set by each command.
    WRAPPED_CLASS: tuple[str, str, str, str] = ("", "", "", "")
    # Type checks: always accept FSDP1 too, whatever the tree keeps?
    ACCEPT_FSDP1_TOO = False

    def __init__(self, context) -> None:
        super().__init__(context)
        self.annotation_refs: set[int] = set()  # FSDP1 references nested in annotations (`Optional[FSDP]`)

    def claim_annotation(self, node: cst.Annotation) -> None:
        refs = [ref for ref in m.findall(node.annotation, m.Name() | m.Attribute()) if self.fsdp(ref) == FSDP1]
        for ref in refs:
            self.claim(ref)
        self.annotation_refs.update(id(ref) for ref in refs if ref is not node.annotation)

    def translate_annotation(self, original: cst.Annotation, updated: cst.Annotation) -> cst.Annotation:
        """`model: FSDP` names the new class; so does each FSDP1 name inside an annotation
        (`Union[nn.Module, FSDP]`, `Optional[FSDP]`), replaced as its own node is left."""
        whole = self.fsdp(original.annotation) == FSDP1
        if not whole and not any(id(ref) in self.annotation_refs for ref in m.findall(original.annotation, m.Name()
                                                                                      | m.Attribute())):
            return updated
        module, class_name, rule, reason = self.WRAPPED_CLASS
        self.site(rule, IN_PLACE, original, "annotation FullyShardedDataParallel", reason)
        if not whole:
            return updated
        self.need(module, class_name)
        self.drop_import_of(original.annotation)
        return updated.with_changes(annotation=cst.Name(class_name))

    def annotation_ref(self, original: cst.Name | cst.Attribute, updated):
        """An FSDP1 name inside an annotation, as the new class (see `translate_annotation`)."""
        if id(original) not in self.annotation_refs:
            return updated
        module, class_name, _, _ = self.WRAPPED_CLASS
        self.need(module, class_name)
        self.drop_import_of(original)
        return cst.Name(class_name, lpar=updated.lpar, rpar=updated.rpar)

    def _accept_fsdp1_reason(self) -> str | None:
        """Why type checks must still accept FullyShardedDataParallel (None: they need not)."""
        elsewhere = self.fsdp1_kept_elsewhere()
        if elsewhere:
            shown = ", ".join(elsewhere[:3]) + (f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else "")
            return f"FSDP1 constructors stay in the migrated tree ({shown}) and still build FSDP1 modules"
        if elsewhere is None:
            return ("this runner migrates one file at a time, so constructors left as FSDP1 in other "
                    "files cannot be known")
        if self.ACCEPT_FSDP1_TOO:
            return ("constructors the migration could not translate, here or in other files, still "
                    "build FSDP1 modules")
        if self.framework_file:
            return ("this file imports a framework (transformers, accelerate, Lightning) that wraps models in "
                    "torch's FSDP1 itself unless configured for FSDP2")
        return None

    def _names_fsdp1_class(self, classes: cst.BaseExpression) -> bool:
        items = [e.value for e in classes.elements] if isinstance(classes, cst.Tuple) else [classes]
        return any(self.fsdp(item) == FSDP1 for item in items)

    def fsdp1_still_built(self) -> str | None:
        """Why FSDP1 modules may still exist in the migrated tree, or None if, as far as this run
        knows, none does; the caller then relies on it, which counts as a narrowing: the driver
        redoes the file if this file or another turns out to keep an FSDP1 constructor."""
        reason = self._accept_fsdp1_reason()
        if reason is None:
            self.context.scratch[FILE_FACTS_KEY]["narrowed"] = True
        return reason

    def translate_type_check(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if len(original.args) != 2:
            return updated
        if self.check_fns and self.ACCEPT_FSDP1_TOO is False and self._names_fsdp1_class(original.args[1].value):
            # `check_fn=lambda m: not isinstance(m, FSDP) and ...`: the test picks out FSDP1's wrapper
            # objects (which forward attribute reads to the block they wrap); fully_shard leaves none,
            # and the sharded blocks themselves are FSDPModules: narrowed, the test would skip every block.
            self.site(self.WRAPPED_CLASS[2], INFO, original, "isinstance(..., FullyShardedDataParallel) in a check_fn",
                      "kept: in an activation-checkpointing check_fn it tests for FSDP1's wrapper objects, which "
                      "the migrated model has none of (it stays False for the sharded blocks, as for the blocks "
                      "FSDP1 wrapped); narrowed to the new class it would skip every sharded block")
            return updated
        classes, new_classes = original.args[1].value, updated.args[1].value
        module, class_name, rule, reason = self.WRAPPED_CLASS
        keep_fsdp1 = self._accept_fsdp1_reason()

        def replacement(old: cst.BaseExpression) -> list[cst.Element]:
            if keep_fsdp1:
                return [cst.Element(cst.Name(class_name), comma=space_comma()), cst.Element(old)]
            return [cst.Element(cst.Name(class_name))]

        if self.fsdp(classes) == FSDP1:
            elements = replacement(new_classes)
            new_classes = elements[0].value if len(elements) == 1 else cst.Tuple(elements)
        elif isinstance(classes, cst.Tuple):
            if any(code(e.value) == class_name for e in classes.elements):
                return updated  # already accepts the new class (a second run)
            elements = []
            for old, new in zip(classes.elements, new_classes.elements):
                if self.fsdp(old.value) != FSDP1:
                    elements.append(new)
                    continue
                *head, last = replacement(new.value)
                elements += [*head, last.with_changes(comma=new.comma)]
            if len(elements) == len(new_classes.elements) and not any(
                    self.fsdp(e.value) == FSDP1 for e in classes.elements):
                return updated
            new_classes = new_classes.with_changes(elements=elements)
        else:
            return updated
        if keep_fsdp1:
            reason += f" (FullyShardedDataParallel is still accepted: {keep_fsdp1})"
        else:
            self.context.scratch[FILE_FACTS_KEY]["narrowed"] = True
        self.site(rule, IN_PLACE, original, "isinstance(..., FullyShardedDataParallel)", reason)
        self.need(module, class_name)
        if not keep_fsdp1:
            self.drop_import_of(classes)
        return updated.with_changes(args=[updated.args[0], updated.args[1].with_changes(value=new_classes)])
