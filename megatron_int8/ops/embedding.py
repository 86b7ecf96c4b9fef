"""The word embedding with its weight gradient added straight into `weight.main_grad`.

Megatron's `VocabParallelEmbedding` leaves its gradient to `F.embedding`'s backward: a zero-filled
[vocab, hidden] gradient in the weight's dtype (778 MB for Qwen3-4B), the token rows scattered into it, and,
once per micro-batch, megatron's DDP hook adding all of it into the fp32 `main_grad`. That costs about 2.4 ms
per micro-batch for Qwen3-4B on an H200 (docs/history.md, 2026-11-23), while only the rows of the
micro-batch's tokens change. Here backward sums each distinct token's rows in fp32 and adds the sums into
those rows of `main_grad`, like megatron's gradient-accumulation fusion does for linears
(`grad_added_to_main_grad` and a placeholder gradient for the DDP hook).

Sync-free (a captured CUDA graph replays it) and deterministic: each id's rows are summed without atomics,
and each row of `main_grad` then gets its id's sum plus, at most, exact zeros. With fp32 parameters on the CPU it
reproduces megatron's numbers bit for bit: one addition per row of its tokens' sum, taken in token order (with
bf16 parameters megatron rounds each sum to bf16 first; here it stays fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from .main_grad import main_grad_placeholder


def add_rows_into(main_grad: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
    """main_grad[i] += the sum of grad_rows[t] over the tokens t with ids[t] == i, for every id, in main_grad's
    dtype. Without a host sync the number of distinct ids stays unknown, so the sums get one slot per token:
    distinct ids take the first slots, in increasing order, and are summed there by `embedding_dense_backward`
    on [tokens, hidden] (the partial-segment reduction of F.embedding's backward: no atomics, and frequent
    tokens do not serialize). Each slot is then added to its id's row; the empty slots, all zeros, go to rows
    of their own, so that no row takes more than a few additions (one index crowded with thousands of them cost
    1.9 ms per call in a sorted index_put_, 2026-11-23) and adding exact zeros keeps the result exact."""
    ids = ids.reshape(-1).long()
    tokens = ids.numel()
    rows = grad_rows.reshape(tokens, grad_rows.shape[-1]).to(main_grad.dtype)
    sorted_ids, order = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_of_sorted = torch.cumsum(first, 0) - 1
    slot = torch.empty_like(slot_of_sorted).scatter_(0, order, slot_of_sorted)
    sums = torch.ops.aten.embedding_dense_backward(rows, slot, tokens, -1, False)
    target = torch.arange(tokens, device=ids.device) % main_grad.shape[0]
    target.scatter_(0, slot_of_sorted, sorted_ids)  # equal values collide: each slot gets its id
    main_grad.index_add_(0, target, sums)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """F.embedding(ids, weight); backward adds the weight gradient into weight.main_grad and returns the
    placeholder megatron's DDP hook expects (or None, when another user of the weight returns it)."""

    @staticmethod
    def forward(ctx, ids, weight, placeholder: bool):
        ctx.save_for_backward(ids, weight)
        ctx.placeholder = placeholder
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ids, weight = ctx.saved_tensors
        add_rows_into(weight.main_grad, ids, grad_output)
        return None, main_grad_placeholder(weight) if ctx.placeholder else None, None


class MainGradEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding whose weight gradient goes into `weight.main_grad` once DDP has given the
    weight one (megatron's forward otherwise). Same parameters, state dict and forward values; built from
    megatron's module by `fuse_embedding_wgrad`.

    `weight_grad_placeholder`: False where the weight is tied to the output layer on this pipeline stage. That
    layer's backward then returns the placeholder that lets DDP's hook run, and this one returns nothing, so
    autograd does not add two [vocab, hidden] placeholders."""

    weight_grad_placeholder: bool = True

    def forward(self, input_):
        weight = self.weight
        if not (torch.is_grad_enabled() and weight.requires_grad and hasattr(weight, "main_grad")):
            return super().forward(input_)
        sharded = self.tp_group.size() > 1
        if sharded:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            input_ = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output = _EmbeddingIntoMainGrad.apply(input_, weight, self.weight_grad_placeholder)
        if sharded:
            output = output.masked_fill(outside.unsqueeze(-1), 0.0)  # rows owned by another rank
        if self.reduce_scatter_embeddings:
            output = output.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)


def fuse_embedding_wgrad(module: VocabParallelEmbedding, placeholder: bool = True) -> MainGradEmbedding:
    """Turn megatron's embedding into a MainGradEmbedding in place (the class only: parameters, buffers and
    hooks stay)."""
    if not isinstance(module, VocabParallelEmbedding):
        raise TypeError(f"fuse_embedding_wgrad needs a VocabParallelEmbedding, got {type(module).__name__}")
    module.__class__ = MainGradEmbedding
    module.weight_grad_placeholder = placeholder
    return module
