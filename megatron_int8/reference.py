"""Reference (pure PyTorch) INT8 quantization, dequantization and scaled INT8 GEMM.

Conventions, shared with the Triton kernels:
- an operand is a 2-D tensor [R, C] whose *last* axis C is the GEMM's contraction axis (K-major, the
  layout Hopper's INT8 tensor cores need for both operands); `gemm(a, b)` computes a @ b^T -> [Ra, Rb];
- scale = amax / 127 in fp32 (1.0 for an all-zero group; at least MIN_SCALE, so that 1 / scale is finite),
  q = clamp(round(x * (1 / scale)), -127, 127):
  one IEEE fp32 reciprocal per group and an fp32 multiply per element (a per-element division made the
  quantize kernels instruction-bound), round half-to-even (or floor(v + U[0,1)) when stochastic);
- scale shapes: "tensor" -> [] ; "row" -> [R] ; "block" -> [R, ceil(C/B)] for 1xB tiles, or
  [ceil(R/B), ceil(C/B)] for BxB tiles (weights).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

from .recipe import GRANULARITIES, QMAX

# The least scale, fp32's smallest normal number (taken where amax < 127 * 2^-126, 1.5e-36): below 3.7e-37 amax /
# 127 has an infinite inverse, and every element rounded to +-127 (an output 2-4x too large); at it such groups
# quantize within half of 2^-126.
MIN_SCALE = 2.0 ** -126
# |acc| <= 127 * 127 * K must fit in int32: split longer contractions and sum the pieces in fp32.
MAX_EXACT_K = (2**31 - 1) // (QMAX * QMAX) // 128 * 128
# MoE experts' token segments start at multiples of this (see Segments): no GEMM tile (BLOCK_M <= 128) and
# no quantize strip ever holds tokens of two experts.
SEGMENT_ALIGN = 128
# wgrad contracts over tokens: Q(X)^T and Q(dY)^T get their token axis zero-padded to a multiple of 16, so
# an MoE expert's arbitrary token count still gives 16-byte aligned rows (see pad_columns)
TOKEN_PAD = 16


class NonFiniteError(FloatingPointError):
    """Raised when a tensor that is about to be quantized holds Inf or NaN."""


@dataclasses.dataclass
class QTensor:
    """An INT8 operand [R, C] (C = contraction axis) with its fp32 scales."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    block_size: int = 128
    tile2d: bool = False  # block granularity with BxB tiles (weights)

    def __post_init__(self):  # a misspelt granularity would otherwise read as a per-row or per-block scale further on
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"QTensor granularity {self.granularity!r}: one of {GRANULARITIES}")
        if self.tile2d and self.granularity != "block":
            raise ValueError(f"QTensor tile2d (BxB tiles) is for block granularity, not {self.granularity!r}")

    @property
    def shape(self):
        return self.data.shape

    def scale_per_row_block(self) -> torch.Tensor:
        """Block scales as [R, ceil(C/B)] (BxB tiles repeated over their rows)."""
        assert self.granularity == "block"
        if not self.tile2d:
            return self.scale
        return self.scale.repeat_interleave(self.block_size, dim=0)[: self.data.shape[0]]

    def row_range(self, rows: slice) -> "QTensor":
        """Rows [start, stop) with their scales (a tensorwise scale is shared); not for BxB-tile operands."""
        if self.tile2d:
            raise ValueError("row_range: a BxB-tile operand's scales cover blocks of rows")
        scale = self.scale if self.granularity == "tensor" else self.scale[rows]
        return QTensor(self.data[rows], scale, self.granularity, self.block_size)

    def transposed(self) -> "QTensor":
        """Q(x)^T without re-quantizing: exact for tensorwise and BxB-tile scales only."""
        if self.granularity == "tensor":
            return QTensor(self.data.t().contiguous(), self.scale, "tensor", self.block_size)
        if self.granularity == "block" and self.tile2d:
            return QTensor(self.data.t().contiguous(), self.scale.t().contiguous(), "block", self.block_size, True)
        raise ValueError(f"a {self.granularity}-wise operand must be re-quantized along the other axis, not transposed")

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize(self).to(dtype)


def device_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table built on the host, on `device`. On CUDA it goes through pinned memory without blocking:
    torch.tensor(values, device=cuda) copies from pageable memory and synchronizes the stream, which drains
    the GPU's queue each time (four times per MoE layer and micro-batch, at the eager step's most
    host-bound point, right after the routing's own sync)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclasses.dataclass(frozen=True)
class Segments:
    """The experts' row ranges [offsets[e], offsets[e + 1]) of a token-sorted MoE operand.

    Each range starts at a multiple of SEGMENT_ALIGN (an expert's tokens are followed by zero rows up to
    the next multiple), so the grouped kernels map every aligned strip of rows to one expert, and the
    wgrad operands of expert e are the aligned column slice [offsets[e], offsets[e + 1]) of Q(x^T).
    """

    offsets: Tuple[int, ...]
    # the device tables below, one per (name, device), owned by this layout: a CUDA graph that captured a step
    # records their addresses, so they live exactly as long as the layout (kept by its user, e.g. the padded
    # MoE layout on its layer), never evicted from a shared cache while a graph may replay them
    _tables: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        offs = tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "offsets", offs)
        if len(offs) < 2 or offs[0] != 0:
            raise ValueError(f"Segments.offsets must start at 0 and hold at least one segment, got {offs}")
        if any(b < a for a, b in zip(offs, offs[1:])) or any(o % SEGMENT_ALIGN for o in offs):
            raise ValueError(f"Segments.offsets must be non-decreasing multiples of {SEGMENT_ALIGN}, got {offs}")

    @classmethod
    def for_counts(cls, counts: Sequence[int]) -> "Segments":
        """The aligned layout of experts receiving `counts` tokens each."""
        offsets = [0]
        for c in counts:
            if c < 0:
                raise ValueError(f"token counts must be >= 0, got {list(counts)}")
            offsets.append(offsets[-1] + padded_length(int(c), SEGMENT_ALIGN))
        return cls(tuple(offsets))

    @property
    def num_segments(self) -> int:
        return len(self.offsets) - 1

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    def bounds(self, e: int) -> Tuple[int, int]:
        return self.offsets[e], self.offsets[e + 1]

    def _table(self, name: str, device: torch.device, values) -> torch.Tensor:
        key = (name, torch.device(device))
        if key not in self._tables:
            self._tables[key] = device_tensor(values(), torch.int32, device)
        return self._tables[key]

    def strip_experts(self, device: torch.device) -> torch.Tensor:
        """int32 [rows // SEGMENT_ALIGN]: the expert owning each aligned strip of rows (on `device`), copied there
        once per layout."""
        return self._table("strips", device, lambda: [
            e for e in range(self.num_segments) for _ in range((self.offsets[e + 1] - self.offsets[e]) // SEGMENT_ALIGN)])

    def ends(self, device: torch.device) -> torch.Tensor:
        """int32 [E]: the segments' ends (as torch._grouped_mm takes them) on `device`, copied there once per layout."""
        return self._table("ends", device, lambda: list(self.offsets[1:]))


def check_segments(x: torch.Tensor, granularity: str, segments: Segments, columnwise_amax,
                   columnwise_pad: int = 1) -> None:
    """A segmented column quantization: row-wise, x's rows laid out as `segments` (so already a multiple
    of any padding that divides SEGMENT_ALIGN), no given amax."""
    if granularity != "row":
        raise ValueError(f"columnwise_segments needs row granularity, got {granularity!r}")
    if not isinstance(segments, Segments):
        raise TypeError(f"columnwise_segments must be a Segments, got {type(segments).__name__}")
    if x.shape[0] != segments.rows:
        raise ValueError(f"columnwise_segments cover {segments.rows} rows, the operand has {x.shape[0]}")
    if columnwise_amax is not None:
        raise ValueError("columnwise_segments and columnwise_amax are mutually exclusive")
    if SEGMENT_ALIGN % columnwise_pad:
        raise ValueError(f"columnwise_pad {columnwise_pad} must divide SEGMENT_ALIGN {SEGMENT_ALIGN} with segments")


def quantize_segment_columns(x: torch.Tensor, segments: Segments, **kw) -> QTensor:
    """Q(x^T) [C, R] with one scale per column of x per segment (scale [E, C]): expert e's slice
    [:, offsets[e]:offsets[e + 1]] is Q(x_e^T), quantized over that expert's rows only. Empty segments
    get scale 1."""
    R, C = x.shape
    data = torch.empty((C, R), dtype=torch.int8, device=x.device)
    scale = torch.ones((segments.num_segments, C), dtype=torch.float32, device=x.device)
    for e in range(segments.num_segments):
        lo, hi = segments.bounds(e)
        if hi > lo:
            q = quantize(x[lo:hi].t(), "row", **kw)
            data[:, lo:hi] = q.data
            scale[e] = q.scale
    return QTensor(data, scale, "row", kw.get("block_size", 128))


def segment_operand(q: QTensor, segments: Segments, e: int) -> QTensor:
    """Expert e's wgrad operand from a segmented Q(x^T): the aligned column slice and its scales."""
    lo, hi = segments.bounds(e)
    return QTensor(q.data[:, lo:hi], q.scale[e], "row", q.block_size)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale max(amax/127, MIN_SCALE); an all-zero group gets scale 1 (finite, and dequantizes to exact
    zeros), a non-finite amax (the group held Inf/NaN) NaN, so its products are NaN, never finite garbage."""
    amax = amax.float()
    # Divide by a tensor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
    # which can differ from the IEEE quotient by one ulp.
    qmax = torch.tensor(QMAX, dtype=torch.float32, device=amax.device)
    scale = torch.where(amax > 0, (amax / qmax).clamp_min(MIN_SCALE), torch.ones_like(amax))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


class _NonFiniteRecord:
    """Which named tensors were quantized with a NaN scale (= held Inf/NaN), kept on their device.

    One fp32 slot per name and device turns NaN once a NaN scale was recorded into it, with no host
    sync: the Triton quantize kernels store the NaN themselves (`slot`), other paths keep the running
    max of their scales (`record`, one or two small launches). `raise_if_nonfinite` reads all slots with
    one sync. Names are few and fixed (e.g. "fprop input", "weight"), so the slots never grow with the
    number of steps, even where nothing ever reads them.
    """

    def __init__(self):
        self._slot = {}  # name -> index, in order of first use (forward order)
        self._flags = {}  # device -> fp32 tensor of slots

    def slot(self, device: torch.device, name: str) -> Tuple[torch.Tensor, int]:
        """(the device's slot tensor, the index of `name`'s slot) for a kernel to write NaN into."""
        index = self._slot.setdefault(name, len(self._slot))
        flags = self._flags.get(device)
        if flags is None or flags.numel() <= index:
            grown = torch.zeros(max(16, 2 * (index + 1)), dtype=torch.float32, device=device)
            if flags is not None:
                grown[: flags.numel()] = flags
            self._flags[device] = flags = grown
        return flags, index

    def record(self, scale: torch.Tensor, name: str) -> None:
        if scale.numel() == 0:
            return
        flags, index = self.slot(scale.device, name)
        slot = flags[index]
        torch.maximum(slot, scale if scale.dim() == 0 else scale.amax(), out=slot)  # NaN propagates

    def raise_if_nonfinite(self) -> None:
        names = list(self._slot)
        seen = []
        for flags in self._flags.values():
            values = flags[: len(names)].tolist()  # the one host sync
            bad = [n for n, v in zip(names, values) if v != v]
            if bad:  # finite slots keep their running max: harmless, and no reset launch per step
                flags.zero_()
                seen += [n for n in bad if n not in seen]
        if seen:
            raise NonFiniteError(f"INT8 quantization: Inf or NaN in {', '.join(seen)} since the last check "
                                 "(Int8Recipe(check_finite='immediate') stops at the first occurrence)")


_NONFINITE = _NonFiniteRecord()


def raise_if_nonfinite() -> None:
    """Raise NonFiniteError naming every tensor quantized with Inf/NaN (check_finite="deferred") since
    the last call, and reset the record. One host sync; the trainer calls it once per step."""
    _NONFINITE.raise_if_nonfinite()


def nonfinite_slot(device: torch.device, name: str) -> Tuple[torch.Tensor, int]:
    """(slot tensor, index) where a kernel quantizing `name` with check_finite="deferred" stores NaN
    when one of its scales is NaN; raise_if_nonfinite reads it."""
    return _NONFINITE.slot(device, name)


def handle_nonfinite(scale: torch.Tensor, name: str, check_finite: str) -> None:
    """After a quantize whose non-finite groups carry NaN scales: act per Int8Recipe.check_finite."""
    if check_finite == "deferred":
        _NONFINITE.record(scale, name)
    elif check_finite == "immediate":
        if bool(torch.isnan(scale).any()):
            raise NonFiniteError(f"INT8 quantization: {name} contains Inf or NaN (amax=inf)")
    elif check_finite != "off":
        raise ValueError(f"check_finite must be 'deferred', 'immediate' or 'off', got {check_finite!r}")


@dataclasses.dataclass(frozen=True)
class KnownMaxima:
    """max |t| per row [R] and per column [C] of a tensor t viewed as [R, C] (C = its last dimension), or
    only max |t| over the whole tensor (`amax`, a 0-d tensor; rows and cols None), as the kernels that wrote t
    computed them (Inf/NaN as inf or NaN). Valid while t keeps the shape and version it had then
    (`known_maxima` checks both), so an in-place change or a reshaped view never reuses them."""

    rows: Optional[torch.Tensor]
    cols: Optional[torch.Tensor]
    shape: Tuple[int, ...]
    version: int
    amax: Optional[torch.Tensor] = None


_MAXIMA_ATTR = "_megatron_int8_maxima"  # stored on the tensor itself, so they die with it


def attach_maxima(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Record t's per-row and per-column maxima (as [R], [C] fp32) so that quantizing t row-wise skips its
    own amax pass (see `known_maxima`). Returns t."""
    if rows.shape != (t.numel() // max(t.shape[-1], 1),) or cols.shape != (t.shape[-1],):
        raise ValueError(f"attach_maxima: maxima {tuple(rows.shape)}, {tuple(cols.shape)} do not match a tensor "
                         f"of shape {tuple(t.shape)}")
    setattr(t, _MAXIMA_ATTR, KnownMaxima(rows, cols, tuple(t.shape), t._version))
    return t


def attach_amax(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Record max |t| (a 0-d fp32 tensor) so that quantizing t tensorwise skips its own amax pass; row-wise
    quantization still computes its maxima. Returns t."""
    if amax.dim() != 0 or amax.dtype != torch.float32:
        raise ValueError(f"attach_amax: expected a 0-d float32 amax, got {tuple(amax.shape)} {amax.dtype}")
    setattr(t, _MAXIMA_ATTR, KnownMaxima(None, None, tuple(t.shape), t._version, amax))
    return t


def known_maxima(t: torch.Tensor) -> Optional[KnownMaxima]:
    """The maxima `attach_maxima` / `attach_amax` recorded on this very tensor object, if it is unchanged
    since; else None."""
    known = getattr(t, _MAXIMA_ATTR, None)
    if known is None or known.shape != tuple(t.shape) or known.version != t._version:
        return None
    return known


def nan_as_inf(amax: torch.Tensor) -> torch.Tensor:
    """A given amax with NaN mapped to +inf (inf kept): max-reductions (the kernels', NCCL's) may drop a
    NaN, while inf survives them and still yields a NaN scale."""
    return torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf"))


def _round_clamp(v: torch.Tensor, stochastic: bool, generator: Optional[torch.Generator]) -> torch.Tensor:
    if stochastic:
        noise = torch.rand(v.shape, device=v.device, dtype=torch.float32, generator=generator)
        v = torch.floor(v + noise)
    else:
        v = torch.round(v)  # round half to even
    return v.clamp_(-QMAX, QMAX).to(torch.int8)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape
    if r == rows and c == cols:
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of integers, on the host (triton.cdiv is a constexpr function: microseconds per call)."""
    return -(-a // b)


def padded_length(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return cdiv(n, multiple) * multiple


def pad_columns(q: QTensor, multiple: int) -> QTensor:
    """Q with its contraction axis zero-padded to a multiple of `multiple` (the scales are unchanged).

    A product contracting over zeros is unchanged, and the Triton GEMM loads 16-byte vectors only from
    rows whose length is a multiple of 16: MoE experts receive any number of tokens, and an unpadded
    wgrad (contraction over tokens) fell back to byte-wise loads."""
    C = q.data.shape[1]
    Cp = padded_length(C, multiple)
    if Cp == C:
        return q
    return dataclasses.replace(q, data=_pad_to(q.data, q.data.shape[0], Cp))


def _check_operand(x: torch.Tensor, granularity: str, amax: Optional[torch.Tensor], block_size: int) -> None:
    """A 2-D real operand, a known granularity, a positive int block size for blocks, and a given amax of the right
    shape: tensorwise a scalar, row-wise one per row [R]."""
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [rows, contraction] tensor, got shape {tuple(x.shape)}")
    if x.is_complex():  # its imaginary part was dropped with a warning only
        raise TypeError(f"quantize expects a real tensor, got {x.dtype}")
    if granularity not in ("tensor", "row", "block"):
        raise ValueError(f"unknown granularity {granularity!r}")
    if granularity == "block" and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1):
        # 0 divided by zero, a negative one failed in a reshape, 32.0 in a pad
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if amax is None:
        return
    if granularity == "block":
        raise ValueError("a precomputed amax is only meaningful for tensorwise or row-wise quantization")
    shapes = ((), (1,)) if granularity == "tensor" else ((x.shape[0],),)
    if tuple(amax.shape) not in shapes:
        raise ValueError(f"a {granularity}-wise amax for a {tuple(x.shape)} operand must have shape "
                         f"{shapes[0]}, got {tuple(amax.shape)}")


def check_quantize_args(x: torch.Tensor, granularity: str, amax: Optional[torch.Tensor],
                        columnwise_pad: int = 1, block_size: int = 128,
                        columnwise_amax: Optional[torch.Tensor] = None,
                        rowwise_amax: Optional[torch.Tensor] = None) -> None:
    """Both backends' quantize contract: a 2-D operand, a known granularity, `amax` only when tensorwise,
    `rowwise_amax` (one per row of x) and `columnwise_amax` (one per column) only when row-wise, a column
    padding that keeps block groups whole."""
    _check_operand(x, granularity, amax, block_size)
    if amax is not None and granularity != "tensor":
        raise ValueError("backend.quantize's amax is tensorwise only (row-wise: rowwise_amax, columnwise_amax)")
    for name, given, axis, what in (("rowwise_amax", rowwise_amax, 0, "row"),
                                    ("columnwise_amax", columnwise_amax, 1, "column")):
        if given is None:
            continue
        if granularity != "row":
            raise ValueError(f"{name} is only meaningful for row-wise quantization")
        if tuple(given.shape) != (x.shape[axis],):
            raise ValueError(f"{name} must hold one amax per {what} of the {tuple(x.shape)} operand, "
                             f"got shape {tuple(given.shape)}")
    if not isinstance(columnwise_pad, int) or isinstance(columnwise_pad, bool) or columnwise_pad < 1:
        raise ValueError(f"columnwise_pad must be a positive int, got {columnwise_pad!r}")
    if granularity == "block" and block_size % columnwise_pad:
        raise ValueError(f"columnwise_pad {columnwise_pad} must divide block_size {block_size}")


def check_quantize_out(x: torch.Tensor, granularity: str, rowwise: bool, columnwise: bool, columnwise_pad: int,
                       columnwise_segments, out) -> None:
    """backend.quantize's `out`: (Q(x) destination or None, Q(x^T) destination or None), row granularity only,
    each a QTensor of contiguous tensors on x's device with exactly the shapes, dtypes of the result it
    receives (Q(x): [R, C] int8 with [R] fp32 scales; Q(x^T): [C, R'] int8 with [C] fp32 scales), given only
    for a requested output; not with segments (their scales are [E, C])."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"out must be a (Q(x) destination, Q(x^T) destination) pair, got {type(out).__name__}")
    if granularity != "row":
        raise ValueError(f"out is supported for row granularity only, got {granularity!r}")
    if columnwise_segments is not None and out[1] is not None:
        raise ValueError("out cannot receive a segmented Q(x^T) (its scales are per segment)")
    R, C = x.shape
    for dest, wanted, name, shape in ((out[0], rowwise, "Q(x)", (R, C)),
                                      (out[1], columnwise, "Q(x^T)", (C, padded_length(R, columnwise_pad)))):
        if dest is None:
            continue
        if not wanted:
            raise ValueError(f"out holds a destination for {name}, which was not requested")
        if not isinstance(dest, QTensor):
            raise TypeError(f"out's {name} destination must be a QTensor, got {type(dest).__name__}")
        for t, dtype, want in ((dest.data, torch.int8, shape), (dest.scale, torch.float32, shape[:1])):
            if (tuple(t.shape) != want or t.dtype != dtype or not t.is_contiguous() or t.device != x.device):
                raise ValueError(f"out's {name} destination needs a contiguous {dtype} tensor of shape {want} on "
                                 f"{x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                                 f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def write_into(result: QTensor, dest: QTensor) -> QTensor:
    """`result` copied into the tensors of `dest` (a checked out destination); returns dest as a QTensor."""
    dest.data.copy_(result.data)
    dest.scale.copy_(result.scale)
    return QTensor(dest.data, dest.scale, result.granularity, result.block_size, result.tile2d)


def quantize(
    x: torch.Tensor,
    granularity: str = "tensor",
    *,
    block_size: int = 128,
    tile2d: bool = False,
    stochastic: bool = False,
    name: str = "tensor",
    check_finite: str = "deferred",
    generator: Optional[torch.Generator] = None,
    amax: Optional[torch.Tensor] = None,
) -> QTensor:
    """Quantize a 2-D tensor [R, C] with scales along its last (contraction) axis; Q(x) is contiguous.

    `amax` replaces the tensor's own (tensorwise: a scalar; row-wise: one per row, [R]), e.g. one reduced
    over a tensor-parallel group, so that every rank's shard of a gathered activation gets the scales of
    the gathered tensor.
    """
    _check_operand(x, granularity, amax, block_size)
    xf = x.float()
    R, C = xf.shape
    if granularity == "tensor":
        if amax is None:
            amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
        amax = amax.reshape(()).float()
        per_element = lambda group: group  # noqa: E731  (one scale broadcasts)
    elif granularity == "row":
        if amax is None:
            amax = xf.abs().amax(dim=1) if C else torch.zeros(R, device=x.device)
        amax = amax.float()
        per_element = lambda group: group[:, None]  # noqa: E731
    else:  # block
        B = block_size
        rb = B if tile2d else 1
        Rp, Cp = padded_length(R, rb), padded_length(C, B)
        tiles = _pad_to(xf, Rp, Cp).abs().reshape(Rp // rb, rb, Cp // B, B)
        amax = tiles.amax(dim=(1, 3))
        per_element = lambda group: group.repeat_interleave(rb, 0).repeat_interleave(B, 1)[:R, :C]  # noqa: E731
    scale = scale_from_amax(amax)  # NaN for a group holding Inf/NaN
    handle_nonfinite(scale, name, check_finite)
    inverse = per_element(torch.ones_like(scale) / scale)  # tensor / tensor: an IEEE quotient on CUDA too
    q = _round_clamp(xf * inverse, stochastic, generator).contiguous()  # a transposed x gives strided q
    return QTensor(q, scale, granularity, block_size, tile2d and granularity == "block")


def dequantize(qt: QTensor) -> torch.Tensor:
    """fp32 reconstruction q * scale."""
    q = qt.data.float()
    if qt.granularity == "tensor":
        return q * qt.scale
    if qt.granularity == "row":
        return q * qt.scale[:, None]
    s = qt.scale_per_row_block().repeat_interleave(qt.block_size, dim=1)[:, : q.shape[1]]
    return q * s


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 a[M,K] @ b[N,K]^T via torch._int_mm (padded where CUDA's shape rules require)."""
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0 or K == 0:  # e.g. an MoE expert that received no tokens: its wgrad has K = 0
        return torch.zeros(M, N, dtype=torch.int32, device=a.device)
    if a.device.type == "cuda":  # cuBLASLt: M > 16, K and N multiples of 8, 8-aligned row strides
        Mp, Kp, Np = max(padded_length(M, 8), 32), padded_length(K, 8), padded_length(N, 8)
        out = torch._int_mm(_pad_to(a, Mp, Kp).contiguous(), _pad_to(b, Np, Kp).contiguous().t())
        return out[:M, :N]
    return torch._int_mm(a, b.t())


def _int_mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32-exact product converted to fp32, chunking K so int32 never overflows."""
    K = a.shape[1]
    if K <= MAX_EXACT_K:
        return int_mm(a, b).float()
    out = None
    for k0 in range(0, K, MAX_EXACT_K):
        part = int_mm(a[:, k0 : k0 + MAX_EXACT_K], b[:, k0 : k0 + MAX_EXACT_K]).float()
        out = part if out is None else out.add_(part)
    return out


def check_gemm_operands(a: QTensor, b: QTensor) -> None:
    """Both backends' GEMM contract: same contraction length and the same granularity."""
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"contraction mismatch: {tuple(a.data.shape)} @ {tuple(b.data.shape)}^T")
    if a.granularity != b.granularity or (a.granularity == "block" and a.block_size != b.block_size):
        raise ValueError(f"operands quantized differently: {a.granularity}/{a.block_size} vs "
                         f"{b.granularity}/{b.block_size}")


def check_gemm_out(a: QTensor, b: QTensor, out_dtype: torch.dtype, accumulate_into: Optional[torch.Tensor],
                   out: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None) -> None:
    """Both backends' contract for the destinations: an fp32 [M, N] accumulator, or a contiguous [M, N]
    out_dtype `out` (a floating dtype), not both; a bias is [N] on the operands' device (a [M, 1] or [N, 1] one
    broadcast over the wrong axis without a word)."""
    shape = (a.data.shape[0], b.data.shape[0])
    if not out_dtype.is_floating_point:  # the dequantized product was cast to it: truncated, an int8 one wrapped
        raise TypeError(f"gemm: out_dtype must be floating point, got {out_dtype}")
    if bias is not None and (tuple(bias.shape) != shape[1:] or bias.device != a.data.device):
        raise ValueError(f"gemm: bias must have shape ({shape[1]},) on {a.data.device}, got {tuple(bias.shape)} on "
                         f"{bias.device}")
    if accumulate_into is not None and (tuple(accumulate_into.shape) != shape or accumulate_into.dtype != torch.float32):
        raise ValueError(f"accumulate_into must be fp32 {list(shape)}, got {accumulate_into.dtype} "
                         f"{tuple(accumulate_into.shape)}")
    if out is not None:
        if accumulate_into is not None:
            raise ValueError("gemm: pass out or accumulate_into, not both")
        if tuple(out.shape) != shape or out.dtype != out_dtype or not out.is_contiguous():
            raise ValueError(f"gemm: out must be a contiguous {out_dtype} {list(shape)} tensor, got "
                             f"{out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()})")


def gemm(
    a: QTensor,
    b: QTensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    bias: Optional[torch.Tensor] = None,
    accumulate_into: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dequant(a @ b^T) [+ bias], or accumulated into an fp32 buffer (gradient-accumulation fusion), or
    written into `out`."""
    check_gemm_operands(a, b)
    check_gemm_out(a, b, out_dtype, accumulate_into, out, bias)
    if a.granularity == "block":
        B = a.block_size
        sa, sb = a.scale_per_row_block(), b.scale_per_row_block()
        result = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32, device=a.data.device)
        for kb in range(sa.shape[1]):
            cols = slice(kb * B, (kb + 1) * B)
            result += _int_mm_fp32(a.data[:, cols], b.data[:, cols]) * sa[:, kb : kb + 1] * sb[None, :, kb]
    else:
        result = _int_mm_fp32(a.data, b.data)
        sa = a.scale[:, None] if a.granularity == "row" else a.scale
        sb = b.scale[None, :] if b.granularity == "row" else b.scale
        result = result * sa * sb
    if bias is not None:
        result = result + bias.float()
    if accumulate_into is not None:
        return accumulate_into.add_(result)
    if out is not None:
        return out.copy_(result)
    return result.to(out_dtype)


def grouped_gemm(a: QTensor, b: QTensor, segments: Segments, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per expert e: rows [offsets[e], offsets[e + 1]) of the output are dequant(a_e @ b[e]^T).

    a: row-wise [R, K] (rows laid out as `segments`); b: the experts' stacked operands, data [E, N, K] and
    row-wise scales [E, N]. Returns [R, N]."""
    check_grouped_operands(a, b, segments)
    out = torch.zeros((a.data.shape[0], b.data.shape[1]), dtype=out_dtype, device=a.data.device)
    for e in range(segments.num_segments):
        lo, hi = segments.bounds(e)
        if hi > lo:
            out[lo:hi] = gemm(QTensor(a.data[lo:hi], a.scale[lo:hi], "row"), QTensor(b.data[e], b.scale[e], "row"),
                              out_dtype=out_dtype)
    return out


def check_grouped_operands(a: QTensor, b: QTensor, segments: Segments) -> None:
    """Both backends' grouped GEMM contract: row-wise operands, one stacked b per segment."""
    if a.granularity != "row" or b.granularity != "row":
        raise ValueError(f"grouped_gemm needs row-wise operands, got {a.granularity} and {b.granularity}")
    if b.data.dim() != 3 or b.scale.shape != b.data.shape[:2]:
        raise ValueError(f"grouped_gemm: b must be stacked [E, N, K] with scales [E, N], got data "
                         f"{tuple(b.data.shape)} and scales {tuple(b.scale.shape)}")
    if b.data.shape[0] != segments.num_segments:
        raise ValueError(f"grouped_gemm: {b.data.shape[0]} stacked operands for {segments.num_segments} segments")
    if a.data.shape[0] != segments.rows or a.data.shape[1] != b.data.shape[2]:
        raise ValueError(f"grouped_gemm: a {tuple(a.data.shape)} does not match {segments.rows} segment rows "
                         f"and b {tuple(b.data.shape)}")


class ReferenceBackend:
    """The PyTorch backend; INT8 products through torch._int_mm (exact INT32 accumulation on CPU and CUDA).

    A backend offers two calls with identical contracts (conventions: this module's docstring):
      quantize(x2d, *, granularity, block_size, weight, rowwise, columnwise, stochastic, name, check_finite,
               amax=None, columnwise_pad=1, columnwise_amax=None, columnwise_segments=None, rowwise_amax=None)
          -> (Q(x) as [R, C] or None, Q(x^T) as [C, R'] or None)
          (`amax`: tensorwise only, a precomputed amax, e.g. reduced over the tensor-parallel group;
          `columnwise_pad`: R' = R rounded up to a multiple of it, the extra columns of Q(x^T) zero, so that
          a GEMM contracting over R (wgrad) gets 16-byte aligned rows; see pad_columns;
          `columnwise_amax`: row-wise only, x's per-column amax [C] for Q(x^T)'s scales, e.g. reduced over
          the tensor-parallel group, while Q(x) keeps its own per-row scales (unless `rowwise_amax` is given);
          `rowwise_amax`: row-wise only, x's per-row amax [R] for Q(x)'s scales, e.g. computed by the kernel
          that wrote x (see known_maxima): with both given, x is read once;
          `columnwise_segments`: row-wise only, a Segments layout of x's rows (MoE experts): Q(x^T)
          gets one scale per column per segment, [E, C], see quantize_segment_columns;
          `out`: row-wise only, (QTensor or None, QTensor or None) to write Q(x) / Q(x^T) and their scales into,
          e.g. an expert's slot of a stacked weight, which saves the copy; see check_quantize_out)
      gemm(a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None) -> dequant(a @ b^T) [+ bias]
          (`autotune`: a hint for kernels with tunable tiles; the result is the same either way; `out`: a
          contiguous [M, N] tensor to write, e.g. a row range of a larger output)
      grouped_gemm(a, b, segments, *, out_dtype) -> per segment e, dequant(a_e @ b[e]^T) in a's rows of e
          (MoE experts: a row-wise [R, K] in the segments' layout, b stacked [E, N, K] with scales [E, N])
    `rowwise` is the operand contracted over its columns, `columnwise` the one contracted over its rows;
    a kernel may produce both in one pass (fused cast-transpose).
    """

    name = "reference"

    def quantize(
        self,
        x: torch.Tensor,
        *,
        granularity: str,
        block_size: int,
        weight: bool,
        rowwise: bool,
        columnwise: bool,
        stochastic: bool = False,
        name: str = "tensor",
        check_finite: str = "deferred",
        amax: Optional[torch.Tensor] = None,
        columnwise_pad: int = 1,
        columnwise_amax: Optional[torch.Tensor] = None,
        columnwise_segments: Optional[Segments] = None,
        rowwise_amax: Optional[torch.Tensor] = None,
        out: Optional[Tuple[Optional[QTensor], Optional[QTensor]]] = None,
    ) -> Tuple[Optional[QTensor], Optional[QTensor]]:
        check_quantize_args(x, granularity, amax, columnwise_pad, block_size, columnwise_amax, rowwise_amax)
        if columnwise_segments is not None:
            check_segments(x, granularity, columnwise_segments, columnwise_amax, columnwise_pad)
        if out is not None:
            check_quantize_out(x, granularity, rowwise, columnwise, columnwise_pad, columnwise_segments, out)
        tile2d = weight and granularity == "block"
        kw = dict(block_size=block_size, stochastic=stochastic, name=name, check_finite=check_finite, amax=amax)
        row = col = None
        if rowwise:
            row = quantize(x, granularity, tile2d=tile2d,
                               **dict(kw, amax=rowwise_amax if rowwise_amax is not None else amax))
        if columnwise and columnwise_segments is not None:  # aligned rows: no padding needed
            col = quantize_segment_columns(x, columnwise_segments, **kw)
        elif columnwise:
            if row is not None and (granularity == "tensor" or tile2d):
                col = row.transposed()  # same scales: a byte transpose, identical rounding
            else:
                col = quantize(x.t(), granularity, tile2d=tile2d,
                                   **dict(kw, amax=columnwise_amax if columnwise_amax is not None else amax))
            col = pad_columns(col, columnwise_pad)
        if out is not None:
            row, col = (r if dest is None else write_into(r, dest) for r, dest in zip((row, col), out))
        return row, col

    def gemm(self, a, b, *, out_dtype, bias=None, accumulate_into=None, autotune=True, out=None):
        return gemm(a, b, out_dtype=out_dtype, bias=bias, accumulate_into=accumulate_into, out=out)

    def grouped_gemm(self, a, b, segments, *, out_dtype):
        return grouped_gemm(a, b, segments, out_dtype=out_dtype)
