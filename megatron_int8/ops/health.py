"""Quantization health of one INT8 linear: the statistics of its operands and the error of its GEMMs.

Pure torch, computed only on statistics steps (the trainer's `--int8-stats-interval`): a `LinearProbe` is
armed for one step, measures the first training forward/backward that passes through its linear, and
keeps the results on the device until the trainer reads every probe at once (one host sync per log line).

The statistics are estimated on a sample, so that a probe costs a few small kernels instead of passes over
whole operands (docs/numerics.md, "Sampling"): `SAMPLE_ROWS` tokens (`sample_rows`) of X and dY, and
`SAMPLE_CHANNELS` channels (`sample_channels`) of W's output and input axes. Every sampled value is
quantized with the scale the whole tensor gives it: its own row's or tile's, the whole tensor's amax
(tensorwise), or its channel's amax over all tokens (the transposed operands of wgrad, the input channels
of W^T), each reduced over the whole tensor in one pass.

Per operand (X: the input, W: the weight, dY: the output gradient), in `OPERAND_STATS` order:
  amax        max |v| over the whole tensor (exact)
  crest       amax / RMS, RMS = sqrt(mean v^2) of the sample; about 4 for 4096 Gaussian values
  kurtosis    E[(v - mean)^4] / Var^2 of the sample (Pearson: 3 for a Gaussian, 1.8 uniform)
  underflow   fraction of the sample's nonzero elements that quantize to 0 (|v| <= half a step)
  saturation  fraction of the sample's elements that quantize to +-127
The samples: X and dY, the sampled tokens (all channels); W, the sampled output channels (all inputs).
underflow and saturation use the scales of the GEMM that reads the operand along its rows: X as fprop reads
it (per token with row scales), W as fprop reads it (per output channel), dY as dgrad reads it (per token).
Per GEMM (fprop, dgrad, wgrad), in `GEMM_STATS` order:
  rel_err     ||INT8 result - exact result||_F / ||exact result||_F on a sampled block of the result: the
              sampled tokens x the sampled output channels (fprop), x the sampled input channels (dgrad);
              the sampled output x input channels of the sampled tokens' partial sum (wgrad). The INT8
              result is the product of the dequantized operands as the recipe quantizes them (the INT32 GEMM
              with its fp32 epilogue computes the same up to fp32 rounding), the exact one the fp32 product
              of the unquantized operands (no TF32)
  underflow   the larger underflow of the GEMM's two operands' samples, each under the scales that GEMM
              uses (dgrad: dY per token, W^T's sampled input channels per input channel; wgrad: dY^T and
              X^T, the sampled tokens of every channel, per channel over all tokens)

INT8 attention (`AttentionProbe`, ops.int8_attention) is measured in its forward, on the first sequence of the
batch, `SAMPLE_HEADS` query heads spread over the key/value heads and `SAMPLE_ROWS` queries from the middle of
the sequence, against fp32 attention of the same inputs (`ATTENTION_STATS`):
  qk/rel_err         ||S~ - S||_F / ||S||_F over the scores the causal mask keeps: S = scale Q (K - mean K)^T, the
                     scores the op quantizes (K smoothed, softmax does not change), S~ from Q and K quantized per
                     token as the op quantizes them (rounded to BF16 with scores="bf16"): with scores="int8", the
                     product whose error dominates INT8 attention's
  attention/rel_err  ||O - O_fp32||_F / ||O_fp32||_F of the op's own output for the sampled queries: everything
                     the forward quantizes (Q, K, P, V). The backward is not measured.
Three fp32 products of SAMPLE_HEADS x SAMPLE_ROWS queries by the keys they see (exact scores, scores from the
quantized operands, P V), per layer and statistics step.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from ..recipe import GEMMS, QMAX, Int8Recipe
from ..reference import QTensor, cdiv, dequantize, padded_length, quantize
from .int8_attention import Int8AttentionConfig, score_operands
from .smooth_swiglu import smooth_scales
from .tp_comm import group_amax

OPERANDS = ("x", "w", "dy")
OPERAND_STATS = ("amax", "crest", "kurtosis", "underflow", "saturation")
GEMM_STATS = ("rel_err", "underflow")
# the flat order of a probe's values: int8_health/<layer>/<operand or GEMM>/<stat>
STAT_NAMES: Tuple[str, ...] = tuple(f"{op}/{s}" for op in OPERANDS for s in OPERAND_STATS) + tuple(
    f"{g}/{s}" for g in GEMMS for s in GEMM_STATS)
SAMPLE_ROWS = 256  # tokens of X and dY that the statistics are estimated on
SAMPLE_CHANNELS = 1024  # channels of W's output axis (and of its input axis) that the statistics see
ATTENTION_STATS = ("qk/rel_err", "attention/rel_err")  # an attention probe's values, in this order
SAMPLE_HEADS = 8  # query heads an attention probe measures


def _index(name: str) -> int:
    return STAT_NAMES.index(name)


def distribution_stats(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[amax, crest, kurtosis] of x's elements, fp32 on x's device (moments accumulated in fp32 from the
    centred values, divided by the sample's amax first: fourth powers of raw values overflow or flush to zero at
    scales that gradients reach, and both ratios are scale-free). `amax`: that of the tensor x is a sample of
    (crest is then amax / x's RMS). An all-zero tensor has crest 0 and kurtosis NaN (no spread)."""
    v = x.detach().reshape(-1).float()
    if v.numel() == 0:
        raise ValueError("health statistics of an empty tensor")
    sample_amax = v.abs().amax()
    amax = sample_amax if amax is None else amax.detach().float().reshape(())
    unit = torch.where(sample_amax > 0, sample_amax, torch.ones_like(sample_amax))
    v = v / unit
    rms = v.square().mean().sqrt() * unit
    crest = torch.where(rms > 0, amax / rms, torch.zeros_like(rms))
    centred = v - v.mean()
    var = centred.square().mean()
    kurtosis = centred.square().square().mean() / var.square()  # 0/0 = NaN for a constant tensor
    return torch.stack([amax, crest, kurtosis])


def _fractions(x2d: torch.Tensor, q: QTensor) -> torch.Tensor:
    """[underflow, saturation] of x2d given its quantization q."""
    nonzero = x2d != 0
    underflow = ((q.data == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)
    saturation = (q.data.abs() == QMAX).sum() / q.data.numel()
    return torch.stack([underflow, saturation]).float()


def _quantize(x2d: torch.Tensor, recipe: Int8Recipe, *, weight: bool, amax: Optional[torch.Tensor] = None):
    tile2d = weight and recipe.granularity == "block"
    return quantize(x2d.detach(), recipe.granularity, block_size=recipe.block_size, tile2d=tile2d,
                    check_finite="off", amax=amax)


def _amax(t: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """max |t| (over `dim`, or all elements) in t's dtype: one min/max pass, no copy of t (NaN propagates)."""
    low, high = torch.aminmax(t.detach()) if dim is None else torch.aminmax(t.detach(), dim=dim)
    return torch.maximum(-low, high)


def _whole_amax(t: torch.Tensor, recipe: Int8Recipe, group) -> torch.Tensor:
    """max |t| of the tensor a GEMM quantizes: under sequence parallelism (`group`) with tensorwise scales, of
    the gathered shards (a collective over the group: every rank probes the same step); else of t."""
    if group is None or recipe.granularity != "tensor":
        return _amax(t)
    return group_amax(t, None, group).reshape(())


def _sample_amax(recipe: Int8Recipe, whole: torch.Tensor, channels: Optional[torch.Tensor] = None):
    """The amax a quantization of a sample of rows needs for the whole tensor's scales, given `whole` (the
    tensor's amax) and `channels` (its per-row amax for the sampled rows, where each row's scale comes from
    more than the sampled part of it): tensorwise the whole amax, row-wise the channels' (None: each sampled
    row is whole, its own), block None (each 1 x B or B x B tile is whole in the sample)."""
    if recipe.granularity == "tensor":
        return whole.float()
    return channels.float() if recipe.granularity == "row" and channels is not None else None


@contextlib.contextmanager
def _exact_fp32_matmul():
    """fp32 products without TF32 (the reference must be more precise than what it judges)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||approx - exact||_F / ||exact||_F (fp32, 0-dim); 0 where both are zero."""
    num = torch.linalg.vector_norm((approx - exact).reshape(-1))
    den = torch.linalg.vector_norm(exact.reshape(-1))
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(num))


def _product_error(a: torch.Tensor, qa: QTensor, b: torch.Tensor, qb: QTensor) -> torch.Tensor:
    """Relative error of deq(qa) deq(qb)^T against a b^T."""
    with _exact_fp32_matmul():
        approx = dequantize(qa) @ dequantize(qb).t()
        exact = a.detach().float() @ b.detach().float().t()
    return relative_error(approx, exact)


def sample_rows(rows: int, block_size: int) -> slice:
    """The sampled tokens: `SAMPLE_ROWS` (rounded up to whole blocks) contiguous rows from the middle of the
    tensor, starting on a multiple of the block size, so that the 1 x B tiles along the tokens that wgrad's
    operands get under block scales are whole; all rows of a smaller tensor."""
    count = padded_length(SAMPLE_ROWS, block_size)
    if rows <= count:
        return slice(0, rows)
    start = min(rows // 2, rows - count) // block_size * block_size
    return slice(start, start + count)


def sample_channels(channels: int, block_size: int, device) -> Optional[torch.Tensor]:
    """The sampled channels of a weight axis: `SAMPLE_CHANNELS` (rounded up to whole blocks) as whole
    blocks of `block_size` spread evenly over the axis (so a weight's B x B tiles stay whole and both halves
    of a fused [gate | up] fc1 are seen), an index tensor on `device`; None (all) for a smaller axis."""
    blocks = cdiv(SAMPLE_CHANNELS, block_size)
    whole = channels // block_size
    if whole <= blocks:
        return None
    starts = torch.arange(blocks, device=device) * whole // blocks * block_size
    return (starts[:, None] + torch.arange(block_size, device=device)).reshape(-1)


def _pick(t: torch.Tensor, index: Optional[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return t if index is None else t.index_select(dim, index)


def _sampled_tokens(tokens: int, recipe: Int8Recipe, input_group, grad_group) -> Tuple[slice, Optional[slice], int]:
    """(X's sampled rows, the rows of dY that hold the same tokens, dY's row count) for an X of `tokens` rows.
    Under sequence parallelism wgrad contracts over the gathered tokens: a column-parallel linear's dY holds all
    of them (this rank's X shard is its rows rank x tokens onwards); a row-parallel one's dY holds this rank's
    share, so X is sampled there. None where those rows would not start on a block of the block recipe (wgrad's
    1 x B tiles along the tokens would differ from the GEMM's)."""
    if input_group is None and grad_group is None:
        rows = sample_rows(tokens, recipe.block_size)
        return rows, rows, tokens
    group = grad_group if grad_group is not None else input_group
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if grad_group is not None:  # row-parallel, output scattered
        shard = tokens // world
        dy_rows, dy_tokens = sample_rows(shard, recipe.block_size), shard
        offset = rank * shard
        rows = slice(offset + dy_rows.start, offset + dy_rows.stop)
    else:  # column-parallel, input gathered
        rows, dy_tokens, offset = sample_rows(tokens, recipe.block_size), tokens * world, rank * tokens
        dy_rows = slice(offset + rows.start, offset + rows.stop)
    if recipe.granularity == "block" and offset % recipe.block_size:
        dy_rows = None
    return rows, dy_rows, dy_tokens


class ForwardRecord:
    """What a probed forward leaves for its backward: the values tensor, the rows of dY that hold the sampled
    tokens (`_sampled_tokens`) and dY's row count, the sampled tokens and channels, X^T's sampled tokens with
    their per-channel amax, W's amax, and the group that gathers dY (sequence parallelism, row-parallel)."""

    def __init__(self, values: torch.Tensor, recipe: Int8Recipe, dy_rows: Optional[slice], dy_tokens: int,
                 x_rows: torch.Tensor, x_col_amax: Optional[torch.Tensor], out_channels: Optional[torch.Tensor],
                 w_amax: torch.Tensor, w_col_amax: Optional[torch.Tensor], grad_group=None):
        self.values, self.recipe, self.grad_group = values, recipe, grad_group
        self.dy_rows, self.dy_tokens = dy_rows, dy_tokens
        self.x_rows, self.x_col_amax = x_rows, x_col_amax
        self.out_channels, self.w_amax, self.w_col_amax = out_channels, w_amax, w_col_amax

    def observe_backward(self, grad_output: torch.Tensor, weight: torch.Tensor) -> None:
        """dY's statistics, and dgrad's and wgrad's errors and underflows (device ops, no sync). wgrad's are
        left out (NaN) where dY's rows do not match the probed X's tokens as the forward expected."""
        recipe, values = self.recipe, self.values
        dy = grad_output.detach().reshape(-1, grad_output.shape[-1])
        w = weight.detach()
        dy_amax = _whole_amax(dy, recipe, self.grad_group)
        matched = self.dy_rows is not None and dy.shape[0] == self.dy_tokens
        dy_rows = dy[self.dy_rows if matched else sample_rows(dy.shape[0], recipe.block_size)]  # X's tokens
        q_dy = _quantize(dy_rows, recipe, weight=False, amax=_sample_amax(recipe, dy_amax))
        i = _index("dy/amax")
        values[i:i + 3] = distribution_stats(dy_rows, dy_amax)
        values[i + 3:i + 5] = _fractions(dy_rows, q_dy)
        # dgrad: dX = dY W, W^T [K, N] scaled per input channel (over all N outputs); its sampled rows
        in_channels = sample_channels(w.shape[1], recipe.block_size, w.device)
        w_t = _pick(w, in_channels, dim=1).t()
        w_t_amax = None if self.w_col_amax is None else _pick(self.w_col_amax, in_channels)
        q_wt = _quantize(w_t, recipe, weight=True, amax=_sample_amax(recipe, self.w_amax, w_t_amax))
        values[_index("dgrad/rel_err")] = _product_error(dy_rows, q_dy, w_t, q_wt)
        values[_index("dgrad/underflow")] = torch.maximum(values[_index("dy/underflow")], _fractions(w_t, q_wt)[0])
        if not matched:
            values[_index("wgrad/underflow")] = float("nan")
            return
        # wgrad: dW = dY^T X over the sampled tokens, each operand [channels, tokens] with the whole tensor's
        # scales: per channel over all tokens (row), tensorwise (tensor), 1 x B tiles of the sampled tokens (block)
        dy_t = dy_rows.t()
        dy_col_amax = None
        if recipe.granularity == "row":  # per channel over all tokens: the gathered dY's under sequence parallelism
            dy_col_amax = _amax(dy, dim=0) if self.grad_group is None else group_amax(dy, 0, self.grad_group)
        q_dyt = _quantize(dy_t, recipe, weight=False, amax=_sample_amax(recipe, dy_amax, dy_col_amax))
        x_t = self.x_rows.t()
        q_xt = _quantize(x_t, recipe, weight=False, amax=self.x_col_amax)
        values[_index("wgrad/underflow")] = torch.maximum(_fractions(dy_t, q_dyt)[0], _fractions(x_t, q_xt)[0])
        out_channels = self.out_channels
        values[_index("wgrad/rel_err")] = _product_error(_pick(dy_t, out_channels), _pick_q(q_dyt, out_channels),
                                                         _pick(x_t, in_channels), _pick_q(q_xt, in_channels))


def _pick_q(q: QTensor, index: Optional[torch.Tensor]) -> QTensor:
    """The rows `index` of a quantized operand with 1 x B (or tensor, or row) scales."""
    if index is None:
        return q
    scale = q.scale if q.granularity == "tensor" else q.scale.index_select(0, index)
    return QTensor(q.data.index_select(0, index), scale, q.granularity, q.block_size)


class _Probe:
    """`arm()` before a statistics step; the next forward that records autograd (a training forward, not
    evaluation or the no-grad first pass of activation recompute) is measured. `take()` returns the measured
    value tensors and forgets them; `take_last(n)` returns them by the arm() that armed each, so that a step that
    did not reach the unit (an MoE expert without tokens) leaves a gap, not a later step's values in its place."""

    def __init__(self):
        self.armed = False
        self.arms = 0  # arm() calls so far
        self._pending: List[Tuple[int, torch.Tensor]] = []  # (the arm() that armed it, values)

    def arm(self) -> None:
        self.armed = True
        self.arms += 1

    def _record(self, values: torch.Tensor) -> None:
        self._pending.append((self.arms, values))

    def take(self) -> List[torch.Tensor]:
        pending, self._pending = self._pending, []
        return [values for _, values in pending]

    def take_last(self, n: int) -> List[Optional[torch.Tensor]]:
        """The values of the last `n` arm() calls in order, None where that step did not reach the unit; forgets
        every value."""
        pending, self._pending = dict(self._pending), []
        return [pending.get(arm) for arm in range(self.arms - n + 1, self.arms + 1)]


class LinearProbe(_Probe):
    """One INT8 linear's health probe (`_Probe`): its forward and its backward are measured, one
    [len(STAT_NAMES)] fp32 tensor per armed step."""

    def observe_forward(self, input: torch.Tensor, weight: torch.Tensor, recipe: Int8Recipe,
                        smooth: bool = False, input_group=None, grad_group=None) -> ForwardRecord:
        """X's and W's statistics and fprop's error (device ops); returns the record for the backward.
        `smooth`: fprop runs on the smoothed operands (ops.smooth_swiglu), as the recipe's guard does.
        `input_group` / `grad_group`: the tensor-parallel group whose shards of X / of dY the GEMMs gather
        (sequence parallelism): tensorwise scales, and wgrad's per-channel ones, then come from the gathered
        tensor, as in the GEMMs."""
        self.armed = False
        x = input.detach().reshape(-1, input.shape[-1])
        w = weight.detach()
        values = torch.full((len(STAT_NAMES),), float("nan"), dtype=torch.float32, device=x.device)
        rows, dy_rows, dy_tokens = _sampled_tokens(x.shape[0], recipe, input_group, grad_group)
        out_channels = sample_channels(w.shape[0], recipe.block_size, w.device)
        x_rows, w_rows = x[rows], _pick(w, out_channels)
        x_amax, w_amax = _whole_amax(x, recipe, input_group), _amax(w)
        need_col_amax = recipe.granularity == "row" or smooth
        x_col_amax = None
        if need_col_amax:  # wgrad's X^T scales per channel over all tokens: the gathered X's under sequence parallelism
            x_col_amax = _amax(x, dim=0) if input_group is None else group_amax(x, 0, input_group)
        w_col_amax = _amax(w, dim=0) if need_col_amax else None
        q_x = _quantize(x_rows, recipe, weight=False, amax=_sample_amax(recipe, x_amax))
        q_w = _quantize(w_rows, recipe, weight=True, amax=_sample_amax(recipe, w_amax))
        for name, sample, q, amax in (("x", x_rows, q_x, x_amax), ("w", w_rows, q_w, w_amax)):
            i = _index(f"{name}/amax")
            values[i:i + 3] = distribution_stats(sample, amax)
            values[i + 3:i + 5] = _fractions(sample, q)
        fprop_underflow = torch.maximum(values[_index("x/underflow")], values[_index("w/underflow")])
        if smooth:
            s = smooth_scales(x_col_amax, w_col_amax)
            x_rows, w_rows = x_rows * (1.0 / s).to(x.dtype), w_rows * s.to(w.dtype)
            # the smoothed tensors' tensorwise amax, from the column maxima (a power-of-two scaling is exact)
            q_x = _quantize(x_rows, recipe, weight=False,
                            amax=_sample_amax(recipe, (x_col_amax * (1.0 / s).to(x.dtype)).amax()))
            q_w = _quantize(w_rows, recipe, weight=True, amax=_sample_amax(recipe, (w_col_amax * s.to(w.dtype)).amax()))
            fprop_underflow = torch.maximum(_fractions(x_rows, q_x)[0], _fractions(w_rows, q_w)[0])
        values[_index("fprop/rel_err")] = _product_error(x_rows, q_x, w_rows, q_w)
        values[_index("fprop/underflow")] = fprop_underflow
        self._record(values)
        x_t_amax = _sample_amax(recipe, x_amax, x_col_amax)
        return ForwardRecord(values, recipe, dy_rows, dy_tokens, x[rows].clone(), x_t_amax, out_channels, w_amax,
                             w_col_amax, grad_group)


def sample_heads(heads: int, device) -> torch.Tensor:
    """`SAMPLE_HEADS` query heads evenly spaced over `heads` (all of fewer), so that under GQA the sample meets as
    many key/value heads as it can: head i * heads // n of n = min(SAMPLE_HEADS, heads)."""
    n = min(SAMPLE_HEADS, heads)
    return torch.arange(n, device=device) * heads // n


class AttentionProbe(_Probe):
    """One INT8 attention's health probe (megatron.attention.SDPAttention, `_Probe`): its forward is measured
    (`ATTENTION_STATS`, module docstring)."""

    def observe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool,
                scale: float, config: Int8AttentionConfig) -> None:
        """q [b, h, sq, d], k and v [b, h_kv, sk, d] as `int8_attention` took them with `config`, `out` what it
        returned."""
        self.armed = False
        heads = sample_heads(q.shape[1], q.device)
        kv_heads = heads // (q.shape[1] // k.shape[1])
        rows = sample_rows(q.shape[2], 1)
        keys = rows.stop if causal else k.shape[2]  # the keys the sampled queries see
        k0 = k[0].detach()
        k_mean = k0.mean(dim=1, keepdim=True, dtype=torch.float32)  # over every token, as the op smooths K
        k_smooth = k0[kv_heads, :keys].float() - k_mean[kv_heads]  # [h, keys, d]: only the sample in fp32
        q_rows = q[0].detach()[heads, rows].float()  # [h, rows, d]
        v_rows = v[0].detach()[kv_heads, :keys].float()
        (q_int, q_scale), (k_int, k_scale) = score_operands(q_rows, k_smooth, config)
        with _exact_fp32_matmul():
            exact = scale * q_rows @ k_smooth.transpose(-1, -2)  # [h, rows, keys]
            approx = scale * (q_int * q_scale) @ (k_int * k_scale).transpose(-1, -2)
            masked = torch.zeros(exact.shape[1:], dtype=torch.bool, device=q.device)
            if causal:
                masked = torch.arange(keys, device=q.device)[None, :] > torch.arange(rows.start, rows.stop,
                                                                                      device=q.device)[:, None]
            o_fp32 = torch.softmax(exact.masked_fill(masked, float("-inf")), dim=-1) @ v_rows
        values = torch.stack([relative_error(approx.masked_fill(masked, 0.0), exact.masked_fill(masked, 0.0)),
                              relative_error(out[0].detach()[heads, rows].float(), o_fp32)])
        self._record(values)


def values_by_name(values: torch.Tensor) -> Dict[str, float]:
    """A probe's values (on the host) as {stat name: value}, NaN (not measured) left out."""
    return {name: float(v) for name, v in zip(STAT_NAMES, values.tolist()) if v == v}
