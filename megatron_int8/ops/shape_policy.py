"""Never slower than BF16: with Int8Recipe(shape_policy="auto"), a linear runs INT8 only at the shapes where
INT8 was measured faster.

The first call at a shape (device, dtype, tokens, in_features, out_features, bias, whether wgrad runs, the
recipe's numerics) times forward + backward of the INT8 linear and of the high-precision one on fresh random
tensors of that shape (`cuda_event_timer`: CUDA events, warm-up included), and every later call at that shape
runs the faster. The INT8 timing quantizes the weight in every call (as a step without gradient accumulation;
with several micro-batches per step the cache makes INT8 a little faster than timed), so the choice leans
to high precision when the two are close. Tensor-parallel communication is not timed (the shapes are the local
GEMM's), but the ranks of a tensor-parallel group take one decision, each time the group's slowest: the two
paths issue different collectives (the INT8 all-gather, the amax all-reduces), so a split decision would hang.

Where no timing can run, the call runs INT8 and nothing is cached: on a device the timer cannot time (the
default one times CUDA only), during CUDA-graph capture, and while torch.compile traces (a compiled graph
takes the decisions eager calls made: run one eager step first).

The default timer counts the host's kernel launches, as an eager step pays them. A step replayed as a CUDA
graph does not, and INT8 launches more kernels than a BF16 linear: `launch_free_timer` times the GPU's work
alone, and the trainer uses it with --cuda-graph-impl local.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.compiler import is_dynamo_compiling

from ..dispatch import ENV_SHAPE_POLICY, env_choice
from ..recipe import HIGH_PRECISION, Int8Recipe

__all__ = ["ShapeDecision", "auto_shapes", "cuda_event_timer", "decisions", "describe_precision", "format_decisions",
           "launch_free_timer", "recipe_for_shape", "set_timer"]


@dataclasses.dataclass(frozen=True)
class ShapeDecision:
    tokens: int
    in_features: int
    out_features: int
    dtype: torch.dtype
    recipe: str  # the numerics, described
    int8_ms: float
    hp_ms: float

    @property
    def int8(self) -> bool:
        return self.int8_ms < self.hp_ms

    @property
    def precision(self) -> str:
        return "int8" if self.int8 else str(self.dtype).replace("torch.", "").replace("bfloat16", "bf16")


def cuda_event_timer(fn: Callable[[], None], path: str, warmup: int = 2, reps: int = 5) -> Optional[float]:
    """Median ms of `fn` (one forward + backward) between CUDA events; None when no CUDA device runs it."""
    if not torch.cuda.is_available():
        return None
    for _ in range(warmup):  # the first calls tune and compile the kernels
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


_SLEEP_CYCLES_PER_S = 2.0e9  # at least any GPU's clock: the sleep lasts at least as long as asked


def launch_free_timer(fn: Callable[[], None], path: str, warmup: int = 2, reps: int = 5) -> Optional[float]:
    """Mean ms of `fn`'s GPU work alone, as a replayed CUDA graph runs it: the GPU sleeps while the host queues
    `reps` calls, then runs them back to back. Where the GPU woke before the host had queued them all (a call that
    synchronizes, or a host slower than planned), the launches were timed too: cuda_event_timer's figure then."""
    if not torch.cuda.is_available():
        return None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_call_s = time.perf_counter() - began  # host and GPU together: more than the host alone takes to queue it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2 * reps * one_call_s * _SLEEP_CYCLES_PER_S))
    start.record()
    for _ in range(reps):
        fn()
    queued_in_time = not start.query()  # the GPU still sleeps: every launch was queued before the timed work
    end.record()
    end.synchronize()
    if not queued_in_time:
        return cuda_event_timer(fn, path, warmup=0, reps=reps)
    return start.elapsed_time(end) / reps


_timer: Callable[..., Optional[float]] = cuda_event_timer
_decisions: Dict[tuple, ShapeDecision] = {}
_env_policy: List[str] = []  # MEGATRON_INT8_SHAPE_POLICY, read at the first call
_measuring: List[bool] = []  # non-empty while _measure times the INT8 path (which then runs INT8, as asked)


def set_timer(timer: Optional[Callable[..., Optional[float]]]) -> None:
    """Replace the timer (`timer(fn, path) -> ms or None`, path "int8" or "hp"; None restores the CUDA one)
    and forget every decision."""
    global _timer
    _timer = timer or cuda_event_timer
    _decisions.clear()


def auto_shapes(recipe: Int8Recipe) -> bool:
    """Whether this recipe's linears choose INT8 or high precision per shape (the recipe's shape_policy, unless
    MEGATRON_INT8_SHAPE_POLICY overrides it)."""
    if not _env_policy:
        _env_policy.append(env_choice(ENV_SHAPE_POLICY))
    env = _env_policy[0]
    return recipe.shape_policy == "auto" if env == "recipe" else env == "auto"


def decisions() -> List[ShapeDecision]:
    """Every shape measured so far in this process."""
    return list(_decisions.values())


def format_decisions() -> str:
    """The measured shapes as a markdown table (an empty string when none was measured)."""
    rows = decisions()
    if not rows:
        return ""
    lines = ["| tokens | in -> out | dtype | recipe | INT8 ms | high precision ms | runs |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {d.tokens} | {d.in_features} -> {d.out_features} | {str(d.dtype).replace('torch.', '')} | {d.recipe} "
              f"| {d.int8_ms:.3f} | {d.hp_ms:.3f} | {d.precision} |" for d in rows]
    return "\n".join(lines)


def describe_weight(out_features: int, in_features: int) -> str:
    """The decisions made for a weight of this shape, e.g. "bf16 at 8192 tokens", for precision tables."""
    made = [d for d in _decisions.values() if (d.out_features, d.in_features) == (out_features, in_features)]
    return ", ".join(f"{d.precision} at {d.tokens} tokens" for d in made)


def describe_precision(recipe: Int8Recipe, weight: torch.Tensor) -> str:
    """A linear's precision for tables: "int8", or under shape_policy "auto" "int8/auto" with what was measured
    for its weight's shape so far, e.g. "int8/auto (bf16 at 8192 tokens)"."""
    if not auto_shapes(recipe):
        return "int8"
    made = describe_weight(*weight.shape)
    return f"int8/auto ({made})" if made else "int8/auto"


def recipe_for_shape(recipe: Int8Recipe, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     tp, int8_linear: Callable) -> Int8Recipe:
    """`recipe`, or HIGH_PRECISION where high precision was measured faster at this shape (the GEMM's rows
    count the tokens after tp's sequence-parallel gather). `int8_linear` is the op to time (passed in: this
    module sits below ops/linear.py)."""
    tokens = input.numel() // max(input.shape[-1], 1)
    if tp.sequence_parallel:
        tokens *= torch.distributed.get_world_size(tp.group)
    key = (input.device, input.dtype, tokens, weight.shape[1], weight.shape[0], bias is not None,
           weight.requires_grad, recipe.numerics)
    if _measuring:
        return recipe
    decision = _decisions.get(key)
    if decision is None:
        if tokens == 0 or is_dynamo_compiling() or (input.is_cuda and torch.cuda.is_current_stream_capturing()):
            return recipe
        decision = _agreed(_measure(recipe, input, weight, bias, tokens, int8_linear), tp.group, input.device)
        if decision is None:
            return recipe
        _decisions[key] = decision
    return recipe if decision.int8 else HIGH_PRECISION


def _agreed(decision: Optional[ShapeDecision], group, device) -> Optional[ShapeDecision]:
    """One decision for every rank of a tensor-parallel group: the INT8 and high-precision paths issue different
    collectives (INT8 all-gather, the amax all-reduces), so ranks that timed differently would wait on each other
    forever. Each time is the group's slowest; no decision where any rank has none."""
    if group is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return decision
    times = torch.tensor([1.0, 0.0, 0.0] if decision is None else [0.0, decision.int8_ms, decision.hp_ms],
                         dtype=torch.float64, device=device)
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX, group=group)
    missing, int8_ms, hp_ms = times.tolist()
    return None if missing else dataclasses.replace(decision, int8_ms=int8_ms, hp_ms=hp_ms)


def _measure(recipe, input, weight, bias, tokens, int8_linear) -> Optional[ShapeDecision]:
    with torch.inference_mode(False), torch.enable_grad():  # the first call may come under no_grad (evaluation)
        return _time_both(recipe, input, weight, bias, tokens, int8_linear)


def _time_both(recipe, input, weight, bias, tokens, int8_linear) -> Optional[ShapeDecision]:
    N, K = weight.shape
    like = dict(device=input.device, dtype=input.dtype)
    x = torch.randn(tokens, K, **like).requires_grad_(True)
    w = (torch.randn(N, K, **like) * K ** -0.5).requires_grad_(weight.requires_grad)
    b = None if bias is None else torch.zeros(N, **like).requires_grad_(bias.requires_grad)
    grad = torch.randn(tokens, N, **like)
    timed = dataclasses.replace(recipe, shape_policy="int8", cache_weights=False)

    def step(linear):
        def run():
            linear().backward(grad)
            x.grad = w.grad = None
            if b is not None:
                b.grad = None
        return run

    _measuring.append(True)
    try:
        int8_ms = _timer(step(lambda: int8_linear(x, w, b, timed)), "int8")
    finally:
        _measuring.clear()
    hp_ms = _timer(step(lambda: F.linear(x, w, b)), "hp")
    if int8_ms is None or hp_ms is None:
        return None
    return ShapeDecision(tokens, K, N, input.dtype, recipe.describe(), float(int8_ms), float(hp_ms))
