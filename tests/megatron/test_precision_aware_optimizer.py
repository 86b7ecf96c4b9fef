"""PrecisionAwareAdamW (megatron_int8/megatron/optimizer.py) as megatron's optimizers use it: states through
fp32 values resume bit for bit, fp32 states load into INT8 ones and back, fp32 parameters are their own
master weights, the Float16 optimizer's parameter-shaped state dict, and bad input."""
import pytest
import torch
from adamw_cases import HYPER, heavy_tailed

from megatron_int8.megatron.optimizer import PrecisionAwareAdamW
from megatron_int8.ops.adamw import QBLOCK, BlockQuantized


def _optimizer(params, moments, remainders, master_weights=True):
    return PrecisionAwareAdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                               weight_decay=HYPER["weight_decay"], exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
                               master_weights=master_weights, store_param_remainders=remainders,
                               use_decoupled_grad=master_weights)


def _run_steps(opt, params, steps, seed):
    for step in range(steps):
        for i, p in enumerate(params):
            p.decoupled_grad = heavy_tailed(p.numel(), 1e-3, seed=seed + 100 * step + i)
        opt.step()


def _shards(seed):
    return [heavy_tailed(n, 0.02, seed=seed + n).bfloat16() for n in (300, 2 * QBLOCK)]


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
    shards = [heavy_tailed(n, 0.02, seed=97 + n) for n in (300, 2 * QBLOCK)]
    plain = [torch.nn.Parameter(s.clone()) for s in shards]
    held = _optimizer(shards, "int8", False)
    free = _optimizer(plain, "int8", False, master_weights=False)
    for step in range(3):
        for i, (a, b) in enumerate(zip(shards, plain)):
            a.decoupled_grad = b.grad = heavy_tailed(a.numel(), 1e-3, seed=200 + 10 * step + i)
        held.step()
        free.step()
    for a, b in zip(shards, plain):
        assert held.state[a]["master_param"].data_ptr() == a.data_ptr()
        assert torch.equal(a, b.detach())


def test_fp32_main_params_mode_saves_moments_in_the_parameters_shape():
    """Under megatron's Float16 optimizer the params are fp32 main params and its checkpoint maps each
    state to the parameter's shape: state_dict gives fp32 tensors of that shape, load_state_dict takes them."""
    param = torch.nn.Parameter(heavy_tailed(6 * 50, 0.02, seed=95).view(6, 50))
    opt = _optimizer([param], "int8", False, master_weights=False)
    param.grad = heavy_tailed(300, 1e-3, seed=96).view(6, 50)
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].shape == (6, 50) and saved["state"][0]["exp_avg"].dtype == torch.float32
    again = _optimizer([torch.nn.Parameter(param.detach().clone())], "int8", False, master_weights=False)
    again.load_state_dict(saved)
    state = again.state[again.param_groups[0]["params"][0]]
    assert torch.equal(state["exp_avg"].codes, opt.state[param]["exp_avg"].codes)


def test_set_scaled_state_skips_megatrons_padding_flag_and_refuses_unknown_states():
    param = torch.zeros(300, dtype=torch.bfloat16)
    opt = _optimizer([param], "int8", True)
    opt.set_scaled_state(param, "padding", False)  # dp_reshardable's bucket bookkeeping
    assert not opt.state.get(param)
    with pytest.raises(KeyError, match="no state 'exp_avg_sqq'"):
        opt.set_scaled_state(param, "exp_avg_sqq", torch.zeros(300))


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
