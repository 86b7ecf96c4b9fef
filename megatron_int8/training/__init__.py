"""A megatron-core pretraining loop for GPT models with INT8 linears (`python -m megatron_int8.pretrain`).

args: Megatron-LM-named flags, `--config FILE.yaml`, validation; data: tokenizers, indexed datasets,
early data checks, resumable sampling; model: process groups, GPTModel with the INT8 (or BF16) spec,
DDP, megatron's optimizer and LR schedule; checkpoint: atomic dist_checkpointing saves and exact
resume, retention, the guard against starting over a used --save; safe_load: checkpoint files read as
tensors and allowlisted types only; metrics: the interval log line, model FLOPs, JSONL, TensorBoard; loop:
the training loop, --skip-train evaluation, exit signals; inference: a checkpoint as a model on one
process, KV-cached sampling; export: to Hugging Face transformers; cpu: megatron's optimizer stack on
CPU-only machines.
"""
