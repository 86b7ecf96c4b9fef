"""FusedRMSNorm (megatron_int8.ops.rms_norm) on CPU: torch's module there, bit for bit, with its parameter
and state-dict key; the kernel choice; the norm that the specs build. The Triton kernel itself runs in
tests/test_kernels.py (under the interpreter) and tests/test_kernels_gpu.py."""
from types import SimpleNamespace

import pytest
import torch
from int8_bounds import heavy_tailed

from megatron_int8.megatron.compat import SequenceParallelNorm
from megatron_int8.ops.rms_norm import ENV_NORM_KERNEL, TRITON_MAX_WIDTH, FusedRMSNorm


def test_cpu_forward_and_backward_are_torchs():
    """Off CUDA the module is torch.nn.RMSNorm: the same outputs and gradients, bit for bit."""
    x = heavy_tailed(3, 5, 24, dtype=torch.bfloat16)
    fused, plain = FusedRMSNorm(24, eps=1e-5, dtype=torch.bfloat16), torch.nn.RMSNorm(24, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        fused.weight.copy_(heavy_tailed(24, dtype=torch.bfloat16))
    plain.load_state_dict(fused.state_dict())
    dy = heavy_tailed(3, 5, 24, dtype=torch.bfloat16)
    outs = []
    for norm in (fused, plain):
        leaf = x.clone().requires_grad_(True)
        y = norm(leaf)
        y.backward(dy)
        outs.append((y, leaf.grad, norm.weight.grad))
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_state_dict_is_torchs():
    """Checkpoints interchange with torch's RMSNorm (and so with megatron's torch norms): one key, `weight`."""
    fused = FusedRMSNorm(16, eps=1e-6)
    assert list(fused.state_dict()) == ["weight"]
    plain = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        plain.weight.normal_()
    fused.load_state_dict(plain.state_dict())
    assert torch.equal(fused.weight, plain.weight)


def test_kernel_choice_from_the_environment(monkeypatch):
    """auto (the default): Triton for head-sized rows and INT8-copy norms, torch's kernels over a hidden size;
    torch: no Triton kernel (the INT8 copy made by the PyTorch reference)."""
    monkeypatch.delenv(ENV_NORM_KERNEL, raising=False)
    assert FusedRMSNorm(128).use_triton and FusedRMSNorm(TRITON_MAX_WIDTH).use_triton
    assert not FusedRMSNorm(TRITON_MAX_WIDTH + 1).use_triton and not FusedRMSNorm(4096).use_triton
    assert FusedRMSNorm(4096, int8_copy=True).use_triton  # the INT8 copy is made by the kernel at every width
    monkeypatch.setenv(ENV_NORM_KERNEL, "torch")
    assert not FusedRMSNorm(128).use_triton and not FusedRMSNorm(4096, int8_copy=True).use_triton
    monkeypatch.setenv(ENV_NORM_KERNEL, "triton")
    assert FusedRMSNorm(4096).use_triton
    monkeypatch.setenv(ENV_NORM_KERNEL, "apex")
    with pytest.raises(ValueError, match="MEGATRON_INT8_NORM_KERNEL='apex'"):
        FusedRMSNorm(8)


def test_rejects_multi_dimensional_shapes():
    with pytest.raises(ValueError, match="last dimension only"):
        FusedRMSNorm((4, 8))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_specs_build_the_fused_norm(sequence_parallel):
    """The norm that the INT8 and BF16 specs build without Transformer Engine is FusedRMSNorm for RMSNorm
    configs (torch's LayerNorm otherwise), its weight tagged for the sequence-parallel gradient reduction."""
    config = SimpleNamespace(layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False,
                             normalization="RMSNorm", sequence_parallel=sequence_parallel)
    norm = SequenceParallelNorm(config, 32, eps=1e-6)
    assert isinstance(norm, FusedRMSNorm) and norm.eps == 1e-6
    assert norm.weight.sequence_parallel is sequence_parallel
    config.normalization = "LayerNorm"
    assert type(SequenceParallelNorm(config, 32)) is torch.nn.LayerNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_copy_reference_keeps_int8_and_stays_within_the_quantization_bound(dtype):
    """FusedRMSNorm(int8_copy=True) on CPU: torch's forward; backward keeps the INT8 copy (1 x 128 blocks, W = 300:
    two full blocks and a partial one), the fp32 rstd and the weight; its gradients are float64's at the dequantized
    copy, and within the quantization step's bound of float64's at x."""
    from int8_bounds import assert_rms_norm_close, assert_rms_norm_int8_copy_bound

    from megatron_int8.ops.rms_norm import INT8_COPY_BLOCK
    from megatron_int8.reference import QTensor, dequantize, quantize

    W = 300
    x = heavy_tailed(4, 5, W, scale=40.0, dtype=dtype)
    norm = FusedRMSNorm(W, eps=1e-6, int8_copy=True, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_((torch.rand(W) + 0.5).to(dtype))
    leaf = x.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                   lambda t: t):
        y = norm(leaf)
    assert saved == [(torch.int8, (20, W)), (torch.float32, (20, 3)), (dtype, (W,)), (torch.float32, (20, 1))]
    assert torch.equal(y, torch.nn.functional.rms_norm(x, (W,), norm.weight.detach(), 1e-6))
    dy = heavy_tailed(4, 5, W, dtype=dtype)
    y.backward(dy)
    copy = quantize(x.reshape(-1, W).float(), "block", block_size=INT8_COPY_BLOCK)
    x_hat = dequantize(copy).view(x.shape)
    assert_rms_norm_close(x, norm.weight.detach(), 1e-6, dy, y.detach(), leaf.grad, norm.weight.grad, grad_at=x_hat)
    step = copy.scale.double().repeat_interleave(INT8_COPY_BLOCK, 1)[:, :W].view(x.shape)
    assert_rms_norm_int8_copy_bound(x, norm.weight.detach(), 1e-6, dy, leaf.grad, norm.weight.grad, x_hat, step)
    assert "int8_copy=True" in repr(norm)


def test_int8_copy_without_an_affine_weight_is_the_copy_with_unit_weight():
    """FusedRMSNorm(elementwise_affine=False, int8_copy=True) raised an AttributeError on the missing weight (in
    forward when x needed no gradient, in backward otherwise); its gradient is the one of a unit weight."""
    from int8_bounds import assert_rms_norm_int8_copy_bound

    from megatron_int8.ops.rms_norm import INT8_COPY_BLOCK
    from megatron_int8.reference import dequantize, quantize

    W = 200
    x, dy = heavy_tailed(6, W, scale=40.0), heavy_tailed(6, W)
    bare, unit = FusedRMSNorm(W, eps=1e-6, elementwise_affine=False, int8_copy=True), FusedRMSNorm(W, eps=1e-6,
                                                                                                  int8_copy=True)
    assert torch.equal(bare(x), unit(x).detach())
    grads = []
    for norm in (bare, unit):
        leaf = x.clone().requires_grad_(True)
        norm(leaf).backward(dy)
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    copy = quantize(x.float(), "block", block_size=INT8_COPY_BLOCK)
    step = copy.scale.double().repeat_interleave(INT8_COPY_BLOCK, 1)[:, :W]
    assert_rms_norm_int8_copy_bound(x, torch.ones(W), 1e-6, dy, grads[0], unit.weight.grad, dequantize(copy), step)


def test_int8_copy_follows_the_recipe_into_int8_layers_only():
    """The spec's input and pre-MLP norms keep the INT8 copy under Int8Recipe(int8_norm_input=True) in INT8
    layers, not in the BF16 baseline's, not by default, and never the q/k head norms; the flag sets the recipe
    option; LayerNorm models reject it."""
    import argparse

    from megatron.core.transformer.spec_utils import build_module
    from mcore_helpers import single_process_megatron, tiny_config

    from megatron_int8 import Int8Recipe
    from megatron_int8.megatron.cli import add_int8_arguments, policy_from_args
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    on = Int8Recipe(backend="reference", int8_norm_input=True)
    with single_process_megatron():
        config = tiny_config(qk_layernorm=True)
        for recipe, int8, want in ((on, True, True), (on, False, False), (Int8Recipe(), True, False)):
            layer = build_module(get_gpt_int8_layer_spec(recipe=recipe, int8=int8, qk_layernorm=True), config=config,
                                 layer_number=1)
            assert layer.input_layernorm.int8_copy is want and layer.pre_mlp_layernorm.int8_copy is want
            assert not layer.self_attention.q_layernorm.int8_copy
        with pytest.raises(ValueError, match="RMSNorm"):
            build_module(get_gpt_int8_layer_spec(recipe=on, normalization="LayerNorm"),
                         config=tiny_config(normalization="LayerNorm"), layer_number=1)
    assert on.describe() == "int8[row,fprop/dgrad/wgrad,norm-in:int8]"
    parser = add_int8_arguments(argparse.ArgumentParser())
    assert policy_from_args(parser.parse_args(["--int8-linear", "--int8-norm-input"])).recipe.int8_norm_input
