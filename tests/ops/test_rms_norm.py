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
    """auto (the default): Triton for head-sized rows, torch's kernels over a hidden size."""
    monkeypatch.delenv(ENV_NORM_KERNEL, raising=False)
    assert FusedRMSNorm(128).use_triton and FusedRMSNorm(TRITON_MAX_WIDTH).use_triton
    assert not FusedRMSNorm(TRITON_MAX_WIDTH + 1).use_triton and not FusedRMSNorm(4096).use_triton
    monkeypatch.setenv(ENV_NORM_KERNEL, "torch")
    assert not FusedRMSNorm(128).use_triton
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
