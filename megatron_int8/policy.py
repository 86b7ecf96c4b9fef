"""Which linears of a GPT model run in INT8, with which recipe; CLI flags; the precision table.

Layer indexes are global and 0-based, as in megatron's `is_first_last_bf16_layer`, so a policy means
the same thing under any pipeline / virtual-pipeline split.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Iterable, List, Optional, Tuple

import torch

from .recipe import BACKENDS, FINITE_CHECKS, GRANULARITIES, ROUNDINGS, Int8Recipe

GEMMS = ("fprop", "dgrad", "wgrad")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao float8 recipes of the FP8 peer (fp8_peer.py)
LINEAR_SUBMODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
EXPERT_GROUPS = ("experts", "shared_experts")  # every linear of the routed / shared experts
BF16_MODULE_NAMES = LINEAR_SUBMODULES + EXPERT_GROUPS


@dataclasses.dataclass(frozen=True)
class Int8Policy:
    """Per-linear INT8 decision for the transformer layers (embedding, output layer, router: always BF16).

    enabled: False builds the BF16 baseline (same attention and norm modules, high-precision linears).
    first_last_layers_bf16: keep the first `num_layers_at_start_in_bf16` and last
        `num_layers_at_end_in_bf16` transformer layers entirely in BF16.
    bf16_modules: submodule names kept in BF16 in every layer: any of linear_qkv, linear_proj,
        linear_fc1, linear_fc2 (dense, routed and shared experts alike), or `experts` /
        `shared_experts` (all linears of the routed / shared experts).
    fp8_peer: None, or a torchao float8 recipe ("tensorwise" or "rowwise"): the benchmarks' FP8 peer,
        every transformer-layer linear in FP8 (`fp8_peer.py`; needs `enabled=False`; the INT8 recipe
        and layer selection above do not apply to it). Embedding, output layer, router stay BF16.
    fp8_compile: with fp8_peer, torch.compile each dense FP8 linear's casts + GEMM.
    """

    enabled: bool = True
    recipe: Int8Recipe = Int8Recipe()
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    bf16_modules: Tuple[str, ...] = ()
    fp8_peer: Optional[str] = None
    fp8_compile: bool = False

    def __post_init__(self):
        object.__setattr__(self, "bf16_modules", tuple(self.bf16_modules))
        if self.fp8_peer is not None:
            if self.fp8_peer not in FP8_RECIPES:
                raise ValueError(f"Int8Policy.fp8_peer must be None or one of {FP8_RECIPES}, got {self.fp8_peer!r}")
            if self.enabled:
                raise ValueError("INT8 linears and the FP8 peer are mutually exclusive "
                                 "(--int8-linear / --fp8-peer): pick one")
        if not isinstance(self.recipe, Int8Recipe):
            raise TypeError(f"Int8Policy.recipe must be an Int8Recipe, got {type(self.recipe).__name__}")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Int8Policy.{name} must be a non-negative int, got {value!r}")
        unknown = [m for m in self.bf16_modules if m not in BF16_MODULE_NAMES]
        if unknown:
            raise ValueError(f"Int8Policy.bf16_modules: unknown {unknown}; expected names from {BF16_MODULE_NAMES}")

    def check_num_layers(self, num_layers: int) -> None:
        """Raise if first/last BF16 would leave no INT8 layer (a silent BF16 run)."""
        if self.enabled and self.first_last_layers_bf16:
            if self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16 >= num_layers:
                raise ValueError(
                    f"INT8 policy: {self.num_layers_at_start_in_bf16} first + {self.num_layers_at_end_in_bf16} "
                    f"last BF16 layers leave no INT8 layer out of {num_layers}")

    def layer_in_int8(self, layer_index: int, num_layers: int) -> bool:
        """Whether transformer layer `layer_index` (global, 0-based) uses INT8 at all."""
        if not self.enabled:
            return False
        if self.first_last_layers_bf16:
            if layer_index < self.num_layers_at_start_in_bf16:
                return False
            if layer_index >= num_layers - self.num_layers_at_end_in_bf16:
                return False
        return True

    def linear_in_int8(self, layer_index: int, num_layers: int, submodule: str, expert_group: Optional[str] = None) -> bool:
        """Whether linear `submodule` (e.g. linear_fc1) of a layer, optionally inside `experts` /
        `shared_experts`, runs in INT8."""
        return self.layer_in_int8(layer_index, num_layers) and not self.keeps_in_bf16(submodule, expert_group)

    def keeps_in_bf16(self, submodule: str, expert_group: Optional[str] = None) -> bool:
        """Whether `bf16_modules` names this linear (or its expert group)."""
        return submodule in self.bf16_modules or expert_group in self.bf16_modules

    def describe(self) -> str:
        if self.fp8_peer is not None:
            compiled = ", torch.compile" if self.fp8_compile else ", eager"
            return f"INT8 off; FP8 peer: {describe_fp8_recipe(self.fp8_peer)}{compiled}"
        if not self.enabled:
            return "INT8 off (BF16 baseline)"
        parts = [self.recipe.describe()]
        if self.first_last_layers_bf16:
            parts.append(f"first {self.num_layers_at_start_in_bf16} / last {self.num_layers_at_end_in_bf16} layers BF16")
        if self.bf16_modules:
            parts.append("BF16 modules: " + ",".join(self.bf16_modules))
        return "; ".join(parts)


def describe_fp8_recipe(recipe: str) -> str:
    """The FP8 peer's recipe in one line, for logs and the precision table."""
    formats = "e4m3 x/w, e5m2 grad" if recipe == "tensorwise" else "e4m3, power-of-2 scales"
    return f"torchao float8 {recipe} ({formats})"


# ------------------------------------------------------------------------------------------- CLI


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
    group.add_argument("--int8-all-gather", action="store_true",
                       help="With --sequence-parallel: quantize each rank's activation shard with the scales "
                            "of the gathered tensor and all-gather INT8 instead of BF16 (tensor and row "
                            "granularity). Half the bytes, but slower over NVLink in our runs "
                            "(docs/scaling.md); for slow links or to save activation memory.")
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
            backend=args.int8_backend,
            check_finite=args.int8_check_finite,
            cache_weights=not args.int8_no_weight_cache,
            int8_all_gather=getattr(args, "int8_all_gather", False),
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


# ------------------------------------------------------------------------------ precision table

TABLE_COLUMNS = ("layer", "module", "shape/rank", "precision", "recipe")


def _precision_of(module) -> Tuple[str, str]:
    from .fp8_peer import Fp8LinearMixin
    from .layers import Int8LinearMixin

    if isinstance(module, Int8LinearMixin) and module.int8:
        return "int8", module.int8_recipe.describe()
    if isinstance(module, Fp8LinearMixin):
        return "fp8", describe_fp8_recipe(module.fp8_recipe)
    weight = getattr(module, "weight", None)
    if weight is None:  # GPTModel's output layer with tied embeddings multiplies by the embedding weight
        return "tied to embedding", "-"
    dtype = str(weight.dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype), "-"


def precision_table_rows(model_chunks) -> List[Tuple]:
    """One row per linear-like module of this rank's model chunks: (sort key, *TABLE_COLUMNS)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.moe.router import Router
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    rows = []
    for chunk in model_chunks:
        layer_of = {}
        for name, module in chunk.named_modules():
            if isinstance(module, TransformerLayer):
                layer_of[name] = module.layer_number
        for order, (name, module) in enumerate(chunk.named_modules()):
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, Router)):
                continue
            owner = max((p for p in layer_of if name.startswith(p + ".")), key=len, default=None)
            if owner is not None:
                layer, local_name, key = str(layer_of[owner]), name[len(owner) + 1:], (1, layer_of[owner], order)
            else:
                is_embedding = isinstance(module, VocabParallelEmbedding)
                layer, local_name, key = ("embedding" if is_embedding else "output"), name, (0 if is_embedding else 2, 0, order)
            weight = getattr(module, "weight", None)
            shape = "x".join(str(s) for s in weight.shape) if weight is not None else "-"
            rows.append((key, layer, re.sub(r"^(module\.)+", "", local_name), shape, *_precision_of(module)))
    return rows


def format_precision_table(rows: Iterable[Tuple], title: str = "") -> str:
    """Markdown table from `precision_table_rows` (rows of every pipeline stage may be concatenated)."""
    seen, body = set(), []
    for row in sorted(rows, key=lambda r: r[0]):
        if row[1:] not in seen:
            seen.add(row[1:])
            body.append(row[1:])
    lines = [title] if title else []
    lines.append("| " + " | ".join(TABLE_COLUMNS) + " |")
    lines.append("|" + "|".join("---" for _ in TABLE_COLUMNS) + "|")
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def print_precision_table(model_chunks, policy: Optional[Int8Policy] = None, *, print_fn=print) -> Optional[str]:
    """Print ONE precision table for the whole model (all pipeline stages) on global rank 0.

    Every rank must call it (it gathers over the pipeline-parallel group). Shapes are per rank, as
    seen by TP/EP rank 0 of each stage. Returns the table on the printing rank, else None.
    """
    rows = precision_table_rows(model_chunks)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
        if group is not None and dist.get_world_size(group) > 1:
            gathered: List[Optional[List]] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, rows, group=group)
            rows = [row for stage_rows in gathered for row in stage_rows]
        if dist.get_rank() != 0:
            return None
    title = "INT8 precision table" + (f" ({policy.describe()})" if policy is not None else "")
    table = format_precision_table(rows, title)
    print_fn(table)
    return table
