"""The CUDA INT8 GEMM's build and host-side checks, on the CPU (its GPU tests: test_sm90_gemm_gpu.py).

The source is compiled for sm_90a with the machine's nvcc (skipped where there is none), and the library's
entry point must refuse shapes, strides and alignments the kernel cannot take before it touches a GPU."""
import ctypes
import importlib

import pytest
import torch

S = importlib.import_module("megatron_int8.kernels.sm90_gemm")
qref = importlib.import_module("megatron_int8.reference")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if S._nvcc() is None:
        pytest.skip("no nvcc")
    path = S.build(out_dir=str(tmp_path_factory.mktemp("sm90")))
    assert path.exists() and path == S.build(out_dir=str(path.parent))  # cached by the source's hash
    lib = ctypes.CDLL(str(path))
    lib.megatron_int8_gemm_sm90.restype = ctypes.c_int
    return lib


def _call(lib, M=256, N=256, K=256, lda=256, ldb=256, ldc=256, a=4096, b=8192, out=16384, accumulate=0, device=0,
          b_rows=None, strips=0, strip_rows=0):
    L, I = ctypes.c_long, ctypes.c_int
    return lib.megatron_int8_gemm_sm90(ctypes.c_void_p(a), L(lda), ctypes.c_void_p(b), L(ldb),
                                       I(N if b_rows is None else b_rows), ctypes.c_void_p(out), L(ldc),
                                       ctypes.c_void_p(64), I(0), ctypes.c_void_p(64), I(0), I(M), I(N), I(K),
                                       ctypes.c_void_p(strips), I(strip_rows), I(accumulate), I(132), I(device),
                                       ctypes.c_void_p(0))


GROUPED = dict(strips=256, strip_rows=128, b_rows=4 * 256)  # 4 experts of N = 256 rows, M = 256: 2 strips


@pytest.mark.parametrize("bad", [dict(K=200, lda=208, ldb=208), dict(lda=264), dict(ldb=8), dict(M=0), dict(N=-1),
                                 dict(K=0), dict(a=4100), dict(b=8200), dict(out=16388), dict(ldc=4),
                                 dict(ldc=2, accumulate=1), dict(lda=128), dict(ldb=240), dict(ldc=248),
                                 dict(device=-1), dict(device=64), dict(b_rows=512),  # plain: b_rows must be N
                                 # grouped: whole-tile strips that divide M, b_rows a multiple of N
                                 dict(GROUPED, strip_rows=0), dict(GROUPED, strip_rows=64),
                                 dict(GROUPED, strip_rows=384, M=768 + 128), dict(GROUPED, b_rows=1000),
                                 dict(GROUPED, b_rows=0)])
def test_entry_point_refuses_what_the_kernel_cannot_take(lib, bad):
    assert _call(lib, **bad) == 1
    if not torch.cuda.is_available():  # valid calls get past the checks to the driver, which is absent
        assert _call(lib) == 2
        assert _call(lib, **GROUPED) == 2


def test_shared_memory_fits_hopper(lib):
    """3 stages of 128x128 + 256x128 int8 tiles, a 64 KB output staging buffer, barriers, alignment slack:
    within the 227 KB a Hopper block may take."""
    lib.megatron_int8_gemm_sm90_smem_bytes.restype = ctypes.c_int
    assert 3 * (128 + 256) * 128 + 64 * 1024 < lib.megatron_int8_gemm_sm90_smem_bytes() <= 227 * 1024


def test_unavailable_without_a_hopper_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("a Hopper GPU is present")
    assert not S.available() and S.unavailable_reason()
    a = qref.QTensor(torch.zeros(32, 32, dtype=torch.int8), torch.tensor(1.0), "tensor")
    assert not S.supports(a, a, None, torch.bfloat16, None, None)  # CPU tensors
    with pytest.raises(ValueError, match="contract"):
        S.sm90_gemm(a, a)
    segments = qref.Segments.for_counts([100, 20])
    x = qref.QTensor(torch.zeros(segments.rows, 32, dtype=torch.int8), torch.ones(segments.rows), "row")
    w = qref.QTensor(torch.zeros(2, 16, 32, dtype=torch.int8), torch.ones(2, 16), "row")
    assert not S.supports_grouped(x, w, torch.bfloat16)
    with pytest.raises(ValueError, match="contract"):
        S.sm90_grouped_gemm(x, w, segments)
