"""INT8 attention test cases shared by the kernel, op and layer tests: activation-like inputs with outliers, float64
attention and its gradients, the elementwise bounds that the INT8 quantization steps allow, and the kernels-against-
PyTorch-path check (tests/kernels/test_int8_attention*.py, tests/megatron/test_int8_attention_layer*.py)."""
import math

import torch
from int8_bounds import float64_group_amax

from megatron_int8.ops.int8_attention import int8_attention, quantize_rows


def attention_inputs(B, H, Hk, S, D, seed, dtype=torch.bfloat16, device="cpu"):
    """Fresh q, k, v, dO as activations look: a few channels of q and k 3x larger, k with a shared bias (what
    the smoothing removes), and 0.2% outliers of 8x in q, k, v."""
    g = torch.Generator().manual_seed(seed)

    def act(*shape, channels=False, bias=None):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        x = torch.where(torch.rand(*shape, generator=g, dtype=torch.float64) < 0.002, 8 * x, x)
        if channels:
            x = x * torch.where(torch.rand(shape[-1], generator=g, dtype=torch.float64) < 0.05, 3.0, 1.0)
        if bias is not None:
            x = x + bias
        return x.to(dtype)

    q = act(B, H, S, D, channels=True)
    k = act(B, Hk, S, D, channels=True, bias=2 * torch.randn(1, Hk, 1, D, generator=g, dtype=torch.float64))
    v = act(B, Hk, S, D)
    do = torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(dtype)
    return [t.to(device) for t in (q, k, v, do)]


def _causal(Sq, Sk, device="cpu"):
    return torch.ones(Sq, Sk, dtype=torch.bool, device=device).triu(1)


def attention64(q, k, v, causal, scale):
    """Plain attention in the inputs' dtype (float64 here), GQA by repeating k and v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(_causal(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def grads64(q, k, v, do, causal, scale):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    o = attention64(*leaves, causal, scale)
    o.backward(do.double())
    return [o.detach()] + [t.grad for t in leaves]


def megatron_layout(x):
    """x [b, h, s, d] as Megatron's core attention hands it over: [s, b, h, d] memory viewed as [b, h, s, d]."""
    return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def run_path(q, k, v, do, causal, config, backend, scale=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = int8_attention(*leaves, causal=causal, scale=scale, config=config, backend=backend)
    o.backward(do)
    return [o.detach()] + [t.grad for t in leaves]


def snr_db(x, ref):
    ref = ref.double()
    return 10 * math.log10(ref.pow(2).sum().item() / max((x.double() - ref).pow(2).sum().item(), 1e-300))


# ------------------------------------------------------------------------------------------ error bounds
def _expand(x, group):
    return x.repeat_interleave(group, dim=1)


def _sum_group(x, group):
    B, H = x.shape[:2]
    return x.view(B, H // group, group, *x.shape[2:]).sum(dim=2)


def int8_attention_bounds(q, k, v, do, o_int8, causal, scale, cfg):
    """Elementwise float64 bounds on |path - exact| of (O, dQ, dK, dV), from the quantization steps.

    Per-token scales s_q, s_k of Q and smoothed K bound the score error E = scale (s_q/2 sum|k^| + sum|q| s_k/2)
    (scores="bf16": E = scale 2^-8 sum|q||k|);
    softmax turns it into |P' - P| <= EP: P'_i = P_i e^(e_i) / sum_j P_j e^(e_j) with |e_j| <= E_j rises with e_i and
    falls with the other e_j, so it lies between P_i e^-E_i / (P_i e^-E_i + sum_(j!=i) P_j e^E_j) and
    P_i e^E_i / (P_i e^E_i + sum_(j!=i) P_j e^-E_j) (a row of one key keeps P' = P = 1). Each INT8 product A B adds
    |dA| |B^| + |A| |dB| + step_A / 2 |B^|, with step_A / 2 <= (row max of A') / 254: P^T, dS^T and dS have step
    (row max of the quantized tile) / 127; the forward's P, exp(s - m) with m the running max up to its key tile,
    has the fixed step 1/127, which is exp(m - m_row) / (127 l) <= 1 / (127 l) = (row max of P') / 127 once the
    row is divided by its sum l (m <= m_row, the row's max).
    The backward sees the forward's O (delta = rowsum(dO O')), so dS' - dS <= EP |dP - delta| + P' |delta' - delta|.
    fp32 sums and the 16-bit outputs add |x| 2^-22 and |result| 2^-8. A worst case (absolute values summed where
    the errors mostly cancel): the median element's error sits 40-10000x below it, the largest up to 0.93 of it (O in
    the first rows under the causal mask, where a few keys leave V's step most of the error); the SNR floor and the
    kernels' comparison with the PyTorch path are the tight checks."""
    group = q.shape[1] // k.shape[1]
    Sq, Sk = q.shape[2], k.shape[2]
    q64, v64, do64 = q.double(), v.double(), do.double()
    k_s = k.float() - k.mean(dim=2, keepdim=True, dtype=torch.float32)
    ks64 = k_s.double()
    mask = ~_causal(Sq, Sk, q.device) if causal else torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    fp32 = 2.0 ** -22
    out16 = 2.0 ** -8 if o_int8.dtype != torch.float32 else fp32

    qk_abs = q64.abs() @ _expand(ks64.abs(), group).transpose(-1, -2)
    if cfg.scores == "bf16":  # Q and smoothed K each rounded to 8 significant bits: 2^-9 each, 1% for the product
        err_s = scale * 2.0 ** -8 * 1.01 * qk_abs
    else:
        q_int, s_q = quantize_rows(q.float())
        k_int, s_k = quantize_rows(k_s)
        k_hat = (k_int * s_k).double()
        err_s = scale * ((s_q.double() / 2) * _expand(k_hat.abs().sum(-1), group)[..., None, :]
                         + q64.abs().sum(-1, keepdim=True) * _expand(s_k.double() / 2, group).transpose(-1, -2))
    err_s = err_s + scale * fp32 * qk_abs
    err_s = err_s.masked_fill(~mask, 0.0)
    s = scale * q64 @ _expand(ks64, group).transpose(-1, -2)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    up, down = p * torch.exp(err_s), p * torch.exp(-err_s)
    p_hi = up / (up + (down.sum(-1, keepdim=True) - down))  # the other scores of the row as low as they can be
    p_lo = down / (down + (up.sum(-1, keepdim=True) - up))
    e_p = torch.maximum(p_hi - p, p - p_lo)
    p_up = p + e_p
    maskf = mask.double()

    def block_steps(x):  # half the step of x [B, H, S, D] per (head, cfg.block tokens, channel): fp32(amax / 127),
        # at least 2^-126 (the quantizer's least scale, whose inverse is finite)
        tokens_last = x.transpose(-1, -2).reshape(-1, x.shape[2])
        amax = float64_group_amax(tokens_last, "block", cfg.block, False).view(*x.shape[:2], x.shape[3], x.shape[2])
        return (amax.transpose(-1, -2).float() / 127).clamp_min(2.0 ** -126).double() / 2

    v_half = _expand(block_steps(v), group)
    v_up = _expand(v64.abs(), group) + v_half
    o = p @ _expand(v64, group)
    e_o = e_p @ v_up + p @ v_half + p_up.amax(-1, keepdim=True) / 254 * (maskf @ v_up)
    e_o = e_o + fp32 * (p_up @ v_up) + o_int8.double().abs() * out16

    e_delta = (do64.abs() * e_o).sum(-1, keepdim=True)
    dp = do64 @ _expand(v64, group).transpose(-1, -2)
    delta = (do64 * o).sum(-1, keepdim=True)
    e_dp = fp32 * (do64.abs() @ _expand(v64.abs(), group).transpose(-1, -2))
    ds = p * (dp - delta)
    e_ds = e_p * (dp - delta).abs() + p_up * (e_dp + e_delta)
    ds_up = ds.abs() + e_ds

    do_half = block_steps(do)
    do_up = do64.abs() + do_half
    pt = p_up.transpose(-1, -2)
    e_dv = (e_p.transpose(-1, -2) @ do_up + p.transpose(-1, -2) @ do_half
            + pt.amax(-1, keepdim=True) / 254 * (maskf.t() @ do_up) + fp32 * (pt @ do_up))
    e_dv = _sum_group(e_dv, group)

    q_half = block_steps(q)
    q_up = q64.abs() + q_half
    dst = ds_up.transpose(-1, -2)
    e_dk = scale * (e_ds.transpose(-1, -2) @ q_up + ds.abs().transpose(-1, -2) @ q_half
                    + dst.amax(-1, keepdim=True) / 254 * (maskf.t() @ q_up) + fp32 * (dst @ q_up))
    e_dk = _sum_group(e_dk, group)

    k_half = _expand(block_steps(k_s), group)
    k_up = _expand(ks64.abs(), group) + k_half
    e_dq = scale * (e_ds @ k_up + ds.abs() @ k_half + ds_up.amax(-1, keepdim=True) / 254 * (maskf @ k_up)
                    + fp32 * (ds_up @ k_up))
    return e_o, e_dq, e_dk, e_dv


def assert_within_bounds(got, exact, bounds, dtypes, what):
    for name, x, ref, bound, dtype in zip(("O", "dQ", "dK", "dV"), got, exact, bounds, dtypes):
        if dtype != torch.float32:
            bound = bound + x.double().abs() * 2.0 ** -8  # the gradient's rounding to its 16-bit dtype
        err = (x.double() - ref).abs()
        ratio = torch.where(err == 0, 0.0, err / bound).max().item()  # an all-zero group's step is 0: exact there
        assert ratio <= 1.0, f"{what}: {name} exceeds its quantization bound by {ratio:.3f}x"


def flip_units(q, k, v, do, causal, scale):
    """What one rounding flip (a quantized P, P^T, dS^T or dS moved by one step, <= 1/127 of its row's maximum) can
    change in one element of O, dQ, dK, dV: the step times the other operand's largest value (float64 maxima,
    5% margin for the INT8 values' own error)."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    s = scale * leaves[0] @ leaves[1].repeat_interleave(group, 1).transpose(-1, -2)
    if causal:
        s = s.masked_fill(_causal(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    dp = do.double() @ v.double().repeat_interleave(group, 1).transpose(-1, -2)
    ds_max = (p * (dp - (dp * p).sum(-1, keepdim=True))).abs().max().item() * 1.05
    k_s = k.double() - k.double().mean(dim=2, keepdim=True)
    amax = [t.double().abs().max().item() * 1.05 for t in (v, k_s, q, do)]
    return [amax[0] / 127, scale * ds_max / 127 * amax[1], scale * ds_max / 127 * amax[2], amax[3] / 127]


def assert_kernels_match(q, k, v, do, causal, cfg, what):
    """Kernels against the PyTorch path. They quantize the same values with the same scales, but fp32 rounding
    (exp2 against exp, the order of sums and scale products) can flip the rounding of a quantized P or dS by one
    step, more often the longer the rows. So: every element within fp32 rounding (1e-5 of the largest value; one
    unit in the last place for 16-bit outputs) plus two flips, and the difference as a whole at most a fifth of
    the path's own quantization error against float64 (a wrong scale or tile would be as large as that error)."""
    want = run_path(q, k, v, do, causal, cfg, "reference")
    if q.dtype == torch.float32 or q.is_cuda:  # through the autograd Function
        got = run_path(q, k, v, do, causal, cfg, "triton")
    else:  # the interpreter rounds fp32 to bf16 toward zero (CUDA to nearest): backward gets the path's O
        from megatron_int8.kernels.int8_attention import triton_attention_backward, triton_attention_forward

        scale = 1 / math.sqrt(q.shape[-1])
        o, saved = triton_attention_forward(q, k, v, causal, scale, cfg)
        got = [o, *triton_attention_backward(do, want[0], v, saved, causal, scale, cfg, q.shape, q.dtype, k.shape,
                                             k.dtype)]
    exact = grads64(q, k, v, do, causal, 1 / math.sqrt(q.shape[-1]))
    units = flip_units(q, k, v, do, causal, 1 / math.sqrt(q.shape[-1]))
    for name, a, b, ref, unit in zip(("O", "dQ", "dK", "dV"), got, want, exact, units):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}"
        ulp = b.float().abs() * (2.0 ** -7 if b.dtype != torch.float32 else 0.0)
        beyond = (a.float() - b.float()).abs() - (1e-5 * b.float().abs().max() + ulp)
        assert beyond.max().item() <= 2 * unit, f"{what}: {name} differs by {beyond.max().item():.3g} > 2 flips"
        if a.dtype == torch.float32 or a.is_cuda:  # (the interpreter's truncation to bf16 is biased)
            ratio = (a.double() - b.double()).norm().item() / (b.double() - ref).norm().item()
            assert ratio <= 0.2, f"{what}: {name} differs from the path by {ratio:.2f}x the path's own error"


def nan_value_inputs(seed, S=64, D=32, dtype=torch.float32, device="cpu"):
    """One NaN in V (token 5, channel 0) and one in dO (token 7, channel 3): what an overflow upstream leaves."""
    q, k, v, do = attention_inputs(1, 2, 1, S, D, seed, dtype=dtype, device=device)
    v[:, :, 5, 0] = float("nan")
    do[:, :, 7, 3] = float("nan")
    return q, k, v, do


def assert_nan_shows(o, dv, what):
    """The causal rows that attend token 5 (all from 5 on, both heads of the group) hold NaN in channel 0 of O, and
    dV NaN in channel 3 of the keys that token 7 attends; nothing turned the NaN into finite values."""
    assert torch.isnan(o[:, :, 5:, 0]).all(), f"{what}: O lost V's NaN"
    assert torch.isnan(dv[:, :, :8, 3]).all(), f"{what}: dV lost dO's NaN"
