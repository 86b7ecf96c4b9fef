"""How the INT8 attention's output error depends on how sharp attention is, and how much of it the INT8 scores make.

Training sharpens attention (the logits grow), and at 344M the INT8 attention's sampled output error grew over the
run while the relative error of its scores stayed flat (docs/convergence.md, section 10). This script scales Q by a
temperature t (softmax(t s): t > 1 sharper), on unit-normal q, k, v with a per-channel bias on k, and reports, against
float64 attention on the same inputs:
  - the mean entropy of a row of P (nats) and the mean of its largest probability,
  - the relative error ||O - O64|| / ||O64|| of the INT8 attention (its PyTorch path: the kernels' arithmetic),
  - that of float64 softmax over the INT8 scores times exact V: the part the scores (Q K^T from INT8 Q, K) make,
  - that of BF16 `F.scaled_dot_product_attention`, for scale,
  - with --score-groups G ..., that of softmax over scores from Q and smoothed K quantized per token and G channels
    (the op's scale is per token over all d channels): what finer scales would buy the scores,
  - with --more-score-bits, the two remedies of more bits for Q K^T: scores from two INT8 terms of Q and of smoothed
    K (each token's value and its rounding residual, quantized per token: three INT8 products, the residuals'
    product dropped), with exact P V and with the op's INT8 P V; and BF16 scores (bf16 Q and smoothed K, fp32 sums,
    as flash attention) with the op's INT8 P V.
Runs on CPU (float64 needs S^2 memory per head, so keep seq x heads modest) or on a GPU (--device cuda).

    python3 benchmarks/attention_sharpness.py                       # seq 1024, 4 heads, d 128, t 0.5 ... 8
    python3 benchmarks/attention_sharpness.py --seq 2048 --temperatures 1 4 16
    python3 benchmarks/attention_sharpness.py --temperatures 1 4 8 --score-groups 64 32
    python3 benchmarks/attention_sharpness.py --temperatures 1 4 8 --more-score-bits
"""
from __future__ import annotations

import argparse
import math

import common  # (first: the repository on sys.path)
import torch
import torch.nn.functional as F

from bench_attention import make_inputs
from megatron_int8.ops.health import relative_error
from megatron_int8.ops.int8_attention import (Int8AttentionConfig, _scores, quantize_rows, reference_forward,
                                              softmax_int8_pv)

INT8_SCORES = Int8AttentionConfig(scores="int8")  # the scores this study measures (the op's default is BF16 scores)


def error(approx, exact):
    """The health statistic's relative error (megatron_int8.ops.health), as a float."""
    return relative_error(approx.double(), exact).item()


def quantized_per_group(x, group):
    """x [..., d] rounded to the op's INT8 steps (quantize_rows) with one scale per `group` channels of each token."""
    values, scale = quantize_rows(x.unflatten(-1, (x.shape[-1] // group, group)))
    return (values * scale).flatten(-2)


def two_int8_terms(x):
    """x [..., d] as the sum of two per-token INT8 terms, (x rounded, its residual rounded), in float64."""
    values, scale = quantize_rows(x)
    head = values * scale
    residual, residual_scale = quantize_rows(x - head)
    return head.double(), (residual * residual_scale).double()


def causal_mask(scores):
    """scores [..., Sq, Sk] with the keys after each query at -inf."""
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(mask, float("-inf"))


def causal_softmax(scores):
    """softmax over keys of float64 scores [..., Sq, Sk], keys after the query masked."""
    return torch.softmax(causal_mask(scores), dim=-1)


def more_score_bits(q, k_smoothed, v, sm_scale, exact):
    """The errors of the remedies of --more-score-bits: two-term INT8 scores with exact and with INT8 P V, BF16
    scores with INT8 P V."""
    (q_hi, q_lo), (k_hi, k_lo) = two_int8_terms(q), two_int8_terms(k_smoothed)
    two_terms = causal_mask((q_hi @ k_hi.transpose(-1, -2) + q_hi @ k_lo.transpose(-1, -2)
                             + q_lo @ k_hi.transpose(-1, -2)) * sm_scale)
    bf16 = causal_mask((q.bfloat16().float() @ k_smoothed.bfloat16().float().transpose(-1, -2)) * sm_scale)
    return (error(torch.softmax(two_terms, dim=-1) @ v.double(), exact),
            error(softmax_int8_pv(two_terms.float(), v, INT8_SCORES)[0], exact),
            error(softmax_int8_pv(bf16, v, INT8_SCORES)[0], exact))


def sharpness_row(q, k, v, temperature, score_groups=(), remedies=False):
    """One table row for Q scaled by `temperature`: entropy, row max, the three relative errors, one for each
    channel group of `score_groups`, and with `remedies` the three of more_score_bits."""
    q = q * temperature
    sm_scale = 1 / math.sqrt(q.shape[-1])
    p = causal_softmax((q.double() @ k.double().transpose(-1, -2)) * sm_scale)
    exact = p @ v.double()
    o_int8, saved = reference_forward(q, k, v, True, sm_scale, INT8_SCORES)
    p_int8_scores = torch.softmax(_scores(saved, 1, sm_scale, True).double(), dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(-1).mean().item()
    bf16 = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    grouped = []
    k_smoothed = k - k.mean(dim=2, keepdim=True)
    for group in score_groups:
        q_g, k_g = quantized_per_group(q, group).double(), quantized_per_group(k_smoothed, group).double()
        grouped.append(error(causal_softmax((q_g @ k_g.transpose(-1, -2)) * sm_scale) @ v.double(), exact))
    if remedies:
        grouped += more_score_bits(q, k_smoothed, v, sm_scale, exact)
    return (temperature, entropy, p.amax(-1).mean().item(), error(o_int8, exact),
            error(p_int8_scores @ v.double(), exact), error(bf16, exact), *grouped)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=common.positive_int, default=1024)
    p.add_argument("--heads", type=common.positive_int, default=4)
    p.add_argument("--dim", type=common.positive_int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.5, 1, 2, 3, 4, 6, 8])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score-groups", type=int, nargs="*", default=[],
                   help="channels per scale of Q and K for extra columns (exact P V; the op's is d)")
    p.add_argument("--more-score-bits", action="store_true",
                   help="columns for two-term INT8 scores (exact and INT8 P V) and BF16 scores (INT8 P V)")
    opts = p.parse_args(argv)
    if any(t <= 0 for t in opts.temperatures):
        p.error("--temperatures are positive")
    if any(g <= 0 or opts.dim % g for g in opts.score_groups):
        p.error(f"--score-groups divide --dim ({opts.dim})")
    q, k, v, _ = make_inputs(1, opts.heads, opts.heads, opts.seq, opts.dim, opts.seed, opts.device, torch.float32)
    print(f"seq {opts.seq}, {opts.heads} heads, d {opts.dim}, causal, {opts.device}; relative error of O against "
          "float64\n")
    extra = [f"INT8 scores per {g} channels, exact P V" for g in opts.score_groups]
    if opts.more_score_bits:
        extra += ["two-term INT8 scores, exact P V", "two-term INT8 scores, INT8 P V", "BF16 scores, INT8 P V"]
    print("| " + " | ".join(["temperature", "row entropy (nats)", "row max of P", "INT8", "INT8 scores, exact P V",
                             "BF16 SDPA", *extra]) + " |")
    print("|---" * (6 + len(extra)) + "|")
    rows = []
    for t in opts.temperatures:
        row = sharpness_row(q, k, v, t, opts.score_groups, opts.more_score_bits)
        rows.append(row)
        print("| {:g} | {:.2f} | {:.3f} | ".format(*row[:3]) + " | ".join(f"{x:.4f}" for x in row[3:]) + " |",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
