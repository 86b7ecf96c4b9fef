"""The `--int8-*` command-line flags, shared by this package's trainer and the upstream Megatron-LM route."""
from __future__ import annotations

import argparse
from typing import List

from ..recipe import (ATTENTION_SCORES, BACKENDS, DEFAULT_ATTENTION_SCORES, FINITE_CHECKS, GEMMS, GRANULARITIES,
                      ROUNDINGS, Int8Recipe)
from .policy import BF16_MODULE_NAMES, Int8Policy

INT8_ATTENTION_NEEDS_INT8_LINEAR = "--int8-attention runs in the INT8 layers: it needs --int8-linear"


def add_int8_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--int8-*` flags (megatron `extra_args_provider` convention: returns the parser)."""
    d = Int8Recipe()
    group = parser.add_argument_group(title="INT8 linear layers (megatron-int8)")
    group.add_argument("--int8-linear", action="store_true",
                       help="Run the transformer layers' linears with INT8 GEMMs.")
    group.add_argument("--int8-granularity", choices=GRANULARITIES, default=d.granularity,
                       help="Scaling granularity of activations, weights and gradients.")
    group.add_argument("--int8-block-size", type=int, default=d.block_size,
                       help="Tile size for --int8-granularity block (multiple of 16).")
    group.add_argument("--int8-bf16-gemms", type=str, default="",
                       help="Comma-separated GEMMs kept in high precision: any of fprop,dgrad,wgrad.")
    group.add_argument("--int8-grad-rounding", choices=ROUNDINGS, default=d.grad_rounding,
                       help="Rounding of output gradients (default: %(default)s; activations and weights "
                            "always round to nearest).")
    group.add_argument("--int8-backend", choices=BACKENDS, default=d.backend,
                       help="INT8 kernels: auto (Triton on CUDA), reference (PyTorch) or triton.")
    group.add_argument("--int8-first-last-layers-bf16", action="store_true",
                       help="Keep the first and last transformer layers in BF16.")
    group.add_argument("--int8-num-layers-at-start-in-bf16", type=int, default=1,
                       help="With --int8-first-last-layers-bf16: number of leading BF16 layers.")
    group.add_argument("--int8-num-layers-at-end-in-bf16", type=int, default=1,
                       help="With --int8-first-last-layers-bf16: number of trailing BF16 layers.")
    group.add_argument("--int8-bf16-modules", nargs="*", default=[],
                       help=f"Submodules kept in BF16 in every layer: any of {', '.join(BF16_MODULE_NAMES)}.")
    group.add_argument("--int8-check-finite", choices=FINITE_CHECKS, default=d.check_finite,
                       help="Inf/NaN in a quantized tensor: 'deferred' raises naming it at the end of the "
                            "step (one host sync per step), 'immediate' inside the quantize call (one host "
                            "sync per quantize), 'off' leaves NaN outputs to the loss and grad-norm checks.")
    group.add_argument("--int8-no-weight-cache", action="store_true",
                       help="Re-quantize weights on every micro-batch instead of once per optimizer step.")
    group.add_argument("--int8-no-dgrad-weight-cache", action="store_true",
                       help="Cache only Q(W) (forward and recomputed forward) and re-quantize dgrad's Q(W)^T in "
                            "every micro-batch: 1 byte per linear parameter less (docs/training.md, 'Memory "
                            "options').")
    group.add_argument("--int8-precision-table", action="store_true",
                       help="Print every linear's precision at start (one row per linear) instead of the "
                            "one-line summary.")
    group.add_argument("--int8-all-gather", action="store_true",
                       help="With --sequence-parallel: quantize each rank's activation shard with the scales "
                            "of the gathered tensor and all-gather INT8 instead of BF16 (tensor and row "
                            "granularity). Half the bytes, but no faster over NVLink on the H200s measured (0.96-0.97x "
                            "eager, within 1%% graphed: docs/scaling.md); for slow links or to save activation "
                            "memory.")
    group.add_argument("--int8-smooth-swiglu", action="store_true",
                       help="Smooth-SwiGLU-style guard for the dense MLP's fc2: per-channel power-of-two factors "
                            "move the SwiGLU output's outlier channels into fc2's weight columns before its "
                            "INT8 fprop (the function is unchanged; docs/numerics.md).")
    group.add_argument("--int8-swiglu-input", action="store_true",
                       help="Dense SwiGLU MLPs keep the SwiGLU's input (fc1's output) for backward in INT8 with "
                            "1x128 block scales instead of BF16 (docs/training.md, 'Memory options').")
    group.add_argument("--int8-norm-input", action="store_true",
                       help="The layers' RMSNorms keep their input for backward in INT8 with 1x128 block scales "
                            "instead of BF16 (docs/training.md, 'Memory options').")
    group.add_argument("--int8-attention", action="store_true",
                       help="With --int8-linear: the INT8 layers' core attention runs P V and the gradient "
                            "products dV, dK, dQ in INT8 (megatron_int8.ops.int8_attention; Q K^T too with "
                            "--int8-attention-scores int8) instead of BF16 flash attention. "
                            "Causal self-attention only: needs --attention-dropout 0, head dim 64 or 128, no "
                            "--reset-attention-mask. Opt-in: 0.34-0.39x the speed of cuDNN BF16 attention on an H200 "
                            "(docs/training.md, 'INT8 attention').")
    group.add_argument("--int8-attention-scores", choices=ATTENTION_SCORES, default=None,
                       help=f"With --int8-attention: its scores Q K^T (forward and backward) from BF16 Q and K with "
                            f"fp32 sums (bf16) or from per-token INT8 Q and K (int8: faster, but its error grows as "
                            f"attention sharpens; at 344M it cost 0.9%% of validation loss). Default "
                            f"{DEFAULT_ATTENTION_SCORES} (docs/training.md, 'INT8 attention').")
    return parser


def _parse_bf16_gemms(text: str) -> List[str]:
    names = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in names if g not in GEMMS]
    if unknown:
        raise ValueError(f"--int8-bf16-gemms: unknown GEMM(s) {unknown}; expected a comma-separated subset of {GEMMS}")
    return names


def policy_from_args(args) -> Int8Policy:
    """The policy the `--int8-*` flags describe (`enabled` = `--int8-linear`); raises ValueError on bad values."""
    bf16_gemms = _parse_bf16_gemms(getattr(args, "int8_bf16_gemms", "") or "")
    try:
        recipe = Int8Recipe(
            granularity=args.int8_granularity,
            block_size=args.int8_block_size,
            fprop="fprop" not in bf16_gemms,
            dgrad="dgrad" not in bf16_gemms,
            wgrad="wgrad" not in bf16_gemms,
            grad_rounding=args.int8_grad_rounding,
            int8_swiglu_input=bool(getattr(args, "int8_swiglu_input", False)),
            int8_norm_input=bool(getattr(args, "int8_norm_input", False)),
            int8_attention=bool(getattr(args, "int8_attention", False)),
            int8_attention_scores=getattr(args, "int8_attention_scores", None) or DEFAULT_ATTENTION_SCORES,
            backend=args.int8_backend,
            check_finite=args.int8_check_finite,
            cache_weights=not args.int8_no_weight_cache,
            cache_dgrad_weight=not getattr(args, "int8_no_dgrad_weight_cache", False),
            int8_all_gather=getattr(args, "int8_all_gather", False),
            smooth_swiglu=bool(getattr(args, "int8_smooth_swiglu", False)),
        )
        policy = Int8Policy(
            enabled=bool(args.int8_linear),
            fp8_peer=getattr(args, "fp8_peer", None),
            fp8_compile=bool(getattr(args, "fp8_peer_compile", False)),
            recipe=recipe,
            first_last_layers_bf16=bool(args.int8_first_last_layers_bf16),
            num_layers_at_start_in_bf16=args.int8_num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=args.int8_num_layers_at_end_in_bf16,
            bf16_modules=tuple(args.int8_bf16_modules or ()),
        )
    except (ValueError, TypeError) as err:
        raise ValueError(f"invalid --int8-* arguments: {err}") from err
    if policy.enabled and not recipe.any_int8:
        raise ValueError("--int8-bf16-gemms fprop,dgrad,wgrad leaves no INT8 GEMM; drop --int8-linear instead")
    num_layers = getattr(args, "num_layers", None)
    if num_layers:
        policy.check_num_layers(num_layers)
    return policy
