"""A warp-specialized CUDA INT8 GEMM for Hopper (`megatron_int8/csrc/int8_gemm_sm90.cu`), built on first use.

Same contract as `triton_gemm` for what it covers: tensorwise or row-wise scales, no bias, a bf16 output
(or `out`) or an fp32 `accumulate_into`; results bit-identical to the reference backend. `sm90_grouped_gemm`:
the same kernel over all MoE experts at once (reference.grouped_gemm's contract, bf16 output). It exists because
Triton 3.6 leaves Hopper's INT8 GEMMs at 60-64% of peak (docs/kernels.md). The source is compiled with the
machine's `nvcc` (sm_90a) into a per-user cache, keyed by the source's hash, and loaded with ctypes, so it
does not depend on torch's C++ ABI. Where there is no nvcc, no sm_90 GPU or the build fails, `available()`
is False with the reason in `unavailable_reason()`, and the dispatch keeps the Triton kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from .. import reference as ref
from ..dispatch import build_cache_dir
from .launch import device_index, num_sms


SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "int8_gemm_sm90.cu"
TILE_M = 128  # the kernel's kBlockM: a grouped GEMM's expert strips must be whole tiles
_ERRORS = {1: "unsupported shape, stride or alignment", 2: "the driver has no cuTensorMapEncodeTiled",
           3: "the driver rejected a tensor map"}


def _nvcc() -> Optional[str]:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def build(out_dir: Optional[str] = None) -> Path:
    """Compile the source into `<cache>/int8_gemm_sm90-<hash>.so` (atomically; concurrent ranks are safe)."""
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME)")
    text = SOURCE.read_bytes()
    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--shared", "-Xcompiler", "-fPIC"]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout  # links its cudart
    digest = hashlib.sha256(text + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    cache = Path(out_dir or build_cache_dir(str(Path.home() / ".cache" / "megatron_int8")))
    target = cache / f"int8_gemm_sm90-{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run([nvcc, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {SOURCE}:\n{proc.stderr[-4000:]}")
        os.replace(built, target)
    return target


@functools.lru_cache(maxsize=None)
def _library():
    """(ctypes library, None) or (None, reason)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return None, f"needs compute capability 9.0, found {torch.cuda.get_device_capability()}"
    try:
        lib = ctypes.CDLL(str(build()))
        probe = lib.megatron_int8_gemm_sm90_probe()  # the driver can load the kernel on this GPU
        if probe:
            raise RuntimeError(f"the driver cannot load the kernel (cudaError_t {probe})")
    except (RuntimeError, OSError) as exc:
        warnings.warn(f"megatron_int8: the CUDA INT8 GEMM is unavailable, the Triton kernels run instead: {exc}")
        return None, str(exc)
    fn = lib.megatron_int8_gemm_sm90
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p]
    return lib, None


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> Optional[str]:
    return _library()[1]


def _operands_ok(a: ref.QTensor, b2d: torch.Tensor, on_device=()) -> bool:
    """What both modes need of a, of b as the 2-D [rows, K] the kernel reads, and of a's scales: int8 on one
    CUDA device (with `on_device`), K-major rows, K a multiple of 16 in the int32-exact range, 16-byte
    aligned pointers and row strides, fp32 scales."""
    ad = a.data
    M, K = ad.shape
    return (ad.is_cuda and all(t.device == ad.device for t in (b2d, a.scale, *on_device))
            and ad.dtype == torch.int8 and b2d.dtype == torch.int8 and M > 0 and b2d.shape[0] > 0
            and ad.stride(1) == 1 and b2d.stride(1) == 1 and K % 16 == 0 and 0 < K <= ref.MAX_EXACT_K
            and ad.stride(0) % 16 == 0 and b2d.stride(0) % 16 == 0
            and ad.data_ptr() % 16 == 0 and b2d.data_ptr() % 16 == 0 and a.scale.dtype == torch.float32)


def supports(a: ref.QTensor, b: ref.QTensor, bias, out_dtype: torch.dtype, accumulate_into, out) -> bool:
    """Whether `sm90_gemm` takes these operands (the caller falls back to Triton otherwise)."""
    M, N = a.data.shape[0], b.data.shape[0]
    dest = accumulate_into if accumulate_into is not None else out
    elem = 4 if accumulate_into is not None else 2
    return (a.granularity in ("tensor", "row") and b.granularity == a.granularity and bias is None
            and (accumulate_into is not None or out_dtype == torch.bfloat16)
            and _operands_ok(a, b.data, (b.scale,) + (() if dest is None else (dest,)))
            and b.scale.dtype == torch.float32
            and (a.scale.numel() == 1 and b.scale.numel() == 1 if a.granularity == "tensor" else
                 a.scale.shape == (M,) and b.scale.shape == (N,))
            and (N * elem % 16 == 0 if dest is None else
                 (dest.stride(1) == 1 and dest.stride(0) >= N and dest.stride(0) * elem % 16 == 0
                  and dest.data_ptr() % 16 == 0)))


def supports_grouped(a: ref.QTensor, b: ref.QTensor, out_dtype: torch.dtype) -> bool:
    """Whether `sm90_grouped_gemm` takes operands that passed reference.check_grouped_operands."""
    E, N, K = b.data.shape
    return (out_dtype == torch.bfloat16 and ref.SEGMENT_ALIGN % TILE_M == 0 and N % 8 == 0
            and b.data.is_contiguous() and _operands_ok(a, b.data.view(E * N, K), (b.scale,))
            and b.scale.dtype == torch.float32 and a.scale.shape == (a.data.shape[0],)
            and b.scale.is_contiguous())


def sm90_grouped_gemm(a: ref.QTensor, b: ref.QTensor, segments: ref.Segments, *,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """reference.grouped_gemm in one launch: rows of segment e = dequant(a_e @ b[e]^T), [R, N] bf16. Every
    row of a belongs to a segment, so every output row is written (alignment rows: a's zero rows give 0)."""
    ref.check_grouped_operands(a, b, segments)
    if not supports_grouped(a, b, out_dtype):
        raise ValueError("sm90_grouped_gemm: operands outside its contract (see supports_grouped())")
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(f"sm90_grouped_gemm unavailable: {reason}")
    (R, K), (E, N, _) = a.data.shape, b.data.shape
    device = a.data.device
    index = device_index(device)
    out = torch.empty((R, N), dtype=out_dtype, device=device)
    launch(lib, a.data.data_ptr(), a.data.stride(0), b.data.data_ptr(), K, E * N, out.data_ptr(), N,
           a.scale.data_ptr(), a.scale.stride(0), b.scale.data_ptr(), 1, R, N, K,
           segments.strip_experts(device).data_ptr(), ref.SEGMENT_ALIGN, 0, num_sms(index), index, _stream(index))
    return out


def sm90_gemm(a: ref.QTensor, b: ref.QTensor, *, out_dtype: torch.dtype = torch.bfloat16,
              accumulate_into: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dequant(a @ b^T) as bf16 (into `out` if given), or added into the fp32 `accumulate_into` and returned."""
    ref.check_gemm_operands(a, b)
    ref.check_gemm_out(a, b, out_dtype, accumulate_into, out)
    if not supports(a, b, None, out_dtype, accumulate_into, out):
        raise ValueError("sm90_gemm: operands outside its contract (see supports())")
    return planned(a, b, out_dtype, accumulate_into is not None)(a, b, accumulate_into, out)


def planned(a: ref.QTensor, b: ref.QTensor, out_dtype: torch.dtype, accumulate: bool):
    """`run(a, b, accumulate_into, out) -> c` for operands like these (`supports` holds for them): int8_gemm's
    plans key on shapes, strides and alignments, so per call only pointers and the stream are read."""
    lib, reason = _library()
    if lib is None:
        raise RuntimeError(f"sm90_gemm unavailable: {reason}")
    M, K = a.data.shape
    N = b.data.shape[0]
    lda, ldb, device = a.data.stride(0), b.data.stride(0), a.data.device
    row = a.granularity == "row"
    sa_stride, sb_stride = (a.scale.stride(0), b.scale.stride(0)) if row else (0, 0)
    index = device_index(device)
    tail = (M, N, K, None, 0, int(accumulate), num_sms(index), index)

    def run(a, b, accumulate_into, out):
        dest = accumulate_into if accumulate else out
        if dest is None:
            dest = torch.empty((M, N), dtype=out_dtype, device=device)
        launch(lib, a.data.data_ptr(), lda, b.data.data_ptr(), ldb, N, dest.data_ptr(), dest.stride(0),
               a.scale.data_ptr(), sa_stride, b.scale.data_ptr(), sb_stride, *tail, _stream(index))
        return dest
    return run


def _stream(index: int) -> int:
    """The current CUDA stream of device `index` as a raw handle: what `torch.cuda.current_stream(d).cuda_stream`
    returns, without building a Stream object (about 8 us of host time per GEMM on an H100 host; Triton's
    launcher reads the stream the same way)."""
    return torch._C._cuda_getCurrentRawStream(index)


def launch(lib, *args) -> None:
    """One kernel launch through the library's C entry point (arguments as in int8_gemm_sm90.cu)."""
    code = lib.megatron_int8_gemm_sm90(*args)
    if code:
        detail = _ERRORS.get(code) or f"CUDA error {code - 100} at launch"
        raise RuntimeError(f"sm90_gemm: {detail} (M, N, K = {args[11:14]})")
