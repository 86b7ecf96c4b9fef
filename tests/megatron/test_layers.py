"""Int8ColumnParallelLinear / Int8RowParallelLinear at TP=1: numerics against float64 with bounds
derived from the quantization scales, main_grad accumulation, frozen weights, BF16 parity."""
import pytest
import torch
from mcore_helpers import nearest_recipe, outlier_tensor, qgemm_bound, single_process_megatron, tiny_config

from megatron_int8.recipe import Int8Recipe


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


def _layers():
    from megatron_int8.megatron.layers import Int8ColumnParallelLinear, Int8RowParallelLinear

    return Int8ColumnParallelLinear, Int8RowParallelLinear


def _build(kind, config, in_f=64, out_f=48, bias=True, skip_bias_add=False, **kw):
    kw.setdefault("recipe", nearest_recipe())
    col, row = _layers()
    init = torch.nn.init.xavier_normal_
    if kind == "column":
        return col(in_f, out_f, config=config, init_method=init, bias=bias, skip_bias_add=skip_bias_add, **kw)
    return row(in_f, out_f, config=config, init_method=init, bias=bias, skip_bias_add=skip_bias_add,
               input_is_parallel=True, **kw)


def _plant_outliers(layer, generator):
    with torch.no_grad():
        layer.weight.copy_(outlier_tensor(*layer.weight.shape, generator=generator, scale=8.0) * 0.05)
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_forward_backward_within_quantization_bound(kind, granularity):
    gen = torch.Generator().manual_seed(7)
    layer = _build(kind, tiny_config(), recipe=nearest_recipe(granularity=granularity, backend="reference"))
    _plant_outliers(layer, gen)
    x = outlier_tensor(8, 3, 64, generator=gen).requires_grad_(True)
    out, out_bias = layer(x)
    assert out_bias is None
    g = outlier_tensor(*out.shape, generator=gen)
    out.backward(g)

    x2, g2, w = x.detach().double().reshape(-1, 64), g.double().reshape(-1, 48), layer.weight.detach().double()
    exact = x2 @ w.T + layer.bias.detach().double()
    fwd_err = (out.detach().double().reshape(-1, 48) - exact).abs()
    assert (fwd_err <= qgemm_bound(x2, w, granularity=granularity)).all()
    assert fwd_err.max() > 0  # INT8 really ran
    dx_err = (x.grad.double().reshape(-1, 64) - g2 @ w).abs()
    assert (dx_err <= qgemm_bound(g2, w.T.contiguous(), granularity=granularity)).all()
    dw_err = (layer.weight.grad.double() - g2.T @ x2).abs()
    assert (dw_err <= qgemm_bound(g2.T.contiguous(), x2.T.contiguous(), granularity=granularity)).all()
    db_exact = g2.sum(0)
    assert ((layer.bias.grad.double() - db_exact).abs() <= 4 * 2**-24 * g2.abs().sum(0) * g2.shape[0]).all()


def test_skip_bias_add_returns_bias():
    layer = _build("row", tiny_config(), skip_bias_add=True)
    out, bias = layer(torch.randn(4, 2, 64))
    assert bias is layer.bias
    assert out.shape == (4, 2, 48)


def test_gradient_accumulation_fusion_without_apex():
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel import layers as mcore_layers

    config = tiny_config(gradient_accumulation_fusion=True)
    if not mcore_layers._grad_accum_fusion_available:
        with pytest.raises(RuntimeError, match="gradient_accumulation_fusion"):
            ColumnParallelLinear(64, 48, config=config, init_method=torch.nn.init.xavier_normal_)
    gen = torch.Generator().manual_seed(3)
    fused = _build("column", config, bias=False)
    plain = _build("column", tiny_config(), bias=False)
    _plant_outliers(fused, gen)
    plain.load_state_dict(fused.state_dict())
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    fused.weight.grad_added_to_main_grad = False

    expected, exact, bound = torch.zeros_like(fused.weight), 0, 0
    for _ in range(3):  # micro-batches of one step: the weight is unchanged, its quantization cached
        x, g = outlier_tensor(6, 2, 64, generator=gen), outlier_tensor(6, 2, 48, generator=gen)
        fused(x)[0].backward(g)
        assert fused.weight.grad_added_to_main_grad
        assert fused.weight.grad.shape == fused.weight.shape  # megatron's dummy grad
        fused.weight.grad, fused.weight.grad_added_to_main_grad = None, False
        plain(x)[0].backward(g)
        expected += plain.weight.grad
        plain.weight.grad = None
        g2, x2 = g.double().reshape(-1, 48), x.double().reshape(-1, 64)
        exact = exact + g2.T @ x2
        bound = bound + qgemm_bound(g2.T.contiguous(), x2.T.contiguous())
    # Same INT8 products summed in the same order: equal up to fp32 rounding of the additions.
    torch.testing.assert_close(fused.weight.main_grad, expected, rtol=4 * 2**-24, atol=0)
    assert ((fused.weight.main_grad.double() - exact).abs() <= bound).all()


def test_ddp_main_grad_accumulation():
    """Through megatron's DDP: main_grad of the grad buffer gets every micro-batch exactly once."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = tiny_config(gradient_accumulation_fusion=True)
    gen = torch.Generator().manual_seed(5)
    layer = _build("column", config, bias=False)
    _plant_outliers(layer, gen)
    reference = _build("column", tiny_config(), bias=False)
    reference.load_state_dict(layer.state_dict())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
    ddp.zero_grad_buffer()
    for _ in range(2):
        x, g = outlier_tensor(4, 2, 64, generator=gen), outlier_tensor(4, 2, 48, generator=gen)
        ddp(x)[0].backward(g)
        reference(x)[0].backward(g)
    torch.testing.assert_close(layer.weight.main_grad, reference.weight.grad, rtol=4 * 2**-24, atol=0)


def test_frozen_weight_gets_no_wgrad():
    gen = torch.Generator().manual_seed(11)
    layer = _build("column", tiny_config(), bias=False)
    _plant_outliers(layer, gen)
    layer.weight.requires_grad_(False)
    x = outlier_tensor(5, 2, 64, generator=gen).requires_grad_(True)
    g = outlier_tensor(5, 2, 48, generator=gen)
    layer(x)[0].backward(g)
    assert layer.weight.grad is None
    w, g2 = layer.weight.double(), g.double().reshape(-1, 48)
    assert ((x.grad.double().reshape(-1, 64) - g2 @ w).abs() <= qgemm_bound(g2, w.T.contiguous())).all()


@pytest.mark.parametrize("kind", ["column", "row"])
def test_int8_off_is_megatron_and_checkpoints_interchange(kind):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = tiny_config()
    mine = _build(kind, config, int8=False)
    stock_cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    extra = {} if kind == "column" else {"input_is_parallel": True}
    stock = stock_cls(64, 48, config=config, init_method=torch.nn.init.xavier_normal_, bias=True,
                      skip_bias_add=False, **extra)
    assert list(mine.state_dict()) == list(stock.state_dict())
    stock.load_state_dict(mine.state_dict())
    int8 = _build(kind, config)
    int8.load_state_dict(stock.state_dict())
    x = torch.randn(4, 2, 64, requires_grad=True)
    xs = x.detach().clone().requires_grad_(True)
    g = torch.randn(4, 2, 48)
    mine(x)[0].backward(g)
    stock(xs)[0].backward(g)
    assert torch.equal(x.grad, xs.grad) and torch.equal(mine.weight.grad, stock.weight.grad)
    assert torch.equal(int8.weight, stock.weight)


def test_unsupported_options_raise():
    config = tiny_config()
    with pytest.raises(NotImplementedError, match="grad_output_buffer"):
        _build("column", config, grad_output_buffer=[])
    config.defer_embedding_wgrad_compute = True
    with pytest.raises(NotImplementedError, match="defer_embedding_wgrad_compute"):
        _build("row", config)


def test_recipe_and_flag_come_from_the_spec():
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    col, _ = _layers()
    recipe = Int8Recipe(granularity="block", block_size=32)
    layer = build_module(ModuleSpec(module=col, params={"recipe": recipe, "int8": True}), 64, 48,
                         config=tiny_config(), init_method=torch.nn.init.xavier_normal_, bias=False)
    assert layer.int8 and layer.int8_recipe is recipe


def test_takes_grad_output_amax_only_when_it_quantizes_that_gradient_tensorwise():
    """An INT8 layer whose recipe quantizes the output gradient tensorwise (dgrad or wgrad in INT8) takes a
    handed-over amax (attention._SplitQKVNormed asks this); row-wise, a BF16 layer, or both backward GEMMs in
    high precision do not."""
    config = tiny_config()
    cases = [(dict(recipe=nearest_recipe(granularity="tensor")), True),
             (dict(recipe=Int8Recipe(granularity="tensor", dgrad=False)), True),
             (dict(recipe=nearest_recipe(granularity="row")), False),
             (dict(recipe=nearest_recipe(granularity="tensor"), int8=False), False),
             (dict(recipe=Int8Recipe(granularity="tensor", dgrad=False, wgrad=False)), False)]
    for kw, want in cases:
        for kind in ("column", "row"):
            assert _build(kind, config, **kw).takes_grad_output_amax is want, (kw, kind)


def test_smooth_swiglu_stays_on_fc2_and_the_probe_measures_the_layer():
    """The guard is kept only where megatron's MLP builds fc2 (tp_comm_buffer_name 'fc2'); the layer remembers
    the recipe it was built with, and a probe attached to it measures its next training forward/backward."""
    from megatron_int8.ops.health import LinearProbe, values_by_name

    config, recipe = tiny_config(), Int8Recipe(smooth_swiglu=True)
    fc2 = _build("row", config, recipe=recipe, bias=False, tp_comm_buffer_name="fc2")
    proj = _build("row", config, recipe=recipe, bias=False, tp_comm_buffer_name="proj")
    fc1 = _build("column", config, recipe=recipe, bias=False, tp_comm_buffer_name="fc1")
    assert fc2.int8_recipe.smooth_swiglu and fc2.int8_built_recipe is fc2.int8_recipe
    assert not proj.int8_recipe.smooth_swiglu and not fc1.int8_recipe.smooth_swiglu
    probe = fc2.int8_probe = LinearProbe()
    probe.arm()
    x = torch.randn(16, 2, 64, requires_grad=True)
    out, _ = fc2(x)
    out.sum().backward()
    (values,) = probe.take()
    got = values_by_name(values)
    assert got["x/amax"] == x.detach().abs().max().item() and 0 < got["wgrad/rel_err"] < 0.1


def test_precision_shows_the_shape_policy_decisions(monkeypatch):
    """shape_policy "auto": the layer's precision (the precision table's column) lists what was measured."""
    from megatron_int8.megatron.precision_table import _precision_of
    from megatron_int8.ops import shape_policy

    monkeypatch.setattr(shape_policy, "_env_policy", [])
    shape_policy.set_timer(lambda fn, path: {"int8": 2.0, "hp": 1.0}[path])  # high precision "faster"
    try:
        layer = _build("column", tiny_config(), recipe=Int8Recipe(shape_policy="auto"))
        assert _precision_of(layer)[0] == "int8/auto"
        x = torch.randn(5, 2, 64)
        out, _ = layer(x)
        assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert _precision_of(layer)[0] == "int8/auto (float32 at 10 tokens)"
        assert _build("column", tiny_config()).precision == "int8"
    finally:
        shape_policy.set_timer(None)


def test_row_parallel_with_gtp_sharded_weights_takes_megatrons_forward(monkeypatch):
    """Under tp_comm_overlap the row-parallel linear runs its GEMM itself, on self.weight: with megatron-core
    0.19's GTP that is this rank's slice (an output of the wrong width, no error). Such a linear takes megatron's
    forward, which gathers the weight (BF16) or refuses GTP by name (INT8)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megatron_int8.megatron.layers import Int8RowParallelLinear

    with single_process_megatron():
        cfg = tiny_config()
        layer = Int8RowParallelLinear(32, 16, config=cfg, init_method=cfg.init_method, bias=False,
                                      input_is_parallel=True, skip_bias_add=True, recipe=nearest_recipe())
        monkeypatch.setattr(RowParallelLinear, "forward", lambda self, x: ("megatron's forward", None))
        layer.tp_comm_overlap = True
        layer.gtp_remat_size = 2  # as megatron-core 0.19 sets it
        assert layer(torch.randn(4, 1, 32))[0] == "megatron's forward"
