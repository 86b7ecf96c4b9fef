"""Quantization health of one INT8 linear: the statistics of its operands and the error of its GEMMs.

Pure torch, computed only on statistics steps (the trainer's `--int8-stats-interval`): a `LinearProbe` is
armed for one step, measures the first training forward/backward that passes through its linear, and
keeps the results on the device until the trainer reads every probe at once (one host sync per log line).

Per operand (X: the input, W: the weight, dY: the output gradient), in `OPERAND_STATS` order:
  amax        max |v|
  crest       amax / RMS (RMS = sqrt(mean v^2)); about 4 for 4096 Gaussian values, large with outliers
  kurtosis    E[(v - mean)^4] / Var^2 (Pearson: 3 for a Gaussian, 1.8 uniform; heavy tails push it up)
  underflow   fraction of the nonzero elements that quantize to 0 (|v| <= half a step)
  saturation  fraction of the elements that quantize to +-127
underflow and saturation use the scales of the GEMM that reads the operand along its rows: X as fprop reads
it (per token with row scales), W as fprop reads it (per output channel), dY as dgrad reads it (per token).
Per GEMM (fprop, dgrad, wgrad), in `GEMM_STATS` order:
  rel_err     ||INT8 result - exact result||_F / ||exact result||_F on a sample of rows (`SAMPLE_ROWS`
              tokens); the INT8 result is the product of the dequantized operands as the recipe quantizes
              them (the INT32 GEMM with its fp32 epilogue computes the same up to fp32 rounding), the exact
              one the fp32 product of the unquantized operands (no TF32)
  underflow   the larger underflow of the GEMM's two operands, each under the scales that GEMM uses
              (dgrad: dY per token, W per input channel; wgrad: dY and X per channel, over the tokens)
wgrad contracts over the tokens: its error is that of the sampled tokens' partial sum, with the scales of
the whole tensors.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch

from ..recipe import QMAX, Int8Recipe
from ..reference import dequantize, quantize
from .smooth_swiglu import smoothed_fprop_operands

OPERANDS = ("x", "w", "dy")
OPERAND_STATS = ("amax", "crest", "kurtosis", "underflow", "saturation")
GEMMS = ("fprop", "dgrad", "wgrad")
GEMM_STATS = ("rel_err", "underflow")
# the flat order of a probe's values: int8_health/<layer>/<operand or GEMM>/<stat>
STAT_NAMES: Tuple[str, ...] = tuple(f"{op}/{s}" for op in OPERANDS for s in OPERAND_STATS) + tuple(
    f"{g}/{s}" for g in GEMMS for s in GEMM_STATS)
SAMPLE_ROWS = 256  # tokens whose products are compared against the exact ones


def _index(name: str) -> int:
    return STAT_NAMES.index(name)


def distribution_stats(x: torch.Tensor) -> torch.Tensor:
    """[amax, crest, kurtosis] of all of x's elements, fp32 on x's device (moments accumulated in fp32 from
    the centred values). An all-zero tensor has crest 0 and kurtosis NaN (no spread)."""
    v = x.detach().reshape(-1).float()
    if v.numel() == 0:
        raise ValueError("health statistics of an empty tensor")
    amax = v.abs().amax()
    rms = v.square().mean().sqrt()
    crest = torch.where(rms > 0, amax / rms, torch.zeros_like(rms))
    centred = v - v.mean()
    var = centred.square().mean()
    kurtosis = centred.square().square().mean() / var.square()  # 0/0 = NaN for a constant tensor
    return torch.stack([amax, crest, kurtosis])


def quantization_fractions(x2d: torch.Tensor, recipe: Int8Recipe, *, weight: bool) -> torch.Tensor:
    """[underflow, saturation] of x2d [rows, K] quantized as the recipe quantizes a GEMM operand along its
    rows (scales over the last axis; BxB tiles for a weight under block granularity), rounding to nearest."""
    q = _quantize(x2d, recipe, weight=weight).data
    nonzero = x2d != 0
    underflow = ((q == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)
    saturation = (q.abs() == QMAX).sum() / q.numel()
    return torch.stack([underflow, saturation]).float()


def _quantize(x2d: torch.Tensor, recipe: Int8Recipe, *, weight: bool, amax: Optional[torch.Tensor] = None):
    tile2d = weight and recipe.granularity == "block"
    return quantize(x2d.detach(), recipe.granularity, block_size=recipe.block_size, tile2d=tile2d,
                    check_finite="off", amax=amax)


def _rows_amax(x2d: torch.Tensor, recipe: Int8Recipe) -> Optional[torch.Tensor]:
    """The amax a quantization of some of x2d's rows needs to use the whole tensor's scales: the tensor's for
    tensorwise scales; None for row and block scales (each row, or tile of one row, has its own)."""
    return x2d.detach().abs().amax().float() if recipe.granularity == "tensor" else None


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


def gemm_relative_error(a_rows: torch.Tensor, b: torch.Tensor, recipe: Int8Recipe, *,
                        a_amax: Optional[torch.Tensor] = None, b_amax: Optional[torch.Tensor] = None,
                        b_is_weight: bool = False) -> torch.Tensor:
    """Relative error of Q(a_rows) Q(b)^T against a_rows b^T (both [., K], K the contraction axis).

    a_rows may be part of a larger operand: `a_amax` then carries the amax the larger operand's quantization
    gives a_rows (tensorwise: one scalar, `_rows_amax`; row-wise: one per row, when a row of a_rows is part
    of a longer one, as wgrad's sampled tokens are); likewise `b_amax` for b. `b_is_weight`: b is a weight,
    quantized in BxB tiles under block granularity."""
    qa = dequantize(_quantize(a_rows, recipe, weight=False, amax=a_amax))
    qb = dequantize(_quantize(b, recipe, weight=b_is_weight, amax=b_amax))
    with _exact_fp32_matmul():
        approx = qa @ qb.t()
        exact = a_rows.detach().float() @ b.detach().float().t()
    return relative_error(approx, exact)


def sample_rows(rows: int, block_size: int) -> slice:
    """The tokens whose products are checked: `SAMPLE_ROWS` (rounded up to whole blocks) contiguous rows from
    the middle of the tensor, starting on a multiple of the block size, so that the 1 x B tiles along the
    tokens that wgrad's operands get under block scales are whole; all rows of a smaller tensor."""
    count = -(-SAMPLE_ROWS // block_size) * block_size
    if rows <= count:
        return slice(0, rows)
    start = min(rows // 2, rows - count) // block_size * block_size
    return slice(start, start + count)


class ForwardRecord:
    """What a probed forward leaves for its backward: the values tensor, the number of input rows (tokens),
    the sampled rows and the amax wgrad's X^T operand gets from the whole input (see `_rows_amax`)."""

    def __init__(self, values: torch.Tensor, recipe: Int8Recipe, tokens: int, rows: slice, x_rows: torch.Tensor,
                 x_col_amax: Optional[torch.Tensor]):
        self.values, self.recipe, self.tokens = values, recipe, tokens
        self.rows, self.x_rows, self.x_col_amax = rows, x_rows, x_col_amax

    def observe_backward(self, grad_output: torch.Tensor, weight: torch.Tensor) -> None:
        """dY's statistics, and dgrad's and wgrad's errors and underflows (device ops, no sync). wgrad's are
        left out (NaN) where dY has other tokens than the probed X (a sequence-parallel shard of them)."""
        recipe, values = self.recipe, self.values
        dy = grad_output.detach().reshape(-1, grad_output.shape[-1])
        w = weight.detach()
        i = _index("dy/amax")
        values[i:i + 3] = distribution_stats(dy)
        values[i + 3:i + 5] = quantization_fractions(dy, recipe, weight=False)
        w_t = w.t()
        values[_index("dgrad/rel_err")] = gemm_relative_error(dy[sample_rows(dy.shape[0], recipe.block_size)], w_t,
                                                              recipe, a_amax=_rows_amax(dy, recipe), b_is_weight=True)
        values[_index("dgrad/underflow")] = torch.maximum(
            values[_index("dy/underflow")], quantization_fractions(w_t, recipe, weight=True)[0])
        if dy.shape[0] != self.tokens:
            values[_index("wgrad/underflow")] = float("nan")
            return
        # wgrad: dW = dY^T X over the sampled tokens, each operand [channels, tokens] with the whole tensor's
        # scales: per channel over all tokens (row), tensorwise (tensor), 1 x B tiles of the sampled tokens (block)
        dy_t_rows = dy[self.rows].t()
        dy_col_amax = dy.abs().amax(dim=0).float() if recipe.granularity == "row" else _rows_amax(dy, recipe)
        values[_index("wgrad/rel_err")] = gemm_relative_error(
            dy_t_rows, self.x_rows.t(), recipe, a_amax=dy_col_amax, b_amax=self.x_col_amax)
        values[_index("wgrad/underflow")] = torch.maximum(
            quantization_fractions(dy.t(), recipe, weight=False)[0], values[_index("wgrad/underflow")])


class LinearProbe:
    """One INT8 linear's health probe. `arm()` before a statistics step; the next forward that records
    autograd (a training forward, not evaluation or the no-grad first pass of activation recompute) is
    measured, and its backward too. `take()` returns the measured value tensors (one [len(STAT_NAMES)] fp32
    tensor per armed step, NaN where not measured) and forgets them."""

    def __init__(self):
        self.armed = False
        self._pending: List[torch.Tensor] = []

    def arm(self) -> None:
        self.armed = True

    def take(self) -> List[torch.Tensor]:
        pending, self._pending = self._pending, []
        return pending

    def observe_forward(self, input: torch.Tensor, weight: torch.Tensor, recipe: Int8Recipe,
                        smooth: bool = False) -> ForwardRecord:
        """X's and W's statistics and fprop's error (device ops); returns the record for the backward.
        `smooth`: fprop runs on the smoothed operands (`smoothed_fprop_operands`), as the recipe's guard does."""
        self.armed = False
        x = input.detach().reshape(-1, input.shape[-1])
        w = weight.detach()
        values = torch.full((len(STAT_NAMES),), float("nan"), dtype=torch.float32, device=x.device)
        for name, t, is_weight in (("x", x, False), ("w", w, True)):
            i = _index(f"{name}/amax")
            values[i:i + 3] = distribution_stats(t)
            values[i + 3:i + 5] = quantization_fractions(t, recipe, weight=is_weight)
        rows = sample_rows(x.shape[0], recipe.block_size)
        fx, fw = smoothed_fprop_operands(x, w) if smooth else (x, w)
        fprop_underflow = torch.maximum(values[_index("x/underflow")], values[_index("w/underflow")])
        if smooth:
            fprop_underflow = torch.maximum(quantization_fractions(fx, recipe, weight=False)[0],
                                            quantization_fractions(fw, recipe, weight=True)[0])
        values[_index("fprop/rel_err")] = gemm_relative_error(fx[rows], fw, recipe, a_amax=_rows_amax(fx, recipe),
                                                              b_is_weight=True)
        values[_index("fprop/underflow")] = fprop_underflow
        # wgrad's X^T operand: its underflow now (the whole X is at hand), its sampled rows for the backward
        values[_index("wgrad/underflow")] = quantization_fractions(x.t(), recipe, weight=False)[0]
        x_col_amax = x.abs().amax(dim=0).float() if recipe.granularity == "row" else _rows_amax(x, recipe)
        self._pending.append(values)
        return ForwardRecord(values, recipe, x.shape[0], rows, x[rows].clone(), x_col_amax)


def values_by_name(values: torch.Tensor) -> Dict[str, float]:
    """A probe's values (on the host) as {stat name: value}, NaN (not measured) left out."""
    return {name: float(v) for name, v in zip(STAT_NAMES, values.tolist()) if v == v}
