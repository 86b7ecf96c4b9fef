"""SwiGLU (megatron_int8.ops.swiglu) on CPU: the reference path against float64, the module megatron's MLP builds
from the spec, the trainer's config, and how the INT8 linear uses maxima attached to its operand. The
Triton kernels themselves run in tests/test_kernels.py (interpreter) and tests/test_kernels_gpu.py."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from int8_bounds import assert_swiglu_close, heavy_tailed
from mcore_helpers import build_layer_mlp, single_process_megatron, submodules_of, tiny_config

from megatron_int8 import Int8Recipe, int8_linear
from megatron_int8.reference import attach_amax, attach_maxima, known_maxima
from megatron_int8.ops.swiglu import SwiGLU, swiglu, swiglu_reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_forward_and_backward_against_float64(dtype):
    x = heavy_tailed(3, 7, 2 * 19, scale=12.0, dtype=dtype).requires_grad_(True)
    y = swiglu(x)
    dy = heavy_tailed(3, 7, 19, dtype=dtype)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype
    assert_swiglu_close(x.detach(), dy, y.detach(), x.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighted_reference_against_float64(dtype):
    """The weighted SwiGLU of the MoE experts (one router probability per row) on CPU: y, dx and the
    probabilities' gradient against float64."""
    from megatron_int8.ops.swiglu import weighted_swiglu

    x = heavy_tailed(21, 2 * 19, scale=12.0, dtype=dtype).requires_grad_(True)
    probs = torch.rand(21, dtype=torch.float32).requires_grad_(True)
    y = weighted_swiglu(x, probs)
    dy = heavy_tailed(21, 19, dtype=dtype)
    y.backward(dy)
    assert y.dtype == dtype and x.grad.dtype == dtype and probs.grad.dtype == torch.float32
    assert_swiglu_close(x.detach(), dy, y.detach(), x.grad, probs=probs.detach(), dprobs=probs.grad)
    with pytest.raises(ValueError, match="probs"):
        weighted_swiglu(x, probs[:-1])


def test_rejects_odd_last_dimension_and_bad_configs():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(4, 5))
    with pytest.raises(ValueError, match="gated_linear_unit"):
        SwiGLU(config=tiny_config(gated_linear_unit=False, activation_func=F.silu))
    with pytest.raises(ValueError, match="gated_linear_unit"):
        SwiGLU(config=tiny_config(gated_linear_unit=True, activation_func=F.gelu))


def test_integer_input_is_refused_not_truncated():
    """An integer x gave silu(a) * b truncated to integers (the fp32 result cast back to x's dtype)."""
    from megatron_int8.ops.swiglu import weighted_swiglu

    x = torch.tensor([[3, -2, 5, 7]])
    with pytest.raises(TypeError, match="x must be floating point, got torch.int64"):
        swiglu(x)
    with pytest.raises(TypeError, match="x must be floating point, got torch.int64"):
        weighted_swiglu(x, torch.ones(1))


def test_known_maxima_follow_the_tensor():
    """Maxima recorded on a tensor are found on that object while it is unchanged, never on a reshaped view
    or after an in-place change; mismatched shapes are rejected."""
    t = heavy_tailed(6, 4)
    rows, cols = t.abs().amax(1), t.abs().amax(0)
    attach_maxima(t, rows, cols)
    assert known_maxima(t).rows is rows
    assert known_maxima(t.view(4, 6)) is None and known_maxima(t.clone()) is None
    t.mul_(2)
    assert known_maxima(t) is None
    with pytest.raises(ValueError, match="do not match"):
        attach_maxima(t, cols, rows)
    amax = t.abs().amax()
    attach_amax(t, amax)
    assert known_maxima(t).amax is amax and known_maxima(t).rows is None and known_maxima(t.view(4, 6)) is None
    for bad in (amax.reshape(1), amax.double()):
        with pytest.raises(ValueError, match="0-d float32"):
            attach_amax(t, bad)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_int8_linear_uses_an_attached_amax_tensorwise_only(granularity):
    """An amax attached to the output gradient (as the fused QKV split hands it over) replaces the gradient's
    own under tensorwise quantization: the exact amax gives the plain result, a 2x one changes the input and
    weight gradients. Row-wise quantization needs per-row maxima, so it ignores a lone amax (same result
    either way)."""
    recipe = Int8Recipe(granularity=granularity, backend="reference")
    x, w, g = heavy_tailed(16, 24), heavy_tailed(8, 24) / 4, heavy_tailed(16, 8)

    def run(factor):
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        out = int8_linear(xi, wi, None, recipe)
        gi = g.clone()
        if factor is not None:
            attach_amax(gi, g.abs().amax() * factor)
        out.backward(gi)
        return xi.grad, wi.grad

    plain = run(None)
    for got, want in zip(run(1.0), plain):
        assert torch.equal(got, want)
    scaled = run(2.0)
    for got, want in zip(scaled, plain):
        assert torch.equal(got, want) == (granularity == "row")


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_int8_linear_uses_attached_maxima(granularity):
    """The linear quantizes its input and its output gradient with the attached maxima: exact maxima give
    the result of quantizing without them; larger ones (here 2x) give coarser scales, so the outputs
    differ, which shows they are used; after an in-place change they are ignored."""
    recipe = Int8Recipe(granularity=granularity, backend="reference")
    x, w, g = heavy_tailed(16, 24), heavy_tailed(8, 24) / 4, heavy_tailed(16, 8)

    def run(attach):
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        inp = xi * 1  # a non-leaf, as an activation is
        if attach is not None:
            attach_maxima(inp, x.abs().amax(1) * attach, x.abs().amax(0) * attach)
        out = int8_linear(inp, wi, None, recipe)
        out.backward(g)
        return out, xi.grad, wi.grad

    plain = run(None)
    for got, want in zip(run(1.0), plain):
        assert torch.equal(got, want)
    coarse = run(2.0)
    assert not torch.equal(coarse[0], plain[0]) and not torch.equal(coarse[2], plain[2])
    # dgrad does not read the input's scales: the input gradient is the same
    assert torch.equal(coarse[1], plain[1])


def test_mlp_builds_the_swiglu_module_and_matches_megatrons():
    """With config.use_te_activation_func (as the trainer sets it for dense SwiGLU models), megatron's MLP from
    the INT8 spec runs megatron_int8's SwiGLU (emit_maxima for INT8 row-wise linears, not for BF16); its
    outputs and gradients equal those of megatron's own SwiGLU path up to bf16 rounding of the activation."""
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    with single_process_megatron():
        ours = tiny_config(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                           use_te_activation_func=True, bias_activation_fusion=False)
        theirs = dataclasses.replace(ours, use_te_activation_func=False)
        for int8, emit in ((True, True), (False, False)):
            spec = get_gpt_int8_layer_spec(recipe=Int8Recipe(backend="reference"), int8=int8).submodules.mlp
            torch.manual_seed(0)
            mlp = build_layer_mlp(spec, config=ours)
            torch.manual_seed(0)
            stock = build_layer_mlp(spec, config=theirs)
            assert isinstance(mlp.activation_func, SwiGLU) and mlp.activation_func.emit_maxima == emit
            assert not isinstance(stock.activation_func, SwiGLU)
            x = heavy_tailed(8, 2, ours.hidden_size)
            outs = []
            for m in (mlp, stock):
                xi = x.clone().requires_grad_(True)
                out, _ = m(xi)
                out.backward(torch.ones_like(out))
                outs.append((out, xi.grad))
            for got, want in zip(*outs):
                torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_trainer_config_opens_the_activation_slot_for_dense_swiglu():
    from megatron_int8.training.args import parse_args, transformer_config_from_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--mock-data", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--train-iters", "1",
            "--lr", "1e-4"]

    def config(*extra):
        args = parse_args(base + list(extra))
        validate_args(args, 1)
        return transformer_config_from_args(args, use_cpu_initialization=True)

    dense = config("--swiglu")
    assert dense.use_te_activation_func and not dense.bias_activation_fusion
    assert not config("--swiglu", "--no-fused-swiglu").use_te_activation_func
    assert not config().use_te_activation_func  # GELU
    moe = config("--swiglu", "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--disable-bias-linear")
    assert not moe.use_te_activation_func


def test_mlp_with_the_swiglu_module_saves_the_same_checkpoint_keys():
    """The module has no state: the MLP's (sharded) state dict keys are those of megatron's own SwiGLU path,
    so checkpoints interchange."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    with single_process_megatron():
        metadata = ensure_metadata_has_dp_cp_group(None)
        ours = tiny_config(use_te_activation_func=True, bias_activation_fusion=False)
        theirs = dataclasses.replace(ours, use_te_activation_func=False)
        spec = get_gpt_int8_layer_spec(recipe=Int8Recipe(backend="reference")).submodules.mlp
        mlps = [build_layer_mlp(spec, config=c) for c in (ours, theirs)]
        assert list(mlps[0].state_dict()) == list(mlps[1].state_dict())
        keys = [sorted(m.sharded_state_dict(prefix="mlp.", metadata=metadata)) for m in mlps]
        assert keys[0] == keys[1] and "mlp.linear_fc1.weight" in keys[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_copy_reference_keeps_int8_and_stays_within_the_quantization_bound(dtype):
    """swiglu(int8_copy=True) on CPU: the same forward; backward keeps only the INT8 copy (1 x 128 blocks of each
    half, F = 200: a full and a partial block) and its gradient is float64's at the dequantized copy, and within
    the quantization step's bound of float64's at x."""
    from int8_bounds import assert_swiglu_int8_copy_bound

    from megatron_int8.ops.swiglu import INT8_COPY_BLOCK, dequantize_halves, int8_copy_of_halves

    S, B, F = 3, 5, 200
    x = heavy_tailed(S, B, 2 * F, scale=40.0, dtype=dtype).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        y = swiglu(x, int8_copy=True)
    assert saved == [(torch.int8, S * B * 2 * F), (torch.float32, S * B * 4)]
    assert torch.equal(y, swiglu(x.detach()))
    dy = heavy_tailed(S, B, F, dtype=dtype)
    y.backward(dy)
    q, scales = int8_copy_of_halves(x.detach())
    x_hat = dequantize_halves(q, scales).view(x.shape)
    assert_swiglu_close(x.detach(), dy, y.detach(), x.grad, grad_at=x_hat)
    step = torch.cat([scales[:, i * 2:(i + 1) * 2].double().repeat_interleave(INT8_COPY_BLOCK, 1)[:, :F]
                      for i in (0, 1)], 1).view(x.shape)
    assert_swiglu_int8_copy_bound(x.detach(), dy, x.grad, x_hat, step)


def test_int8_copy_follows_the_recipe_into_int8_layers_only():
    """The spec's SwiGLU keeps the INT8 copy under Int8Recipe(int8_swiglu_input=True) in INT8 layers, not in the
    BF16 baseline's, not by default; the flag sets the recipe option and the precision summary names it."""
    import argparse

    from megatron_int8.megatron.cli import add_int8_arguments, policy_from_args
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    on = Int8Recipe(backend="reference", int8_swiglu_input=True)
    for recipe, int8, want in ((on, True, True), (on, False, False), (Int8Recipe(), True, False)):
        spec = submodules_of(get_gpt_int8_layer_spec(recipe=recipe, int8=int8).submodules.mlp).activation_func
        assert spec.params["int8_copy"] is want
    assert SwiGLU(int8_copy=True).int8_copy and on.describe() == "int8[row,fprop/dgrad/wgrad,swiglu-in:int8]"
    parser = add_int8_arguments(argparse.ArgumentParser())
    assert policy_from_args(parser.parse_args(["--int8-linear", "--int8-swiglu-input"])).recipe.int8_swiglu_input
    assert not policy_from_args(parser.parse_args(["--int8-linear"])).recipe.int8_swiglu_input
    with pytest.raises(TypeError, match="int8_swiglu_input"):
        Int8Recipe(int8_swiglu_input=1)


def test_int8_swiglu_input_without_the_swiglu_module_is_an_error():
    """A model whose MLPs would not run the SwiGLU module (megatron's own SwiGLU, MoE experts) rejects the option
    instead of ignoring it; with the module slot open it builds."""
    from megatron_int8.megatron.policy import Int8Policy
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    policy = Int8Policy(recipe=Int8Recipe(int8_swiglu_input=True))
    with single_process_megatron():
        for config in (tiny_config(), tiny_config(use_te_activation_func=True, bias_activation_fusion=False,
                                                  num_moe_experts=4, moe_ffn_hidden_size=32)):
            with pytest.raises(ValueError, match="--int8-swiglu-input"):
                get_gpt_int8_block_spec(config, policy)
        config = tiny_config(use_te_activation_func=True, bias_activation_fusion=False)
        assert get_gpt_int8_block_spec(config, policy).layer_specs
