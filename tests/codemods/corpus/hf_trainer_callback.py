"""Trainer callback that saves a consolidated checkpoint at the end of training."""
import os

from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import TrainerCallback, TrainingArguments


def training_args(output_dir):
    return TrainingArguments(
        output_dir,
        fsdp="full_shard auto_wrap",
        fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )


class SaveFullCheckpoint(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(self.trainer.model, StateDictType.FULL_STATE_DICT, policy):
            self.trainer.save_model(os.path.join(args.output_dir, "final"))
