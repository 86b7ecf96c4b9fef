"""The custom ops' fake implementations against the Triton backend's real outputs (TRITON_INTERPRET=1 on CPU):
the same shapes, dtypes and strides, so a compiled graph plans its buffers as the kernels write them.

Runs in a subprocess with TRITON_INTERPRET=1 (tests/interpreter.py)."""
import importlib.util

import pytest
import torch
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

if not INTERPRETING:

    def test_under_triton_interpreter():
        run_file_interpreted(__file__, timeout=900)

from int8_bounds import heavy_tailed  # noqa: E402
from megatron_int8 import Int8Recipe, int8_linear  # noqa: E402
from megatron_int8.ops import library  # noqa: E402
from megatron_int8.reference import TOKEN_PAD  # noqa: E402


@needs_interpreter
@pytest.mark.parametrize("granularity,weight", [("row", False), ("row", True), ("tensor", False), ("block", False),
                                                ("block", True)])
@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_fake_quantize_matches_triton(granularity, weight, rowwise, columnwise):
    x = heavy_tailed(37, 80)
    args = ("triton", granularity, 32, weight, rowwise, columnwise, False, "fprop input", "deferred", TOKEN_PAD)
    real = library.quantize_op(x, *args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = library.quantize_op(mode.from_tensor(x), *args)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    storages = [r.untyped_storage().data_ptr() for r in real if r.numel()]
    assert len(storages) == len(set(storages)), "an op's outputs must not alias each other"


@needs_interpreter
def test_compiled_equals_eager_with_triton_backend():
    torch._dynamo.reset()
    recipe = Int8Recipe(backend="triton")
    x, w, gy = heavy_tailed(24, 64), heavy_tailed(32, 64), heavy_tailed(24, 32)
    outs = []
    for fn in (int8_linear, torch.compile(int8_linear, fullgraph=True, backend="aot_eager")):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xl, wl, None, recipe)
        y.backward(gy)
        outs.append((y.detach(), xl.grad, wl.grad))
    for e, c in zip(*outs):
        assert torch.equal(e, c)
