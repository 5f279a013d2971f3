"""Training frameworks on fsdp_bridge's engine, each by one changed import or argument.

- `fsdp_bridge.integrations.accelerate.Accelerator`: accelerate's Accelerator; with an FSDP2
  plugin, `prepare()` shards the model with our `fully_shard` using the plugin's settings.
- `fsdp_bridge.integrations.transformers.Trainer`: Hugging Face's Trainer on that Accelerator.
- `fsdp_bridge.integrations.lightning`: Lightning's FSDP strategy on our engine.

Each module imports its framework on import: a missing one is named in one line with the
extra that installs it.
"""
