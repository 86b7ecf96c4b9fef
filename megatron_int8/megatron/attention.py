"""Core attention on `torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient
kernels on GPU) for specs without Transformer Engine.

megatron-core's own `DotProductAttention` materializes the [b, np, sq, sk] score matrix, which at
sequence 4096 dominates a layer's time and memory and would blur an INT8-vs-BF16 linear comparison.
This module is a drop-in for it in layer specs (same constructor, same forward, same `[s, b, h, d]`
layout and mask convention), used by both the INT8 and the BF16 baseline specs. Given a recipe with
int8_attention, it runs `ops.int8_attention` instead (the `--int8-attention` route; see `SDPAttention`).

`QueryNormInPlaceSelfAttention` is megatron's `SelfAttention` with a query norm that reads the query heads
in place instead of after megatron's copy, and, with both q/k norms on the Triton kernels, a backward that
writes the QKV gradient in place of megatron's cat; every spec of this package uses it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.attention import SplitAlongDim as _split_along_dim  # TE's, or None
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide, is_torch_min_version

from ..dispatch import resolve_backend_name
from ..ops.backend import triton_available
from ..ops.int8_attention import Int8AttentionConfig, int8_attention
from ..ops.rms_norm import FusedRMSNorm
from ..recipe import Int8Recipe
from ..reference import attach_amax
from .layers import run_forward_pre_hooks
from .policy import int8_attention_problems

_SDPA_HAS_GQA = is_torch_min_version("2.5.0a0")  # the enable_gqa keyword


class SDPAttention(MegatronModule):
    """`DotProductAttention` semantics on SDPA: causal or masked softmax(q k^T * scale) v, GQA, dropout.

    Masks follow megatron: a bool tensor broadcastable to [b, np, sq, sk], True = masked out; with
    a causal mask type and no mask, the causal mask is implied (as in megatron's softmax).

    `recipe` with int8_attention (`--int8-attention`): `int8_attention` on the same [b, h, s, d] views, on the
    recipe's backend (MEGATRON_INT8_BACKEND overrides it), for what that op serves: causal self-attention
    with the causal mask implied (sq == sk, no mask tensor), and a KV-cached decoding step (one query over the
    cached keys, unmasked). The constructor refuses attention dropout and head dims other than 64 and 128
    (policy.int8_attention_problems), as it refuses sliding windows and context parallelism; a call with a mask
    tensor or another shape raises. Nothing falls back to BF16 silently. `int8_attention` is the switch the
    trainer's auto fallback turns off (training/health.py: the layer then runs BF16 SDPA); `int8_probe` an
    ops.health.AttentionProbe while the trainer collects statistics. No parameters either way: state dicts
    are the same.
    """

    int8_probe = None
    int8_fallback_note: Optional[str] = None  # set by the trainer's auto fallback

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        recipe: Optional[Int8Recipe] = None,
    ):
        super().__init__(config=config)
        self.int8_recipe = recipe
        self.int8_attention = self.int8_attention_built = bool(recipe is not None and recipe.int8_attention)
        self.int8_attention_config = (Int8AttentionConfig(scores=recipe.int8_attention_scores)
                                      if self.int8_attention else None)
        owner = "--int8-attention (SDPAttention)" if self.int8_attention else "SDPAttention"
        if config.context_parallel_size != 1:
            raise NotImplementedError(f"{owner}: context parallelism needs TEDotProductAttention")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"{owner}: softmax_type={config.softmax_type!r} is not supported")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(f"{owner}: sliding-window attention is not supported")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        world_size = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        # megatron's query-key layer scaling divides the scale by the layer number and multiplies
        # the fp32 softmax input back: the product is unchanged, so SDPA takes the plain scale.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if self.int8_attention:
            problems = int8_attention_problems(self.hidden_size_per_attention_head, self.dropout_p)
            if problems:
                raise ValueError("--int8-attention: " + "; ".join(text for _, text in problems))

    def extra_repr(self) -> str:
        if not self.int8_attention_built:
            return ""
        return f"int8_attention={self.int8_attention}, scores={self.int8_attention_config.scores}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys/values -> [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention: packed sequences need TEDotProductAttention")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention_bias is not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, sk = query.shape[0], key.shape[0]
        if self.int8_attention:
            return self._int8_forward(query, key, value, attention_mask, mask_type)

        attn_mask, is_causal = None, False
        if attention_mask is not None:
            attn_mask = ~attention_mask.to(torch.bool)  # megatron: True = masked; SDPA: True = attend
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise ValueError(f"SDPAttention: causal attention without a mask needs sq == sk, got {sq} vs {sk}")
            is_causal = True
        elif mask_type == AttnMaskType.causal_bottom_right and sq > 1:
            attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(diagonal=sk - sq)

        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        gqa_kwargs = {}
        if groups > 1:
            if _SDPA_HAS_GQA and attn_mask is None:
                gqa_kwargs["enable_gqa"] = True  # keeps the flash kernel, no K/V copies
            else:
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)

        # [s, b, n, d] -> [b, n, s, d] (views; SDPA accepts strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=self.softmax_scale, **gqa_kwargs)

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # per-TP-rank stream, as megatron
                context = attend()
        else:
            context = attend()
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, context.shape[0], self.hidden_size_per_partition)

    def _int8_forward(self, query, key, value, attention_mask, mask_type) -> torch.Tensor:
        """The INT8 path: causal over sq == sk tokens, or a decoding step (one query, every cached key)."""
        sq, sk = query.shape[0], key.shape[0]
        if attention_mask is not None:
            raise NotImplementedError(
                "--int8-attention: a mask tensor reached the core attention; INT8 attention takes the causal mask "
                "from the layer's mask type (document masks, --reset-attention-mask, are not supported; upstream "
                "Megatron-LM needs --no-create-attention-mask-in-dataloader)")
        # one decoding query sees every cached key, whatever the mask type (megatron's static inference says no_mask)
        causal = sq > 1
        if causal and not (mask_type in (AttnMaskType.causal, AttnMaskType.causal_bottom_right) and sq == sk):
            raise NotImplementedError(f"--int8-attention: {mask_type.name} attention of {sq} queries over {sk} keys "
                                      "is not supported (causal self-attention, or one query over a KV cache)")
        # [s, b, n, d] -> [b, n, s, d] (views; the op takes strided inputs and GQA as they are)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        backend = resolve_backend_name(q.device, self.int8_recipe, triton_available())
        context = int8_attention(q, k, v, causal=causal, scale=self.softmax_scale,
                                 config=self.int8_attention_config, backend=backend)
        probe = self.int8_probe
        if probe is not None and probe.armed and torch.is_grad_enabled():
            probe.observe(q, k, v, context, causal, self.softmax_scale, self.int8_attention_config)
        return context.permute(2, 0, 1, 3).reshape(sq, context.shape[0], self.hidden_size_per_partition)


class QueryNormInPlaceSelfAttention(SelfAttention):
    """megatron's `SelfAttention`, except that a query norm takes the query heads where the fused QKV
    projection wrote them.

    The QKV output holds each key/value group's np/ng query heads next to the group's key and value head.
    megatron merges them into [sq, b, np, hn] with a reshape, which under GQA is a strided copy (85 us per
    layer and micro-batch for Qwen3-4B on an H200, in every precision), and then normalizes the copy. The
    norm acts on the head dimension only, so it can read the heads in place, as a view [sq, b, ng, np/ng, hn],
    and write them contiguous: same result, one pass fewer (with this package's norms; Transformer Engine's
    TENorm makes its input contiguous itself, so there the copy only moves into it). Parameters and
    state-dict keys are megatron's. Without a query norm, and in megatron's special cases (output gate,
    unsplit QKV, fewer query groups than tensor-parallel ranks, test mode), this is megatron's own method.

    When both norms are this package's `FusedRMSNorm` on its Triton kernels, the split and the two norms run
    as one autograd node (`_SplitQKVNormed`, same kernels and results); the norm modules' forward pre-hooks
    run (megatron's parameter all-gather waits there), their forward hooks do not. When the QKV linear quantizes
    its output gradient tensorwise, that node also hands it the gradient's amax, so the linear reads the
    gradient once.
    """

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if (self.q_layernorm is None or isinstance(self.q_layernorm, IdentityOp) or output_gate or not split_qkv
                or self.config.test_mode or self.config.num_query_groups < self.world_size):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        head = self.hidden_size_per_attention_head
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        norms = (self.q_layernorm, self.k_layernorm)
        if all(isinstance(n, FusedRMSNorm) and n.runs_triton(mixed_qkv) and n.weight.shape == (head,) for n in norms):
            emit_amax = getattr(self.linear_qkv, "takes_grad_output_amax", False)  # this package's linears only
            for norm in norms:
                run_forward_pre_hooks(norm, mixed_qkv)
            return _SplitQKVNormed.apply(mixed_qkv, self.q_layernorm.weight, self.k_layernorm.weight,
                                         self.q_layernorm.eps_for(mixed_qkv), self.k_layernorm.eps_for(mixed_qkv),
                                         groups, head, emit_amax)
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], groups, (per_group + 2) * head)
        split = _split_along_dim or (lambda t, dim, sizes: torch.split(t, sizes, dim=dim))
        query, key, value = split(mixed_qkv, 3, [per_group * head, head, head])
        query = self.q_layernorm(query.unflatten(-1, (per_group, head)))
        query = query.reshape(query.shape[0], query.shape[1], -1, head)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value


def _qkv_parts(qkv: torch.Tensor, groups: int, head: int):
    """Views of a fused QKV tensor [sq, b, groups * (per_group + 2) * head]: the query heads
    [sq, b, groups, per_group, head], the key and the value heads [sq, b, groups, head]. For _SplitQKVNormed,
    whose backward is its own: autograd through these slices would zero-fill a full-size gradient per part
    (megatron's path keeps its split, whose backward is one cat)."""
    qkv = qkv.view(*qkv.shape[:-1], groups, -1)
    per_group = qkv.shape[-1] // head - 2
    return (qkv[..., :per_group * head].unflatten(-1, (per_group, head)), qkv[..., per_group * head:-head],
            qkv[..., -head:])


class _SplitQKVNormed(torch.autograd.Function):
    """The fused QKV output split into query, key and value, the query and key heads normalized by the Triton
    RMSNorm, as one autograd node. The forward is the split and the two norms' forwards. The backward writes
    the norms' input gradients (their kernels take a strided destination) and the value gradient into one
    QKV-shaped gradient, where megatron's split backward concatenates separate dq, dk and dv: 96 MB of copies
    per layer and micro-batch for Qwen3-4B (49 us on an H200, in both precisions). `emit_amax`: the gradient
    also carries its max |.| (reference.attach_amax), folded by the norm kernels and one reduction of dv, for
    an INT8 QKV linear that quantizes it tensorwise."""

    @staticmethod
    def forward(ctx, mixed, q_weight, k_weight, q_eps, k_eps, groups, head, emit_amax=False):
        """mixed [sq, b, groups * (per_group + 2) * head] -> query [sq, b, groups * per_group, head] and key
        [sq, b, groups, head] (both contiguous), value [sq, b, groups, head] (a view of mixed)."""
        from ..kernels.rms_norm import triton_rms_norm_forward

        q_in, k_in, value = _qkv_parts(mixed, groups, head)
        query, q_rstd = triton_rms_norm_forward(q_in, q_weight, q_eps)
        key, k_rstd = triton_rms_norm_forward(k_in, k_weight, k_eps)
        ctx.save_for_backward(mixed, q_weight, k_weight, q_rstd, k_rstd)
        ctx.groups, ctx.head, ctx.emit_amax = groups, head, emit_amax
        return query.flatten(2, 3), key, value

    @staticmethod
    def backward(ctx, d_query, d_key, d_value):
        from ..kernels.rms_norm import triton_rms_norm_backward

        mixed, q_weight, k_weight, q_rstd, k_rstd = ctx.saved_tensors
        grad = torch.empty(mixed.shape, dtype=mixed.dtype, device=mixed.device)
        q_in, k_in, _ = _qkv_parts(mixed, ctx.groups, ctx.head)
        dq_in, dk_in, dv_in = _qkv_parts(grad, ctx.groups, ctx.head)
        amax = torch.zeros(1, dtype=torch.float32, device=grad.device) if ctx.emit_amax else None
        weight_grads = []
        for dy, x, weight, rstd, dx in ((d_query, q_in, q_weight, q_rstd, dq_in), (d_key, k_in, k_weight, k_rstd, dk_in)):
            if dy is None:
                dx.zero_()
                weight_grads.append(None)
            else:
                weight_grads.append(triton_rms_norm_backward(dy.reshape(x.shape), x, weight, rstd, dx=dx,
                                                             amax=amax)[1])
        if d_value is None:
            dv_in.zero_()
        else:
            dv_in.copy_(d_value)
            if amax is not None:  # max |dv|, NaN kept (the quantizer maps a given NaN amax to a NaN scale)
                amax = torch.maximum(amax, torch.linalg.vector_norm(d_value, float("inf"), dtype=torch.float32))
        if amax is not None:
            attach_amax(grad, amax.reshape(()))
        return grad, *weight_grads, None, None, None, None, None
