"""The names `fsdp-bridge compare` and `compare-scripts` offer as choices, free of torch so that
their `--help` and argument errors come at once. The modules that implement them (`recipes`,
`backends`, `compare`) take these names from here or are checked against them
(tests/harness/test_harness_units.py)."""

RECIPES = ("tiny-llama", "tiny-gpt2", "mlp")
BACKENDS = ("reference", "torch-fsdp1", "torch-fsdp2", "bridge-fsdp1", "bridge-fsdp2",
            "bridge-yafsdp")
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = ("fp32", "bf16", "fp16")
TOLERANCE_GROWTH = ("window", "linear", "none")  # compare.GROWTH
STRICT_STEPS = 50  # growth "window": see [Note: tolerance growth] in compare.py
TOLERANCE_GROWTH_HELP = (
    f"window: the one-step tolerance for the first {STRICT_STEPS} steps (where a changed "
    "setting shows), "
    "then growing linearly, since rounding differences between correct implementations "
    "compound; linear: step k allows k times the one-step tolerance (misses a steady drift); "
    "none: the one-step tolerance at every step (default window)")
# A built-in recipe's size (`recipes.Size`) unless `--layers`, `--hidden`, ... say otherwise.
SIZE_DEFAULTS = {"layers": 2, "hidden": 64, "vocab": 128, "seq": 16, "batch": 8, "heads": 4}

# compare-scripts' loss lines: `step 3 loss 4.21` (also `step: 3, loss = 4.21`, ...).
_NUMBER = r"(?P<loss>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
DEFAULT_LOSS_PATTERN = r"step\s*[:=#]?\s*(?P<step>\d+).*?loss\s*[:=]?\s*" + _NUMBER
# The Hugging Face Trainer's log lines, `{'loss': 2.31, 'grad_norm': ..., 'epoch': 0.1}` (recent
# transformers quote the values: `{'loss': '2.31', ...}`): no step in them, so the k-th such line
# is taken as step k (right for `logging_steps=1`, said in the report). Tried when the default
# pattern matches no line.
HF_TRAINER_LOSS_PATTERN = r"""^\s*\{['"]loss['"]:\s*['"]?""" + _NUMBER
