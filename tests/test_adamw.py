"""The precision-aware AdamW: state formats, the fused step's reference against float64, remainders, the
Triton kernel (under TRITON_INTERPRET=1) against the reference, the optimizer's state round trips, and the
errors on bad input."""
import math

import pytest
import torch
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

from megatron_int8.megatron.optimizer import PrecisionAwareAdamW
from megatron_int8.ops.adamw import (QBLOCK, AdamWScalars, BlockQuantized, adamw_step_reference, merge_remainder,
                                     new_moment, split_remainder, store_moment)

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
F32_EPS = 2.0 ** -24  # unit roundoff of fp32


def _heavy_tailed(n, scale, seed):
    """Random values with outliers (1% of them 100x larger), as gradients are."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * scale
    outliers = torch.rand(n, generator=gen) < 0.01
    return torch.where(outliers, x * 100, x)


# --- formats --------------------------------------------------------------------------------------------------

def _scale64(amax: float, sqrt: bool) -> float:
    """The format's scale computed in float64: the smallest power of two with amax / scale < 128 (256)."""
    if amax == 0:
        return 2.0 ** -126
    exponent = math.frexp(amax)[1] - 1  # amax in [2^e, 2^(e+1))
    return max(2.0 ** (exponent - (7 if sqrt else 6)), 2.0 ** -126)


@pytest.mark.parametrize("sqrt", [False, True])
def test_blockwise_quantization_bounds_and_exact_round_trip(sqrt):
    x = _heavy_tailed(5 * QBLOCK + 37, 1e-3, seed=1)
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
    x = torch.cat([_heavy_tailed(4096, 1.0, seed=2), torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38])])
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
    master = _heavy_tailed(n, 0.02, seed=3)
    param = master.clone()
    m, v = new_moment(n, dtypes[0], False, "cpu"), new_moment(n, dtypes[1], True, "cpu")
    for step in range(1, 6):
        grad = _heavy_tailed(n, 1e-3 * step, seed=10 + step)
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
    ours = _heavy_tailed(n, 0.02, seed=4)
    theirs = torch.nn.Parameter(ours.clone())
    opt = torch.optim.AdamW([theirs], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    m, v = new_moment(n, "fp32", False, "cpu"), new_moment(n, "fp32", True, "cpu")
    for step in range(1, 8):
        grad = _heavy_tailed(n, 1e-3, seed=20 + step)
        adamw_step_reference(ours, grad, m, v, AdamWScalars.of(**HYPER, step=step))
        theirs.grad = grad.clone()
        opt.step()
    # torch orders the fp32 operations differently: a few units of roundoff of the largest weights per step
    assert torch.allclose(ours, theirs.detach(), rtol=0, atol=7 * 8 * F32_EPS * float(ours.abs().max()))
    assert torch.allclose(m, opt.state[theirs]["exp_avg"], rtol=0, atol=7 * 4 * F32_EPS * float(m.abs().max()))


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_remainder_master_updates_equal_fp32_master_bit_for_bit(moments):
    n = 2 * QBLOCK + 11
    start = _heavy_tailed(n, 0.02, seed=5)
    master32 = start.clone()
    param32 = start.bfloat16()
    param16, remainder = split_remainder(start.clone())
    states = [(new_moment(n, moments, False, "cpu"), new_moment(n, moments, True, "cpu")) for _ in range(2)]
    for step in range(1, 11):
        grad = _heavy_tailed(n, 1e-3, seed=30 + step)
        scalars = AdamWScalars.of(**HYPER, step=step)
        adamw_step_reference(param32, grad, *states[0], scalars, master32)
        adamw_step_reference(param16, grad, *states[1], scalars, remainder)
        assert torch.equal(merge_remainder(param16, remainder).view(torch.int32), master32.view(torch.int32)), step
        tie = (master32.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(param16[~tie].view(torch.int16), param32[~tie].view(torch.int16)), step


# --- the Triton kernel --------------------------------------------------------------------------------------

@pytest.mark.skipif(INTERPRETING, reason="the driver runs in the parent session")
@pytest.mark.timeout(900)
def test_kernel_under_interpreter():
    pytest.importorskip("triton")
    run_file_interpreted(__file__, timeout=900)


MASTER_KINDS = ["param", "fp32", "remainder"]


def kernel_case(n, moments, master_kind, device, seed):
    """(param, grad, exp_avg, exp_avg_sq, master) with states after one reference step, on `device`."""
    weight = _heavy_tailed(n, 0.02, seed=seed)
    m, v = new_moment(n, moments[0], False, "cpu"), new_moment(n, moments[1], True, "cpu")
    store_moment(m, _heavy_tailed(n, 1e-3, seed=seed + 1))
    store_moment(v, _heavy_tailed(n, 1e-3, seed=seed + 2) ** 2)
    if master_kind == "param":
        param, master = weight, None
    elif master_kind == "fp32":
        param, master = weight.bfloat16(), weight.clone()
    else:
        param, master = split_remainder(weight.clone())
    grad = _heavy_tailed(n, 1e-3, seed=seed + 3)
    move = lambda x: x if x is None else x.to(device)  # noqa: E731
    moved = lambda s: BlockQuantized(s.codes.to(device), s.scales.to(device)) if isinstance(s, BlockQuantized) \
        else s.to(device)  # noqa: E731
    return move(param), move(grad), moved(m), moved(v), move(master)


def assert_kernel_matches_reference(kernel_out, reference_out, bf16_ulps: int):
    """fp32 values, INT8 codes and scales bit for bit; bf16 outputs within `bf16_ulps` (the interpreter's
    float -> bf16 conversion does not round to nearest even)."""
    for got, want in zip(kernel_out, reference_out):
        if want is None:
            continue
        if isinstance(want, BlockQuantized):
            assert torch.equal(got.codes.cpu(), want.codes) and torch.equal(got.scales.cpu(), want.scales)
        elif want.dtype == torch.bfloat16:
            distance = (got.cpu().view(torch.int16).int() - want.view(torch.int16).int()).abs().max()
            assert int(distance) <= bf16_ulps
        else:
            assert torch.equal(got.cpu(), want)


@needs_interpreter
@pytest.mark.parametrize("master_kind", MASTER_KINDS)
@pytest.mark.parametrize("moments", [("int8", "int8"), ("bf16", "bf16"), ("fp32", "int8")])
def test_kernel_matches_reference(moments, master_kind):
    from megatron_int8.kernels.adamw import triton_adamw_step

    n = 9 * QBLOCK + 77  # two programs, a partial block
    scalars = AdamWScalars.of(**HYPER, step=4)
    ref = kernel_case(n, moments, master_kind, "cpu", seed=40)
    out = kernel_case(n, moments, master_kind, "cpu", seed=40)
    adamw_step_reference(ref[0], ref[1], ref[2], ref[3], scalars, ref[4])
    parts = lambda s: (s.codes, s.scales) if isinstance(s, BlockQuantized) else (s, None)  # noqa: E731
    triton_adamw_step(out[0], out[1], *parts(out[2]), *parts(out[3]), out[4], **scalars.__dict__)
    assert_kernel_matches_reference(out, ref, bf16_ulps=1)


# --- the optimizer ------------------------------------------------------------------------------------------

def _optimizer(params, moments, remainders, master_weights=True):
    return PrecisionAwareAdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                               weight_decay=HYPER["weight_decay"], exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
                               master_weights=master_weights, store_param_remainders=remainders,
                               use_decoupled_grad=master_weights)


def _run_steps(opt, params, steps, seed):
    for step in range(steps):
        for i, p in enumerate(params):
            p.decoupled_grad = _heavy_tailed(p.numel(), 1e-3, seed=seed + 100 * step + i)
        opt.step()


def _shards(seed):
    return [_heavy_tailed(n, 0.02, seed=seed + n).bfloat16() for n in (300, 2 * QBLOCK)]


@pytest.mark.parametrize("moments,remainders", [("int8", True), ("bf16", False), ("fp32", True)])
def test_state_through_fp32_values_resumes_bit_for_bit(moments, remainders):
    """What megatron's DistributedOptimizer saves (get_unscaled_state: fp32) and loads (set_scaled_state)
    restores the states exactly, so the resumed steps equal the uninterrupted ones."""
    params = _shards(seed=50)
    whole = _optimizer(params, moments, remainders)
    _run_steps(whole, params, 3, seed=60)
    saved = {i: {k: whole.get_unscaled_state(p, k) for k in ("step", "exp_avg", "exp_avg_sq", "master_param")}
             for i, p in enumerate(params)}
    assert all(v.dtype == torch.float32 for s in saved.values() for v in s.values())
    resumed_params = [p.clone() for p in params]
    resumed = _optimizer(resumed_params, moments, remainders)
    for i, p in enumerate(resumed_params):
        p.zero_()  # the master weight sets the parameter too
        for key, value in saved[i].items():
            resumed.set_scaled_state(p, key, value)
    _run_steps(whole, params, 2, seed=70)
    _run_steps(resumed, resumed_params, 2, seed=70)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(whole.get_unscaled_state(p, key), resumed.get_unscaled_state(q, key)), key


def test_fp32_states_load_into_int8_and_back():
    params = _shards(seed=80)
    fp32 = _optimizer(params, "fp32", False)
    _run_steps(fp32, params, 3, seed=90)
    int8_params = [p.clone() for p in params]
    int8 = _optimizer(int8_params, "int8", True)
    int8.load_state_dict(fp32.state_dict())
    for p, q in zip(params, int8_params):
        state = int8.state[q]
        assert isinstance(state["exp_avg"], BlockQuantized) and state["master_param"].dtype == torch.int16
        want = BlockQuantized.quantize(fp32.state[p]["exp_avg"], sqrt=False)
        assert torch.equal(state["exp_avg"].codes, want.codes)
        assert torch.equal(int8.get_unscaled_state(q, "master_param"), fp32.state[p]["master_param"])
        assert float(state["step"]) == 3
    back_params = [p.clone() for p in int8_params]
    back = _optimizer(back_params, "fp32", False)
    back.load_state_dict(int8.state_dict())
    for p, q in zip(int8_params, back_params):
        assert torch.equal(back.state[q]["exp_avg"], int8.get_unscaled_state(p, "exp_avg"))
        assert torch.equal(back.state[q]["exp_avg_sq"], int8.get_unscaled_state(p, "exp_avg_sq"))


def test_fp32_params_are_their_own_master_weights():
    """Without --bf16 megatron's distributed optimizer hands over fp32 shards: the master weight is the shard
    itself (no copy), and the steps are those of the fp32-parameter mode."""
    shards = [_heavy_tailed(n, 0.02, seed=97 + n) for n in (300, 2 * QBLOCK)]
    plain = [torch.nn.Parameter(s.clone()) for s in shards]
    held = _optimizer(shards, "int8", False)
    free = _optimizer(plain, "int8", False, master_weights=False)
    for step in range(3):
        for i, (a, b) in enumerate(zip(shards, plain)):
            a.decoupled_grad = b.grad = _heavy_tailed(a.numel(), 1e-3, seed=200 + 10 * step + i)
        held.step()
        free.step()
    for a, b in zip(shards, plain):
        assert held.state[a]["master_param"].data_ptr() == a.data_ptr()
        assert torch.equal(a, b.detach())


def test_fp32_main_params_mode_saves_moments_in_the_parameters_shape():
    """Under megatron's Float16 optimizer the params are fp32 main params and its checkpoint maps each
    state to the parameter's shape: state_dict gives fp32 tensors of that shape, load_state_dict takes them."""
    param = torch.nn.Parameter(_heavy_tailed(6 * 50, 0.02, seed=95).view(6, 50))
    opt = _optimizer([param], "int8", False, master_weights=False)
    param.grad = _heavy_tailed(300, 1e-3, seed=96).view(6, 50)
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].shape == (6, 50) and saved["state"][0]["exp_avg"].dtype == torch.float32
    again = _optimizer([torch.nn.Parameter(param.detach().clone())], "int8", False, master_weights=False)
    again.load_state_dict(saved)
    state = again.state[again.param_groups[0]["params"][0]]
    assert torch.equal(state["exp_avg"].codes, opt.state[param]["exp_avg"].codes)


def test_bad_optimizer_input_fails_clearly():
    with pytest.raises(ValueError, match="needs bf16 parameters"):
        _optimizer([torch.zeros(10)], "int8", True)
    with pytest.raises(ValueError, match="exp_avg_dtype 'fp8'"):
        _optimizer([torch.zeros(10, dtype=torch.bfloat16)], "fp8", False)
    with pytest.raises(ValueError, match="needs master_weights"):
        _optimizer([torch.zeros(10)], "int8", True, master_weights=False)
    with pytest.raises(ValueError, match="updates fp32 parameters"):
        _optimizer([torch.zeros(10, dtype=torch.bfloat16)], "int8", False, master_weights=False)
    with pytest.raises(ValueError, match="Inf or NaN"):
        BlockQuantized.quantize(torch.tensor([1.0, float("nan")]), sqrt=False)


def _args(flags):
    from megatron_int8.training.args import parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "512"]
    return validate_args(parse_args(base + flags), world_size=2)


@pytest.mark.parametrize("flags,message", [
    (["--exp-avg-dtype", "int8"], "--exp-avg-dtype needs --use-precision-aware-optimizer"),
    (["--store-param-remainders", "--bf16"], "--store-param-remainders needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "int8", "--optimizer", "sgd"],
     "--optimizer sgd is not supported"),
    (["--use-precision-aware-optimizer", "--store-param-remainders", "--use-distributed-optimizer"], "needs --bf16"),
    (["--use-precision-aware-optimizer", "--store-param-remainders", "--bf16"], "needs --use-distributed-optimizer"),
    (["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], "--main-params-dtype fp16 is not supported"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], "need Transformer Engine"),
])
def test_bad_flags_fail_clearly(flags, message):
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        _args(flags)


def test_memory_per_parameter_counts_each_state():
    from megatron_int8.training.memory import bytes_per_parameter

    model = torch.nn.Linear(128, 64, bias=False)  # 8192 parameters, no INT8 linear
    args = _args(["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype",
                  "int8", "--exp-avg-sq-dtype", "bf16", "--store-param-remainders"])
    numel, rows = bytes_per_parameter(args, [model])
    assert numel == 8192
    assert dict(rows) == {"bf16 weight": 2.0, "main_grad (fp32)": 4.0, "master weight (int16 remainder)": 1.0,
                          "exp_avg (int8)": (1 + 4 / 128) / 2, "exp_avg_sq (bf16)": 1.0}  # DP 2 shards
    # the formula is what the optimizer allocates: one DP shard of the parameter
    shard = torch.zeros(numel // 2, dtype=torch.bfloat16)
    opt = _optimizer([shard], "int8", True)
    opt.exp_avg_sq_dtype = "bf16"
    opt.initialize_all_states()
    held = opt.state_nbytes()
    assert held["master_param"] / numel == dict(rows)["master weight (int16 remainder)"]
    assert held["exp_avg"] / numel == dict(rows)["exp_avg (int8)"]
    assert held["exp_avg_sq"] / numel == dict(rows)["exp_avg_sq (bf16)"]
    plain = _args(["--bf16"])
    assert dict(bytes_per_parameter(plain, [model])[1]) == {
        "bf16 weight": 2.0, "main_grad (fp32)": 4.0, "master weight (fp32)": 4.0, "exp_avg (fp32)": 4.0,
        "exp_avg_sq (fp32)": 4.0}

