"""The one place where the entry points (pretrain, scripts/generate.py, scripts/export_hf.py) silence warnings
that a user of this trainer cannot act on. Each filter says why; any other warning still prints."""
from __future__ import annotations

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
    (FutureWarning, "`load_state_dict` is deprecated",
     "megatron-core's dist_checkpointing calls torch's old loader internally; nothing in a command changes it"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor",
     "torch's notice about the ShardedTensor that megatron-core's checkpoint format is built on"),
)


def filter_known_warnings() -> None:
    """Ignore the warnings in KNOWN (call before megatron-core is imported: most fire at import)."""
    for category, message, _why in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
