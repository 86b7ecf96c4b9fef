"""Test helpers: float64 references and error bounds derived from quantization steps.

For y = a @ b^T with a = s_a*(q_a + e_a), |e_a| <= 1/2 (round to nearest, in units of the element's scale):
  |y_int8 - y| <= (S_a/2) @ |b|^T + |a| @ (S_b/2)^T + (S_a/2) @ (S_b/2)^T      (elementwise)
where S_a, S_b are the per-element scale matrices of the two operands. A stochastically rounded operand
has |e| < 1: its S/2 becomes S.
"""
import torch

from megatron_int8.reference import QTensor, quantize


def heavy_tailed(*shape, outliers=0.01, scale=30.0, generator=None, dtype=torch.float32):
    """Gaussian data with a fraction of large outliers (fresh on every call)."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(*shape, generator=generator, dtype=torch.float64) < outliers
    x = torch.where(mask, x * scale, x)
    return x.to(dtype)


def expanded_scale(qt: QTensor) -> torch.Tensor:
    """The scale of every element of a quantized operand, as a float64 [R, C] matrix."""
    R, C = qt.data.shape
    if qt.granularity == "tensor":
        return qt.scale.double().expand(R, C)
    if qt.granularity == "row":
        return qt.scale.double()[:, None].expand(R, C)
    s = qt.scale_per_row_block().double()
    return s.repeat_interleave(qt.block_size, dim=1)[:, :C]


def float64_group_amax(x, granularity, block, tile2d):
    """The amax of each element's quantization group of x [R, C] in float64 (C the contraction axis; block
    granularity: 1 x block groups, or block x block tiles with tile2d)."""
    x = x.double().abs()
    R, C = x.shape
    if granularity == "tensor":
        return x.max().expand(R, C)
    if granularity == "row":
        return x.amax(dim=1, keepdim=True).expand(R, C)
    rb = block if tile2d else 1
    out = torch.empty_like(x)
    for r0 in range(0, R, rb):
        for c0 in range(0, C, block):
            out[r0 : r0 + rb, c0 : c0 + block] = x[r0 : r0 + rb, c0 : c0 + block].max()
    return out


def product_bound(a, b, granularity, *, a_weight=False, b_weight=False, block_size=128, a_stochastic=False):
    """Elementwise float64 bound on |dequant(Q(a) @ Q(b)^T) - a @ b^T| from the two operands' scales."""
    qa = quantize(a, granularity, block_size=block_size, tile2d=a_weight and granularity == "block")
    qb = quantize(b, granularity, block_size=block_size, tile2d=b_weight and granularity == "block")
    sa, sb = expanded_scale(qa) / (1 if a_stochastic else 2), expanded_scale(qb) / 2
    a64, b64 = a.double(), b.double()
    return sa @ b64.abs().t() + a64.abs() @ sb.t() + sa @ sb.t()


def rounding_slack(ref: torch.Tensor, dtype: torch.dtype, a, b) -> torch.Tensor:
    """Output-dtype rounding of the result plus fp32 dequant/accumulation rounding."""
    out_eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    fp32_terms = a.double().abs() @ b.double().abs().t() * (4 * torch.finfo(torch.float32).eps)
    return ref.abs() * out_eps + fp32_terms


def assert_within_int8_bound(out, a, b, granularity, *, a_weight=False, b_weight=False, block_size=128, what="",
                             a_stochastic=False):
    ref = a.double() @ b.double().t()
    bound = product_bound(a, b, granularity, a_weight=a_weight, b_weight=b_weight, block_size=block_size,
                          a_stochastic=a_stochastic)
    bound = bound + rounding_slack(ref, out.dtype, a, b)
    err = (out.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error exceeds the quantization bound by {worst:.3f}x"
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0).item()
    return cos


def rope_float64(t, freqs, inverse=False):
    """RoPE (or its transpose) in float64: halves [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2]."""
    rot = freqs.shape[-1]
    x, f = t[..., :rot].double(), freqs.double()
    c, s = torch.cos(f), torch.sin(f)
    h = rot // 2
    x1, x2 = x[..., :h], x[..., h:]
    if inverse:
        out = torch.cat((x1 * c[..., :h] + x2 * s[..., h:], x2 * c[..., h:] - x1 * s[..., :h]), dim=-1)
    else:
        out = torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), dim=-1)
    return torch.cat((out, t[..., rot:].double()), dim=-1)


def assert_rope_close(got, t, freqs, inverse, what, rounding_ulps=0.5):
    """got (a new contiguous tensor of t's dtype) within `rounding_ulps` of t's dtype of the float64
    RoPE of t (half an ulp: one round-to-nearest), plus fp32 arithmetic (cos/sin, two products, a sum)
    on the magnitudes |x1| + |x2| it combines; the dimensions past the rotary ones copied exactly."""
    want = rope_float64(t, freqs, inverse)
    rot = freqs.shape[-1]
    pair = t[..., :rot // 2].double().abs() + t[..., rot // 2:rot].double().abs()  # |x1| + |x2|
    mag = torch.cat((pair, pair, torch.zeros_like(t[..., rot:], dtype=torch.float64)), dim=-1)
    bound = want.abs() * torch.finfo(t.dtype).eps * rounding_ulps + mag * 4 * torch.finfo(torch.float32).eps
    err = (got.double() - want).abs()
    assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous(), what
    assert (err <= bound).all(), f"{what}: max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    assert torch.equal(got[..., rot:], t[..., rot:]), f"{what}: pass-through dimensions changed"


def assert_rms_norm_close(x, weight, eps, dy, y, dx, dw, rounding_ulps=0.5, grad_at=None):
    """An RMSNorm's forward (y) and gradients (dx, dw) against float64, over the last dimension W.

    Bounds: one rounding to the output dtype (`rounding_ulps` of it), plus fp32 arithmetic. fp32 sums of
    W squares put a relative error of up to (W/2 + 4) eps32 on 1/rms, hence on y; backward's row sum
    mean(g x r) and its products are bounded on the magnitudes they combine, and the weight gradient's
    fp32 sum over the R rows on the sum of |dy x r|.

    `grad_at`: the values the gradients are taken at (the norm's dequantized INT8 copy of x), with x's r."""
    f32 = torch.finfo(torch.float32).eps
    W = x.shape[-1]
    x64, w64, dy64 = x.double(), weight.double(), dy.double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    want_y = x64 * r * w64
    xhat = (x64 if grad_at is None else grad_at.double()) * r
    g = dy64 * w64
    c = (g * xhat).mean(-1, keepdim=True)
    want_dx = r * (g - xhat * c)
    want_dw = (dy64 * xhat).reshape(-1, W).sum(0)
    out_eps = torch.finfo(x.dtype).eps * rounding_ulps
    checks = [
        ("forward", y, want_y, want_y.abs() * (out_eps + (W / 2 + 4) * f32)),
        ("input gradient", dx, want_dx, want_dx.abs() * out_eps
         + r * (g.abs() + xhat.abs() * (g * xhat).abs().mean(-1, keepdim=True)) * (2 * W + 16) * f32),
        ("weight gradient", dw, want_dw, want_dw.abs() * torch.finfo(weight.dtype).eps * rounding_ulps
         + (dy64 * xhat).abs().reshape(-1, W).sum(0) * (x.numel() // W + W + 8) * f32),
    ]
    for what, got, want, bound in checks:
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (f"{what}: max error {err.max():.3g}, worst excess {(err - bound).max():.3g} "
                                      f"at {(err - bound).argmax().item()}")


def assert_rms_norm_int8_copy_bound(x, weight, eps, dy, dx, dw, x_hat, step, rounding_ulps=0.5):
    """An RMSNorm's gradients taken at x_hat, a quantized copy of x with elementwise step `step`, against
    float64 at x itself. With e = r (step / 2 + fp32 rounding) >= |r x_hat - r x| and c = mean(g xhat):
    |d dx| <= r (e (|c| + mean(|g| e)) + |xhat| mean(|g| e)) and |d dw| <= sum over rows of |dy| e, plus
    assert_rms_norm_close's rounding terms."""
    f32 = torch.finfo(torch.float32).eps
    W = x.shape[-1]
    x64, w64, dy64 = x.double(), weight.double(), dy.double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    e = r * (step.double() / 2 + x64.abs() * 4 * f32)
    assert ((x_hat.double() - x64).abs() * r <= e).all(), "x_hat is not within half a step"
    xhat, g = x64 * r, dy64 * w64
    c = (g * xhat).mean(-1, keepdim=True)
    ge = (g.abs() * e).mean(-1, keepdim=True)
    out_eps = torch.finfo(dx.dtype).eps * rounding_ulps
    want_dx, want_dw = r * (g - xhat * c), (dy64 * xhat).reshape(-1, W).sum(0)
    quant_dx = r * (e * (c.abs() + ge) + xhat.abs() * ge)
    quant_dw = (dy64.abs() * e).reshape(-1, W).sum(0)
    checks = [
        ("input gradient", dx, want_dx, quant_dx + (want_dx.abs() + quant_dx) * out_eps
         + r * ((g.abs() + (xhat.abs() + e) * (g * xhat).abs().mean(-1, keepdim=True) + ge)) * (2 * W + 16) * f32),
        ("weight gradient", dw, want_dw, quant_dw + (want_dw.abs() + quant_dw) * torch.finfo(dw.dtype).eps
         * rounding_ulps + (dy64 * (xhat.abs() + e)).abs().reshape(-1, W).sum(0) * (x.numel() // W + W + 8) * f32),
    ]
    for what, got, want, bound in checks:
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (f"{what}: max error {err.max():.3g}, worst excess {(err - bound).max():.3g} "
                                      f"at {(err - bound).argmax().item()}")


def assert_swiglu_close(x, dy, y, dx, rounding_ulps=0.5, probs=None, dprobs=None, grad_at=None):
    """SwiGLU's forward y = silu(a) b and input gradient dx = [da | db] (x = [a | b] on the last dimension)
    against float64. Bounds: one rounding to the output dtype (`rounding_ulps` of it) plus fp32 arithmetic,
    bounded on the magnitudes each formula combines: da = dy b s (1 + a (1 - s)) cancels near a = -1.28.
    sigmoid(a) of a very negative a underflows in fp32 (subnormal or 0): an absolute error of up to the
    smallest normal fp32 number in s, times the factors it meets.

    With `probs` (one weight p per row), the weighted SwiGLU: y = silu(a) b p, dx as above for dy p, and
    `dprobs` = the row sums of silu(a) b dy, within an fp32 sum's bound over the row plus one rounding to
    probs' dtype.

    `grad_at`: the values the input gradient is taken at (SwiGLU's dequantized INT8 copy of x), x by default."""
    f32 = torch.finfo(torch.float32).eps
    tiny = torch.finfo(torch.float32).tiny
    out_eps = torch.finfo(x.dtype).eps * rounding_ulps
    a, b = x.double().chunk(2, dim=-1)
    p = torch.ones(a.shape[:-1], dtype=torch.float64) if probs is None else probs.double()
    want_y = a * torch.sigmoid(a) * b * p.unsqueeze(-1)
    y_bound = want_y.abs() * (out_eps + 8 * f32) + ((a * b * p.unsqueeze(-1)).abs() + 1) * tiny
    if grad_at is not None:
        a, b = grad_at.double().chunk(2, dim=-1)
    g = dy.double() * p.unsqueeze(-1)
    s = torch.sigmoid(a)
    want_da, want_db = g * b * s * (1 + a * (1 - s)), g * a * s
    checks = [
        ("forward", y, want_y, y_bound),
        ("gradient of a", dx[..., :a.shape[-1]], want_da,
         want_da.abs() * out_eps + (g * b).abs() * (1 + a.abs()) * (s * 16 * f32 + tiny) + tiny),
        ("gradient of b", dx[..., a.shape[-1]:], want_db,
         want_db.abs() * (out_eps + 8 * f32) + ((g * a).abs() + 1) * tiny),
    ]
    if probs is not None:
        terms = a * s * b * dy.double()
        want_dp = terms.sum(-1)
        magnitude = ((a * b).abs() * (s + tiny) * dy.double().abs()).sum(-1)
        checks.append(("gradient of the row weights", dprobs, want_dp,
                       (a.shape[-1] + 8) * f32 * magnitude + want_dp.abs() * torch.finfo(probs.dtype).eps
                       * rounding_ulps + tiny))
    for what, got, want, bound in checks:
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (f"{what}: max error {err.max():.3g}, worst excess {(err - bound).max():.3g} "
                                      f"at {(err - bound).argmax().item()}")


def assert_swiglu_int8_copy_bound(x, dy, dx, x_hat, step, rounding_ulps=0.5):
    """SwiGLU's input gradient taken at x_hat, a quantized copy of x with elementwise step `step`
    (|x_hat - x| <= step / 2 plus fp32 rounding), against float64 at x itself. The quantization bound follows from
    |silu'| <= 1.1 and |silu''| <= 0.5: |d db| <= |dy| 1.1 |d a| and |d da| <= |dy| (1.1 |d b| + 0.5 |b_hat| |d a|),
    plus one rounding of the output dtype and fp32 arithmetic at x_hat."""
    f32, tiny = torch.finfo(torch.float32).eps, torch.finfo(torch.float32).tiny
    out_eps = torch.finfo(dx.dtype).eps * rounding_ulps
    a, b = x.double().chunk(2, dim=-1)
    ah, bh = x_hat.double().chunk(2, dim=-1)
    # half a step, plus fp32 rounding of x * (1 / scale) and of q * scale
    da_step, db_step = (step.double() / 2 + x.double().abs() * 4 * f32).chunk(2, dim=-1)
    assert (ah - a).abs().le(da_step).all() and (bh - b).abs().le(db_step).all(), "x_hat is not within half a step"
    g = dy.double()
    s = torch.sigmoid(a)
    want_da, want_db = g * b * s * (1 + a * (1 - s)), g * a * s
    slack = g.abs() * (bh.abs() + ah.abs() + 1) * (1 + ah.abs()) * 16 * f32 + tiny
    checks = [("gradient of a", dx[..., :a.shape[-1]], want_da,
               g.abs() * (1.1 * db_step + 0.5 * bh.abs() * da_step)),
              ("gradient of b", dx[..., a.shape[-1]:], want_db, g.abs() * 1.1 * da_step)]
    for what, got, want, quantization in checks:
        err = (got.double() - want).abs()
        bound = quantization + (want.abs() + quantization) * out_eps + slack
        assert (err <= bound).all(), (f"{what}: max error {err.max():.3g}, worst excess {(err - bound).max():.3g} "
                                      f"at {(err - bound).argmax().item()}")


def assert_fp32_accumulation_close(after, before, g, x, what=""):
    """after = before + g^T x accumulated in fp32 (APEX-style fused wgrad): within the standard bound of a
    K-term fp32 sum, gamma_(K+1) * (|before| + |g|^T |x|), plus the final rounding. The bound is also checked
    to be tight enough that a route rounding g^T x to bf16 before the add would exceed it."""
    K = g.shape[0]
    u = 2.0 ** -24
    gamma = (K + 1) * u / (1 - (K + 1) * u)
    ref = before.double() + g.double().t() @ x.double()
    bound = gamma * (before.double().abs() + g.double().abs().t() @ x.double().abs()) + u * ref.abs()
    err = (after.double() - ref).abs()
    assert (err <= bound).all(), f"{what}: fp32 accumulation error {(err / bound).max():.2f}x its bound"
    rounded = before.double() + (g.double().t() @ x.double()).to(torch.bfloat16).double()
    assert ((rounded - ref).abs() > bound).any(), f"{what}: the bound does not tell fp32 from bf16 rounding"
