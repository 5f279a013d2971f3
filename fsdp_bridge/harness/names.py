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
# A built-in recipe's size (`recipes.Size`) unless `--layers`, `--hidden`, ... say otherwise.
SIZE_DEFAULTS = {"layers": 2, "hidden": 64, "vocab": 128, "seq": 16, "batch": 8, "heads": 4}
