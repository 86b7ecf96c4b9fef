"""MoE experts whose linears run grouped: one quantization and one GEMM launch for all local experts.

`Int8GroupedMLP` is megatron's SequentialMLP (same `local_experts.{i}` MLPs, same parameters, state dicts
and sharded checkpoints, so checkpoints interchange with the per-expert layers and with BF16) with a
grouped forward: the token-sorted input is laid out with each expert's rows at a multiple of 128, both
expert linears run through `grouped_int8_linear`, and the activation (with the router probabilities)
runs once over all experts' rows. Where megatron would fuse it (`bias_activation_fusion`, SwiGLU) that
is `swiglu.weighted_swiglu`: one Triton kernel each way, same math as megatron's torch.compile'd weighted
SwiGLU (fp32, one rounding), which took two passes backward and ~3x the time of a copy (Mixtral, H200).
Otherwise it is megatron's own MLP code. Per expert, this trades ~4 quantize
launches and 6 short GEMMs for a share of 4 quantizes and 2 grouped GEMMs (wgrad stays one GEMM per
expert, on aligned slices). BF16 experts (the baseline) run the same way through `grouped_hp_linear`,
as Transformer Engine's grouped experts would run them, rather than SequentialMLP's loop.

Where the grouped op does not apply (FP8 experts, a tensorwise/block or partly high-precision INT8
recipe, experts of both precisions, biases), it is SequentialMLP, and says why once at construction.

With megatron's padded expert capacity (`moe_expert_capacity_factor` and `moe_pad_expert_input_to_capacity`)
every expert receives the same number of rows, which the input's shape gives (`padded_expert_capacity`): the
layer then reads no count from the device and builds its layout from shapes alone, so a whole training step
can be captured in a CUDA graph (`--cuda-graph-impl local`). Otherwise the counts are data, read once per
call from `tokens_per_expert`.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP

from ..ops.grouped_linear import grouped_hp_linear, grouped_int8_linear, grouped_recipe_problem
from . import layers
from .layers import Int8LinearMixin, run_forward_pre_hooks
from ..reference import SEGMENT_ALIGN, Segments, device_tensor, padded_length
from ..ops.swiglu import weighted_swiglu


class _ExpertLinears(torch.nn.Module):
    """Stands in for one expert's linear: calls the grouped op over every local expert's weight. A Module because
    megatron's MLP.forward checks that its linears are (0.17 on); the experts' linears stay unregistered here."""

    def __init__(self, linears: List[Int8LinearMixin], segments: Segments):
        super().__init__()
        object.__setattr__(self, "linears", linears)
        self.segments = segments

    def forward(self, x: torch.Tensor):
        for lin in self.linears:
            run_forward_pre_hooks(lin, x)
        weights = [lin.weight for lin in self.linears]
        first = self.linears[0]
        fuse = bool(first.gradient_accumulation_fusion)
        if not first.int8:
            return grouped_hp_linear(x, self.segments, weights, fuse_wgrad=fuse), None
        return grouped_int8_linear(x, self.segments, weights, first.int8_recipe, fuse_wgrad=fuse), None


class _GroupedExperts:
    """What megatron's `MLP.forward` reads from its MLP (config, activation, the two linears), with the
    linears grouped over all local experts: megatron's activation code then runs once for all of them."""

    def __init__(self, experts: torch.nn.ModuleList, segments: Segments):
        first = experts[0]
        self.config = first.config
        self.activation_func = first.activation_func
        self.linear_fc1 = _ExpertLinears([e.linear_fc1 for e in experts], segments)
        self.linear_fc2 = _ExpertLinears([e.linear_fc2 for e in experts], segments)


class Int8GroupedMLP(SequentialMLP):
    """SequentialMLP with its expert linears (INT8, or BF16 for the baseline) run grouped (see the module
    docstring)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **newer_options):
        """`newer_options`: what later megatron-core versions pass SequentialMLP (0.17: `name`), handed on."""
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, **newer_options)
        self._padded_layouts: Dict[int, "_PaddedLayout"] = {}  # by capacity; few: one per micro-batch shape
        self.grouped_problem = self._grouped_problem()
        self._recipes_seen = layers.RECIPE_CHANGES
        if self.grouped_problem is not None:
            warnings.warn(f"megatron-int8: experts run one by one (SequentialMLP): {self.grouped_problem}")
        # where megatron fuses the weighted SwiGLU; the trainer's --no-fused-swiglu turns it off
        self.fused_swiglu = bool(
            config.bias_activation_fusion and config.gated_linear_unit and config.activation_func is F.silu
            and not config.use_te_activation_func and not config.activation_func_fp8_input_store
            and getattr(config, "activation_func_clamp_value", None) is None
            and getattr(config, "glu_linear_offset", 0.0) == 0.0)

    def _grouped_problem(self) -> Optional[str]:
        linears = [lin for e in self.local_experts for lin in (e.linear_fc1, e.linear_fc2)]
        if not all(isinstance(lin, Int8LinearMixin) for lin in linears):
            return "the expert linears are not this package's INT8/BF16 linears (FP8 peer?)"
        if len({lin.int8 for lin in linears}) != 1:
            return "experts of both precisions"
        if any(lin.bias is not None for lin in linears):
            return "expert linears with biases"
        if any(getattr(lin, "gtp_remat_size", 1) > 1 for lin in linears):
            # megatron-core 0.19's GTP: each rank holds a slice of every weight, gathered in megatron's own GEMM
            return "expert weights sharded by megatron-core's GTP (--expert-tensor-parallel-num-weight-shards)"
        if not linears[0].int8:
            return None  # BF16: grouped_hp_linear takes any such experts
        recipes = {lin.int8_recipe for lin in linears}
        if len(recipes) != 1:
            return "the expert linears use different recipes"
        return grouped_recipe_problem(recipes.pop())

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        # asked again after any recipe change: a fallback move restored from a checkpoint (or made since) can give one
        # expert linear another recipe, which the grouped op (one recipe for all) cannot run
        if self._recipes_seen != layers.RECIPE_CHANGES:
            self.grouped_problem, self._recipes_seen = self._grouped_problem(), layers.RECIPE_CHANGES
        if self.grouped_problem is not None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input needs moe_router_topk = 1")
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)  # already applied
        layout = self._layout(hidden, tokens_per_expert)
        x, p = layout.place(hidden), layout.place(probs)
        experts = _GroupedExperts(self.local_experts, layout.segments)
        if self.fused_swiglu:
            h, _ = experts.linear_fc1(x)
            out, _ = experts.linear_fc2(weighted_swiglu(h, p))
        else:
            out, _ = MLP.forward(experts, x, per_token_scale=p)
        return layout.take(out), None

    def _layout(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor):
        """Where each expert's rows go in the aligned layout: from the shape under padded capacity, else from
        the counts (the one host read of a device value in this layer)."""
        capacity = padded_expert_capacity(self.config, hidden.shape[0], self.num_local_experts)
        if capacity is not None:
            if tuple(tokens_per_expert.shape) != (self.num_local_experts,):
                raise ValueError(f"Int8GroupedMLP: tokens_per_expert of shape {tuple(tokens_per_expert.shape)} "
                                 f"for {self.num_local_experts} local experts")
            if capacity not in self._padded_layouts:  # kept: a captured step reads its device tables
                self._padded_layouts[capacity] = _PaddedLayout(self.num_local_experts, capacity)
            return self._padded_layouts[capacity]
        counts = [int(c) for c in tokens_per_expert.tolist()]
        if len(counts) != self.num_local_experts or sum(counts) != hidden.shape[0]:
            raise ValueError(f"Int8GroupedMLP: tokens_per_expert {counts} does not match "
                             f"{self.num_local_experts} experts and {hidden.shape[0]} tokens")
        return _CountedLayout(counts, hidden.device)


def padded_expert_capacity(config, rows: int, num_local_experts: int) -> Optional[int]:
    """The row count of every local expert when megatron pads every expert's input to its capacity; None when it
    does not (the counts are then data, known only to `tokens_per_expert`).

    With `moe_expert_capacity_factor` F and `moe_pad_expert_input_to_capacity`, megatron's router keeps for each
    expert exactly capacity = ceil(tokens * topk / experts * F) of a rank's tokens (the excess dropped, the
    shortfall filled with tokens of probability 0; every token when the capacity exceeds them), and the
    dispatcher (alltoall, allgather, flex) hands each local expert those rows from each of the TP x EP ranks.
    So every local expert gets `rows / num_local_experts` rows, a function of the input's shape: reading the
    counts would be a host sync where they live on the device (allgather), and the layout derived from the
    shape is the same at every step, which a CUDA graph replays. (megatron's TransformerConfig refuses the
    padding without a capacity factor.)"""
    if not config.moe_pad_expert_input_to_capacity:
        return None
    if rows % num_local_experts:
        raise ValueError(f"Int8GroupedMLP: {rows} rows padded to capacity do not split evenly over "
                         f"{num_local_experts} local experts")
    return rows // num_local_experts


class _PaddedLayout:
    """`capacity` rows per expert, expert-major. The aligned layout is then a reshape: each expert's block padded
    with zero rows to a multiple of SEGMENT_ALIGN (nothing to do when the capacity already is one, as Mixtral's 2560
    rows at 2 x 4096 tokens), with no index table, so nothing is copied from the host either."""

    def __init__(self, num_experts: int, capacity: int):
        self.segments = Segments.for_counts([capacity] * num_experts)
        self.experts, self.capacity = num_experts, capacity
        self.stride = padded_length(capacity, SEGMENT_ALIGN)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """[experts * capacity, ...] -> [segments.rows, ...]"""
        if self.stride == self.capacity:
            return t
        blocks = t.reshape(self.experts, self.capacity, *t.shape[1:])
        pad = blocks.new_zeros((self.experts, self.stride - self.capacity, *t.shape[1:]))
        return torch.cat([blocks, pad], dim=1).flatten(0, 1)

    def take(self, out: torch.Tensor) -> torch.Tensor:
        """[segments.rows, ...] -> [experts * capacity, ...]"""
        if self.stride == self.capacity:
            return out
        return out.unflatten(0, (self.experts, self.stride))[:, :self.capacity].flatten(0, 1)


class _CountedLayout:
    """Expert e's `counts[e]` rows at its aligned offset, through a row table built on the host."""

    def __init__(self, counts: List[int], device: torch.device):
        self.segments = Segments.for_counts(counts)
        self.rows = _aligned_rows(counts, self.segments, device)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros((self.segments.rows, *t.shape[1:])).index_copy(0, self.rows, t)

    def take(self, out: torch.Tensor) -> torch.Tensor:
        return _SelectRows.apply(out, self.rows)


class _SelectRows(torch.autograd.Function):
    """x[rows] for distinct rows. Its backward copies the gradient into place: index_select's own backward
    adds it with index_add_, which allows repeated rows and is ~10x slower (0.58 ms for Mixtral's
    16k x 4096 aligned layout on an H200, once per micro-batch and layer)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        ctx.rows_in = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        rows, = ctx.saved_tensors
        return grad.new_zeros((ctx.rows_in,) + tuple(grad.shape[1:])).index_copy_(0, rows, grad), None


def _aligned_rows(counts: List[int], segments: Segments, device: torch.device) -> torch.Tensor:
    """Row of each token in the aligned layout: expert e's i-th token goes to offsets[e] + i."""
    shift, start = [], 0
    for e, c in enumerate(counts):
        shift.append(segments.offsets[e] - start)
        start += c
    total = start
    table = device_tensor(shift + list(counts), torch.int64, device)  # [shifts, counts]: one copy
    E = len(counts)
    return torch.arange(total, device=device) + torch.repeat_interleave(table[:E], table[E:], output_size=total)
