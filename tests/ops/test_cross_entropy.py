"""Fused vocab-parallel cross entropy (megatron_int8.ops.cross_entropy) against float64, on CPU.

- the PyTorch path (what runs on the CPU) and the Triton kernels (under TRITON_INTERPRET=1, in a subprocess:
  Triton decides at import time whether it interprets, so, as tests/test_kernels.py does, a driver test
  runs this file again in a fresh interpreter with TRITON_INTERPRET=1 set; run directly with it set, the
  kernel tests run in-process: TRITON_INTERPRET=1 python3 -m pytest -q tests/test_cross_entropy.py);
- tensor parallelism over a real gloo group of 2 processes, against one rank and megatron's own
  vocab_parallel_cross_entropy;
- install(): megatron's compute_language_model_loss (native fusion) then calls ours and matches
  megatron's native fused cross entropy; the trainer installs it;
- on a GPU (`gpu` marker): the compiled kernels at [512, 50257] bf16, and peak memory (no fp32 copy).

Bounds are derived from fp32 rounding (unit U = 2^-24) and one rounding of the gradient to its dtype:
half a bf16 ulp (<= 2^-8 of the value) on a GPU, a whole ulp under the interpreter, whose fp32 -> bf16
cast truncates. They are elementwise, tighter than 2^-8 of the largest gradient.
"""
import importlib.util
import math
import os
from types import SimpleNamespace

import pytest
import torch
from interpreter import INTERPRETING, needs_interpreter, run_file_interpreted
from mcore_helpers import init_megatron, run_distributed, single_process_megatron

from megatron_int8.ops import cross_entropy as ce
from repo_paths import CONFIGS

HAS_TRITON = importlib.util.find_spec("triton") is not None
U = 2.0 ** -24
MIN_BLOCK = 128  # the smallest chunk the kernel tests use: bounds count its chunk rescalings

parent_only = pytest.mark.skipif(INTERPRETING, reason="runs in the parent pytest process (not interpreted)")


# ----------------------------------------------------------------------------- data and float64 reference


def outlier_logits(N, V, dtype, generator=None):
    """Fresh logits [N, V]: Gaussian body (std 2), plus per row 3 outliers of +-30..60."""
    x = torch.randn(N, V, generator=generator, dtype=torch.float64) * 2
    cols = torch.randint(0, V, (N, 3), generator=generator)
    signs = torch.where(torch.rand(N, 3, generator=generator) < 0.5, -1.0, 1.0).double()
    vals = signs * (30 + 30 * torch.rand(N, 3, generator=generator, dtype=torch.float64))
    x.scatter_(1, cols, vals)
    return x.to(dtype), cols


def targets_for(N, V, outlier_cols, generator=None, out_of_range=True):
    """Random ids; row 0 hits its largest outlier (a confident, right prediction: loss ~ 0, p_t ~ 1),
    row 1 one of its outliers (+-); the last two rows, out_of_range, ids outside [0, V) (megatron counts
    them: loss log-sum-exp - max, no -1 in the gradient)."""
    t = torch.randint(0, V, (N,), generator=generator)
    t[0] = outlier_cols[0, 0]
    t[1] = outlier_cols[1, 1]
    if out_of_range:
        t[-1], t[-2] = V + 3, -1
    return t


def exact(x, target, g):
    """float64 loss [N], gradient [N, V] and the row statistics of full-vocabulary logits x [N, V]."""
    xd = x.double()
    N, V = xd.shape
    m = xd.amax(-1)
    lse = torch.logsumexp(xd, -1)
    hit = (target >= 0) & (target < V)
    xt = xd.gather(1, target.clamp(0, V - 1)[:, None]).squeeze(1)
    loss = lse - torch.where(hit, xt, m)
    p = torch.exp(xd - lse[:, None])
    one_hot = torch.zeros_like(p)
    rows = torch.arange(N, device=xd.device)[hit]
    one_hot[rows, target[hit]] = 1.0
    grad = g.double().reshape(N, 1) * (p - one_hot)
    return SimpleNamespace(loss=loss, grad=grad, m=m, lse=lse, xt=torch.where(hit, xt, m), p=p)


def bounds(x, ref, g, out_dtype, *, rounding="nearest", factor=1.0, extra=0.0, block=MIN_BLOCK):
    """Elementwise bounds (loss [N], gradient [N, V]) for the fp32 computation of `ref` (from `exact`).

    Sum of exp: each term relative error <= (|x - m| + 2) U (argument rounding, exp), summation and chunk
    rescalings <= (2 log2 V + 4 chunks + 8) U; the softmax-weighted mean of |x - m| is at most log V.
    Loss = log(l) - (x_t - m): + |log l| U, |x_t - m| U, |loss| U. lse = m + log(l): + |lse| U.
    Gradient before rounding: g (p (1 + d_lse + (|x - lse| + 4) U) - y), with the p - y and product
    roundings (2 U); then one rounding to out_dtype (half an ulp, a whole one when truncating)."""
    N, V = x.shape
    chunks = math.ceil(V / block)
    log_l = ref.lse - ref.m
    d_l = U * (math.log(V) + 2 * math.log2(V) + 4 * chunks + 8) + extra
    loss_b = factor * (d_l + 2 * U * (log_l.abs() + (ref.xt - ref.m).abs() + ref.loss.abs()))
    d_lse = factor * (d_l + 2 * U * (log_l.abs() + ref.lse.abs()))
    ga = g.double().abs().reshape(N, 1)
    dist = torch.where(ref.p > 0, (x.double() - ref.lse[:, None]).abs(), 0.0)  # -inf logits: p = 0 exactly
    pre = factor * ga * (ref.p * (d_lse[:, None] + U * (dist + 4)) + 2 * U)
    pre = pre + 2.0 ** -148 * (1 + ga)  # p or g p in fp32's subnormal range (exp(x - lse) below 2^-126)
    info = torch.finfo(out_dtype)
    ulps = 0.5 if rounding == "nearest" or out_dtype == torch.float32 else 1.0
    r = ulps * info.eps  # of a value: half an ulp is 2^-8 (bf16), 2^-11 (fp16), 2^-24 (fp32)
    grad_b = pre + r * (ref.grad.abs() + pre) + ulps * info.eps * info.smallest_normal  # subnormal spacing
    return loss_b, grad_b


def assert_within(got, want, bound, what):
    err = (got.double() - want).abs()
    bad = ~((err <= bound) | (got.double() == want))  # NaN fails; equal infinities pass
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outside the bound; first at flat index "
                             f"{i}: got {got.flatten()[i].item()!r}, want {want.flatten()[i].item()!r}, "
                             f"bound {bound.flatten()[i].item():.3g}")


LAYOUTS = ["contiguous [s, b, V]", "row slice of a wider tensor", "[b, s, V] transposed", "[N, V]"]


def _make(S, B, V, dtype, layout, generator=None):
    """(logits leaf in the layout, full-vocab rows [S * B, V] in s-major row order, targets [s, b] or [N])."""
    x, cols = outlier_logits(S * B, V, dtype, generator)
    t = targets_for(S * B, V, cols, generator)
    x[2, :300] = -torch.inf  # masked ids: the first chunks of 128 hold -inf only
    t[2] = V - 1
    if layout == "contiguous [s, b, V]":
        leaf = x.view(S, B, V).clone()
        tt = t.view(S, B)
    elif layout == "row slice of a wider tensor":
        wide = torch.zeros(S, B, V + 37, dtype=dtype)
        wide[..., 5:V + 5] = x.view(S, B, V)
        leaf = wide[..., 5:V + 5]  # strides (B (V + 37), V + 37, 1)
        tt = t.view(S, B)
    elif layout == "[b, s, V] transposed":
        leaf = x.view(S, B, V).transpose(0, 1).contiguous().transpose(0, 1)  # strides (V, S V, 1)
        tt = t.view(S, B)
    else:
        leaf = x.clone()
        tt = t
    assert leaf.stride(-1) == 1
    return leaf.requires_grad_(True), x, tt


def _run_and_check(dtype, V, layout, grad_kind, rounding):
    """Our loss and logit gradient for fresh data against float64, within `bounds`."""
    S, B = 5, 3
    leaf, x, t = _make(S, B, V, dtype, layout)
    loss = ce.vocab_parallel_cross_entropy(leaf, t, None)
    assert loss.dtype == torch.float32 and loss.shape == t.shape and not loss._is_view()
    if grad_kind == "non-uniform":
        g = 0.25 + 1.5 * torch.rand(t.shape)
        g.view(-1)[4] = 0.0  # a masked-out token
        loss.backward(g)
    else:  # the mean as sum / N: autograd hands backward an expanded (stride 0) gradient
        strides = []
        loss.register_hook(lambda grad: strides.append(grad.stride()))
        (loss.sum() / t.numel()).backward()
        assert set(strides[0]) == {0}
        g = torch.full(t.shape, 1.0 / t.numel())
    assert leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape
    ref = exact(x, t.reshape(-1), g.reshape(-1))
    loss_b, grad_b = bounds(x, ref, g.reshape(-1), dtype, rounding=rounding)
    assert_within(loss.reshape(-1), ref.loss, loss_b, f"loss ({dtype}, V {V}, {layout})")
    assert_within(leaf.grad.reshape(-1, V), ref.grad, grad_b, f"grad ({dtype}, V {V}, {layout})")
    if grad_kind == "non-uniform":
        assert (leaf.grad.reshape(-1, V)[4] == 0).all()
    return loss


# ----------------------------------------------------------------------------- PyTorch path (parent pytest process)


@parent_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("V", [1000, 1187])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_kind", ["non-uniform", "mean"])
def test_reference_path_matches_float64(dtype, V, layout, grad_kind):
    loss = _run_and_check(dtype, V, layout, grad_kind, "nearest")
    assert loss.grad_fn.use_triton is False


@parent_only
def test_saves_only_the_logits_targets_and_lse():
    """Nothing of the logits' size is kept but the logits themselves (no copy, no softmax)."""
    leaf, _, t = _make(4, 2, 1187, torch.bfloat16, "contiguous [s, b, V]")
    loss = ce.vocab_parallel_cross_entropy(leaf, t, None)
    saved = loss.grad_fn.saved_tensors
    big = [s for s in saved if s.numel() > t.numel()]
    assert len(big) == 1 and big[0].data_ptr() == leaf.data_ptr() and big[0].dtype == torch.bfloat16
    small = sorted((str(s.dtype), tuple(s.shape)) for s in saved if s.numel() <= t.numel())
    assert len(saved) == 3 and small == [("torch.float32", (t.numel(),)), ("torch.int64", (t.numel(),))]


@parent_only
def test_loss_is_a_tensor_of_its_own():
    """The loss is not a view (autograd forbids in-place ops on views a Function returns): a caller may
    mask it in place, even at micro-batch 1 where megatron's transpose(0, 1).contiguous() is a no-op."""
    leaf, _, t = _make(4, 1, 300, torch.bfloat16, "contiguous [s, b, V]")
    loss = ce.vocab_parallel_cross_entropy(leaf, t, None)
    assert not loss._is_view() and loss.is_contiguous()
    loss.transpose(0, 1).contiguous().mul_(torch.ones(1, 4)).sum().backward()
    assert leaf.grad is not None


@parent_only
def test_int32_targets_and_megatron_out_of_range_semantics():
    """int32 ids give the int64 result; an id outside the vocabulary counts as megatron counts it."""
    x, cols = outlier_logits(6, 300, torch.float32)
    t = targets_for(6, 300, cols)
    a = ce.vocab_parallel_cross_entropy(x.view(3, 2, 300), t.view(3, 2), None)
    b = ce.vocab_parallel_cross_entropy(x.view(3, 2, 300), t.view(3, 2).int(), None)
    assert torch.equal(a, b)
    lse_minus_max = torch.logsumexp(x.double(), -1) - x.double().amax(-1)
    assert abs(a.view(-1)[-1].item() - lse_minus_max[-1].item()) < 1e-5


@parent_only
@pytest.mark.parametrize("logits,target,error,message", [
    (torch.zeros(2, 3, 8, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.long), TypeError, "logits must be"),
    (torch.zeros(2, 3, 8, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.long), TypeError, "logits must be"),
    (torch.zeros(2, 3, 8), torch.zeros(2, 3), TypeError, "integer ids"),
    (torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.bool), TypeError, "integer ids"),
    (torch.zeros(2, 3, 8), torch.zeros(3, 2, dtype=torch.long), ValueError, r"\[s, b, V/tp\]"),
    (torch.zeros(2, 3, 8), torch.zeros(2, 3, 8, dtype=torch.long), ValueError, r"\[s, b, V/tp\]"),
    (torch.zeros(8), torch.zeros((), dtype=torch.long), ValueError, r"\[s, b, V/tp\]"),
    (torch.zeros(2, 3, 0), torch.zeros(2, 3, dtype=torch.long), ValueError, "empty"),
])
def test_rejects_bad_input(logits, target, error, message):
    with pytest.raises(error, match=message):
        ce.vocab_parallel_cross_entropy(logits, target, None)


# ----------------------------------------------------------------------------- tensor parallel (gloo, 2 ranks)


def _tp_worker(rank, world_size, init_file):
    init_megatron(world_size, rank, init_file, tp=world_size)
    from megatron.core import parallel_state, tensor_parallel

    group = parallel_state.get_tensor_model_parallel_group()
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(11)  # the same data on every rank
        S, B, V_local = 4, 3, 593  # a ragged vocabulary of 1186 over 2 ranks
        V = world_size * V_local
        x, cols = outlier_logits(S * B, V, dtype, gen)
        t = targets_for(S * B, V, cols, gen)
        t[2], t[3] = V_local - 1, V_local  # the last id of rank 0 and the first of rank 1
        x[4, :V_local] = -torch.inf  # rank 0's whole shard masked
        t[4] = V_local + 7
        g = 0.25 + 1.5 * torch.rand(S * B, generator=gen)
        lo, hi = rank * V_local, (rank + 1) * V_local
        shard = x[:, lo:hi].reshape(S, B, V_local).clone().requires_grad_(True)
        loss = ce.vocab_parallel_cross_entropy(shard, t.view(S, B), group)
        assert loss.grad_fn.use_triton is INTERPRETING  # the kernels under TRITON_INTERPRET=1
        loss.backward(g.view(S, B))
        full = x.view(S, B, V).clone().requires_grad_(True)
        loss1 = ce.vocab_parallel_cross_entropy(full, t.view(S, B), None)  # one rank
        loss1.backward(g.view(S, B))
        mx = x[:, lo:hi].reshape(S, B, V_local).clone().requires_grad_(True)
        mloss = tensor_parallel.vocab_parallel_cross_entropy(mx.clone(), t.view(S, B))
        mloss.backward(g.view(S, B))

        ref = exact(x, t, g)
        shard_max = torch.stack([x[:, i * V_local:(i + 1) * V_local].double().amax(-1) for i in range(world_size)])
        gap = ref.m - shard_max
        rescale = U * gap[torch.isfinite(gap)].abs().max().item()  # exp(m_rank - M): argument rounding
        rounding = "truncating" if INTERPRETING else "nearest"
        loss_b, grad_b = bounds(x, ref, g, dtype, rounding=rounding, factor=2.0, extra=rescale)
        what = f"{dtype}, rank {rank}"
        assert_within(loss.view(-1), ref.loss, loss_b, f"TP loss ({what})")
        assert_within(loss1.view(-1), ref.loss, loss_b, f"TP=1 loss ({what})")
        assert_within(mloss.view(-1), ref.loss, loss_b, f"megatron's TP loss ({what})")  # the bound's sanity
        assert_within(loss.view(-1), loss1.view(-1).double(), 2 * loss_b, f"TP vs TP=1 loss ({what})")
        assert_within(loss.view(-1), mloss.view(-1).double(), 2 * loss_b, f"TP vs megatron loss ({what})")
        assert shard.grad.dtype == dtype
        assert_within(shard.grad.view(-1, V_local), ref.grad[:, lo:hi], grad_b[:, lo:hi], f"TP grad ({what})")
        assert_within(full.grad.view(-1, V)[:, lo:hi], ref.grad[:, lo:hi], grad_b[:, lo:hi], f"TP=1 grad ({what})")
        assert_within(mx.grad.view(-1, V_local).to(dtype), ref.grad[:, lo:hi], grad_b[:, lo:hi],
                      f"megatron's TP grad ({what})")


@pytest.mark.slow
def test_tensor_parallel_over_two_gloo_ranks_equals_one_rank():
    """The vocabulary split over 2 ranks (megatron's ranges, ragged 593 per rank, targets on both sides of
    the split and outside the vocabulary): loss and shard gradients within the float64 bounds, as the
    full vocabulary on one rank and megatron's own vocab_parallel_cross_entropy at TP 2 give. Runs the
    PyTorch path in the parent pytest process and the Triton kernels in the TRITON_INTERPRET=1 one."""
    run_distributed(_tp_worker, 2)


# ----------------------------------------------------------------------------- megatron hook and trainer


@pytest.fixture
def megatron_binding(monkeypatch):
    """megatron's own function bound in language_module for the test, restored afterwards."""
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.models.common.language_module import language_module

    monkeypatch.setattr(language_module, "fused_vocab_parallel_cross_entropy",
                        fused_cross_entropy.fused_vocab_parallel_cross_entropy)
    return language_module


@parent_only
def test_install_makes_megatrons_native_fusion_call_ours_and_matches_native(megatron_binding):
    """megatron's compute_language_model_loss with cross_entropy_loss_fusion (impl "native") gives the same
    losses before install() (megatron's torch.compile'd fused cross entropy) and after (ours), both
    within the float64 bounds; their bf16 gradients too. install() is idempotent."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    with single_process_megatron():
        from megatron.core import parallel_state

        module = SimpleNamespace(
            config=SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native"),
            pg_collection=SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group()))
        S, B, V = 6, 2, 1187
        x, cols = outlier_logits(S * B, V, torch.bfloat16)
        t = targets_for(S * B, V, cols, out_of_range=False)
        g = 0.25 + 1.5 * torch.rand(S, B)
        labels = t.view(S, B).t().contiguous()  # megatron's labels are [b, s], its logits [s, b, V]
        results = []
        for step in ("native", "ours"):
            if step == "ours":
                assert ce.install() and ce.install()
                assert megatron_binding.fused_vocab_parallel_cross_entropy is ce.vocab_parallel_cross_entropy
            leaf = x.view(S, B, V).clone().requires_grad_(True)
            loss = LanguageModule.compute_language_model_loss(module, labels, leaf)  # [b, s]
            loss.backward(g.t())
            results.append((loss.t().reshape(-1), leaf.grad.reshape(-1, V)))
    ref = exact(x, t, g.reshape(-1))
    loss_b, grad_b = bounds(x, ref, g.reshape(-1), torch.bfloat16)
    for name, (loss, grad) in zip(("native", "ours"), results):
        assert grad.dtype == torch.bfloat16
        assert_within(loss, ref.loss, loss_b, f"{name} loss")
        assert_within(grad, ref.grad, grad_b, f"{name} grad")
    assert_within(results[1][0], results[0][0].double(), 2 * loss_b, "ours vs native loss")


@parent_only
def test_install_leaves_a_third_partys_function(megatron_binding):
    def theirs(logits, target, tp_group):
        raise AssertionError("not called")

    megatron_binding.fused_vocab_parallel_cross_entropy = theirs
    assert not ce.install()
    assert megatron_binding.fused_vocab_parallel_cross_entropy is theirs


@parent_only
def test_trainer_installs_it_with_cross_entropy_fusion(megatron_binding):
    from megatron_int8.training.args import parse_args, validate_args
    from megatron_int8.training.model import build_config

    tiny = os.path.join(CONFIGS, "tiny.yaml")
    args = validate_args(parse_args(["--config", tiny, "--mock-data", "--tokenizer-type", "NullTokenizer",
                                     "--vocab-size", "512", "--bf16", "--cross-entropy-loss-fusion"]), 1)
    lines = []
    config = build_config(args, lines.append)
    assert config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "native"
    assert megatron_binding.fused_vocab_parallel_cross_entropy is ce.vocab_parallel_cross_entropy
    assert any(line.startswith("note: cross entropy fused (megatron's native path calling megatron_int8.ops.cross_entropy")
               for line in lines), lines


# ----------------------------------------------------------------------------- Triton kernels (interpreter)


if not INTERPRETING and HAS_TRITON:

    def test_kernels_under_triton_interpreter():
        """Run this file's kernel tests in a fresh interpreter with TRITON_INTERPRET=1 set before triton loads."""
        run_file_interpreted(__file__, timeout=600)


@pytest.fixture
def small_blocks(request, monkeypatch):
    """Chunks of MIN_BLOCK (several per row, the last one ragged) or the default block (one chunk)."""
    from megatron_int8.kernels import cross_entropy as kce

    if request.param == "small":
        monkeypatch.setattr(kce, "FORWARD_BLOCK", MIN_BLOCK)
        monkeypatch.setattr(kce, "BACKWARD_BLOCK", MIN_BLOCK)
    return request.param


@needs_interpreter
@pytest.mark.parametrize("small_blocks", ["small", "default"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("V,layout,grad_kind", [
    (1000, "contiguous [s, b, V]", "non-uniform"),
    (1187, "row slice of a wider tensor", "mean"),
    (1187, "[b, s, V] transposed", "non-uniform"),
    (1000, "[N, V]", "mean"),
])
def test_triton_kernels_match_float64(small_blocks, dtype, V, layout, grad_kind):
    loss = _run_and_check(dtype, V, layout, grad_kind, "truncating")
    assert loss.grad_fn.use_triton is True


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_shard_statistics_and_gradient(dtype):
    """The kernels on one tensor-parallel shard (vocab_start 1000, 613 local ids, chunks of 128): the max
    and the target logit exact, the sum of exp within the bound, 0 for targets of other ranks; backward
    with a given global lse subtracts 1 only at local targets, for a loss gradient broadcast over b."""
    from megatron_int8.kernels.cross_entropy import triton_cross_entropy_backward, triton_cross_entropy_forward

    S, B, V, start = 4, 2, 613, 1000
    N = S * B
    x, cols = outlier_logits(N, V, dtype)
    t = torch.randint(0, 3000, (N,))
    t[0], t[1], t[2], t[3] = start + cols[0, 0], start, start + V - 1, start + V  # the last: rank r + 1's
    x[5] = -torch.inf  # a shard of masked ids only: max -inf, sum 0
    x[6, :200] = -torch.inf  # the first chunks -inf only
    t[5], t[6] = start - 1, start + V - 2
    m, l_, xt = triton_cross_entropy_forward(x.view(S, B, V), t, start, finish=False, block=MIN_BLOCK)
    xd = x.double()
    local = t - start
    hit = (local >= 0) & (local < V)
    assert torch.equal(m.double(), xd.amax(-1))
    want_xt = torch.where(hit, xd.gather(1, local.clamp(0, V - 1)[:, None]).squeeze(1), 0.0)
    assert torch.equal(xt.double(), want_xt)
    shift = xd.amax(-1, keepdim=True)
    want_l = torch.exp(xd - torch.where(shift == -torch.inf, 0.0, shift)).sum(-1)
    d_l = U * (math.log(V) + 2 * math.log2(V) + 4 * math.ceil(V / MIN_BLOCK) + 8)
    assert ((l_.double() - want_l).abs() <= d_l * want_l).all()
    lse = torch.where(shift == -torch.inf, 3.0, shift + 1.5).squeeze(1).float()  # as if other ranks held more
    g = (0.25 + 1.5 * torch.rand(S, 1)).expand(S, B)  # strides (1, 0)
    grad = triton_cross_entropy_backward(x.view(S, B, V), g, lse, t, start, block=MIN_BLOCK)
    g = g.reshape(N, 1)
    p = torch.exp(xd - lse.double()[:, None])
    p[torch.arange(N)[hit], local[hit]] -= 1
    want = g.double() * p
    dist = torch.where(p != 0, (xd - lse.double()[:, None]).abs(), 0.0)
    pre = g.double() * (p.abs() * U * (dist + 4) + 2 * U)
    pre = pre + 2.0 ** -148 * (1 + g.double())
    r = U if dtype == torch.float32 else 2.0 ** -7  # a whole bf16 ulp: the interpreter's cast truncates
    assert_within(grad.view(N, V), want, pre + r * (want.abs() + pre), f"shard grad ({dtype})")


# ----------------------------------------------------------------------------- GPU (compiled kernels)


@parent_only
@pytest.mark.gpu
def test_gpu_kernels_match_float64_at_gpt2_vocabulary():
    """[512, 50257] bf16 with outliers on CUDA: loss and gradient within the float64 bounds with half-ulp
    rounding (tl.exp is an ex2.approx: the bounds' fp32 terms get a factor 4)."""
    assert torch.cuda.is_available()
    N, V = 512, 50257
    gen = torch.Generator().manual_seed(5)
    x, cols = outlier_logits(N, V, torch.bfloat16, gen)
    t = targets_for(N, V, cols, gen)
    g = 0.25 + 1.5 * torch.rand(N, generator=gen)
    leaf = x.view(128, 4, V).cuda().requires_grad_(True)
    loss = ce.vocab_parallel_cross_entropy(leaf, t.cuda().view(128, 4), None)
    assert loss.grad_fn.use_triton is True
    loss.backward(g.cuda().view(128, 4))
    ref = exact(x.cuda(), t.cuda(), g.cuda())
    loss_b, grad_b = bounds(x.cuda(), ref, g.cuda(), torch.bfloat16, factor=4.0, block=4096)
    assert_within(loss.view(-1), ref.loss, loss_b, "GPU loss")
    assert_within(leaf.grad.view(N, V), ref.grad, grad_b, "GPU grad")


@parent_only
@pytest.mark.gpu
def test_gpu_peak_memory_holds_no_fp32_copy_of_the_logits():
    """Forward + backward allocate at most 1.5x the bf16 logits' bytes beyond what the process already holds
    (the logits themselves included there): their gradient (1x) and per-row statistics, nothing of fp32
    logits' size (an fp32 copy alone would add 2x). Measured from the current allocation, as earlier tests
    in the same process may leave tensors and caches behind."""
    S, B, V = 256, 2, 50257
    x = torch.randn(S, B, V, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, V, (S, B), device="cuda")
    g = torch.rand(S, B, device="cuda")
    warm = x.detach().clone().requires_grad_(True)  # compile both kernels outside the measurement
    ce.vocab_parallel_cross_entropy(warm, t, None).backward(g)
    del warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = ce.vocab_parallel_cross_entropy(x, t, None)
    loss.backward(g)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1.5 * x.numel() * x.element_size(), (extra, x.numel() * x.element_size())
