"""int8_linear under torch.compile(fullgraph=True): the custom ops (ops/library.py) against eager.

The compiled graph calls the same backend through the ops, so with the "aot_eager" compiler its outputs and
gradients are the eager ones bit for bit; under inductor the ops between the linears may round differently.
"""
import pytest
import torch

from int8_bounds import assert_within_int8_bound, heavy_tailed
from megatron_int8 import Int8Recipe, int8_linear
from megatron_int8.ops import library
from megatron_int8.reference import ReferenceBackend, TOKEN_PAD

RECIPES = [Int8Recipe(), Int8Recipe(granularity="tensor", grad_rounding="stochastic"),
           Int8Recipe(granularity="block", block_size=32), Int8Recipe(wgrad=False), Int8Recipe(fprop=False),
           Int8Recipe(cache_dgrad_weight=False), Int8Recipe(smooth_swiglu=True)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test's models share one forward code object: start each test with Dynamo's caches empty, so
    that its compilations do not count against the recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TwoLinears(torch.nn.Module):
    def __init__(self, recipe, k=64, hidden=96, n=48, dtype=torch.float32):
        super().__init__()
        self.recipe = recipe
        self.up = torch.nn.Linear(k, hidden, dtype=dtype)
        self.down = torch.nn.Linear(hidden, n, bias=False, dtype=dtype)
        with torch.no_grad():
            self.up.weight.copy_(heavy_tailed(hidden, k, dtype=dtype) / k ** 0.5)

    def forward(self, x):
        h = torch.nn.functional.gelu(int8_linear(x, self.up.weight, self.up.bias, self.recipe))
        return int8_linear(h, self.down.weight, None, self.recipe)


def _run(model, x, gy):
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(gy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def _compare(model, shapes, compiler, dtype=torch.float32, exact=True):
    compiled = torch.compile(model, fullgraph=True, backend=compiler)
    for shape in shapes:
        x, gy = heavy_tailed(*shape, 64, dtype=dtype), heavy_tailed(*shape, 48, dtype=dtype)
        # stochastic rounding draws from the global generator: the same seed for both runs
        torch.manual_seed(1)
        eager = _run(model, x, gy)
        torch.manual_seed(1)
        got = _run(compiled, x, gy)
        for e, g in zip(eager, got):
            assert g.dtype == e.dtype and g.shape == e.shape
            if exact:
                assert torch.equal(g, e)
            else:
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4 * e.abs().max().item())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_compiled_fullgraph_equals_eager(recipe):
    _compare(TwoLinears(recipe), [(5, 3)], "aot_eager")


def test_compiled_bf16_and_dynamic_token_counts():
    """Token counts that change between calls (Dynamo recompiles with symbolic sizes on the second one)."""
    model = TwoLinears(Int8Recipe(), dtype=torch.bfloat16)
    _compare(model, [(5, 3), (7, 2), (33,)], "aot_eager", dtype=torch.bfloat16)


def test_compiled_with_inductor_within_fp32_rounding():
    _compare(TwoLinears(Int8Recipe()), [(6, 2)], "inductor", exact=False)


def test_compiled_result_within_quantization_bound():
    """Not only equal to eager: the compiled single linear is within the INT8 bound of a float64 product."""
    x, w, gy = heavy_tailed(40, 64), heavy_tailed(24, 64), heavy_tailed(40, 24)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.compile(lambda a, b: int8_linear(a, b), fullgraph=True, backend="aot_eager")(xl, wl)
    y.backward(gy)
    assert_within_int8_bound(y.detach(), x, w, "row", b_weight=True, what="fprop")
    assert_within_int8_bound(xl.grad, gy, w.t(), "row", b_weight=True, what="dgrad")
    assert_within_int8_bound(wl.grad, gy.t(), x.t(), "row", what="wgrad")


def test_weight_cache_works_inside_compiled_graphs(monkeypatch):
    """Q(W) comes from the cache when the graph runs: once per weight change, not once per call."""
    names = []
    quantize = ReferenceBackend.quantize

    def counting(self, x, **kw):
        names.append(kw["name"])
        return quantize(self, x, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", counting)
    model = TwoLinears(Int8Recipe())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, gy = heavy_tailed(8, 64), heavy_tailed(8, 48)
    weight_quantizations = []
    for step in range(3):
        names.clear()
        _run(compiled, x, gy)
        weight_quantizations.append(names.count("weight"))
        if step == 1:
            torch.optim.SGD(model.parameters(), lr=0.1).step()  # the optimizer hook invalidates the cache
    assert weight_quantizations == [2, 0, 2]


@pytest.mark.parametrize("granularity,weight,rows,pad", [
    ("row", False, 37, TOKEN_PAD), ("tensor", False, 37, TOKEN_PAD), ("block", False, 37, TOKEN_PAD),
    ("block", True, 37, TOKEN_PAD), ("tensor", True, 1, 1)])  # the last: a byte transpose that is a view of Q(x)
def test_quantize_op_fake_matches_real(granularity, weight, rows, pad):
    """opcheck: the fake implementation's shapes and strides are those of the real outputs, no output aliases
    another, and the op traces under make_fx / AOT dispatch (dynamic sizes too)."""
    x = heavy_tailed(rows, 80)
    args = (x, "reference", granularity, 16, weight, True, True, False, "fprop input", "deferred", pad)
    torch.library.opcheck(library.quantize_op, args)
    row = library.quantize_op(*args)
    q = ReferenceBackend().quantize(x, granularity=granularity, block_size=16, weight=weight, rowwise=True,
                                    columnwise=True, columnwise_pad=pad)
    for got, want in zip(row, (q[0].data, q[0].scale, q[1].data, q[1].scale)):
        assert torch.equal(got, want)
    assert len({t.untyped_storage().data_ptr() for t in row}) == 4


def test_gemm_ops_fake_match_real():
    a = ReferenceBackend().quantize(heavy_tailed(19, 64), granularity="row", block_size=128, weight=False,
                                    rowwise=True, columnwise=False)[0]
    w = heavy_tailed(24, 64)
    b = ReferenceBackend().quantize(w, granularity="row", block_size=128, weight=True, rowwise=True,
                                    columnwise=False)[0]
    bias = torch.randn(24)
    torch.library.opcheck(library.gemm_op, (a.data, a.scale, b.data, b.scale, "reference", "row", 128, False, False,
                                            torch.bfloat16, bias, True))
    for transposed, cache_dgrad_weight in ((False, True), (True, False)):
        a_op = a if not transposed else ReferenceBackend().quantize(
            heavy_tailed(19, 24), granularity="row", block_size=128, weight=False, rowwise=True, columnwise=False)[0]
        torch.library.opcheck(library.weight_gemm_op, (a_op.data, a_op.scale, w, transposed, "reference", "row", 128,
                                                       "deferred", True, cache_dgrad_weight, True, True, torch.float32,
                                                       None, True))


def test_ops_carry_no_python_autograd_layer():
    """The ops are plain Library ops: one CompositeExplicitAutograd kernel, a fake one, and no Autograd kernel
    of their own (custom_op's Python autograd wrapper cost ~50 us of host time per call)."""
    for op in (library.quantize_op, library.gemm_op, library.weight_gemm_op):
        name = op._schema.name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
        assert torch.Tag.pt2_compliant_tag in op.tags


def test_unsupported_under_compile_is_a_clear_error():
    backend = library.TracedBackend("reference")
    with pytest.raises(NotImplementedError, match="torch.compile.*accumulate_into"):
        backend.gemm(None, None, out_dtype=torch.float32, accumulate_into=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="columnwise_segments"):
        backend.quantize(torch.zeros(2, 2), granularity="row", block_size=128, weight=False, rowwise=True,
                         columnwise=True, columnwise_segments=object())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_on_gpu_with_triton_backend(mode):
    """Inductor on CUDA with the Triton backend (and, reduce-overhead, its CUDA graphs) against eager."""
    torch.manual_seed(0)
    model = TwoLinears(Int8Recipe(backend="triton"), k=256, hidden=512, n=48, dtype=torch.bfloat16).cuda()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records its graph on a later call
        x, gy = heavy_tailed(64, 256, dtype=torch.bfloat16).cuda(), heavy_tailed(64, 48, dtype=torch.bfloat16).cuda()
        eager, got = _run(model, x, gy), _run(compiled, x, gy)
        for e, g in zip(eager, got):
            torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2 * e.abs().max().item())


@pytest.mark.gpu
def test_eager_cuda_graph_capture_still_works():
    x = heavy_tailed(64, 256, dtype=torch.bfloat16).cuda().requires_grad_()
    w = torch.nn.Parameter(heavy_tailed(128, 256, dtype=torch.bfloat16).cuda())
    gy = heavy_tailed(64, 128, dtype=torch.bfloat16).cuda()

    def step():
        y = int8_linear(x, w)
        y.backward(gy)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            expected = step().detach().clone()
            x.grad = w.grad = None
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected)


def test_the_traced_backend_choice_reads_no_importlib():
    """On a GPU the backend is chosen inside the linear's autograd.Function while Dynamo traces it, where it cannot
    trace importlib (H100, 2026-11-27: find_spec refused): the choice reads a module constant."""
    import inspect

    from megatron_int8 import dispatch

    assert "importlib" not in inspect.getsource(dispatch.triton_installed)
    assert "importlib" not in inspect.getsource(dispatch.resolve_backend_name)
    assert dispatch.triton_installed() is dispatch.TRITON_FOUND
