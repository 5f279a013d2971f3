"""The registry of rule codes: every `FBxxx` a migration can report, in one table.

A code appears in the report and in the `# TODO(fsdp-bridge FBxxx): ...` comments a codemod
leaves, so it must stay stable and mean one thing. Each entry says what the code is about (a
short title), what the migration does there (the doc text) and which codemods or passes emit it.
Emitters use the constants defined here, never a literal code; `tests/codemods/test_rules.py`
checks that the codes are distinct, documented, and that no source emits an unregistered one.

This module is plain data: reading it imports neither libcst nor torch.

Families: FB0xx `--to bridge`; FB1xx translated for FSDP2; FB2xx left with a TODO (shared by
`--to fsdp2` and `--to yafsdp`); FB3xx translated for YaFSDP; FB4xx report only.
"""

from __future__ import annotations

import dataclasses

# Who emits a code: the three codemods, and the migration driver (files it does not parse).
BRIDGE, FSDP2, YAFSDP, DRIVER = "to_bridge", "to_fsdp2", "to_yafsdp", "migrate.driver"


@dataclasses.dataclass(frozen=True)
class Rule:
    code: str  # "FB101"
    title: str  # a few words, as a heading
    emitted_by: tuple[str, ...]  # BRIDGE, FSDP2, YAFSDP, DRIVER
    doc: str  # what the migration does at such a site, and why


TABLE: list[Rule] = []


def _rule(code: str, title: str, emitted_by: tuple[str, ...], doc: str) -> str:
    """Add one row to TABLE and give back its code, for the emitters' constant."""
    TABLE.append(Rule(code, title, emitted_by, " ".join(doc.split())))
    return code


# -- FB0xx: `--to bridge` ------------------------------------------------------------------

IMPORT_MIRRORED = _rule("FB001", "import of a mirrored module", (BRIDGE,), """
    An import (or a dotted use after a plain `import torch.distributed.fsdp`) of torch FSDP,
    ya_fsdp, zeta.training or torchacc now names the fsdp_bridge module that mirrors it name for
    name; nothing else in the file changes.""")
PRIVATE_MODULE = _rule("FB002", "private torch FSDP module or name", (BRIDGE,), """
    `torch.distributed.fsdp._runtime_utils` and other private modules or names are not mirrored:
    the import is left pointing at torch's, under a TODO.""")
PRIVATE_WRAPPER_ATTRIBUTE = _rule("FB003", "private FSDP1 wrapper attribute", (BRIDGE,), """
    A read of `_handle`, `_flat_param`, `_lazy_init` and the like: fsdp_bridge's
    FullyShardedDataParallel has internals of its own, so the read is flagged with a TODO.""")
NOT_MIRRORED = _rule("FB004", "name the mirror does not have", (BRIDGE,), """
    An import whose names (or, for `import torchacc as ta`, the attributes the file reads
    through it, such as `ta.sync`) are not all in the fsdp_bridge module that mirrors it: the
    import is left pointing at the original, under a TODO naming what is missing.""")
FRAMEWORK_MODEL = _rule("FB005", "model built by a framework", (BRIDGE,), """
    In a file that uses the Hugging Face Trainer (or TrainingArguments), accelerate or Lightning
    (importing transformers' model classes alone does not count) and does not build the FSDP
    wrapper itself: where the framework's entry point stays the framework's (it is set up in
    another file, or cannot be rewritten: the `pytorch_lightning` package, trl's trainers, a
    dotted `transformers.Trainer(...)`), the file's torch FSDP imports are kept, each under a
    TODO saying why; where the entry point is rewritten to a `fully_shard` route (Trainer,
    Accelerator), FSDP1 static calls and `isinstance(x, FullyShardedDataParallel)` on the
    framework's model are flagged: that model holds no FSDP1 wrapper.""")
FRAMEWORK_ENTRY_POINT = _rule("FB006", "framework entry point", (BRIDGE,), """
    In a file whose model a framework builds: `from transformers import Trainer`,
    `from accelerate import Accelerator` and Lightning's `FSDPStrategy` (Trainer's or Fabric's)
    now import fsdp_bridge's route (`fsdp_bridge.integrations`), and Lightning's
    `strategy="fsdp"` becomes `strategy="fsdp_bridge"` with `import
    fsdp_bridge.integrations.lightning`; the file's torch FSDP imports are then swapped, since
    the wrappers it handles are ours.""")

# -- FB1xx: translated for native torch FSDP2 ------------------------------------------------

CONSTRUCTOR_IN_PLACE = _rule("FB100", "FSDP(...) with literal arguments", (FSDP2,), """
    `FSDP(model, ...)` becomes bottom-up `fully_shard` calls, root last; a literal wrap policy
    becomes a loop over the matching submodules.""")
CONSTRUCTOR_AT_RUN_TIME = _rule("FB101", "FSDP(...) with values known at run time", (FSDP2,), """
    `FSDP(model, ...)` with non-literal values becomes `fsdp1_fully_shard(model, ...)` with the
    same arguments; the runtime helper translates them when the script runs.""")
NO_SYNC = _rule("FB102", "no_sync()", (FSDP2,), """
    `with model.no_sync():` becomes `set_requires_gradient_sync(False)` before a `try` whose
    `finally` sets it back to True where the receiver is proven to be the wrapped model; other
    calls of `no_sync()` on a receiver that may be one go through `fsdp1_no_sync`; on any other
    receiver (a DDP model) the call is left as it was.""")
CLIP_GRAD_NORM = _rule("FB103", "clip_grad_norm_()", (FSDP2,), """
    `model.clip_grad_norm_(...)` becomes `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`
    where the receiver is proven to be the wrapped model, `fsdp1_clip_grad_norm_` where it may be
    one; any other receiver is flagged as FB215.""")
STATE_DICT = _rule("FB104", "state dicts", (FSDP2, YAFSDP), """
    `with FSDP.state_dict_type(...)` blocks, `model.state_dict()` / `load_state_dict()` and
    `FSDP.optim_state_dict*` become `torch.distributed.checkpoint.state_dict` calls with
    `StateDictOptions` (through runtime helpers where the options are known only at run time).
    Under `--to yafsdp` the same, for all but a FULL_STATE_DICT block with a literal config (see
    FB304): torch's helpers take a YaFSDP model as they take an FSDP2 one.""")
FSDP2_TYPE_CHECK = _rule("FB105", "isinstance and annotations, FSDP2", (FSDP2,), """
    `isinstance(x, FSDP)` becomes `isinstance(x, FSDPModule)`, or `isinstance(x, (FSDPModule,
    FSDP))` while the migrated tree keeps FSDP1 constructors or the file imports a framework that
    wraps models in FSDP1 itself; annotations become `FSDPModule`. In an activation-checkpointing
    `check_fn` the test (for FSDP1's wrapper objects) is kept as written and reported.""")
MODULE_ATTRIBUTE = _rule("FB106", "model.module", (FSDP2, YAFSDP), """
    `model.module` becomes `model` where `model` is proven to hold the wrapper (neither fully_shard
    nor YaFSDP leaves a `.module`), `fsdp1_unwrap(model)` where it may.""")
RUNTIME_HELPER = _rule("FB107", "FSDP1 API with no one-call FSDP2 form", (FSDP2, YAFSDP), """
    `FSDP.fsdp_modules(model)` becomes a list of the `FSDPModule`s in `model.modules()` where the
    migrated tree keeps no FSDP1 constructor, `fsdp1_fsdp_modules` (which finds FSDP1 wrappers
    too) where it does or cannot be known; `FSDP.scatter_full_optim_state_dict` and
    `model.no_sync` used as a value become calls of the runtime helpers that give the same
    result for FSDP2 modules.""")
SHARDED_OPTIMIZER_LOAD = _rule("FB108", "load_sharded_optimizer_state_dict", (FSDP2, YAFSDP), """
    `torch.distributed.checkpoint.load_sharded_optimizer_state_dict(...)` builds FSDP1's
    ShardedTensors, which the migrated model's optimizer cannot step with: it becomes
    `fsdp1_load_sharded_optimizer_state_dict(...)`, which reads the same checkpoint into DTensors
    sharded as the model's parameters (and calls torch's function for a model left as FSDP1).""")
CLASS_TEST = _rule("FB109", "class test on a sharded module", (FSDP2,), """
    `type(m)` or `m.__class__` read for a class test (its `__name__`, `__bases__`, or compared
    with `is`, `==`, `in`) in an activation-checkpointing check_fn or in a walk over the wrapped
    model's modules becomes `fsdp1_module_class(m)`: fully_shard gives each module it shards the
    class `FSDP<Name>(FSDPModule, <its class>)`, so the test would now match (or miss) every
    sharded block; the helper gives the class the module had before, as FSDP1's tree showed it.
    `isinstance(m, Block)` is left: the new class subclasses the block's.""")
DROPPED_COMMENT = _rule("FB110", "comment on a dropped argument", (FSDP2, YAFSDP), """
    An FSDP1 argument the new call does not take carried a comment: the comment moves into a
    TODO above the statement, so nothing the user wrote is lost.""")

# -- FB2xx: left as it was, under a TODO ------------------------------------------------------

SUBCLASS = _rule("FB201", "subclass of FSDP", (FSDP2, YAFSDP), """
    `class X(FullyShardedDataParallel)`: neither target is a wrapper class to subclass; move the
    overrides onto the model.""")
PARTIAL = _rule("FB202", "partial(FSDP, ...)", (FSDP2, YAFSDP), """
    A partial of the FSDP1 class builds wrappers elsewhere; shard the model where the partial is
    applied.""")
PRIVATE_INTERNALS = _rule("FB203", "private FSDP1 internals", (FSDP2, YAFSDP), """
    Imports from `torch.distributed.fsdp._*` and reads of the wrapper's private attributes
    (`_fsdp_wrapped_module`, `_flat_param`, ...) have no counterpart.""")
LOCAL_STATE_DICT = _rule("FB204", "LOCAL_STATE_DICT", (FSDP2,), """
    FSDP2 has no local (flat-parameter) state dict; use the sharded DTensor state dict.""")
SUMMON_FULL_PARAMS = _rule("FB205", "summon_full_params", (FSDP2,), """
    FSDP2 has no exact equivalent (unshard()/reshard() or DTensor.full_tensor(); writeback
    differs), so the call stays.""")
ENABLE_WRAP = _rule("FB206", "enable_wrap / wrap", (FSDP2, YAFSDP), """
    Wrapping inside `enable_wrap()` has no counterpart; shard each module after construction,
    bottom-up.""")
SET_STATE_DICT_TYPE = _rule("FB207", "set_state_dict_type", (FSDP2,), """
    FSDP2 keeps no state-dict mode on the model; pass StateDictOptions where the state dict is
    taken.""")
STATE_DICT_TYPE_VALUE = _rule("FB208", "state_dict_type used as a value", (FSDP2,), """
    `FSDP.state_dict_type(...)` held in a variable or returned by a helper becomes
    `fsdp1_state_dict_type(...)`; the file's state-dict calls then ask the runtime helper for
    their options.""")
STATE_DICT_TYPE_ELSEWHERE = _rule("FB209", "state_dict_type configuring other calls", (FSDP2, YAFSDP), """
    A `with FSDP.state_dict_type(...)` block that configures calls made elsewhere (a library's
    `save_model()`, a method of the model's owner) or whose arguments cannot be read is kept.""")
AMBIGUOUS_NAME = _rule("FB210", "name bound by a conditional import", (FSDP2, YAFSDP), """
    A name that is FSDP's or another object depending on which import ran (a branch or an
    `except ImportError` fallback) is left as it was.""")
STAR_IMPORT = _rule("FB211", "import * of an FSDP module", (FSDP2, YAFSDP), """
    Names from a star import cannot be resolved, so nothing in the file is translated; import
    the names explicitly and migrate again.""")
EXACT_CLASS_TEST = _rule("FB212", "type(x) is FSDP", (FSDP2, YAFSDP), """
    An exact-class test has no translation (the migrated model's class is not the FSDP1 class);
    test isinstance against the new class instead.""")
STRATEGY_READ = _rule("FB213", "read of .sharding_strategy", (FSDP2, YAFSDP), """
    Outside the constructor, a read of an FSDP1 sharding strategy may no longer describe how the
    migrated model is sharded (the attribute is gone, or names something else).""")
INEXACT_STATE_DICT_OPTIONS = _rule("FB214", "state-dict config DCP cannot express", (FSDP2, YAFSDP), """
    A `FullStateDictConfig` / `FullOptimStateDictConfig` whose `offload_to_cpu` and `rank0_only`
    differ: DCP's `cpu_offload` means both at once, so the block is translated with the closer
    option and a TODO says where the state dict now lives.""")
CLIP_ELSEWHERE = _rule("FB215", "clip_grad_norm_ of a model wrapped elsewhere", (FSDP2,), """
    `model.clip_grad_norm_(max_norm)` in a file that does not use the FSDP1 class (it may import
    other FSDP names), or on a receiver the
    file does not show to hold an FSDP1 model: FSDP1's method on a model wrapped in another
    file; fully_shard modules have none, so the call is flagged with the torch.nn.utils form to
    use.""")
PARAMETER_WALK = _rule("FB216", "parameters walked on a wrapped model", (FSDP2, YAFSDP), """
    A walk over the parameters of a model wrapped with `use_orig_params=False` (FSDP1's default;
    or where the file cannot tell): a loop or comprehension over `model.parameters()`, any use of
    `model.named_parameters()`, a count. FSDP1 showed one flat parameter per unit there, so
    parameter groups built by name or shape (weight decay off for norms and biases), filters
    and counts saw flat pieces; the migrated model shows its original parameters, so they now
    differ, and the statement is flagged. Under `--to fsdp2` a walk that reads shapes or sizes is
    flagged with `use_orig_params=True` too (FSDP1 showed 1-D local views, FSDP2 full-shape
    DTensors). Handing `model.parameters()` to an optimizer is not a walk.""")
UNIT_TYPE_TEST = _rule("FB217", "isinstance(m, FSDP) in a walk, YaFSDP", (YAFSDP,), """
    `isinstance(m, FullyShardedDataParallel)` on the modules of a walk over a model: FSDP1 found
    every unit it wrapped there; YaFSDP wraps the model once and its units stay plain modules,
    so the test would find the YaFSDP model alone. Left as written, flagged.""")
OTHER_FSDP1_USE = _rule("FB299", "any other FSDP1 API use", (FSDP2, YAFSDP), """
    An FSDP1 name used in a way no rule translates (passed on as a class, an unknown static
    method, arguments outside the translated forms).""")

# -- FB3xx: translated for fsdp_bridge.ya_fsdp.YaFSDP ---------------------------------------

YAFSDP_IN_PLACE = _rule("FB300", "FSDP(...) to YaFSDP(...)", (YAFSDP,), """
    `FSDP(model, ...)` with literal arguments becomes `YaFSDP(model, zero_stage=...,
    modules_to_wrap_with_names=[...], param_dtype=..., gradient_accumulation_steps=1, ...)`.""")
YAFSDP_AT_RUN_TIME = _rule("FB301", "FSDP(...) to fsdp1_to_yafsdp(...)", (YAFSDP,), """
    `FSDP(model, ...)` with non-literal values becomes `fsdp1_to_yafsdp(model, ...)`, which
    translates them when the script runs.""")
YAFSDP_UNSUPPORTED = _rule("FB302", "setting YaFSDP cannot express", (YAFSDP,), """
    Hybrid or NO_SHARD strategies (also held in a variable that only ever holds them), CPU
    offload, ignored modules or a device mesh: the call is left as it was, with a TODO.""")
YAFSDP_TYPE_CHECK = _rule("FB303", "isinstance and annotations, YaFSDP", (YAFSDP,), """
    `isinstance(x, FSDP)` becomes `isinstance(x, (YaFSDP, FSDP))`: constructors this run could not
    translate still build FSDP1 modules; annotations become `YaFSDP`.""")
YAFSDP_STATE_DICT_TYPE = _rule("FB304", "state_dict_type under YaFSDP", (YAFSDP,), """
    YaFSDP's `state_dict()` is full, so a `with FSDP.state_dict_type(model, FULL_STATE_DICT)`
    block keeps its body and loses the `with` (a `rank0_only=True` config goes to the model's
    `state_dict(rank0_only=True)`); sharded types and configs known at run time go through
    torch's checkpoint helpers (FB104); a local state dict, a context held under a name, or used
    as a value, gets a TODO.""")
YAFSDP_PRECISION = _rule("FB305", "mixed precision YaFSDP cannot express", (YAFSDP,), """
    YaFSDP reduces gradients in fp32, or in `param_dtype` with `bit16_reduce_scatter=True` (what
    FSDP1 does when `reduce_dtype` is unset or equal to `param_dtype`); another `reduce_dtype` or
    a `buffer_dtype` has no YaFSDP field, so the call is translated under a TODO that names it.""")

# -- FB4xx: report only -----------------------------------------------------------------------

LIBRARY_CONFIG = _rule("FB400", "FSDP configured through a library", (FSDP2, YAFSDP), """
    Hugging Face Trainer arguments or an accelerate plugin enable FSDP: there is no FSDP code to
    rewrite, the report says which setting selects FSDP2.""")
ACCELERATE_YAML = _rule("FB401", "accelerate YAML enables FSDP", (DRIVER,), """
    An accelerate config file enables FSDP: set `fsdp_version: 2` there (and check
    `fsdp_reshard_after_forward`); the file is not rewritten.""")
NOTEBOOK = _rule("FB402", "notebook mentions FSDP", (DRIVER,), """
    Notebooks are not rewritten: convert one to a script, migrate that, and convert back.""")
DUAL_DIALECT = _rule("FB410", "code that handles FSDP1 and FSDP2", (FSDP2, YAFSDP), """
    A function that names both FSDP1 and FSDP2 already chooses between them: it is left as it
    was.""")

BY_CODE: dict[str, Rule] = {rule.code: rule for rule in TABLE}
