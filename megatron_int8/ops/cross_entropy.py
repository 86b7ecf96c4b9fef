"""Fused vocab-parallel cross entropy for megatron-core: megatron's `fused_vocab_parallel_cross_entropy`
contract, without its fp32 copies of the logits.

megatron-core's native fused cross entropy (`cross_entropy_loss_fusion`, impl "native", compiled by
torch.compile) upcasts the logits to fp32 and passes over them about six times (max, exp and sum, the
target logit, the stored softmax, backward). For Qwen3-4B (vocabulary 151,936, 8192 tokens per micro-batch)
that took ~20 ms per micro-batch on an H100, in BF16 and INT8 runs alike. Here, on CUDA, one Triton kernel
(kernels/cross_entropy.py) reads the bf16 logits once forward, and one reads them again and writes the
gradient backward; nothing of the logits' size is kept but the logits themselves. Elsewhere (CPU) the same
fp32 math runs as PyTorch ops (`_reference_stats`, `_reference_grad`).

Math, per token row r of the local logits x [V_local] (this rank's vocabulary ids [start, start + V_local),
start = rank * V_local, as megatron's VocabUtility.vocab_range_from_per_partition_vocab_size):
    m = max_v x,  l = sum_v exp(x - m),  x_t = x[t - start] if the target t is local, else 0
Tensor parallel (tp_group of more than one rank): one all-reduce MAX of m, l *= exp(m - M) with M the
global max, then one all-reduce SUM of [l, p] stacked, p = (x_t - M) where t is local, else 0 (megatron
batches its two sums the same way):
    loss = log(L) - P,   lse = M + log(L)
which is log-sum-exp - x_t. A target outside the whole vocabulary is counted (megatron has no ignore_index
in this path): its loss is log(L) and its gradient has no -1, as megatron's. Logits of -inf (masked ids)
are allowed, a shard of nothing else included (its l is 0).
Backward: grad_logits = grad_loss * (exp(x - lse) - one_hot(t - start)), rounded once to the logits' dtype
(megatron's native path always returns bf16). Saved for backward: the logits (not copied), the targets
and lse (fp32, one value per token).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .backend import triton_available, triton_runs_on

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TARGET_DTYPES = (torch.int64, torch.int32)


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("vocab_parallel_cross_entropy: logits and target must be tensors")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be one of {LOGIT_DTYPES}, got {logits.dtype}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"vocab_parallel_cross_entropy: target must hold integer ids ({TARGET_DTYPES}), "
                        f"got {target.dtype}")
    if logits.dim() < 2 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"vocab_parallel_cross_entropy: logits must be [s, b, V/tp] and target [s, b], got "
                         f"logits {tuple(logits.shape)} and target {tuple(target.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("vocab_parallel_cross_entropy: the logits' vocabulary dimension is empty")
    if target.device != logits.device:
        raise ValueError(f"vocab_parallel_cross_entropy: target on {target.device}, logits on {logits.device}")


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """t [..., V] as [S, B, V] (a view where possible): [s, b, V] itself, [N, V] as [N, 1, V]."""
    if t.dim() == 3:
        return t
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(-1, 1, t.shape[-1])


def _group_size_rank(tp_group) -> Tuple[int, int]:
    if tp_group is None:
        return 1, 0
    world = torch.distributed.get_world_size(group=tp_group)
    return world, (torch.distributed.get_rank(group=tp_group) if world > 1 else 0)


# ----------------------------------------------------------------------------- PyTorch path (CPU)


def _reference_stats(x3: torch.Tensor, target: torch.Tensor, start: int):
    """(m, l, x_t, hit) per row of x3 [S, B, V] in fp32 for targets [S * B] (x_t = 0 where not hit)."""
    V = x3.shape[-1]
    x = x3.reshape(-1, V).float()
    m = x.amax(dim=-1)
    l_ = torch.exp(x - torch.where(m == -torch.inf, 0.0, m)[:, None]).sum(dim=-1)  # a shard of -inf: l = 0
    local = target - start
    hit = (local >= 0) & (local < V)
    xt = x.gather(1, torch.where(hit, local, 0)[:, None]).squeeze(1)
    return m, l_, torch.where(hit, xt, 0.0), hit


def _reference_grad(x3, grad_loss, lse, target, start) -> torch.Tensor:
    S, B, V = x3.shape
    p = torch.exp(x3.reshape(-1, V).float() - lse[:, None])
    local = target - start
    hit = (local >= 0) & (local < V)
    rows = torch.arange(p.shape[0], device=p.device)
    p[rows, torch.where(hit, local, 0)] -= hit.float()
    p *= grad_loss.reshape(-1, 1).float()
    return p.to(x3.dtype).view(S, B, V)


# ----------------------------------------------------------------------------- autograd


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, use_triton):
        world, rank = _group_size_rank(tp_group)
        x3 = _rows3(logits)
        if x3.stride(-1) != 1:
            x3 = x3.contiguous()
        V = x3.shape[-1]
        start = rank * V
        tgt = target.reshape(-1).to(torch.int64).contiguous()
        shape = target.shape
        if use_triton:
            from ..kernels.cross_entropy import triton_cross_entropy_forward

            if world == 1:
                loss, lse = triton_cross_entropy_forward(x3, tgt, 0, finish=True, loss_shape=shape)
            else:
                m, l_, xt = triton_cross_entropy_forward(x3, tgt, start, finish=False)
                hit = (tgt >= start) & (tgt < start + V)
        else:
            m, l_, xt, hit = _reference_stats(x3, tgt, start)
            if world == 1:
                log_l = torch.log(l_)
                loss, lse = log_l.view(shape) - torch.where(hit, xt - m, 0.0).view(shape), m + log_l
        if world > 1:
            m_global = m.clone()
            torch.distributed.all_reduce(m_global, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            sums = torch.stack((l_ * torch.exp(m - m_global), torch.where(hit, xt - m_global, 0.0)))
            torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=tp_group)
            log_l = torch.log(sums[0])
            loss, lse = log_l.view(shape) - sums[1].view(shape), m_global + log_l
        ctx.save_for_backward(x3, tgt, lse)  # x3: the logits themselves, or a view of them
        ctx.shape, ctx.start, ctx.use_triton = logits.shape, start, use_triton
        return loss  # a tensor of its own: autograd forbids in-place ops on views returned by a Function

    @staticmethod
    def backward(ctx, grad_loss):
        x3, tgt, lse = ctx.saved_tensors
        S, B, _ = x3.shape
        g = grad_loss if grad_loss.dim() == 2 and tuple(grad_loss.shape) == (S, B) else grad_loss.reshape(S, B)
        if ctx.use_triton:
            from ..kernels.cross_entropy import triton_cross_entropy_backward

            grad = triton_cross_entropy_backward(x3, g, lse, tgt, ctx.start)
        else:
            grad = _reference_grad(x3, g, lse, tgt, ctx.start)
        return (grad if grad.shape == ctx.shape else grad.view(ctx.shape)), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group: Optional[object] = None
) -> torch.Tensor:
    """megatron-core's `fused_vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group)`:
    logits [s, b, V/tp] (bf16, fp16 or fp32; this rank's slice of the vocabulary, rank r holding the ids
    [r V/tp, (r + 1) V/tp)), target [s, b] global ids (int64 or int32); returns the per-token loss [s, b] in
    fp32, differentiable w.r.t. the logits only (their gradient in the logits' dtype). tp_group None or of
    one rank: no communication. On CUDA (or under TRITON_INTERPRET=1) the Triton kernels run."""
    _check(vocab_parallel_logits, target)
    use_triton = triton_runs_on(vocab_parallel_logits.device) and triton_available()
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, use_triton)


def install() -> bool:
    """Make megatron-core's fused cross entropy (`cross_entropy_loss_fusion` with
    `cross_entropy_fusion_impl == "native"`) call `vocab_parallel_cross_entropy`: rebinds the name
    `fused_vocab_parallel_cross_entropy` in megatron's language_module, which
    `LanguageModule.compute_language_model_loss` calls. Idempotent; a function that someone else put
    there (neither megatron's nor ours) stays. Returns whether ours is (now) megatron's."""
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.models.common.language_module import language_module

    if language_module.fused_vocab_parallel_cross_entropy is fused_cross_entropy.fused_vocab_parallel_cross_entropy:
        language_module.fused_vocab_parallel_cross_entropy = vocab_parallel_cross_entropy
    return language_module.fused_vocab_parallel_cross_entropy is vocab_parallel_cross_entropy
