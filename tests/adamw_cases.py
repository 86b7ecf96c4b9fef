"""Shared cases of the precision-aware AdamW's tests (ops, kernels, megatron tiers): hyperparameters,
heavy-tailed random data, and a step's inputs in every state format."""
import torch

from megatron_int8.ops.adamw import BlockQuantized, new_moment, split_remainder, store_moment

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
F32_EPS = 2.0 ** -24  # unit roundoff of fp32


def heavy_tailed(n, scale, seed):
    """Random values with outliers (1% of them 100x larger), as gradients are."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * scale
    outliers = torch.rand(n, generator=gen) < 0.01
    return torch.where(outliers, x * 100, x)


MASTER_KINDS = ["param", "fp32", "remainder"]


def kernel_case(n, moments, master_kind, device, seed):
    """(param, grad, exp_avg, exp_avg_sq, master) of heavy-tailed values, the moments stored in their formats
    (`moments`: exp_avg's and exp_avg_sq's dtype), the master weight as `master_kind` says, on `device`."""
    weight = heavy_tailed(n, 0.02, seed=seed)
    m, v = new_moment(n, moments[0], False, "cpu"), new_moment(n, moments[1], True, "cpu")
    store_moment(m, heavy_tailed(n, 1e-3, seed=seed + 1))
    store_moment(v, heavy_tailed(n, 1e-3, seed=seed + 2) ** 2)
    if master_kind == "param":
        param, master = weight, None
    elif master_kind == "fp32":
        param, master = weight.bfloat16(), weight.clone()
    else:
        param, master = split_remainder(weight.clone())
    grad = heavy_tailed(n, 1e-3, seed=seed + 3)
    move = lambda x: x if x is None else x.to(device)  # noqa: E731
    moved = lambda s: BlockQuantized(s.codes.to(device), s.scales.to(device)) if isinstance(s, BlockQuantized) \
        else s.to(device)  # noqa: E731
    return move(param), move(grad), moved(m), moved(v), move(master)


def assert_kernel_matches_reference(kernel_out, reference_out, bf16_ulps: int):
    """fp32 values, INT8 codes and scales bit for bit; bf16 outputs within `bf16_ulps` (the interpreter's
    float -> bf16 conversion does not round to nearest even)."""
    for got, want in zip(kernel_out, reference_out):
        if want is None:
            continue
        if isinstance(want, BlockQuantized):
            assert torch.equal(got.codes.cpu(), want.codes) and torch.equal(got.scales.cpu(), want.scales)
        elif want.dtype == torch.bfloat16:
            distance = (got.cpu().view(torch.int16).int() - want.view(torch.int16).int()).abs().max()
            assert int(distance) <= bf16_ulps
        else:
            assert torch.equal(got.cpu(), want)
