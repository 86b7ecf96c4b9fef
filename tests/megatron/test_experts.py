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

from megatron_int8.ops.grouped_linear import grouped_hp_linear, grouped_int8_linear, stacked_quantized_weights, \
    stacked_weights
from megatron_int8.ops.linear import int8_linear
from megatron_int8.reference import Segments
from megatron_int8.recipe import Int8Recipe
from mcore_helpers import assert_layers_bit_identical, build_layer_mlp, build_spec, outlier_tensor, qgemm_bound, \
    single_process_megatron, tiny_config

ROW = Int8Recipe(granularity="row", backend="reference")
COUNTS = [37, 0, 130, 5]  # an empty expert, one spanning two aligned strips, ragged counts
EPS32 = torch.finfo(torch.float32).eps


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
    for bad in ((1, 128), (0, 100), (0, 256, 128)):
        with pytest.raises(ValueError):
            Segments(bad)
    with pytest.raises(ValueError):
        Segments.for_counts([3, -1])


def _tokens(counts, K, gen):
    return [outlier_tensor(c, K, generator=gen) if c else torch.zeros(0, K) for c in counts]


def _experts(gen, E, N, K):
    return [outlier_tensor(N, K, generator=gen).mul_(0.05).requires_grad_(True) for _ in range(E)]


def _assert_alignment_rows_and_empty_expert(seg, out, dx, dws):
    """Over COUNTS' layout: the alignment rows stay zero in both directions, the empty expert's weight
    gradient is zero, every other expert's is not."""
    pad = torch.ones(seg.rows, dtype=torch.bool)
    for e, c in enumerate(COUNTS):
        pad[seg.offsets[e]:seg.offsets[e] + c] = False
    assert (out[pad] == 0).all() and (dx[pad] == 0).all()
    assert torch.equal(dws[1], torch.zeros_like(dws[1]))
    assert all(g.abs().sum() > 0 for e, g in enumerate(dws) if COUNTS[e])


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
    _assert_alignment_rows_and_empty_expert(seg, out, x.grad, grouped_dw)


def test_grouped_linear_under_non_reentrant_checkpointing():
    """The grouped op's backward read ctx.saved_tensors twice, which non-reentrant checkpointing refuses."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(4)
    seg = Segments.for_counts(COUNTS)
    ws = _experts(gen, len(COUNTS), 40, 48)
    x, g = _aligned(_tokens(COUNTS, 48, gen), seg), _aligned(_tokens(COUNTS, 40, gen), seg)
    grads = []
    for checkpointed in (False, True):
        xi = x.clone().requires_grad_(True)
        f = lambda t: grouped_int8_linear(t, seg, ws, ROW)  # noqa: E731
        (checkpoint(f, xi, use_reentrant=False) if checkpointed else f(xi)).backward(g)
        grads.append([xi.grad] + [w.grad.clone() for w in ws])
        for w in ws:
            w.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_hp_linear_equals_per_expert_linears(dtype):
    """The BF16 baseline's grouped experts against float64 per expert: outputs x_e W_e^T, input gradients
    g_e W_e and weight gradients g_e^T x_e (over the expert's rows, its zero alignment rows included), each
    within the fp32 accumulation bound plus one rounding to the dtype (the matmuls see other shapes than a
    per-expert F.linear, so BLAS may block the sums differently: no bit-identity promised); the alignment
    rows zero both ways, an empty expert's gradient zero."""
    gen = torch.Generator().manual_seed(13)
    K, N = 48, 40
    seg = Segments.for_counts(COUNTS)
    xs = [t.to(dtype) for t in _tokens(COUNTS, K, gen)]
    gs = [t.to(dtype) for t in _tokens(COUNTS, N, gen)]
    ws = [w.detach().to(dtype).requires_grad_(True) for w in _experts(gen, len(COUNTS), N, K)]
    x = _aligned(xs, seg).requires_grad_(True)
    out = grouped_hp_linear(x, seg, ws)
    out.backward(_aligned(gs, seg))
    grouped_dw = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    def within(got, a, b, depth):  # got ~ a @ b, with a, b float64
        exact = a @ b
        bound = depth * EPS32 * (a.abs() @ b.abs()) + torch.finfo(dtype).eps * exact.abs()
        return ((got.double() - exact).abs() <= bound).all()

    for e, (xe, ge, we) in enumerate(zip(xs, gs, ws)):
        lo, n = seg.offsets[e], xe.shape[0]
        if not n:
            continue
        x64, g64, w64 = xe.double(), ge.double(), we.detach().double()
        assert within(out[lo:lo + n], x64, w64.T, K), e
        assert within(x.grad[lo:lo + n], g64, w64, N), e
        assert within(grouped_dw[e], g64.T, x64, seg.offsets[e + 1] - lo), e
    _assert_alignment_rows_and_empty_expert(seg, out, x.grad, grouped_dw)


def test_grouped_hp_linear_main_grad_and_stack_cache():
    """fuse_wgrad adds each expert's fp32 product into its main_grad (megatron's placeholder returned); the
    stacked weights are reused until a weight changes, then rebuilt; bad input is refused."""
    gen = torch.Generator().manual_seed(14)
    counts = [20, 0, 140]
    seg = Segments.for_counts(counts)
    ws = _experts(gen, 3, 24, 32)
    for w in ws:
        w.main_grad = torch.full_like(w, 0.5)
        w.grad_added_to_main_grad = False
    x = _aligned(_tokens(counts, 32, gen), seg)
    g = _aligned(_tokens(counts, 24, gen), seg)
    grouped_hp_linear(x, seg, ws, fuse_wgrad=True).backward(g)
    assert all(w.grad_added_to_main_grad for w in ws)
    for e, w in enumerate(ws):
        lo, hi = seg.bounds(e)
        g64, x64 = g[lo:hi].double(), x[lo:hi].double()
        bound = ((hi - lo) + 1) * EPS32 * (0.5 + g64.abs().T @ x64.abs())
        assert ((w.main_grad.double() - (0.5 + g64.T @ x64)).abs() <= bound).all(), e
    assert torch.equal(ws[1].main_grad, torch.full_like(ws[1], 0.5))  # the empty expert: nothing added
    stack = stacked_weights(ws)
    assert stacked_weights(ws) is stack and torch.equal(stack[2], ws[2].detach())
    with torch.no_grad():
        ws[2].mul_(2.0)
    assert torch.equal(stacked_weights(ws)[2], ws[2].detach()) and stacked_weights(ws) is not stack
    with pytest.raises(ValueError, match="segments"):
        grouped_hp_linear(x, seg, ws[:2])
    with pytest.raises(ValueError, match="rows"):
        grouped_hp_linear(x[:-1], seg, ws)
    with pytest.raises(TypeError, match="dtype"):
        grouped_hp_linear(x.bfloat16(), seg, ws)


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
    from megatron_int8.reference import ReferenceBackend

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
    from megatron_int8.reference import ReferenceBackend

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
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    cfg = tiny_config(**MOE, moe_grouped_gemm=grouped, **config)
    spec = get_gpt_int8_layer_spec(num_experts=4, moe_grouped_gemm=grouped, recipe=recipe)
    return build_spec(spec.submodules.mlp, config=cfg)


def test_grouped_moe_layer_equals_sequential_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_int8.megatron.experts import Int8GroupedMLP

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


def test_grouped_moe_runs_each_expert_linears_forward_pre_hooks():
    """megatron's DDP waits for a bucket's parameter all-gather (--overlap-param-gather) in the forward pre-hook
    of the module that owns the parameters: the grouped op reads the expert linears' weights without calling
    them, so it runs their hooks itself, once per forward, as SequentialMLP's calls do."""
    from megatron_int8.megatron.experts import Int8GroupedMLP

    x = outlier_tensor(24, 2, 32, generator=torch.Generator().manual_seed(3))
    with single_process_megatron():
        counts = {}
        for grouped in (False, True):
            layer = _moe_mlp(grouped)
            assert isinstance(layer.experts, Int8GroupedMLP) == grouped
            owners = [name for name, m in layer.experts.named_modules() if list(m.parameters(recurse=False))]
            calls = dict.fromkeys(owners, 0)
            for name, module in layer.experts.named_modules():
                if name in calls:
                    module.register_forward_pre_hook(
                        lambda m, args, name=name: calls.__setitem__(name, calls[name] + 1))
            layer(x)
            counts[grouped] = calls
        assert counts[True] == counts[False] and len(counts[True]) == 8, counts  # fc1 and fc2 of 4 experts
        assert set(counts[True].values()) == {1}, counts


def test_smooth_swiglu_stays_on_dense_fc2_and_experts_still_run_grouped():
    """The recipe's smooth_swiglu guards a dense MLP's fc2; the experts' fc2 (whose buffer megatron also names
    "fc2") keeps the experts' one recipe, so they run grouped."""
    smooth = dataclasses.replace(ROW, smooth_swiglu=True)
    with single_process_megatron():
        layer = _moe_mlp(True, recipe=smooth)
        assert layer.experts.grouped_problem is None
        assert not any(e.linear_fc2.int8_recipe.smooth_swiglu for e in layer.experts.local_experts)
        from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

        dense = build_layer_mlp(get_gpt_int8_layer_spec(recipe=smooth).submodules.mlp, tiny_config())
        assert dense.linear_fc2.int8_recipe.smooth_swiglu and not dense.linear_fc1.int8_recipe.smooth_swiglu


def test_grouped_experts_with_a_moved_expert_run_one_by_one_as_sequential_experts_would():
    """A fallback move restored from a checkpoint (or made during the run) gives one expert linear its own
    recipe: the grouped op, one recipe for all, would run it with the first expert's (or refuse a GEMM in high
    precision), so the layer runs its experts one by one, each with its recipe, as SequentialMLP does."""
    gen = torch.Generator().manual_seed(13)
    x0 = outlier_tensor(24, 2, 32, generator=gen)
    g0 = outlier_tensor(24, 2, 32, generator=gen)
    moved = dataclasses.replace(ROW, wgrad=False)
    with single_process_megatron():
        seq, grp = _moe_mlp(False), _moe_mlp(True)
        grp.load_state_dict(seq.state_dict())
        assert grp.experts.grouped_problem is None
        for layer in (seq, grp):
            layer.experts.local_experts[1].linear_fc2.int8_recipe = moved
        assert_layers_bit_identical(seq, grp, x0, g0)
        assert grp.experts.grouped_problem == "the expert linears use different recipes"


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

        from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

        # experts of both precisions in one layer cannot share one grouped op
        mixed = _moe_mlp(True)
        mixed.experts.local_experts[1].linear_fc2.int8 = False
        assert mixed.experts._grouped_problem() == "experts of both precisions"


def test_grouped_bf16_moe_layer_equals_sequential_experts():
    """The BF16 baseline's experts with moe_grouped_gemm run grouped (grouped_hp_linear) with SequentialMLP's
    parameters, and give bit-identical outputs and gradients."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_int8.megatron.experts import Int8GroupedMLP
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    gen = torch.Generator().manual_seed(12)
    x0 = outlier_tensor(24, 2, 32, generator=gen)
    g0 = outlier_tensor(24, 2, 32, generator=gen)
    with single_process_megatron():
        layers = []
        for grouped in (False, True):
            spec = get_gpt_int8_layer_spec(num_experts=4, moe_grouped_gemm=grouped, int8=False)
            layers.append(build_spec(spec.submodules.mlp, config=tiny_config(**MOE, moe_grouped_gemm=grouped)))
        seq, grp = layers
        assert type(seq.experts) is SequentialMLP
        assert isinstance(grp.experts, Int8GroupedMLP) and grp.experts.grouped_problem is None
        grp.load_state_dict(seq.state_dict())
        assert_layers_bit_identical(seq, grp, x0, g0)



def test_grouped_moe_layer_fused_weighted_swiglu(monkeypatch):
    """With megatron's activation fusion on, the grouped experts run megatron_int8.ops.swiglu.weighted_swiglu
    (on CPU its fp32 reference; the Triton kernels are checked in test_kernels.py): outputs and every
    gradient, the router's through the probabilities included, agree in fp32 with SequentialMLP's unfused
    SwiGLU (a few fp32 roundings apart), and --no-fused-swiglu's switch sends it back to megatron's code."""
    import megatron_int8.megatron.experts as experts_mod

    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    calls = []
    real = experts_mod.weighted_swiglu
    monkeypatch.setattr(experts_mod, "weighted_swiglu", lambda h, p: calls.append(h.shape) or real(h, p))
    gen = torch.Generator().manual_seed(13)
    x0 = outlier_tensor(24, 2, 32, generator=gen)
    g0 = outlier_tensor(24, 2, 32, generator=gen)
    with single_process_megatron():
        layers = []
        for grouped, fusion in ((False, False), (True, True)):
            spec = get_gpt_int8_layer_spec(num_experts=4, moe_grouped_gemm=grouped, int8=False)
            cfg = tiny_config(**MOE, moe_grouped_gemm=grouped, bias_activation_fusion=fusion)
            layers.append(build_spec(spec.submodules.mlp, config=cfg))
        seq, grp = layers
        assert grp.experts.fused_swiglu and not hasattr(seq.experts, "fused_swiglu")
        grp.load_state_dict(seq.state_dict())
        results = []
        for layer in (seq, grp):
            x = x0.clone().requires_grad_(True)
            out, _ = layer(x)
            out.backward(g0)
            results.append([("output", out.detach()), ("input gradient", x.grad)]
                           + [(n, p.grad) for n, p in layer.named_parameters()])
        assert len(calls) == 1
        for (name, want), (_, got) in zip(*results):
            assert want.abs().sum() > 0, name
            err = (got.double() - want.double()).abs().max() / want.double().abs().max()
            assert err <= 1e-5, f"{name}: relative error {err:.3g}"
        grp.experts.fused_swiglu = False  # what the trainer's --no-fused-swiglu sets
        grp(x0)
        assert len(calls) == 1


def test_experts_with_gtp_sharded_weights_run_megatrons_path():
    """megatron-core 0.19's GTP leaves each rank a slice of every expert weight, which megatron gathers only in
    its own GEMM path: the grouped op read the slices (a shape error, or a wrong product), so such experts run one
    by one through megatron's path, where INT8 refuses GTP by name."""
    with single_process_megatron():
        layer = _moe_mlp(True)
        assert layer.experts._grouped_problem() is None
        layer.experts.local_experts[2].linear_fc1.gtp_remat_size = 2  # as megatron-core 0.19 sets it
        assert "sharded by megatron-core's GTP" in layer.experts._grouped_problem()


def test_grouped_linear_rounds_output_gradients_stochastically_when_asked():
    """grad_rounding="stochastic" reaches the grouped experts' dY: each dY row is an outlier at 127 steps beside
    entries at 0.3 of a step, which round to nearest gives 0 every time, so the mean input and weight gradients
    over fresh draws reach the float64 products (W and X integer-valued with a 127 in every row and column: their
    quantization is exact) only if dY is rounded without bias, within five standard errors of that rounding."""
    gen = torch.Generator().manual_seed(21)
    K, N, draws = 24, 16, 256
    counts = [37, 0, 70]
    seg = Segments.for_counts(counts)
    recipe = dataclasses.replace(ROW, grad_rounding="stochastic")

    def integers(rows, cols):  # entries in [-127, 127], a 127 in every row and column
        m = torch.randint(-126, 127, (rows, cols), generator=gen).double()
        m[torch.arange(rows), torch.arange(rows) % cols] = 127.0
        m[torch.arange(cols) % rows, torch.arange(cols)] = 127.0
        return m

    ws = [integers(N, K).float().requires_grad_(True) for _ in counts]
    xs = [integers(c, K) if c else torch.zeros(0, K, dtype=torch.float64) for c in counts]
    gs = []
    for c in counts:  # one outlier per row (127 steps of 1.0), the rest at 0.3 of a step, random signs
        g = 0.3 * torch.randint(0, 2, (c, N), generator=gen).double().mul(2).sub(1)
        g[torch.arange(c), torch.arange(c) % N] = 127.0
        gs.append(g)
    x = _aligned([t.float() for t in xs], seg).requires_grad_(True)
    g = _aligned([t.float() for t in gs], seg)
    dx, dws = torch.zeros(seg.rows, K, dtype=torch.float64), [torch.zeros(N, K, dtype=torch.float64) for _ in counts]
    for draw in range(draws):
        torch.manual_seed(draw)
        grouped_int8_linear(x, seg, ws, recipe).backward(g)
        dx += x.grad.double() / draws
        for e, w in enumerate(ws):
            dws[e] += w.grad.double() / draws
            w.grad = None
        x.grad = None
    for e, c in enumerate(counts):
        if not c:
            continue
        lo, w = seg.offsets[e], ws[e].detach().double()
        # rounding 0.3 up with probability 0.3: variance 0.21 per entry; the mean over the draws' standard error
        se_dx = (0.21 * (w ** 2).sum(0) * (gs[e].abs() < 1).double().mean() / draws).sqrt()
        assert ((dx[lo:lo + c] - gs[e] @ w).abs() <= 5 * se_dx + 1e-6).all(), e
        # dW = dY^T X: the columns of dY quantized for it have their own outliers (scales <= 127 / 127 = 1 step)
        se_dw = (0.21 * (xs[e] ** 2).sum(0) / draws).sqrt()
        assert ((dws[e] - gs[e].T @ xs[e]).abs() <= 5 * se_dw + 1e-6).all(), e
