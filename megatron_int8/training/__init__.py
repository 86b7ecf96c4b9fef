"""A megatron-core pretraining loop for GPT models with INT8 linears (`python -m megatron_int8.pretrain`).

args: Megatron-LM-named flags, `--config FILE.yaml`, validation; data: tokenizers, indexed datasets,
early data checks, resumable sampling; model: process groups, GPTModel with the INT8 (or BF16) spec,
DDP, megatron's optimizer and LR schedule; checkpoint: atomic dist_checkpointing saves and exact
resume; metrics: the interval log line, model FLOPs, JSONL, TensorBoard; loop: the training loop;
cpu: megatron's optimizer stack on CPU-only machines.
"""
