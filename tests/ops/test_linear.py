import pytest
import torch
import torch.nn.functional as F

from int8_bounds import assert_fp32_accumulation_close, assert_within_int8_bound, float64_group_amax, heavy_tailed
from megatron_int8 import Int8Recipe, NonFiniteError, TPOptions, int8_linear, invalidate_weight_caches, raise_if_nonfinite
from megatron_int8.reference import ReferenceBackend

RECIPES = [Int8Recipe(grad_rounding=r, **g) for r in ("nearest", "stochastic")
           for g in (dict(), dict(granularity="row"), dict(granularity="block", block_size=32))]


def _leaf(t, dtype):
    return t.to(dtype).detach().requires_grad_()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fprop_dgrad_wgrad_within_quantization_bound(recipe, dtype, record_property):
    S, B, K, N = 11, 3, 96, 40  # 3-D [seq, batch, hidden] input as in megatron, ragged sizes
    x, w, gy = heavy_tailed(S, B, K, dtype=dtype), heavy_tailed(N, K, dtype=dtype), heavy_tailed(S, B, N, dtype=dtype)
    bias = torch.randn(N, dtype=dtype)
    xl, wl, bl = _leaf(x, dtype), _leaf(w, dtype), _leaf(bias, dtype)
    y = int8_linear(xl, wl, bl, recipe)
    assert y.dtype == dtype and y.shape == (S, B, N)
    y.backward(gy)
    assert xl.grad.dtype == dtype and wl.grad.dtype == dtype
    g, bs, sr = recipe.granularity, recipe.block_size, recipe.grad_rounding == "stochastic"
    x2, gy2 = x.reshape(-1, K), gy.reshape(-1, N)
    cos = {}
    cos["fprop"] = assert_within_int8_bound((y - bl).reshape(-1, N).detach(), x2, w, g, b_weight=True, block_size=bs, what="fprop")
    cos["dgrad"] = assert_within_int8_bound(xl.grad.reshape(-1, K), gy2, w.t(), g, b_weight=True, block_size=bs,
                                            a_stochastic=sr, what="dgrad")
    cos["wgrad"] = assert_within_int8_bound(wl.grad, gy2.t(), x2.t(), g, block_size=bs, a_stochastic=sr, what="wgrad")
    assert torch.allclose(bl.grad.double(), gy2.double().sum(0), rtol=torch.finfo(dtype).eps * 4, atol=1e-3)
    record_property("cosine_similarity", cos)
    print(recipe.describe(), dtype, "cosine vs float64:", {k: round(v, 6) for k, v in cos.items()})


@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 33), (1, 33)])
def test_all_switches_off_equals_f_linear_exactly(shape):
    recipe = Int8Recipe(fprop=False, dgrad=False, wgrad=False)
    x, w, b = torch.randn(*shape), torch.randn(21, 33), torch.randn(21)
    gy = torch.randn(*shape[:-1], 21)
    leaves = [_leaf(t, torch.float32) for t in (x, w, b)]
    ref_leaves = [_leaf(t, torch.float32) for t in (x, w, b)]
    y = int8_linear(*leaves, recipe)
    y_ref = F.linear(*ref_leaves)
    assert torch.equal(y, y_ref)
    y.backward(gy)
    y_ref.backward(gy)
    for a, r in zip(leaves, ref_leaves):
        assert torch.equal(a.grad, r.grad)


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_single_gemm_in_high_precision_is_exact_there(gemm):
    recipe = Int8Recipe(**{gemm: False})
    x, w, gy = heavy_tailed(24, 64), heavy_tailed(16, 64), heavy_tailed(24, 16)
    xl, wl = _leaf(x, torch.float32), _leaf(w, torch.float32)
    y = int8_linear(xl, wl, None, recipe)
    y.backward(gy)
    exact = {"fprop": (y, x @ w.t()), "dgrad": (xl.grad, gy @ w), "wgrad": (wl.grad, gy.t() @ x)}[gemm]
    assert torch.allclose(exact[0], exact[1], rtol=1e-5, atol=1e-5)
    others = [k for k in ("fprop", "dgrad", "wgrad") if k != gemm]
    for k in others:  # the INT8 GEMMs really are quantized
        got, ref = {"fprop": (y, x @ w.t()), "dgrad": (xl.grad, gy @ w), "wgrad": (wl.grad, gy.t() @ x)}[k]
        assert not torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_saved_activation_is_int8_not_the_input():
    x = _leaf(torch.randn(4, 6, 64), torch.bfloat16)
    w = _leaf(torch.randn(32, 64), torch.bfloat16)
    for granularity, scales in (("tensor", 1), ("row", 64)):  # Q(X)^T's scales: one, or one per feature
        y = int8_linear(x, w, None, Int8Recipe(granularity=granularity))
        saved = y.grad_fn.saved_tensors
        int8 = [t for t in saved if t.dtype == torch.int8]
        # Q(X)^T, already K-major for the wgrad GEMM, its 24 tokens zero-padded to 32 (TOKEN_PAD)
        assert len(int8) == 1 and int8[0].shape == (64, 32)
        assert int8[0][:, :24].any() and not int8[0][:, 24:].any()
        floating = [t for t in saved if t.is_floating_point() and t.numel() > 1 and t is not w]
        assert [t.numel() for t in floating] == ([scales] if scales > 1 else []), \
            "only the weight (a parameter) and Q(X)^T's fp32 scales may be saved in high precision"


def test_high_precision_wgrad_saves_the_input():
    x, w = _leaf(torch.randn(4, 64), torch.float32), _leaf(torch.randn(32, 64), torch.float32)
    y = int8_linear(x, w, None, Int8Recipe(wgrad=False))
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in y.grad_fn.saved_tensors)


class _GemmShapes(ReferenceBackend):
    def __init__(self):
        self.calls = []

    def gemm(self, a, b, **kw):
        self.calls.append((a, b))
        return super().gemm(a, b, **kw)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_wgrad_contracts_over_tokens_padded_to_16(monkeypatch, granularity):
    """An MoE expert gets any number of tokens; wgrad contracts over them, and the Triton GEMM needs
    16-byte aligned rows for vector loads. Both Q(dY)^T and Q(X)^T come zero-padded to a multiple of 16,
    and the gradient equals the unpadded product exactly."""
    spy = _GemmShapes()
    monkeypatch.setattr("megatron_int8.ops.linear.get_backend", lambda device, recipe: spy)
    recipe = Int8Recipe(granularity=granularity, block_size=32)
    x, w, gy = heavy_tailed(37, 64), heavy_tailed(24, 64), heavy_tailed(37, 24)
    xl, wl = _leaf(x, torch.float32), _leaf(w, torch.float32)
    int8_linear(xl, wl, None, recipe).backward(gy)
    fprop, dgrad, wgrad = spy.calls
    assert fprop[0].shape == (37, 64) and dgrad[0].shape == (37, 24)
    qg, qx = wgrad
    assert qg.shape == (24, 48) and qx.shape == (64, 48)
    assert not qg.data[:, 37:].any() and not qx.data[:, 37:].any()
    unpadded = ReferenceBackend()
    kw = dict(granularity=granularity, block_size=32, weight=False, rowwise=False, columnwise=True)
    _, qg0 = unpadded.quantize(gy, **kw)
    _, qx0 = unpadded.quantize(x, **kw)
    assert torch.equal(qg.data[:, :37], qg0.data) and torch.equal(qx.data[:, :37], qx0.data)
    assert torch.equal(wl.grad, unpadded.gemm(qg0, qx0, out_dtype=torch.float32))


class _ColumnwiseSpy(ReferenceBackend):
    def __init__(self):
        self.columnwise_inputs = 0

    def quantize(self, x, **kw):
        self.columnwise_inputs += bool(kw.get("columnwise")) and not kw["weight"]
        return super().quantize(x, **kw)


def test_forward_without_grad_skips_the_wgrad_operand(monkeypatch):
    """Under no_grad (evaluation, generation, a recompute's first forward) no backward takes Q(X)^T: the forward
    quantizes X row-wise only, and its output is the one with gradients on, bit for bit."""
    spy = _ColumnwiseSpy()
    monkeypatch.setattr("megatron_int8.ops.linear.get_backend", lambda device, recipe: spy)
    x, w = heavy_tailed(9, 2, 64), heavy_tailed(24, 64)
    xl, wl = _leaf(x, torch.float32), _leaf(w, torch.float32)
    for recipe in (Int8Recipe(), Int8Recipe(granularity="row"), Int8Recipe(granularity="block", block_size=32)):
        with_grad = int8_linear(xl, wl, None, recipe)
        assert spy.columnwise_inputs == 1
        with torch.no_grad():
            without = int8_linear(xl, wl, None, recipe)
        assert spy.columnwise_inputs == 1 and torch.equal(without, with_grad.detach())
        spy.columnwise_inputs = 0


class _CountingBackend(ReferenceBackend):
    def __init__(self):
        self.weight_quantizations = 0

    def quantize(self, x, **kw):
        self.weight_quantizations += kw["weight"]
        return super().quantize(x, **kw)


def _patch_backend(monkeypatch):
    counting = _CountingBackend()
    monkeypatch.setattr("megatron_int8.ops.linear.get_backend", lambda device, recipe: counting)
    return counting


def test_weight_quantization_reused_across_micro_batches_until_step(monkeypatch):
    counting = _patch_backend(monkeypatch)
    w = torch.nn.Parameter(torch.randn(32, 64))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):  # three micro-batches: fprop + dgrad each
        int8_linear(torch.randn(8, 64, requires_grad=True), w).sum().backward()
    assert counting.weight_quantizations == 1
    opt.step()
    int8_linear(torch.randn(8, 64), w)
    assert counting.weight_quantizations == 2


@pytest.mark.parametrize("recipe", [Int8Recipe(), Int8Recipe(wgrad=False), Int8Recipe(granularity="tensor")])
def test_non_reentrant_activation_checkpointing_gives_the_same_gradients(recipe):
    """torch.utils.checkpoint's default (non-reentrant) mode unpacks each saved tensor once: the backward read
    ctx.saved_tensors several times and failed ("Unpack is being triggered for a tensor that was already unpacked
    once"), e.g. under a Hugging Face model's gradient_checkpointing_enable()."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    w = torch.nn.Parameter(heavy_tailed(48, 64))
    x, g = heavy_tailed(2, 8, 64), torch.randn(2, 8, 48)
    grads = []
    for checkpointed in (False, True):
        xi = x.clone().requires_grad_(True)
        f = lambda t: int8_linear(t, w, recipe=recipe)  # noqa: E731
        (checkpoint(f, xi, use_reentrant=False) if checkpointed else f(xi)).backward(g)
        grads.append((xi.grad, w.grad.clone()))
        w.grad = None
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_weight_cache_sees_writes_through_data_by_an_optimizer(monkeypatch):
    """Megatron's optimizers copy into param.data, which the version counter does not see."""
    counting = _patch_backend(monkeypatch)
    w = torch.nn.Parameter(torch.randn(32, 64))
    x = torch.randn(8, 64)

    class CopyingOptimizer(torch.optim.Optimizer):
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                p.data.copy_(torch.randn_like(p))

    opt = CopyingOptimizer([w], {})
    y0 = int8_linear(x, w)
    opt.step()
    y1 = int8_linear(x, w)
    assert counting.weight_quantizations == 2
    assert torch.allclose(y1, int8_linear(x, w.detach().clone()), rtol=0, atol=0)
    assert not torch.allclose(y0, y1)
    w.data = torch.randn(32, 64)  # new storage
    int8_linear(x, w)
    assert counting.weight_quantizations == 4  # the detached clone above was quantized once too
    invalidate_weight_caches()
    int8_linear(x, w)
    assert counting.weight_quantizations == 5


def test_non_finite_output_gradient_raises_naming_it():
    x, w, gy = torch.randn(6, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True), torch.randn(6, 8)
    gy[2, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="output gradient"):
        int8_linear(x, w, None, Int8Recipe(check_finite="immediate")).backward(gy)
    # deferred (the default): backward completes with NaN where the bad token reaches, and the step-end
    # check names the tensor
    x.grad = w.grad = None
    int8_linear(x, w).backward(gy)
    assert torch.isnan(x.grad[2]).all() and torch.isfinite(x.grad[[0, 1, 3, 4, 5]]).all()
    assert torch.isnan(w.grad).any()
    with pytest.raises(NonFiniteError, match="output gradient"):
        raise_if_nonfinite()


@pytest.mark.parametrize("where, name", [("input", "fprop input"), ("weight", "weight")])
def test_non_finite_forward_raises_naming_the_tensor(where, name):
    x, w = torch.randn(6, 32), torch.randn(8, 32)
    {"input": x, "weight": w}[where][2, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=name):
        int8_linear(x, w, None, Int8Recipe(check_finite="immediate"))
    assert torch.isnan(int8_linear(x, w)).any()
    with pytest.raises(NonFiniteError, match=name):
        raise_if_nonfinite()


def test_bad_shapes_and_dtypes_are_clear_errors():
    with pytest.raises(ValueError, match="does not match"):
        int8_linear(torch.randn(4, 10), torch.randn(8, 12))
    with pytest.raises(ValueError, match="2-D"):
        int8_linear(torch.randn(4, 10), torch.randn(8, 10, 1))
    with pytest.raises(ValueError, match="bias"):
        int8_linear(torch.randn(4, 10), torch.randn(8, 10), torch.randn(7))
    with pytest.raises(TypeError, match="floating"):
        int8_linear(torch.ones(4, 10, dtype=torch.int64), torch.randn(8, 10))
    with pytest.raises(ValueError, match="no input features"):
        int8_linear(torch.randn(4, 0), torch.randn(8, 0))
    with pytest.raises(TypeError, match="must be an Int8Recipe, got dict"):  # not an AttributeError deep inside
        int8_linear(torch.randn(4, 16), torch.randn(8, 16), recipe={"granularity": "row"})


@pytest.mark.parametrize("recipe", [Int8Recipe(), Int8Recipe(fprop=False, dgrad=False, wgrad=False)],
                         ids=["int8", "all high"])
def test_weight_and_bias_of_another_kind_or_device_are_named(recipe):
    """An int8 weight (one quantized already, its scales elsewhere) was cast to the input's dtype and multiplied
    as if its integers were the weight; a weight on another device failed inside a GEMM."""
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="weight must be floating point, got torch.int8"):
        int8_linear(x, torch.randint(-127, 128, (8, 16), dtype=torch.int8), None, recipe)
    with pytest.raises(TypeError, match="bias must be floating point, got torch.int64"):
        int8_linear(x, torch.randn(8, 16), torch.ones(8, dtype=torch.int64), recipe)
    with pytest.raises(ValueError, match="weight is on meta, the input on cpu"):
        int8_linear(x, torch.randn(8, 16, device="meta"), None, recipe)
    with pytest.raises(ValueError, match="bias is on meta, the input on cpu"):
        int8_linear(x, torch.randn(8, 16), torch.randn(8, device="meta"), recipe)


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_tiny_inputs_stay_within_the_bound_of_the_smallest_scale(granularity):
    # an input near fp32's smallest normal gave 2-4x the product (1/scale overflowed), 1e-44 all zeros; every
    # group's amax under 3.7e-37, where amax / 127 has an infinite inverse (outliers of 8x, the largest about 40x)
    x = (heavy_tailed(64, 256, scale=8.0) * 3e-39).float()
    w = heavy_tailed(48, 256).float() * 0.05
    y = int8_linear(x, w, recipe=Int8Recipe(granularity=granularity, block_size=32))
    ref = x.double() @ w.double().t()
    half_x = torch.full_like(ref[:, :1], 2.0 ** -127)  # half of every x group's scale: amax/127 is below 2^-126
    half_w = float64_group_amax(w, granularity, 32, granularity == "block") / 254  # independent of the op
    bound = half_x @ w.double().abs().sum(dim=1, keepdim=True).t() + x.double().abs() @ half_w.t() \
        + half_x @ half_w.sum(dim=1, keepdim=True).t()
    # fp32 dequantization: the scale product is subnormal (2^-126 x 0.002), half its ulp 2^-150 per int32 unit
    slack = 2.0 ** -150 * 127 * 127 * 256 + ref.abs() * 4 * torch.finfo(torch.float32).eps
    err = (y.double() - ref).abs()
    assert (err <= bound + slack).all(), f"worst {(err / (bound + slack)).max():.2f}x the bound"
    assert (y != 0).float().mean() > 0.9  # not flushed to zero


def test_odd_inner_dimensions_are_handled():
    for K, N in [(1, 1), (3, 5), (17, 130)]:
        x, w = heavy_tailed(9, K), heavy_tailed(N, K)
        y = int8_linear(x, w)
        assert_within_int8_bound(y, x, w, "tensor", b_weight=True, what=f"K={K},N={N}")


def test_stochastic_recipe_rounds_only_gradients_stochastically():
    """Forward (activations, weights) is deterministic; gradients follow the RNG and are reproducible."""
    x, w, gy = heavy_tailed(16, 64), heavy_tailed(24, 64), heavy_tailed(16, 24)

    def run(seed):
        torch.manual_seed(seed)
        xl, wl = _leaf(x, torch.float32), _leaf(w, torch.float32)
        y = int8_linear(xl, wl, None, Int8Recipe(granularity="tensor", grad_rounding="stochastic"))
        y.backward(gy)
        return y.detach(), xl.grad, wl.grad

    (y0, dx0, dw0), (y1, dx1, dw1), (_, dx2, dw2) = run(0), run(1), run(0)
    assert torch.equal(y0, y1)
    assert not torch.equal(dx0, dx1) and not torch.equal(dw0, dw1)
    assert torch.equal(dx0, dx2) and torch.equal(dw0, dw2)


def test_high_precision_recipe_needs_no_int8_backend(monkeypatch):
    """BF16 layers (e.g. fused main_grad accumulation without apex) must not depend on the INT8 backend."""
    from megatron_int8.dispatch import ENV_BACKEND
    from megatron_int8.recipe import HIGH_PRECISION

    monkeypatch.setenv(ENV_BACKEND, "triton")  # unusable on CPU without the interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.nn.Parameter(torch.randn(8, 16))
    w.main_grad = torch.zeros(8, 16)
    x, gy = torch.randn(4, 16, requires_grad=True), torch.randn(4, 8)
    int8_linear(x, w, None, HIGH_PRECISION, tp=TPOptions(gradient_accumulation_fusion=True)).backward(gy)
    assert torch.allclose(w.main_grad, gy.t() @ x.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gemms", [dict(), dict(fprop=False), dict(fprop=False, dgrad=False, wgrad=False)],
                         ids=["int8", "fprop high", "all high"])
def test_a_weight_of_another_dtype_is_cast_to_the_inputs_on_every_path(gemms):
    """A bf16 input with fp32 weight and bias: the output is bf16 whichever GEMMs are INT8, so a fallback of all
    three to high precision (the auto fallback, the shape policy) takes what the INT8 recipe took."""
    gen = torch.Generator().manual_seed(4)
    x = heavy_tailed(6, 32, generator=gen).bfloat16().requires_grad_()
    w = heavy_tailed(16, 32, generator=gen).requires_grad_()
    b = torch.randn(16, generator=gen).requires_grad_()
    y = int8_linear(x, w, b, Int8Recipe(**gemms))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    if not any(gemms.get(g, True) for g in ("fprop", "dgrad", "wgrad")):
        assert torch.equal(y, F.linear(x, w.bfloat16(), b.bfloat16()))


def test_hp_wgrad_into_accumulates_the_bf16_product_in_fp32():
    """The BF16 linears' fused wgrad (gradient-accumulation fusion without APEX): main_grad += g^T x with no
    bf16 rounding of the product, on top of what main_grad already holds (a second micro-batch)."""
    from megatron_int8.ops.main_grad import hp_wgrad_into

    g = heavy_tailed(256, 48).to(torch.bfloat16)
    x = heavy_tailed(256, 40).to(torch.bfloat16)
    main_grad = heavy_tailed(48, 40)
    before = main_grad.clone()
    hp_wgrad_into(main_grad, g, x)
    assert_fp32_accumulation_close(main_grad, before, g, x, "CPU")


def test_hp_wgrad_into_on_the_cpu_is_megatrons_unfused_arithmetic():
    """The CPU reference adds the fp32 product as megatron's DDP hook adds an unfused weight.grad, bit for bit,
    also where a GEMM splits K (4096 tokens): the fused and unfused trainer runs then stay bitwise equal."""
    from megatron_int8.ops.main_grad import hp_wgrad_into

    g, x = heavy_tailed(4096, 48), heavy_tailed(4096, 40)
    main_grad = heavy_tailed(48, 40)
    expected = main_grad + g.t() @ x
    hp_wgrad_into(main_grad, g, x)
    assert torch.equal(main_grad, expected)


def test_cached_weight_is_not_reused_across_check_finite_settings():
    w = torch.randn(8, 32)
    w[1, 2] = float("inf")
    x = torch.randn(4, 32)
    # tensorwise: the Inf makes the one weight scale NaN, so every output is NaN (row scales: one column)
    assert torch.isnan(int8_linear(x, w, None, Int8Recipe(granularity="tensor", check_finite="off"))).all()
    assert torch.isnan(int8_linear(x, w, None, Int8Recipe(check_finite="off"))[:, 1]).all()
    with pytest.raises(NonFiniteError, match="weight"):
        int8_linear(x, w, None, Int8Recipe(check_finite="immediate"))


def test_cached_weight_is_not_reused_across_block_sizes():
    """A weight quantized in 32x32 tiles must not serve a recipe of 64x64 tiles: the second recipe's output and
    input gradient (Q(W) and Q(W)^T) equal those of an uncached quantization."""
    w = heavy_tailed(40, 96).requires_grad_()
    x, gy = heavy_tailed(12, 96), heavy_tailed(12, 40)
    int8_linear(x, w, None, Int8Recipe(granularity="block", block_size=32)).backward(gy)
    results = []
    for cache in (True, False):
        xl = x.clone().requires_grad_()
        y = int8_linear(xl, w, None, Int8Recipe(granularity="block", block_size=64, cache_weights=cache))
        y.backward(gy)
        results.append((y.detach(), xl.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_no_tokens_gives_empty_output_and_zero_weight_gradient(granularity):
    """An MoE expert that received no tokens still runs its linears: M = 0 in fprop and dgrad, and K = 0
    in wgrad, whose product is then zero (added to main_grad: no change)."""
    recipe = Int8Recipe(granularity=granularity, block_size=16)
    w = torch.randn(8, 32, requires_grad=True)
    x = torch.randn(0, 32, requires_grad=True)
    y = int8_linear(x, w, None, recipe)
    assert y.shape == (0, 8)
    y.backward(torch.randn(0, 8))
    assert x.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros(8, 32))
    w2 = torch.nn.Parameter(torch.randn(8, 32))
    w2.main_grad = torch.randn(8, 32)
    before = w2.main_grad.clone()
    int8_linear(x, w2, None, recipe, tp=TPOptions(gradient_accumulation_fusion=True)).backward(torch.randn(0, 8))
    assert torch.equal(w2.main_grad, before)
