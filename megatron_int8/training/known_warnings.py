"""The one place where the entry points (pretrain, scripts/generate.py, scripts/export_hf.py) silence warnings
that a user of this trainer cannot act on. Each filter says why; any other warning still prints."""
from __future__ import annotations

import logging
import warnings

# (category, start of the message, why a user of this trainer has nothing to do about it)
KNOWN = (
    (UserWarning, "Transformer Engine and Apex are not installed",
     "megatron-core's import-time notice; this trainer runs its own INT8 and fused kernels, fuses the weight-gradient "
     "accumulation without APEX, and falls back to torch's optimizers by design (docs/training.md)"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm",
     "megatron-core's layer specs without APEX: torch's norms are the ones this trainer builds on"),
    (UserWarning, "absl.logging is not installed",
     "megatron-core 0.19's import-time notice: without absl it logs through Python's logging, which is what this "
     "trainer prints; absl-py changes nothing in a run"),
    (UserWarning, "MimoModelConfig is experimental",
     "megatron-core 0.19 imports its multimodal (MIMO) config with the model code; this trainer builds no MIMO "
     "model"),
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized",
     "megatron-core 0.19 reads a checkpoint's common state through torch's distributed reader; the trainer reads "
     "the saved arguments in one process, before torch.distributed starts, on purpose"),
    (UserWarning, "Could not determine rank from torch.distributed, RANK, or SLURM_PROCID",
     "megatron-core 0.19 asks for the rank while the trainer reads the saved arguments before torch.distributed "
     "starts; only a single process (torchrun sets RANK) gets here, whose rank 0 is right"),
    (UserWarning, "The argument order of load has been changed",
     "torch's notice on how megatron-core 0.19 calls torch.distributed.checkpoint.load for the common state; no "
     "argument of this trainer is involved"),
    (FutureWarning, "`load_state_dict` is deprecated",
     "megatron-core's dist_checkpointing calls torch's old loader internally; nothing in a command changes it"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor",
     "torch's notice about the ShardedTensor that megatron-core's checkpoint format is built on"),
)

# (logger, start of the message, why): notices that megatron-core or torch log rather than warn
KNOWN_LOG_RECORDS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED",
     "megatron-core 0.19 points to HybridModel at every model build; GPTModel is the model this trainer and "
     "upstream's pretrain_gpt.py build in every supported megatron-core"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found",
     "torch 2.15 on a machine without CUDA, when megatron-core imports torch's extension builder; this trainer "
     "builds no C++/CUDA extension"),
    ("megatron.core.dist_checkpointing.strategies.common", "load_common is deprecated",
     "megatron-core 0.19 reading the common.pt of a checkpoint that an earlier megatron-core wrote; it loads, and "
     "the next save stores the common state the new way"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated",
     "megatron-core 0.19's synchronous save runs through its own deprecated async path and says so; this trainer "
     "saves synchronously and asks for no async strategy"),
)


def filter_known_warnings() -> None:
    """Ignore the warnings in KNOWN and the log records in KNOWN_LOG_RECORDS (call before megatron-core is
    imported: most fire at import)."""
    for category, message, _why in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, message, _why in KNOWN_LOG_RECORDS:
        logging.getLogger(name).addFilter(lambda record, start=message: not record.getMessage().startswith(start))
