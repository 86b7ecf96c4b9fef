"""The precision of every linear of a model (and of every core attention built for --int8-attention), as one
table for all pipeline stages."""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, List, Optional, Tuple

import torch

from ..recipe import DEFAULT_ATTENTION_SCORES
from .attention import SDPAttention
from .layers import Int8LinearMixin
from .policy import Int8Policy, describe_fp8_recipe

TABLE_COLUMNS = ("layer", "module", "shape/rank", "precision", "recipe")


def _fallback(module) -> str:
    note = getattr(module, "int8_fallback_note", None)  # set by the trainer's auto fallback (training/health.py)
    return f" (fallback {note})" if note else ""


def _precision_of(module) -> Tuple[str, str]:
    if isinstance(module, SDPAttention):  # a core attention built for --int8-attention: its own row
        return (("int8" if module.int8_attention else "bf16"),
                f"int8_attention, scores {module.int8_attention_config.scores}" + _fallback(module))
    if isinstance(module, Int8LinearMixin) and module.int8:
        # the linear's GEMMs: whether attention runs in INT8 is the attention row's to say
        recipe = dataclasses.replace(module.int8_recipe, int8_attention=False,
                                     int8_attention_scores=DEFAULT_ATTENTION_SCORES)
        return module.precision, recipe.describe() + _fallback(module)
    if getattr(module, "fp8_recipe", None) is not None:  # the FP8 peer's linears (peers/fp8.py)
        return "fp8", describe_fp8_recipe(module.fp8_recipe)
    weight = getattr(module, "weight", None)
    if weight is None:  # GPTModel's output layer with tied embeddings multiplies by the embedding weight
        return "tied to embedding", "-"
    dtype = str(weight.dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype), "-"


def precision_table_rows(model_chunks) -> List[Tuple]:
    """One row per linear-like module of this rank's model chunks, and per core attention built for INT8: (sort
    key, *TABLE_COLUMNS)."""
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
            linear_like = isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, Router))
            if not (linear_like or isinstance(module, SDPAttention) and module.int8_attention_built):
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


def summarize_precision_table(rows: Iterable[Tuple], title: str = "") -> str:
    """Totals of `precision_table_rows`: linears and weight elements (per rank) by precision, in one line."""
    linears, elements = {}, {}
    seen = set()
    for row in rows:
        if row[1:] in seen:
            continue
        seen.add(row[1:])
        _, _, _, shape, precision, recipe = row
        label = precision if recipe == "-" else f"{precision} {recipe}"
        linears[label] = linears.get(label, 0) + 1
        size = 1
        for dim in shape.split("x") if shape != "-" else ():
            size *= int(dim)
        elements[label] = elements.get(label, 0) + size
    total = sum(elements.values()) or 1
    parts = [f"{linears[k]} {k} ({100 * elements[k] / total:.1f}% of weights)"
             for k in sorted(linears, key=lambda k: -elements[k])]
    return (f"{title}: " if title else "") + "; ".join(parts) + " (--int8-precision-table lists every linear)"


def print_precision_table(model_chunks, policy: Optional[Int8Policy] = None, *, print_fn=print,
                          full: bool = False) -> Optional[str]:
    """Print ONE precision table for the whole model (all pipeline stages) on global rank 0: every linear
    (`full`), or one line of totals by precision.

    Every rank must call it (it gathers over the pipeline-parallel group). Shapes are per rank, as
    seen by TP/EP rank 0 of each stage. Returns what it printed on the printing rank, else None.
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
    table = format_precision_table(rows, title) if full else summarize_precision_table(rows, title)
    print_fn(table)
    return table
