"""`torchacc.dist.fsdp`: consolidating per-rank sharded checkpoints into one full one."""

from __future__ import annotations

import glob
import os

import torch

from fsdp_bridge.outputs import write_with
from fsdp_bridge.translation import bad_argument


def consolidate_sharded_model_checkpoints(ckpt_dir: str, ckpt_suffix: str = "rank*-of-*-model.pth",
                                          save_path: str = "", save_model: bool = True) -> dict:
    """Read every `ckpt_dir/<ckpt_suffix>` file saved by `torchacc.save({'model':
    model.state_dict(), 'shard_metadata': model.get_shard_metadata()}, ..., master_only=False)`,
    put the shards together and save `{'model': full_state_dict}` to `save_path` (default
    `ckpt_dir/consolidated.pth`). Returns the full state dict."""
    pattern = os.path.join(ckpt_dir, ckpt_suffix) if os.path.isdir(ckpt_dir) else ckpt_dir + ckpt_suffix
    files = sorted(glob.glob(pattern))
    if not files:
        raise bad_argument("consolidate_sharded_model_checkpoints", "ckpt_suffix", ckpt_suffix,
                           f"a pattern matching the saved shards (nothing matches {pattern!r})",
                           "Pass the directory and file pattern used by torchacc.save.")
    checkpoints = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    for path, ckpt in zip(files, checkpoints):
        if not isinstance(ckpt, dict) or "model" not in ckpt or "shard_metadata" not in ckpt:
            raise bad_argument("consolidate_sharded_model_checkpoints", "checkpoint", path,
                               "a dict with 'model' and 'shard_metadata'", "Save "
                               "{'model': model.state_dict(), 'shard_metadata': "
                               "model.get_shard_metadata()}.")
    world = checkpoints[0]["shard_metadata"]["world_size"]
    if len(checkpoints) != world:
        raise bad_argument("consolidate_sharded_model_checkpoints", "ckpt_suffix", ckpt_suffix,
                           f"a pattern matching all {world} shards (it matched {len(files)})",
                           "Check the directory holds one file per rank of one run.")
    checkpoints.sort(key=lambda c: c["shard_metadata"]["rank"])
    meta = checkpoints[0]["shard_metadata"]
    shard_world = meta["shard_world_size"]
    # One complete replica: the ranks of the first shard group, in shard-rank order.
    replica = sorted((c for c in checkpoints[: shard_world] ),
                     key=lambda c: c["shard_metadata"]["shard_rank"])
    full = {}
    for key, value in checkpoints[0]["model"].items():
        shape = meta["shard_shapes"].get(key)
        if shape is None:
            full[key] = value
            continue
        flat = torch.cat([c["model"][key].reshape(-1) for c in replica])
        full[key] = flat.view(shape).clone()
    if save_model:  # replaces that one file, atomically; the shards and the rest stay
        path = save_path or os.path.join(
            ckpt_dir if os.path.isdir(ckpt_dir) else os.path.dirname(ckpt_dir) or ".",
            "consolidated.pth")
        write_with(path, lambda handle: torch.save({"model": full}, handle))
    return full
