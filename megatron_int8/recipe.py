"""INT8 training recipe: what is quantized, how finely, and how it is rounded (the numerics), and how it
runs (the execution options).

Frozen dataclasses, validated on construction, so that an unsupported choice fails where it is made
instead of being silently ignored deep inside a training step.
"""
from __future__ import annotations

import dataclasses

QMAX = 127  # symmetric INT8 range [-127, 127]: -128 is never produced, so negation is exact.
GRANULARITIES = ("tensor", "row", "block")
GEMMS = ("fprop", "dgrad", "wgrad")  # a linear's three products, each a recipe field (True: INT8)
ATTENTION_SCORES = ("int8", "bf16")
# INT8 attention's scores (Q K^T) unless told otherwise: BF16 Q and K held the loss where INT8 scores drifted (344M,
# docs/convergence.md section 10a)
DEFAULT_ATTENTION_SCORES = "bf16"
ROUNDINGS = ("nearest", "stochastic")
BACKENDS = ("auto", "reference", "triton")
FINITE_CHECKS = ("deferred", "immediate", "off")
SHAPE_POLICIES = ("int8", "auto")
# the block of the INT8 copies that int8_swiglu_input / int8_norm_input keep for backward (1 x 128 scales, as
# the block GEMMs; one column tile of the SwiGLU and RMSNorm kernels)
INT8_COPY_BLOCK = 128


def _check_choice(owner: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


def _check_bools(owner, names) -> None:
    for name in names:
        if not isinstance(getattr(owner, name), bool):
            raise TypeError(f"Int8Recipe.{name} must be a bool, got {getattr(owner, name)!r}")


@dataclasses.dataclass(frozen=True)
class Int8Numerics:
    """What the INT8 layers compute: the part of a recipe that changes results (Int8Recipe's fields
    granularity, block_size, fprop, dgrad, wgrad, grad_rounding, smooth_swiglu, int8_swiglu_input,
    int8_norm_input, int8_attention, int8_attention_scores). Quantized-weight caches are keyed and recipes
    described by it alone."""

    granularity: str = "row"
    block_size: int = 128
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    grad_rounding: str = "nearest"
    smooth_swiglu: bool = False
    int8_swiglu_input: bool = False
    int8_norm_input: bool = False
    int8_attention: bool = False
    int8_attention_scores: str = DEFAULT_ATTENTION_SCORES

    def __post_init__(self):
        _check_choice("Int8Recipe", "granularity", self.granularity, GRANULARITIES)
        _check_choice("Int8Recipe", "int8_attention_scores", self.int8_attention_scores, ATTENTION_SCORES)
        if self.int8_attention_scores != DEFAULT_ATTENTION_SCORES and not self.int8_attention:
            raise ValueError(f"Int8Recipe.int8_attention_scores={self.int8_attention_scores!r} needs "
                             "int8_attention=True (it sets the INT8 attention's scores)")
        _check_choice("Int8Recipe", "grad_rounding", self.grad_rounding, ROUNDINGS)
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool):  # 128.0 fails in reshape
            raise TypeError(f"Int8Recipe.block_size must be an int, got {self.block_size!r}")
        if self.block_size < 16 or self.block_size % 16:  # also the health probes' sampling alignment
            raise ValueError(f"Int8Recipe.block_size must be a positive multiple of 16, got {self.block_size}")
        _check_bools(self, GEMMS + ("smooth_swiglu", "int8_swiglu_input", "int8_norm_input", "int8_attention"))

    def describe(self) -> str:
        """Short human-readable form for precision tables and logs."""
        gemms = "/".join(g if getattr(self, g) else f"{g}:hp" for g in GEMMS)
        gran = self.granularity if self.granularity != "block" else f"block{self.block_size}"
        sr = ",sr" if self.grad_rounding == "stochastic" else ""
        smooth = ",smooth" if self.smooth_swiglu else ""
        swiglu = ",swiglu-in:int8" if self.int8_swiglu_input else ""
        norm = ",norm-in:int8" if self.int8_norm_input else ""
        attention = f",attn:int8/scores:{self.int8_attention_scores}" if self.int8_attention else ""
        return f"int8[{gran},{gemms}{sr}{smooth}{swiglu}{norm}{attention}]"


@dataclasses.dataclass(frozen=True)
class Int8Execution:
    """How the GEMMs run, with the same results either way (Int8Recipe's fields backend, check_finite,
    cache_weights, cache_dgrad_weight, autotune, int8_all_gather, shape_policy)."""

    backend: str = "auto"
    check_finite: str = "deferred"
    cache_weights: bool = True
    cache_dgrad_weight: bool = True
    autotune: bool = True
    int8_all_gather: bool = False
    shape_policy: str = "int8"

    def __post_init__(self):
        _check_choice("Int8Recipe", "check_finite", self.check_finite, FINITE_CHECKS)
        _check_choice("Int8Recipe", "shape_policy", self.shape_policy, SHAPE_POLICIES)
        _check_choice("Int8Recipe", "backend", self.backend, BACKENDS)
        _check_bools(self, ("cache_weights", "cache_dgrad_weight", "autotune", "int8_all_gather"))


NUMERICS_FIELDS = tuple(f.name for f in dataclasses.fields(Int8Numerics))
EXECUTION_FIELDS = tuple(f.name for f in dataclasses.fields(Int8Execution))


@dataclasses.dataclass(frozen=True)
class Int8Recipe:
    """How an INT8 linear quantizes its three GEMMs.

    granularity: "row" (the default: one scale per token for activations and gradients, per output
        channel for weights; every operand is scaled along the GEMM's contraction axis, so backward
        re-quantizes along the other axis), "tensor" (one fp32 scale per tensor: the fastest, a byte
        transpose serves backward) or "block" (1 x block_size tiles for activations/gradients,
        block_size x block_size tiles for weights; on Hopper its GEMMs run a kernel of their own at 0.3-0.6x the
        row-scale GEMMs' throughput at block size 128, and a Llama2-7B layer at 0.85x BF16's speed: docs/benchmarks.md,
        "Block-scale GEMMs on Hopper"). Row scales are the default because they track
        BF16: the 125M-class (88M-parameter) parity model ended 2000 iterations 0.06% (training) and
        0.14% (validation) from BF16, against +2.3% / +0.9% with tensorwise scales and stochastic
        rounding (docs/convergence.md).
    fprop, dgrad, wgrad: run that GEMM in INT8 (True) or in the input's precision (False).
    grad_rounding: rounding of output gradients: "nearest" (the default, round half to even) or
        "stochastic" (unbiased, floor(v + U[0,1))). Activations and weights always round to nearest.
        Output gradients are heavy-tailed: under one tensorwise scale most of their entries fall below
        half a step, rounded to nearest they vanish systematically, and the parity model ended 91% above
        BF16's validation loss; use "stochastic" with granularity "tensor". Row scales follow each
        token's own magnitude, and nearest rounding then matches BF16 (docs/convergence.md).
    backend: "auto" (Triton on CUDA when available, else the PyTorch reference), "reference" or
        "triton". The environment variable MEGATRON_INT8_BACKEND overrides it.
    check_finite: Inf/NaN in a quantized tensor always gives its group a NaN scale, so the outputs it
        touches are NaN, never finite garbage. On top of that: "deferred" (the default) records the
        tensor's name in a device-side flag, and `megatron_int8.raise_if_nonfinite()` (the trainer calls it
        once per step, before the optimizer) raises NonFiniteError naming it: one host sync per step.
        Where nobody calls it (upstream Megatron-LM), the NaN reaches the loss and gradient checks.
        "immediate" raises inside the quantize call (one host sync per quantize: a debugging aid that
        cost 6% of end-to-end throughput on Llama2-7B). "off" records nothing.
    cache_weights: reuse a weight's quantization until the weight changes (micro-batches of a step, and the
        forward that full recomputation runs again in backward): Q(W) and Q(W)^T, 2 bytes per parameter.
    cache_dgrad_weight: with cache_weights, also cache dgrad's Q(W)^T (the default); False caches Q(W) only
        and quantizes Q(W)^T for each dgrad: 1 byte per linear parameter less, one quantize pass over W per
        micro-batch more (dense linears; grouped MoE experts keep both). See docs/training.md, "Memory options".
    autotune: tune the Triton GEMM's tiles once per shape bucket (first call); False launches one
        fixed kernel with no tuning (on Hopper the CUDA sm_90a kernel where it builds, else the persistent TMA
        kernel where the operands allow it, else the plain kernel's fixed tile). The INT8
        layers turn it off for MoE experts, whose token count (M of fprop/dgrad, K of wgrad) changes
        with every routing: tuning kept a Mixtral run in its first iterations for minutes
        (docs/scaling.md).
    int8_all_gather: under sequence parallelism with INT8 fprop (tensor or row granularity), quantize
        each rank's shard with the scales of the gathered tensor and all-gather INT8 instead of BF16: the
        same values at half the bytes, and backward keeps only the local shard (1 byte per element).
        Tensorwise: one amax all-reduced over the tensor-parallel group. Row-wise: per-token scales are
        local; the wgrad operand's per-channel amax is all-reduced. Block granularity gathers BF16.
        Off by default: over NVLink on 4 H200s it was slower than the BF16 gather (0.974x row-wise,
        0.956x tensorwise, Llama2-7B TP 2 + SP x DP 2; docs/scaling.md): the blocking amax all-reduce,
        the extra amax pass and backward's re-gather cost more than the halved bytes save. It is meant
        for slower links, or for the activation memory it saves.
    smooth_swiglu: a Smooth-SwiGLU-style guard (after Fishman et al., ICLR 2025) for the MLP's fc2, whose
        input is the SwiGLU output, where aligned gate/up weights grow a few channels 10-1000x over long
        runs. fprop computes (X diag(1/s)) (W diag(s))^T = X W^T with per-channel powers of two
        s_k ~ sqrt(amax X[:, k] / amax W[:, k]) (ops.health.smooth_scales): the outlier channels' magnitude
        moves into W's columns, so the other channels keep their share of each token's INT8 range. The
        function is unchanged (powers of two scale exactly); dgrad and wgrad use the unscaled operands.
        Costs a pass over X and a quantization of W per call (fprop's W is not cached). The INT8 layers keep
        it only on linear_fc2 of dense MLPs; off by default.
    int8_swiglu_input: the dense MLP's SwiGLU keeps its input (fc1's output, the largest tensor a layer keeps
        for backward) as INT8 with 1 x 128 block scales instead of BF16, and backward differentiates at the
        dequantized values (megatron_int8.ops.swiglu): 2F + 8 ceil(F/128) instead of 4F bytes per token. Off
        by default until loss parity is measured on GPU (docs/training.md, "Memory options").
    int8_norm_input: the layers' RMSNorms (input_layernorm, pre_mlp_layernorm) keep their input as INT8 with
        1 x 128 block scales (plus the fp32 1/rms per token) instead of BF16, backward taking the gradient at the
        dequantized values (megatron_int8.ops.rms_norm): H + 4 ceil(H/128) + 4 instead of 2H bytes per token and
        norm. Off by default until loss parity is measured on GPU.
    int8_attention: the core attention of the INT8 layers of this package's megatron specs runs
        `ops.int8_attention.int8_attention` (P V, dV, dK and dQ in INT8, and Q K^T too with int8_attention_scores
        "int8"; per-token and per-block scales, K smoothed) instead of BF16 SDPA or cuDNN (SDPAttention,
        also where Transformer Engine is installed). A numerics field: it changes results, which the execution
        options never do. It serves causal self-attention without a mask tensor, attention dropout or a sliding
        window, head dims 64 and 128, GQA; the layer refuses anything else when it is built. Layers the policy
        keeps in BF16 keep BF16 attention. Off by default: its kernels run at 0.34-0.39x the speed of cuDNN's BF16
        attention on an H200 (2026-12-04, `python3 benchmarks/bench_attention.py --bf16-scores`). Only the
        megatron specs read it: `convert_to_int8_training` converts linears and refuses it; other models call
        `int8_attention` in their attention themselves.
    int8_attention_scores: "bf16" (the default) or "int8": with int8_attention, its scores (Q K^T, forward and the
        backward's recomputation) from BF16 Q and smoothed K with fp32 sums, or from per-token INT8 Q and K
        (`Int8AttentionConfig.scores`); P V, dV, dK and dQ are INT8 either way. INT8 scores run the op
        1.07-1.23x faster on an H200, but their error grows as attention sharpens over training: at 344M they
        trailed the INT8 linears alone by 0.9-1.5% in validation loss where BF16 scores stayed within 0.6%
        (docs/convergence.md, sections 10 and 10a); BF16 scores gain 4-10 dB SNR on O and every gradient on
        outlier-heavy inputs, 1-2 dB on plain ones (docs/numerics.md).
    shape_policy: "int8" (the default: every GEMM of the linear in INT8) or "auto": on a GPU, the first call
        at each shape (tokens, in, out, dtype, numerics) times forward + backward of the INT8 linear and of
        the high-precision one and runs the faster from then on (ops/shape_policy.py; the decisions are
        cached per process and listed by `shape_policy.format_decisions()`). MEGATRON_INT8_SHAPE_POLICY
        overrides it.

    Set as one flat dataclass; `numerics` (Int8Numerics) and `execution` (Int8Execution) are its two parts,
    each validated on construction.
    """

    granularity: str = "row"
    block_size: int = 128
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    grad_rounding: str = "nearest"
    smooth_swiglu: bool = False
    int8_swiglu_input: bool = False
    int8_norm_input: bool = False
    int8_attention: bool = False
    int8_attention_scores: str = DEFAULT_ATTENTION_SCORES
    backend: str = "auto"
    check_finite: str = "deferred"
    cache_weights: bool = True
    cache_dgrad_weight: bool = True
    autotune: bool = True
    int8_all_gather: bool = False
    shape_policy: str = "int8"

    def __post_init__(self):
        # the parts are built once (and validated), not on every call that reads them
        object.__setattr__(self, "_numerics", Int8Numerics(**{n: getattr(self, n) for n in NUMERICS_FIELDS}))
        object.__setattr__(self, "_execution", Int8Execution(**{n: getattr(self, n) for n in EXECUTION_FIELDS}))

    @property
    def numerics(self) -> Int8Numerics:
        return self._numerics

    @property
    def execution(self) -> Int8Execution:
        return self._execution

    @property
    def any_int8(self) -> bool:
        return self.fprop or self.dgrad or self.wgrad

    def describe(self) -> str:
        """Short human-readable form for precision tables and logs (the numerics only)."""
        return self._numerics.describe()


DEFAULT_RECIPE = Int8Recipe()
HIGH_PRECISION = Int8Recipe(fprop=False, dgrad=False, wgrad=False)  # all three GEMMs in the input's dtype
