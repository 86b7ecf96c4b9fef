"""Fused RoPE (megatron_int8.ops.rope) on CPU: the reference math against float64, the hook into megatron's
`apply_rope_fusion` path, and the trainer's flag. The Triton kernel runs in tests/test_kernels.py (under
the interpreter) and tests/test_kernels_gpu.py."""
import os

import pytest
import torch
from int8_bounds import assert_rope_close, heavy_tailed
from mcore_helpers import single_process_megatron

from megatron_int8.ops import rope
from megatron_int8.training.args import parse_args, transformer_config_from_args, validate_args
from repo_paths import CONFIGS

TINY_YAML = os.path.join(CONFIGS, "tiny.yaml")


def _angles(S, B, rot):
    return torch.rand(S, B, 1, rot) * 4096  # up to the angles of late positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rot,batch_freqs", [(16, False), (8, True)])
def test_reference_matches_float64(dtype, rot, batch_freqs):
    """rope_reference (the CPU path of fused_rope) on heavy-tailed data: one rounding of the float64
    value, dimensions past the rotary ones untouched; its autograd gradient is the transposed rotation."""
    S, B, H, D = 6, 2, 3, 16
    t = heavy_tailed(S, B, H, D, dtype=dtype).requires_grad_(True)
    freqs = _angles(S, B if batch_freqs else 1, rot)
    out = rope.fused_rope(t, freqs)
    assert_rope_close(out, t.detach(), freqs, False, "forward")
    grad = heavy_tailed(S, B, H, D, dtype=dtype)
    out.backward(grad)
    # the gradient of one rounding of fp32 math: the transposed rotation, rounded once more
    assert_rope_close(t.grad, grad, freqs, True, "backward", rounding_ulps=1.0)


def test_interleaved_pairs_rotate_adjacent_dimensions():
    """interleaved=True rotates each (even, odd) pair: the same as the half layout after permuting
    the dimensions [0, 2, 4, ..., 1, 3, 5, ...]."""
    S, B, H, D = 4, 1, 2, 8
    t = heavy_tailed(S, B, H, D)
    angles = _angles(S, 1, D // 2)
    half = rope.fused_rope(t[..., list(range(0, D, 2)) + list(range(1, D, 2))], torch.cat((angles, angles), -1))
    inter = rope.fused_rope(t, angles.repeat_interleave(2, dim=-1), interleaved=True)
    torch.testing.assert_close(inter[..., 0::2], half[..., :D // 2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(inter[..., 1::2], half[..., D // 2:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("freqs_shape,message", [
    ((5, 1, 1, 8), "freqs must be"),  # sequence length differs
    ((6, 3, 1, 8), "freqs must be"),  # batch neither 1 nor b
    ((6, 1, 1, 7), "must be even"),
    ((6, 1, 1, 18), "must be even and <="),
])
def test_rejects_mismatched_angles(freqs_shape, message):
    with pytest.raises(ValueError, match=message):
        rope.fused_rope(torch.randn(6, 2, 3, 16), torch.randn(*freqs_shape))


@pytest.fixture
def megatron_world():
    with single_process_megatron():
        yield


def test_megatron_fused_path_calls_it_and_matches_unfused(megatron_world):
    """After install(), megatron's apply_rotary_pos_emb with apply_rope_fusion=True runs fused_rope; its
    result and megatron's unfused one (bf16 cos/sin and bf16 products) agree within a few bf16 ulps."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert rope.install() and rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope
    assert rope.install()  # idempotent
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True)
    t = heavy_tailed(8, 2, 4, 16, dtype=torch.bfloat16)
    freqs = _angles(8, 1, 16)
    calls = []
    original = rope_utils.fused_apply_rotary_pos_emb
    rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        fused = rope_utils.apply_rotary_pos_emb(t, freqs, config=config)
    finally:
        rope_utils.fused_apply_rotary_pos_emb = original
    assert calls == [1]
    unfused = rope_utils.apply_rotary_pos_emb(t, freqs, config=TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4))
    assert_rope_close(fused, t, freqs, False, "fused via megatron")
    scale = t.double().abs()[..., :8] + t.double().abs()[..., 8:]
    scale = torch.cat((scale, scale), -1)
    assert ((fused.double() - unfused.double()).abs() <= 4 * 2.0 ** -8 * scale + 1e-6).all()


def _config(extra):
    args = validate_args(parse_args(["--config", TINY_YAML, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"] + extra), 1)
    return transformer_config_from_args(args)


def test_trainer_fuses_rope_unless_told_not_to():
    assert _config([]).apply_rope_fusion
    assert not _config(["--no-rope-fusion"]).apply_rope_fusion
    assert not _config(["--position-embedding-type", "learned_absolute"]).apply_rope_fusion
