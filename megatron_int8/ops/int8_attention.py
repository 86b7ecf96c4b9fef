"""INT8 causal attention with GQA, forward and backward: `int8_attention(q, k, v)`.

Layout as `F.scaled_dot_product_attention`: q [b, h, s, d], k and v [b, h_kv, s_kv, d] with h % h_kv == 0
(query head i reads key/value head i // (h / h_kv)); the output has q's shape and dtype, the gradients their
inputs' dtypes. `causal` masks key j > query i (top-left, as SDPA's is_causal).

Which products are INT8 (by default four of the seven: the scores S = Q K^T, forward and the backward's recomputation,
from BF16 Q and smoothed K with fp32 sums, and dP = dO V^T, are 16-bit; with scores="int8" six, SageBwd's split):
    forward   S = Q K^T             scores="int8": INT8 x INT8 -> INT32, Q and K per token (row scales of both)
              O = P V               INT8, P with the fixed scale 1/127, V per (head, block, channel)
    backward  S = Q K^T             recomputed from the saved Q and K of the scores (per-token INT8 or BF16)
              dP = dO V^T           BF16 inputs, fp32 accumulation
              dV = P^T dO           INT8, P^T per (key, tile of `bwd_block_m` queries), dO per (head, block, channel)
              dK = dS^T Q           INT8, dS^T per (key, tile of `bwd_block_m` queries), Q per (head, block, channel)
              dQ = dS K             INT8, dS per (query, tile of `dq_block_n` keys), K per (head, block, channel)
Q and K are thus saved twice: for the scores (in BF16, or per token in INT8, whose error then dominates the op's)
and in INT8 per block and channel for dK and dQ, which contract over tokens (an operand's scales must be constant
along the contraction axis of a tile). INT8 scores, measured on this PyTorch path against fp64 (CPU, 2026-12-02,
seq 512, d 128, blocks of 64 tokens, tiles of 32 and 64):
- per-token instead of per-block (64 tokens) Q, K scales for the scores: O 29.5 -> 33.2 dB (4 query / 2 kv heads,
  a few 3x channels in q and k, k biased); 20.9 -> 30.3 dB with 0.1% outliers of 10x added;
- per block and channel instead of per block for the Q, K copies of dK, dQ: dK 24.2 -> 27.3, dQ 24.3 -> 25.3 dB
  (8 query / 2 kv heads, 0.2% outliers of 8x: the data of test_snr_against_fp64_beside_bf16_sdpa);
- on the second data, scores from unquantized Q and K would gain 8-9 dB on every tensor, and leaving any one of
  P (per-tile scales then), P^T, dS^T, dS unquantized at most 0.3 dB; on the first, PV in 16 bits (P and V
  unquantized) gains 1.7 dB on O and dV in 16 bits 1.9 dB on dV, against the 15-25 dB that the INT8 scores cost
  beside BF16 SDPA. So PV and all three gradient products run in INT8: they cost little beside the scores;
- P's fixed scale 1/127 in the forward (P = exp(s - running max) <= 1) instead of per (query, tile of 32 keys):
  O 0.4-0.8 dB lower (seq 512 and 1024), for no row maximum or division per tile. For dV's P^T it would cost
  5.3-10.3 dB (a key's column of P is far below 1 for most queries), so the backward keeps its per-tile scales.
BF16 scores (`Int8AttentionConfig.scores`, the default) take Q and smoothed K in BF16 with fp32 sums, as flash
attention forms them: the INT8 scores' error grows as attention sharpens over training, and at 344M it cost 0.9-1.5%
of validation loss against the INT8 linears alone (docs/convergence.md, section 10); BF16 scores take that part out
(section 10a; docs/numerics.md, "Sharper attention") for a 16-bit product (the op 1.07-1.23x slower on an H200).
K is smoothed first: K - mean_s(K) per head. Softmax is invariant to it (it adds q . mean to every score of a
row, also under the causal mask), and so is the gradient: the rows of dS sum to zero, so the gradient through
the mean vanishes and dK is dS^T Q as without smoothing. It takes K's shared bias out of the INT8 range.
Every other scale is amax / 127 of its group (reference.scale_from_amax: 1 for an all-zero group, at least 2^-126,
NaN for a group holding Inf/NaN); all round half to even, as reference.quantize.
The scales of an operand are constant along each tile of its contraction axis, so each INT8 product
dequantizes once per tile: (int32 tile) * row scale * column scale, summed in fp32. Softmax, exp and the
accumulators are fp32.

`attention_reference` computes that quantization with PyTorch ops (any device: the CPU path, and the
kernels' test oracle), tile by tile where the scales depend on the tiles; kernels/int8_attention.py does it
in Triton on CUDA (or on CPU under TRITON_INTERPRET=1). The two agree up to fp32 rounding, which can move a
quantized value by one step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from ..dispatch import resolve_backend_name
from ..recipe import ATTENTION_SCORES, BACKENDS, DEFAULT_ATTENTION_SCORES, DEFAULT_RECIPE
from ..reference import cdiv, scale_from_amax
from .backend import triton_available, triton_runs_on

__all__ = ["Int8AttentionConfig", "attention_reference", "int8_attention"]


FWD_BLOCK_M = {"int8": 64, "bf16": 128}  # the forward's default queries per program, by the scores' precision


@dataclasses.dataclass(frozen=True)
class Int8AttentionConfig:
    """Scale granularity and the kernels' tiles (which set the scale groups of P^T and dS, and the running maxima that
    the forward's P is relative to, so the reference takes them).

    block: tokens per scale of Q, K (their copies for dK, dQ), V and dO, each per head, block and channel;
    every token tile below divides it, so an operand's scale is constant along a tile of its contraction axis.
    """
    block: int = 128
    # queries per forward program; None: FWD_BLOCK_M[scores] (on an H200, INT8 scores ran 21-23% faster at 64 x 128
    # than 128 x 64, and BF16 scores' forward 22-27% faster at 128 x 128 than 64 x 128: docs/benchmarks.md)
    fwd_block_m: Optional[int] = None
    fwd_block_n: int = 128  # keys per forward step (P is exp(s - the running max of the keys so far))
    bwd_block_m: int = 32  # queries per step of the dK/dV program: P^T's and dS^T's scales per key and tile
    # (32 x 128 ran the backward 7-8% faster than 64 x 128 on an H200: fewer registers spilled)
    bwd_block_n: int = 128  # keys per dK/dV program
    dq_block_m: int = 128  # queries per dQ program
    dq_block_n: int = 64  # keys per step of the dQ program: dS's scales per query and such a tile
    scores: str = DEFAULT_ATTENTION_SCORES  # Q K^T from BF16 Q and K with fp32 sums, or "int8": per-token INT8 Q, K

    def __post_init__(self):
        if self.scores not in ATTENTION_SCORES:
            raise ValueError(f"Int8AttentionConfig.scores must be one of {ATTENTION_SCORES}, got {self.scores!r}")
        if self.fwd_block_m is None:  # resolved once here, so the kernels, the reference and replace() see an int
            object.__setattr__(self, "fwd_block_m", FWD_BLOCK_M[self.scores])
        for name in ("fwd_block_m", "fwd_block_n", "bwd_block_m", "bwd_block_n", "dq_block_m", "dq_block_n"):
            tile = getattr(self, name)
            if tile < 16 or tile & (tile - 1) or self.block % tile:
                raise ValueError(f"Int8AttentionConfig.{name}={tile}: a power of two >= 16 dividing block={self.block}")


DEFAULT_CONFIG = Int8AttentionConfig()
ROW_AMAX_FLOOR = 2.0 ** -100  # the least amax of a row of P^T or dS: a row below it quantizes to zeros


# ------------------------------------------------------------------------------------------ quantization
def _round_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(round_half_even(x * (1 / scale)), -127, 127) as float values (exact small integers). A NaN scale (its
    group held Inf/NaN) gives NaN products, which become 0 as in the kernels' _round_clamp: the NaN scale still
    shows in the dequantized result."""
    return torch.round((x * (1.0 / scale)).nan_to_num_(nan=0.0)).clamp_(-127, 127)


def quantize_blocks(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, S, D] (fp32) quantized per (head, `block` tokens, channel).
    Returns (integer values as fp32 [B, H, S, D], scales [B, H, ceil(S / block), D])."""
    B, H, S, D = x.shape
    nb = cdiv(S, block)
    blocks = torch.nn.functional.pad(x, (0, 0, 0, nb * block - S)).view(B, H, nb, block, D)
    scale = scale_from_amax(blocks.abs().amax(dim=3))
    return _round_int8(x, _per_token(scale, block, S)), scale


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (Q or K per token, a tile of P^T or dS) quantized per row: scale = max(amax, ROW_AMAX_FLOOR) / 127,
    so that 1 / scale stays finite for a row of P^T whose values underflow toward 0 (exp of scores far below the
    row's max). Returns (values as fp32, scales [..., 1])."""
    scale = scale_from_amax(x.abs().amax(dim=-1, keepdim=True).clamp_min(ROW_AMAX_FLOOR))
    return _round_int8(x, scale), scale


def _per_token(scale: torch.Tensor, block: int, S: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=2)[:, :, :S]


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _sum_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    B, H = x.shape[:2]
    return x.view(B, H // group, group, *x.shape[2:]).sum(dim=2) if group > 1 else x


def _causal_mask(Sq: int, Sk: int, device) -> torch.Tensor:
    return torch.arange(Sk, device=device)[None, :] > torch.arange(Sq, device=device)[:, None]


# ------------------------------------------------------------------------------------------ reference path
@dataclasses.dataclass
class _Saved:
    """What backward needs: Q and smoothed K for the scores (INT8 per token, or BF16 values with unit scales) and in
    INT8 per block and channel, with their scales."""
    q_int: torch.Tensor  # [B, H, Sq, D] integer values (fp32), per token (scores="bf16": BF16 values, unit scales)
    q_scale: torch.Tensor  # [B, H, Sq]
    k_int: torch.Tensor  # [B, Hk, Sk, D]
    k_scale: torch.Tensor  # [B, Hk, Sk]
    qb_int: torch.Tensor  # [B, H, Sq, D] per block and channel
    qb_scale: torch.Tensor  # [B, H, nbq, D]
    kb_int: torch.Tensor  # [B, Hk, Sk, D]
    kb_scale: torch.Tensor  # [B, Hk, nbk, D]
    lse: Optional[torch.Tensor] = None  # [B, H, Sq] natural log-sum-exp of the scaled scores


def _scores(saved: _Saved, group: int, sm_scale: float, causal: bool) -> torch.Tensor:
    """sm_scale * dequant(Q_int K_int^T) [B, H, Sq, Sk] in fp32 (BF16 scores: their product, unit scales), -inf
    where masked."""
    Sq, Sk = saved.q_int.shape[2], saved.k_int.shape[2]
    # INT8 scores: exact in fp32, |sum| <= 127^2 d < 2^24
    acc = saved.q_int @ _expand_heads(saved.k_int, group).transpose(-1, -2)
    s = acc * (saved.q_scale[..., :, None] * _expand_heads(saved.k_scale, group)[..., None, :] * sm_scale)
    if causal:
        s = s.masked_fill(_causal_mask(Sq, Sk, s.device), float("-inf"))
    return s


def score_operands(qf: torch.Tensor, kf: torch.Tensor, cfg: Int8AttentionConfig):
    """((Q values, scales [..., 1]), (K values, scales)) that the scores multiply, from fp32 Q and smoothed K: per-token
    INT8, or BF16-rounded values with unit scales (scores="bf16")."""
    if cfg.scores == "bf16":
        return tuple((x.bfloat16().float(), torch.ones_like(x[..., :1])) for x in (qf, kf))
    return quantize_rows(qf), quantize_rows(kf)


def reference_forward(q, k, v, causal: bool, sm_scale: float, cfg: Int8AttentionConfig):
    """(O in q's dtype, _Saved) of the INT8 attention, with PyTorch ops."""
    group = q.shape[1] // k.shape[1]
    qf = q.float()
    kf = k.float() - k.mean(dim=2, keepdim=True, dtype=torch.float32)  # the kernels' mean, bit for bit
    (q_int, q_scale), (k_int, k_scale) = score_operands(qf, kf, cfg)
    saved = _Saved(q_int, q_scale.squeeze(-1), k_int, k_scale.squeeze(-1), *quantize_blocks(qf, cfg.block),
                   *quantize_blocks(kf, cfg.block))
    o, saved.lse = softmax_int8_pv(_scores(saved, group, sm_scale, causal), v, cfg)
    return o.to(q.dtype), saved


def softmax_int8_pv(s: torch.Tensor, v: torch.Tensor, cfg: Int8AttentionConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """(softmax(s) V in fp32, log-sum-exp of s [B, H, Sq]) as the forward kernel forms it from scaled, masked scores s
    [B, H, Sq, Sk]: online over key tiles, P = exp(s - running max) <= 1 in INT8 at the fixed scale 1/127, V in INT8
    per block. Apart from reference_forward so that scores of another precision can be set before it
    (benchmarks/attention_sharpness.py)."""
    group = s.shape[1] // v.shape[1]
    v_int, v_scale = quantize_blocks(v.float(), cfg.block)
    v_int = _expand_heads(v_int, group)
    v_tok = _per_token(_expand_heads(v_scale, group), cfg.block, v.shape[2])
    B, H, Sq, _ = s.shape
    m = torch.full((B, H, Sq, 1), float("-inf"), device=s.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, H, Sq, v.shape[-1], device=s.device)
    for n0 in range(0, v.shape[2], cfg.fwd_block_n):
        tile = slice(n0, n0 + cfg.fwd_block_n)
        st = s[..., tile].float()
        m_new = torch.maximum(m, st.amax(dim=-1, keepdim=True))
        p = torch.exp(st - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        # V's scales are constant along the tile (cfg.block % fwd_block_n == 0): one per channel, with P's 1/127
        acc = acc * alpha + (torch.round(p * 127) @ v_int[..., tile, :]) * (v_tok[..., n0:n0 + 1, :] * (1 / 127))
        m = m_new
    return acc / l, (m + torch.log(l)).squeeze(-1)


def reference_backward(do, o, v, saved: _Saved, causal: bool, sm_scale: float, cfg: Int8AttentionConfig):
    """(dQ, dK, dV) in fp32 of the INT8 attention, with PyTorch ops."""
    group = o.shape[1] // v.shape[1]
    B, H, Sq, D = o.shape
    Sk = v.shape[2]
    s = _scores(saved, group, sm_scale, causal)
    p = torch.exp(s - saved.lse[..., None])
    dof = do.float()
    delta = (dof * o.float()).sum(dim=-1, keepdim=True)
    dp = dof @ _expand_heads(v.float(), group).transpose(-1, -2)  # BF16 product: bf16 inputs, fp32 sums
    ds = p * (dp - delta)
    do_int, do_scale = quantize_blocks(dof, cfg.block)
    do_tok = _per_token(do_scale, cfg.block, Sq)
    q_tok = _per_token(saved.qb_scale, cfg.block, Sq)

    dv = torch.zeros(B, H, Sk, D, device=o.device)
    dk = torch.zeros_like(dv)
    for m0 in range(0, Sq, cfg.bwd_block_m):  # contraction over query tiles: scales per (key, tile)
        tile = slice(m0, m0 + cfg.bwd_block_m)
        pt_int, pt_scale = quantize_rows(p[..., tile, :].transpose(-1, -2))
        dv += (pt_int @ do_int[..., tile, :]) * pt_scale * do_tok[..., m0:m0 + 1, :]
        dst_int, dst_scale = quantize_rows(ds[..., tile, :].transpose(-1, -2))
        dk += (dst_int @ saved.qb_int[..., tile, :]) * dst_scale * q_tok[..., m0:m0 + 1, :]

    dq = torch.zeros(B, H, Sq, D, device=o.device)
    k_int = _expand_heads(saved.kb_int, group)
    k_tok = _per_token(_expand_heads(saved.kb_scale, group), cfg.block, Sk)
    for n0 in range(0, Sk, cfg.dq_block_n):  # contraction over key tiles: scales per (query, tile)
        tile = slice(n0, n0 + cfg.dq_block_n)
        ds_int, ds_scale = quantize_rows(ds[..., tile])
        dq += (ds_int @ k_int[..., tile, :]) * ds_scale * k_tok[..., n0:n0 + 1, :]
    return dq * sm_scale, _sum_heads(dk, group) * sm_scale, _sum_heads(dv, group)


def attention_reference(q, k, v, causal: bool = True, scale: Optional[float] = None,
                        config: Optional[Int8AttentionConfig] = None) -> torch.Tensor:
    """`int8_attention` computed with PyTorch ops on any device (differentiable)."""
    _check(q, k, v, config)
    cfg = config or DEFAULT_CONFIG
    return _ReferenceAttention.apply(q, k, v, causal, _sm_scale(q, scale), cfg)


class _ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, cfg):
        o, saved = reference_forward(q, k, v, causal, sm_scale, cfg)
        ctx.saved = saved
        ctx.save_for_backward(v, o)
        ctx.args = (causal, sm_scale, cfg, q.dtype, k.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        v, o = ctx.saved_tensors
        causal, sm_scale, cfg, q_dtype, k_dtype = ctx.args
        dq, dk, dv = reference_backward(do, o, v, ctx.saved, causal, sm_scale, cfg)
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v.dtype), None, None, None


# ------------------------------------------------------------------------------------------ Triton path
class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, cfg):
        from ..kernels.int8_attention import triton_attention_forward

        o, saved = triton_attention_forward(q, k, v, causal, sm_scale, cfg)
        ctx.save_for_backward(v, o, *saved)
        ctx.args = (causal, sm_scale, cfg, q.shape, q.dtype, k.shape, k.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        from ..kernels.int8_attention import triton_attention_backward

        v, o, *saved = ctx.saved_tensors
        causal, sm_scale, cfg, q_shape, q_dtype, k_shape, k_dtype = ctx.args
        dq, dk, dv = triton_attention_backward(do, o, v, saved, causal, sm_scale, cfg, q_shape, q_dtype, k_shape,
                                               k_dtype)
        return dq, dk, dv, None, None, None


def _sm_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _check(q, k, v, config) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():  # an integer O (the fp32 result cast back) was truncated
            raise TypeError(f"int8_attention: {name} must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"int8_attention: {name} is on {t.device}, q on {q.device}")
    if config is not None and not isinstance(config, Int8AttentionConfig):
        raise TypeError(f"int8_attention: config must be an Int8AttentionConfig, got {type(config).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"int8_attention: q [b, h, s, d] and k, v [b, h_kv, s_kv, d] expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if 0 in q.shape or 0 in k.shape:  # before h % h_kv, which h_kv = 0 would divide by
        raise ValueError(f"int8_attention: empty inputs, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"int8_attention: batch and head dim must match and h % h_kv == 0, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")


# The tiles that an INT8 product contracts over (P V over keys, dV and dK over queries, dQ over keys): the GPU's INT8
# tensor-core instructions take at least 32 along it (the interpreter and the PyTorch path take 16)
CONTRACTION_TILES = ("fwd_block_n", "bwd_block_m", "dq_block_n")


def check_gpu_tiles(cfg: Int8AttentionConfig) -> None:
    """Refuse, by name, a config whose contraction tiles the GPU kernels cannot compile."""
    for name in CONTRACTION_TILES:
        if getattr(cfg, name) < 32:
            raise ValueError(f"int8_attention: Int8AttentionConfig.{name}={getattr(cfg, name)}: the GPU kernels need "
                             f"at least 32 (an INT8 product contracts over it)")


def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: Optional[float] = None, config: Optional[Int8AttentionConfig] = None,
                   backend: str = "auto") -> torch.Tensor:
    """Attention softmax(scale * q k^T) v with INT8 products (see the module docstring), differentiable.

    q [b, h, s, d], k and v [b, h_kv, s_kv, d] (GQA: h % h_kv == 0); scale defaults to 1/sqrt(d).
    backend: "auto" (Triton kernels on a GPU where they import, else the PyTorch path; MEGATRON_INT8_BACKEND
    overrides it, as it does a recipe's), "triton" or "reference".
    The Triton kernels take head dims 32..256 that are powers of two (64 and 128 are tested on the GPU).
    """
    _check(q, k, v, config)
    cfg = config or DEFAULT_CONFIG
    if backend not in BACKENDS:
        raise ValueError(f"int8_attention: backend {backend!r}: expected one of {BACKENDS}")
    if backend == "auto":  # the default recipe's backend is "auto": resolved as any recipe's
        backend = resolve_backend_name(q.device, DEFAULT_RECIPE, triton_available())
    use_triton = backend == "triton"
    if use_triton and not (triton_runs_on(q.device) and triton_available()):
        raise RuntimeError("int8_attention: the Triton kernels need CUDA (or TRITON_INTERPRET=1) and triton")
    d = q.shape[-1]
    if use_triton and (d & (d - 1) or not 32 <= d <= 256):
        raise ValueError(f"int8_attention: the Triton kernels take head dims 32..256 that are powers of two, got {d}")
    if use_triton and q.is_cuda:
        check_gpu_tiles(cfg)
    fn = _TritonAttention if use_triton else _ReferenceAttention
    return fn.apply(q, k, v, causal, _sm_scale(q, scale), cfg)
