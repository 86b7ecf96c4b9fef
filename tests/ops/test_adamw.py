"""The precision-aware AdamW's state formats and its fused step's PyTorch reference (megatron_int8/ops/adamw.py):
INT8 block quantization bounds and exact round trips, remainders bit for bit, the step against a float64
AdamW with the same quantization and against torch's AdamW."""
import math

import pytest
import torch
from adamw_cases import F32_EPS, HYPER, heavy_tailed

from megatron_int8.ops.adamw import (QBLOCK, AdamWScalars, BlockQuantized, adamw_step_reference, merge_remainder,
                                     new_moment, split_remainder)


# --- formats --------------------------------------------------------------------------------------------------

def _scale64(amax: float, sqrt: bool) -> float:
    """The format's scale computed in float64: the smallest power of two with amax / scale < 128 (256)."""
    if amax == 0:
        return 2.0 ** -126
    exponent = math.frexp(amax)[1] - 1  # amax in [2^e, 2^(e+1))
    return max(2.0 ** (exponent - (7 if sqrt else 6)), 2.0 ** -126)


@pytest.mark.parametrize("sqrt", [False, True])
def test_blockwise_quantization_bounds_and_exact_round_trip(sqrt):
    x = heavy_tailed(5 * QBLOCK + 37, 1e-3, seed=1)
    x[QBLOCK:2 * QBLOCK] = 0  # an all-zero block
    x[3 * QBLOCK + 5] = 0  # a zero in a nonzero block
    values = x * x if sqrt else x
    q = BlockQuantized.quantize(values, sqrt=sqrt)
    assert q.codes.dtype == (torch.uint8 if sqrt else torch.int8) and q.scales.numel() == 6
    stored = q.dequantize().sqrt() if sqrt else q.dequantize()
    target = x.abs() if sqrt else x
    for b in range(6):
        block = slice(b * QBLOCK, (b + 1) * QBLOCK)
        amax = float(target[block].abs().max())
        assert float(q.scales[b]) == _scale64(amax, sqrt), b
        scale = float(q.scales[b])
        error = (stored[block] - target[block]).abs()
        qmax = 255 if sqrt else 127
        clamped = target[block].abs() / scale > qmax
        if sqrt and amax > 0:  # raised to the floor of one step: within a step
            clamped |= target[block] < scale / 2
        # half a step where rounded to nearest; a clamped value (amax / scale in (qmax, qmax + 1)) within a step
        assert bool((error[~clamped] <= scale / 2).all()) and bool((error[clamped] <= scale).all()), b
        if sqrt and amax > 0:
            assert bool((q.codes[block] >= 1).all())  # the floor: no sqrt(v) stored as 0 in a nonzero block
    assert bool((q.codes[QBLOCK:2 * QBLOCK] == 0).all())
    again = BlockQuantized.quantize(q.dequantize(), sqrt=sqrt)  # power-of-two scales: exact
    assert torch.equal(again.codes, q.codes) and torch.equal(again.scales, q.scales)


def test_remainders_reconstruct_fp32_bit_for_bit():
    x = torch.cat([heavy_tailed(4096, 1.0, seed=2), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38])])
    bits = x.view(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000  # exact ties between two bf16 values
    x = torch.cat([x, ties.view(torch.float32)])
    high, remainder = split_remainder(x)
    assert high.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(merge_remainder(high, remainder).view(torch.int32), x.view(torch.int32))
    # the high half is the nearest bf16; on exact ties away from zero where a cast rounds to even
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(high[~tie].view(torch.int16), x[~tie].bfloat16().view(torch.int16))
    assert bool((high[tie].float().abs() > x[tie].abs()).all())


# --- the reference step against float64 ----------------------------------------------------------------------

def _quantize64(values: torch.Tensor, sqrt: bool) -> torch.Tensor:
    """The format's stored values (dequantized), computed in float64."""
    out = torch.empty_like(values)
    qmax = 255 if sqrt else 127
    for start in range(0, values.numel(), QBLOCK):
        block = values[start:start + QBLOCK]
        amax = float(block.abs().max())
        scale = _scale64(amax, sqrt)
        codes = torch.round(block / scale).clamp(0 if sqrt else -qmax, qmax)
        if sqrt and amax > 0:
            codes = codes.clamp(min=1)
        out[start:start + QBLOCK] = codes * scale
    return out


@pytest.mark.parametrize("dtypes", [("int8", "int8"), ("bf16", "int8"), ("fp32", "fp32")])
def test_reference_step_matches_float64_adamw_with_the_same_quantization(dtypes):
    """Each step from the reference's stored states: the update in float64 vs the reference's fp32, and
    the stored moments vs float64's values quantized the same way. Bounds: fp32 arithmetic (a few units
    of roundoff) on the master; on the moments one step of the format where float64 and fp32 round
    differently at a boundary, and half a step plus roundoff from the exact value."""
    n = 3 * QBLOCK + 50
    master = heavy_tailed(n, 0.02, seed=3)
    param = master.clone()
    m, v = new_moment(n, dtypes[0], False, "cpu"), new_moment(n, dtypes[1], True, "cpu")
    for step in range(1, 6):
        grad = heavy_tailed(n, 1e-3 * step, seed=10 + step)
        m64 = _stored64(m).double()
        v64 = _stored64(v).double()
        p64 = param.double()
        s = HYPER
        terms = s["beta1"] * m64.abs() + (1 - s["beta1"]) * grad.double().abs()  # what fp32 rounds relative to
        m64 = s["beta1"] * m64 + (1 - s["beta1"]) * grad.double()
        v64 = s["beta2"] * v64 + (1 - s["beta2"]) * grad.double() ** 2
        bc1, bc2 = 1 - s["beta1"] ** step, 1 - s["beta2"] ** step
        update = (s["lr"] / bc1) * m64 / (v64.sqrt() / math.sqrt(bc2) + s["eps"])
        p64 = p64 * (1 - s["lr"] * s["weight_decay"]) - update
        adamw_step_reference(param, grad, m, v, AdamWScalars.of(**HYPER, step=step))
        bound = 8 * F32_EPS * (p64.abs() + update.abs())
        assert bool(((param.double() - p64).abs() <= bound).all()), step
        for moment, exact, sqrt, size in ((m, m64, False, terms), (v, v64, True, v64)):
            stored = _stored64(moment).double()
            if isinstance(moment, BlockQuantized):
                scales = moment.scales.double().repeat_interleave(QBLOCK)[:n]
                target = exact.sqrt() if sqrt else exact
                got = stored.sqrt() if sqrt else stored
                same_format = _quantize64(target, sqrt)
                assert bool(((got - same_format).abs() <= scales + 4 * F32_EPS * target.abs()).all()), step
                mismatched = (got - same_format).abs() > 4 * F32_EPS * target.abs()
                assert float(mismatched.double().mean()) < 0.01, step  # only at rounding boundaries
                floor = sqrt & (target < scales / 2)
                assert bool(((got - target).abs()[~floor] <= scales[~floor] + 4 * F32_EPS * target[~floor]).all())
            else:
                unit = 2.0 ** -8 if moment.dtype == torch.bfloat16 else 4 * F32_EPS
                assert bool(((stored - exact).abs() <= unit * exact.abs() + 4 * F32_EPS * size).all()), step


def _stored64(moment):
    return moment.dequantize() if isinstance(moment, BlockQuantized) else moment.float()


def test_fp32_states_step_like_torch_adamw():
    n = 1000
    ours = heavy_tailed(n, 0.02, seed=4)
    theirs = torch.nn.Parameter(ours.clone())
    opt = torch.optim.AdamW([theirs], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    m, v = new_moment(n, "fp32", False, "cpu"), new_moment(n, "fp32", True, "cpu")
    for step in range(1, 8):
        grad = heavy_tailed(n, 1e-3, seed=20 + step)
        adamw_step_reference(ours, grad, m, v, AdamWScalars.of(**HYPER, step=step))
        theirs.grad = grad.clone()
        opt.step()
    # torch orders the fp32 operations differently: a few units of roundoff of the largest weights per step
    assert torch.allclose(ours, theirs.detach(), rtol=0, atol=7 * 8 * F32_EPS * float(ours.abs().max()))
    assert torch.allclose(m, opt.state[theirs]["exp_avg"], rtol=0, atol=7 * 4 * F32_EPS * float(m.abs().max()))


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_remainder_master_updates_equal_fp32_master_bit_for_bit(moments):
    n = 2 * QBLOCK + 11
    start = heavy_tailed(n, 0.02, seed=5)
    master32 = start.clone()
    param32 = start.bfloat16()
    param16, remainder = split_remainder(start.clone())
    states = [(new_moment(n, moments, False, "cpu"), new_moment(n, moments, True, "cpu")) for _ in range(2)]
    for step in range(1, 11):
        grad = heavy_tailed(n, 1e-3, seed=30 + step)
        scalars = AdamWScalars.of(**HYPER, step=step)
        adamw_step_reference(param32, grad, *states[0], scalars, master32)
        adamw_step_reference(param16, grad, *states[1], scalars, remainder)
        assert torch.equal(merge_remainder(param16, remainder).view(torch.int32), master32.view(torch.int32)), step
        tie = (master32.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(param16[~tie].view(torch.int16), param32[~tie].view(torch.int16)), step
