"""A megatron-core pretraining loop for GPT models with INT8 linears (`python -m megatron_int8.pretrain`).

args: Megatron-LM-named flags and `--config FILE.yaml`; data: tokenizers, indexed datasets, resumable
sampling; model: spec, GPTModel, DDP; optimizer: megatron's optimizer and LR schedule; checkpoint:
atomic dist_checkpointing saves and exact resume; metrics: the interval log line, FLOPs, JSONL,
TensorBoard; loop: the training loop that ties them together.
"""
