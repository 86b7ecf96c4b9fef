"""kernels/launch.py: a cached CompiledKernel is reused only for launches Triton would specialize
identically, and the direct launch passes every parameter in the kernel's order."""
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_int8.kernels import launch  # noqa: E402

INTS = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 4096, 4097, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**32,
        2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16]
OTHERS = [True, False, 0.5, 1.0, -3.25, None]


def _triton_specialization(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


@pytest.mark.parametrize("a, b", list(itertools.combinations(INTS + OTHERS, 2)))
def test_equal_signatures_mean_equal_triton_specializations(a, b):
    if launch._arg_signature(a) == launch._arg_signature(b):
        assert _triton_specialization(a) == _triton_specialization(b), (a, b)


def test_tensor_signature_is_dtype_and_16_byte_alignment():
    base = torch.zeros(256, dtype=torch.int8)
    views = [base, base[1:], base[8:], base[16:], base.view(torch.float32), base.view(torch.float32)[1:],
             base.view(torch.float32)[4:], base.view(torch.bfloat16)[8:]]
    for a, b in itertools.combinations(views, 2):
        same = launch._arg_signature(a) == launch._arg_signature(b)
        assert same == (_triton_specialization(a) == _triton_specialization(b)), (a.dtype, a.data_ptr() % 16,
                                                                                  b.dtype, b.data_ptr() % 16)


def test_unsupported_argument_is_an_error():
    with pytest.raises(TypeError, match="unsupported kernel argument of type list"):
        launch._arg_signature([1, 2])


class _Param:
    def __init__(self, name, default):
        self.name, self.default = name, default


class _FakeCompiled:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("direct", grid, args))


class _FakeKernel:
    """Stands in for a JITFunction: kernel(x_ptr, n, BLOCK: constexpr, EVEN: constexpr = True)."""

    def __init__(self):
        import inspect

        self.calls = []
        self.params = [_Param("x_ptr", inspect.Parameter.empty), _Param("n", inspect.Parameter.empty),
                       _Param("BLOCK", inspect.Parameter.empty), _Param("EVEN", True)]
        self.compiled = _FakeCompiled(self.calls)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return self.compiled
        return run


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_first_launch_compiles_then_identical_signatures_go_direct(direct):
    kernel = _FakeKernel()
    cache = launch.LaunchCache(kernel)
    x = torch.zeros(64, dtype=torch.float32)
    cache.launch((4,), x, 32, BLOCK=16, num_warps=4)
    cache.launch((5, 2), x, 48, BLOCK=16, num_warps=4)  # 48: also divisible by 16, not 1, i32
    assert kernel.calls[0] == ("jit", (4,), (x, 32), {"BLOCK": 16, "num_warps": 4})
    # the direct launch takes a 3-D grid and every parameter in order, the default of EVEN included
    assert kernel.calls[1] == ("direct", (5, 2, 1), (x, 48, 16, True))
    assert len(cache) == 1


@pytest.mark.parametrize("change", ["int not divisible by 16", "int 1", "misaligned pointer", "dtype",
                                    "constexpr", "launch option"])
def test_a_different_signature_goes_through_jit(direct, change):
    kernel = _FakeKernel()
    cache = launch.LaunchCache(kernel)
    x = torch.zeros(64, dtype=torch.float32)
    cache.launch((1,), x, 32, BLOCK=16, num_warps=4)
    args, kwargs = [x, 32], {"BLOCK": 16, "num_warps": 4}
    if change == "int not divisible by 16":
        args[1] = 33
    elif change == "int 1":
        args[1] = 1
    elif change == "misaligned pointer":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.view(torch.int32)
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    else:
        kwargs["num_warps"] = 8
    cache.launch((1,), *args, **kwargs)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"] and len(cache) == 2


def test_switched_off_or_interpreted_every_launch_goes_through_jit(direct, monkeypatch):
    kernel = _FakeKernel()
    cache = launch.LaunchCache(kernel)
    x = torch.zeros(64)
    monkeypatch.setattr(launch, "DIRECT", False)
    cache.launch((1,), x, 32, BLOCK=16)
    cache.launch((1,), x, 32, BLOCK=16)
    monkeypatch.setattr(launch, "DIRECT", True)
    monkeypatch.setattr(launch, "INTERPRETING", True)
    cache.launch((1,), x, 32, BLOCK=16)
    assert [c[0] for c in kernel.calls] == ["jit"] * 3 and len(cache) == 0


def test_the_table_stays_bounded(direct, monkeypatch):
    monkeypatch.setattr(launch, "MAX_SIGNATURES", 3)
    kernel = _FakeKernel()
    cache = launch.LaunchCache(kernel)
    x = torch.zeros(64)
    for block in range(10):
        cache.launch((1,), x, 32, BLOCK=block)
    assert len(cache) <= 3



def test_bound_launch_fills_its_per_call_arguments_and_goes_direct_after_the_first(direct):
    kernel = _FakeKernel()
    cache = launch.LaunchCache(kernel)
    bound = cache.prepare((3,), (launch.ARG, 32), BLOCK=16, num_warps=4)
    x, y = torch.zeros(64), torch.ones(64)
    bound(x)
    bound(y)
    assert kernel.calls[0] == ("jit", (3,), (x, 32), {"BLOCK": 16, "num_warps": 4})
    # the fixed integer, the constexpr and the default follow the per-call tensor, on the 3-D grid
    assert kernel.calls[1][:2] == ("direct", (3, 1, 1)) and kernel.calls[1][2][1:] == (32, 16, True)
    assert kernel.calls[1][2][0] is y
    assert len(cache) == 1


def test_bound_launch_checks_the_number_of_per_call_arguments(direct):
    bound = launch.LaunchCache(_FakeKernel()).prepare((1,), (launch.ARG, 32), BLOCK=16)
    with pytest.raises(TypeError, match="1 per-call arguments expected, got 2"):
        bound(torch.zeros(4), torch.zeros(4))


def test_bound_launch_switched_off_or_interpreted_goes_through_jit(direct, monkeypatch):
    kernel = _FakeKernel()
    bound = launch.LaunchCache(kernel).prepare((2,), (launch.ARG, 32), BLOCK=16)
    x = torch.zeros(8)
    bound(x)  # bound to the compiled kernel
    monkeypatch.setattr(launch, "DIRECT", False)  # switched off at runtime (A/B timing): JIT from here on
    bound(x)
    bound(x)
    monkeypatch.setattr(launch, "DIRECT", True)
    bound(x)
    monkeypatch.setattr(launch, "INTERPRETING", True)
    fresh = launch.LaunchCache(kernel).prepare((2,), (launch.ARG, 32), BLOCK=16)
    fresh(x)
    fresh(x)
    assert [c[0] for c in kernel.calls] == ["jit", "jit", "jit", "direct", "jit", "jit"]


def test_plan_cache_drops_the_least_recently_used():
    cache = launch.PlanCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2
