"""Grouped INT8 MoE experts (grouped_linear.py, experts.py) against the per-expert INT8 linears and float64.

The grouped op promises the per-expert linears' exact values: per-token scales do not depend on the
grouping, per-expert column scales are computed over each expert's own tokens, and the alignment rows
are zeros. So outputs and gradients must be bit-identical to `int8_linear` per expert, and within the
row-wise quantization bound of the float64 product.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from megatron_int8.grouped_linear import grouped_int8_linear, stacked_quantized_weights
from megatron_int8.linear import int8_linear
from megatron_int8.quantize import Segments
from megatron_int8.recipe import Int8Recipe
from mcore_helpers import assert_layers_bit_identical, outlier_tensor, qgemm_bound, single_process_megatron, \
    tiny_config

ROW = Int8Recipe(granularity="row", backend="reference")
COUNTS = [37, 0, 130, 5]  # an empty expert, one spanning two aligned strips, ragged counts


def _aligned(parts, segments):
    """The experts' token blocks placed in the aligned layout (zero rows between them)."""
    x = parts[0].new_zeros((segments.rows, parts[0].shape[1]))
    for e, p in enumerate(parts):
        lo = segments.offsets[e]
        x[lo:lo + p.shape[0]] = p
    return x


def _per_expert(x, segments, counts):
    return [x[segments.offsets[e]:segments.offsets[e] + c] for e, c in enumerate(counts)]


def test_segments_layout_and_errors():
    seg = Segments.for_counts(COUNTS)
    assert seg.offsets == (0, 128, 128, 384, 512) and seg.rows == 512 and seg.num_segments == 4
    assert seg.strip_experts(torch.device("cpu")).tolist() == [0, 2, 2, 3]
    assert seg.strip_offsets(torch.device("cpu")).tolist() == [0, 1, 1, 3, 4]
    for bad in ((1, 128), (0, 100), (0, 256, 128)):
        with pytest.raises(ValueError):
            Segments(bad)
    with pytest.raises(ValueError):
        Segments.for_counts([3, -1])


def _tokens(counts, K, gen):
    return [outlier_tensor(c, K, generator=gen) if c else torch.zeros(0, K) for c in counts]


def _experts(gen, E, N, K):
    return [outlier_tensor(N, K, generator=gen).mul_(0.05).requires_grad_(True) for _ in range(E)]


def test_grouped_linear_equals_per_expert_linears_and_fp64_bound():
    gen = torch.Generator().manual_seed(3)
    K, N = 48, 40
    seg = Segments.for_counts(COUNTS)
    xs = _tokens(COUNTS, K, gen)
    gs = _tokens(COUNTS, N, gen)
    ws = _experts(gen, len(COUNTS), N, K)

    x = _aligned(xs, seg).requires_grad_(True)
    out = grouped_int8_linear(x, seg, ws, ROW)
    out.backward(_aligned(gs, seg))
    grouped_dw = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None

    for e, (xe, ge, we) in enumerate(zip(xs, gs, ws)):
        lo = seg.offsets[e]
        xe = xe.clone().requires_grad_(True)
        ye = int8_linear(xe, we, recipe=ROW)
        ye.backward(ge)
        assert torch.equal(out[lo:lo + xe.shape[0]], ye), e
        assert torch.equal(x.grad[lo:lo + xe.shape[0]], xe.grad), e
        assert torch.equal(grouped_dw[e], we.grad), e
        if xe.shape[0]:  # within the row-wise bound of the exact product (fresh outlier data)
            exact = xe.double() @ we.double().T
            bound = qgemm_bound(xe.double(), we.detach().double(), granularity="row")
            assert ((ye.double() - exact).abs() <= bound).all()
    # the alignment rows stay zero in both directions, and the empty expert's gradient is zero
    pad = torch.ones(seg.rows, dtype=torch.bool)
    for e, c in enumerate(COUNTS):
        pad[seg.offsets[e]:seg.offsets[e] + c] = False
    assert (out[pad] == 0).all() and (x.grad[pad] == 0).all()
    assert torch.equal(grouped_dw[1], torch.zeros_like(grouped_dw[1]))
    assert all(g.abs().sum() > 0 for e, g in enumerate(grouped_dw) if COUNTS[e])


def test_grouped_wgrad_accumulates_into_main_grad():
    gen = torch.Generator().manual_seed(4)
    K, N = 32, 24
    counts = [20, 140]
    seg = Segments.for_counts(counts)
    ws = _experts(gen, 2, N, K)
    for w in ws:
        w.main_grad = torch.full_like(w, 0.5)
        w.grad_added_to_main_grad = False
    x = _aligned(_tokens(counts, K, gen), seg)
    g = _aligned(_tokens(counts, N, gen), seg)
    grouped_int8_linear(x, seg, ws, ROW, fuse_wgrad=True).backward(g)
    assert all(w.grad_added_to_main_grad for w in ws)
    plain = [w.detach().clone().requires_grad_(True) for w in ws]
    grouped_int8_linear(x, seg, plain, ROW).backward(g)
    for w, p in zip(ws, plain):  # added into the existing main_grad, no .grad of its own
        assert torch.equal(w.main_grad, 0.5 + p.grad.float()) and p.grad.abs().sum() > 0


def test_stacked_weights_are_each_experts_quantization():
    """The experts are quantized straight into their slots of the stacks (backend.quantize's `out`): every
    slot holds exactly that expert's own row-wise Q(W_e), Q(W_e)^T and scales."""
    from megatron_int8.backend import ReferenceBackend

    gen = torch.Generator().manual_seed(9)
    ws = [w.detach() for w in _experts(gen, 3, 24, 40)]
    backend = ReferenceBackend()
    row, col = stacked_quantized_weights(ws, backend, dataclasses.replace(ROW, cache_weights=False))
    assert row.data.shape == (3, 24, 40) and col.data.shape == (3, 40, 24)
    for e, w in enumerate(ws):
        r, c = backend.quantize(w, granularity="row", block_size=128, weight=True, rowwise=True, columnwise=True)
        assert torch.equal(row.data[e], r.data) and torch.equal(row.scale[e], r.scale)
        assert torch.equal(col.data[e], c.data) and torch.equal(col.scale[e], c.scale)
        assert r.data.abs().max() == 127 and not torch.equal(row.data[e], row.data[(e + 1) % 3])


def test_stacked_weight_cache_follows_weight_changes():
    gen = torch.Generator().manual_seed(5)
    ws = [w.detach() for w in _experts(gen, 3, 16, 32)]
    from megatron_int8.backend import ReferenceBackend

    backend = ReferenceBackend()
    row, col = stacked_quantized_weights(ws, backend, ROW)
    assert stacked_quantized_weights(ws, backend, ROW)[0] is row  # cached
    ws[2].mul_(3.0)  # an in-place edit of another expert's weight bumps its version
    row2, col2 = stacked_quantized_weights(ws, backend, ROW)
    assert row2 is not row
    torch.testing.assert_close(row2.scale[2], row.scale[2] * 3.0, rtol=1e-6, atol=0)
    assert torch.equal(row2.data[:2], row.data[:2]) and torch.equal(col2.data[:2], col.data[:2])


def test_grouped_linear_rejects_bad_input():
    seg = Segments.for_counts([4, 4])
    ws = [torch.randn(8, 16), torch.randn(8, 16)]
    x = torch.randn(seg.rows, 16)
    with pytest.raises(ValueError, match="granularity"):
        grouped_int8_linear(x, seg, ws, dataclasses.replace(ROW, granularity="tensor"))
    with pytest.raises(ValueError, match="segments"):
        grouped_int8_linear(x, seg, ws[:1], ROW)
    with pytest.raises(ValueError, match="rows"):
        grouped_int8_linear(x[:-1], seg, ws, ROW)
    with pytest.raises(ValueError, match="weights"):
        grouped_int8_linear(x, seg, [ws[0], torch.randn(8, 12)], ROW)


# ------------------------------------------------------------------------------ megatron MoE layer

MOE = dict(hidden_size=32, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def _moe_mlp(grouped: bool, recipe=ROW, **config):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_int8.spec import get_gpt_int8_layer_spec

    cfg = tiny_config(**MOE, moe_grouped_gemm=grouped, **config)
    spec = get_gpt_int8_layer_spec(num_experts=4, moe_grouped_gemm=grouped, recipe=recipe)
    return build_module(spec.submodules.mlp, config=cfg)


def test_grouped_moe_layer_equals_sequential_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_int8.experts import Int8GroupedMLP

    gen = torch.Generator().manual_seed(11)
    x0 = outlier_tensor(24, 2, 32, generator=gen)
    g0 = outlier_tensor(24, 2, 32, generator=gen)
    with single_process_megatron():
        seq = _moe_mlp(False)
        grp = _moe_mlp(True)
        assert type(seq.experts) is SequentialMLP
        assert isinstance(grp.experts, Int8GroupedMLP) and grp.experts.grouped_problem is None
        assert list(seq.state_dict()) == list(grp.state_dict())  # checkpoints interchange
        grp.load_state_dict(seq.state_dict())
        # expert weights and the router (through the probabilities)
        assert_layers_bit_identical(seq, grp, x0, g0)


def test_grouped_moe_falls_back_with_a_reason():
    from megatron.core.transformer.moe.experts import SequentialMLP

    with single_process_megatron():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer = _moe_mlp(True, recipe=dataclasses.replace(ROW, granularity="tensor"))
        assert "granularity 'tensor'" in layer.experts.grouped_problem
        assert any("one by one" in str(w.message) for w in caught)
        x = outlier_tensor(8, 2, 32, generator=torch.Generator().manual_seed(1))
        out, _ = layer(x)  # SequentialMLP's loop
        assert torch.isfinite(out).all()

        from megatron.core.transformer.spec_utils import build_module

        from megatron_int8.spec import get_gpt_int8_layer_spec

        with pytest.warns(UserWarning, match="no BF16 grouped GEMM"):
            spec = get_gpt_int8_layer_spec(num_experts=4, moe_grouped_gemm=True, int8=False)
        bf16 = build_module(spec.submodules.mlp, config=tiny_config(**MOE, moe_grouped_gemm=True))
        assert type(bf16.experts) is SequentialMLP

