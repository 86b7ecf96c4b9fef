"""INT8 attention's Triton kernels on a CUDA GPU: against the PyTorch path (the same quantization) and float64,
at seq 1024-4096 with GQA and head dims 64 and 128, with the default tiles; and the SNR of O, dQ, dK, dV
against float64 beside BF16 SDPA's (printed with -s).

    python3 -m pytest -q -s -m gpu tests/kernels/test_int8_attention_gpu.py

Skipped without CUDA (tests/conftest.py). The helpers (data, float64 attention, bounds) are tests/attention_cases.py.
"""
import math

import pytest
import torch
from attention_cases import (assert_kernels_match, assert_nan_shows, assert_within_bounds, attention_inputs, grads64,
                             int8_attention_bounds, megatron_layout, nan_value_inputs, run_path, snr_db)

from megatron_int8.ops.int8_attention import Int8AttentionConfig, int8_attention

pytestmark = pytest.mark.gpu
INT8_SCORES = Int8AttentionConfig(scores="int8")  # the faster, coarser scores; the BF16 default's tests follow


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


@pytest.mark.parametrize("heads,kv_heads,seq,dim,causal", [
    (8, 2, 1024, 128, True), (8, 8, 2048, 64, True), (16, 4, 4096, 128, True), (4, 1, 1000, 128, False),
    (8, 2, 1500, 64, True),  # ragged: not a multiple of any tile
])
def test_kernels_match_pytorch_path(heads, kv_heads, seq, dim, causal):
    q, k, v, do = attention_inputs(1, heads, kv_heads, seq, dim, seed=seq + dim, device="cuda")
    assert_kernels_match(q, k, v, do, causal, INT8_SCORES, f"h={heads}/{kv_heads} s={seq} d={dim}")


@pytest.mark.parametrize("config", [Int8AttentionConfig(), INT8_SCORES], ids=["bf16-scores", "int8-scores"])
def test_kernels_carry_a_nan_of_v_and_do(config):
    # tl.max may drop a NaN on the GPU: the block scales of V and dO take the NaN-keeping maximum
    o, _, _, dv = run_path(*nan_value_inputs(20, S=512, D=128, dtype=torch.bfloat16, device="cuda"), True, config,
                           "triton")
    assert_nan_shows(o, dv, f"kernels, scores {config.scores}")


@pytest.mark.parametrize("dim", [64, 128])
def test_kernels_within_quantization_bounds(dim):
    q, k, v, do = attention_inputs(2, 8, 2, 1024, dim, seed=dim, device="cuda")
    scale = 1 / math.sqrt(dim)
    got = run_path(q, k, v, do, True, INT8_SCORES, "triton")
    bounds = int8_attention_bounds(q, k, v, do, got[0], True, scale, INT8_SCORES)
    assert_within_bounds(got, grads64(q, k, v, do, True, scale), bounds, [torch.bfloat16] * 4, f"d={dim}")


def test_int8_attention_is_differentiable_through_the_api():
    """int8_attention's default backend on CUDA is the kernels; grads come back in the inputs' dtypes, and
    strided inputs (slices of a fused [b, s, h, d] qkv, as attention layers make) give the same result."""
    q, k, v, do = attention_inputs(2, 8, 2, 1024, 128, seed=3, device="cuda")
    want = run_path(q, k, v, do, True, None, "triton")
    qkv = torch.cat([q, k, v], dim=1).transpose(1, 2).contiguous().requires_grad_(True)  # [b, s, h, d]
    heads = qkv.transpose(1, 2)
    o = int8_attention(heads[:, :8], heads[:, 8:10], heads[:, 10:])
    assert heads[:, :8].stride(-1) == 1 and not heads[:, :8].is_contiguous()
    o.backward(do)
    grads = qkv.grad.transpose(1, 2)
    for x, y in zip([o.detach(), grads[:, :8], grads[:, 8:10], grads[:, 10:]], want):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y)


@pytest.mark.parametrize("seq", [1024, 4096])
def test_snr_against_fp64_beside_bf16_sdpa(seq):
    q, k, v, do = attention_inputs(1, 16, 4, seq, 128, seed=seq, device="cuda")
    exact = grads64(q, k, v, do, True, 1 / math.sqrt(128))
    got = run_path(q, k, v, do, True, INT8_SCORES, "triton")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    o.backward(do)
    bf16 = [o.detach()] + [t.grad for t in leaves]
    rows = [(n, snr_db(a, r), snr_db(b, r)) for n, a, b, r in zip(("O", "dQ", "dK", "dV"), got, bf16, exact)]
    print(f"\nseq {seq}, 16 query / 4 key-value heads, d 128")
    print("| tensor | INT8 SNR dB | BF16 SDPA SNR dB |\n|---|---|---|")
    print("\n".join(f"| {n} | {a:.1f} | {b:.1f} |" for n, a, b in rows))
    # The PyTorch path on CPU (4 query / 1 kv heads) measured 29.4, 24.1, 27.5, 29.2 dB at seq 1024 and 28.2, 22.7,
    # 24.9, 28.4 at 2048 with P per tile: ~1.3 dB less per doubling of the keys a query sees (dK 2.6). Floors: that
    # trend carried to `seq`, less 2 dB. With the forward's P at the fixed scale (c16b635): 29.6, 24.6, 26.6, 30.7
    # and 27.3, 23.9, 25.3, 28.1, above the floors by 1.1-3.5 dB; on an H200 (68462cf) the kernels gave 30.7, 27.3,
    # 28.1, 31.9 at 1024 and 27.2, 21.1, 23.0, 27.4 at 4096 with 16 / 4 heads (docs/numerics.md).
    doublings = math.log2(seq / 1024)
    floors = {"O": 27.4 - 1.3 * doublings, "dQ": 22.1 - 1.4 * doublings, "dK": 25.5 - 2.6 * doublings,
              "dV": 27.2 - 1.3 * doublings}
    assert all(a >= floors[n] for n, a, _ in rows), (rows, floors)


@pytest.mark.parametrize("seq,causal", [(1024, True), (1500, True), (1000, False)])
def test_bf16_scores_kernels_match_pytorch_path_and_gain(seq, causal):
    """scores="bf16": the kernels against the PyTorch path, and every tensor's SNR above the INT8 scores' (the
    PyTorch path on CPU gained 5.8-9.0 dB at seq 512, tests/kernels/test_int8_attention.py)."""
    cfg = Int8AttentionConfig(scores="bf16")  # its default tiles
    q, k, v, do = attention_inputs(1, 8, 2, seq, 128, seed=seq + 7, device="cuda")
    assert_kernels_match(q, k, v, do, causal, cfg, f"bf16 scores s={seq} causal={causal}")
    exact = grads64(q, k, v, do, causal, 1 / math.sqrt(128))
    int8 = [snr_db(a, r) for a, r in zip(run_path(q, k, v, do, causal, INT8_SCORES, "triton"), exact)]
    bf16 = [snr_db(a, r) for a, r in zip(run_path(q, k, v, do, causal, cfg, "triton"), exact)]
    print(f"\nseq {seq} causal={causal}: INT8 scores {[round(x, 1) for x in int8]}, BF16 {[round(x, 1) for x in bf16]}")
    assert all(b >= a + 4.0 for a, b in zip(int8, bf16)), (int8, bf16)


@pytest.mark.parametrize("scores", ["int8", "bf16"])
def test_kernels_match_pytorch_path_in_megatrons_layout(scores):
    """[s, b, h, d] tensors viewed as [b, h, s, d], batch 2, as Megatron's core attention hands them over."""
    q, k, v, do = (megatron_layout(t) for t in attention_inputs(2, 8, 2, 1024, 128, seed=21, device="cuda"))
    assert not k.is_contiguous()
    assert_kernels_match(q, k, v, do, True, Int8AttentionConfig(scores=scores),
                         f"[s, b, h, d] layout, {scores} scores")
