#!/usr/bin/env python3
"""Benchmark one Llama2-7B-shaped megatron-core TransformerLayer, forward + backward:
INT8 spec vs the BF16 baseline spec (same SDPA attention and norms, so only the linears differ), the FP8
peer (torchao float8 linears in the same spec; on CUDA GPUs of compute capability >= 8.9 with torchao
installed, else skipped with the reason printed), plus megatron-core's stock local spec
(DotProductAttention) for reference.

Needs only torch + megatron-core (no TE, no apex); world size 1 through a file-store process group.
    python benchmarks/bench_layer.py                      # GPU, hidden 4096, ffn 11008, mbs 2 x seq 4096
    python benchmarks/bench_layer.py --device cpu --tiny  # CI smoke test
    python benchmarks/bench_layer.py --cuda-graph         # replays of captured steps: GPU time, no host overhead
    # a Mixtral-8x7B MoE layer (8 experts, top-2, SequentialMLP; one micro-batch of 4096 tokens):
    python benchmarks/bench_layer.py --ffn 14336 --num-query-groups 8 --num-experts 8 --micro-batch 1
    # FP8 peer: rowwise recipe instead of tensorwise, plus a torch.compile'd FP8 row
    python benchmarks/bench_layer.py --fp8-recipe rowwise --fp8-compile
    # memory options: one more INT8 row per option (the SwiGLU's / the norms' inputs kept in INT8), one with both
    python benchmarks/bench_layer.py --int8-swiglu-input --int8-norm-input --no-fp8 --no-stock
    # INT8 attention (forward and backward) beside the INT8 linears, at a length where attention dominates
    python benchmarks/bench_layer.py --int8-attention --seq 16384 --micro-batch 1 --cuda-graph --no-fp8 --no-stock
Prints a markdown table and writes it to $OUT/bench_layer.md when $OUT is set; its rows go to the results
CSV (benchmarks/common.append_results; a CPU or --tiny run's only to $OUT). On CUDA the table also
gives each spec's memory: the tensors its forward keeps for backward, and its fwd+bwd peak. On every device
it gives the bytes per token of the tensors autograd saves for backward (saved_tensors_hooks: distinct
storages, parameters left out; weight caches are not saved tensors).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import common  # noqa: E402  (puts the repository on sys.path)
from megatron_int8.megatron.policy import FP8_RECIPES  # noqa: E402
from megatron_int8.recipe import (ATTENTION_SCORES, DEFAULT_ATTENTION_SCORES, DEFAULT_RECIPE,  # noqa: E402
                                  FINITE_CHECKS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=None, help="GQA key/value heads (default: --heads)")
    p.add_argument("--kv-channels", type=int, default=None,
                   help="head dimension (default: hidden / heads); e.g. one TP-4 rank of Llama2-13B: "
                        "--hidden 5120 --heads 10 --kv-channels 128 --ffn 3456")
    p.add_argument("--num-experts", type=int, default=0,
                   help="MoE layer with this many experts of width --ffn (0: a dense SwiGLU MLP)")
    p.add_argument("--topk", type=int, default=2, help="experts per token (with --num-experts)")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="INT8 experts grouped (Int8GroupedMLP), with an 'INT8 per-expert' row for comparison")
    p.add_argument("--seq", type=common.positive_int, default=4096)
    p.add_argument("--micro-batch", type=common.positive_int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=common.positive_int, default=20)
    p.add_argument("--granularity", choices=("tensor", "row", "block"), default=DEFAULT_RECIPE.granularity)
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--cache-weights", action="store_true",
                         help="keep weight quantization across iterations (as micro-batches of one step do); by "
                              "default every iteration is a new optimizer step: the weight cache is invalidated, so "
                              "the forward quantizes Q(W) and Q(W)^T in one pass, as the trainer does at one "
                              "micro-batch per step")
    weights.add_argument("--no-weight-cache", action="store_true",
                         help="the recipe's cache_weights=False: Q(W) quantized in the forward and Q(W)^T in the "
                              "backward, each its own pass, every iteration")
    p.add_argument("--no-dgrad-weight-cache", dest="cache_dgrad_weight", action="store_false",
                   help="cache Q(W) only, so every iteration quantizes dgrad's Q(W)^T in the backward (recipe "
                        "cache_dgrad_weight=False; the time it costs a micro-batch)")
    p.add_argument("--check-finite", choices=FINITE_CHECKS, default=DEFAULT_RECIPE.check_finite,
                   help="the recipe's Inf/NaN check: deferred (default; no host sync), immediate (one host "
                        "sync per quantize) or off")
    p.add_argument("--int8-swiglu-input", action="store_true",
                   help="add an INT8 row whose SwiGLU keeps its input in INT8 (recipe int8_swiglu_input; dense MLPs "
                        "with the fused SwiGLU)")
    p.add_argument("--int8-norm-input", action="store_true",
                   help="add an INT8 row whose RMSNorms keep their inputs in INT8 (recipe int8_norm_input)")
    p.add_argument("--int8-attention", action="store_true",
                   help="add an INT8 row whose attention runs INT8 too, forward and backward (recipe int8_attention)")
    p.add_argument("--int8-attention-scores", choices=ATTENTION_SCORES, default=DEFAULT_ATTENTION_SCORES,
                   help="the scores of --int8-attention's row (recipe int8_attention_scores; default %(default)s)")
    p.add_argument("--no-stock", action="store_true", help="skip megatron's stock local spec")
    p.add_argument("--no-fused-swiglu", dest="fused_swiglu", action="store_false",
                   help="dense MLPs: megatron's SwiGLU instead of megatron_int8.ops.swiglu (as the trainer's flag)")
    p.add_argument("--no-fp8", action="store_true", help="skip the FP8 peer (torchao float8) row")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="tensorwise",
                   help="torchao float8 scaling recipe of the FP8 peer")
    p.add_argument("--fp8-compile", action="store_true",
                   help="add a second FP8 row with each dense linear's casts + GEMM under torch.compile")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time replays of one captured forward + backward per spec (the trainer's "
                        "--cuda-graph-impl local steps): GPU time without the eager host overhead")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile 3 steps of the INT8 and the BF16 layer: each one's GPU kernels "
                        "by time per step (on CPU: the INT8 layer's operators)")
    args = p.parse_args(argv)
    if args.no_weight_cache and not args.cache_dgrad_weight:
        p.error("--no-dgrad-weight-cache: with --no-weight-cache no Q(W) is cached either")
    if args.int8_swiglu_input and (args.num_experts or not args.fused_swiglu):
        p.error("--int8-swiglu-input needs a dense MLP with the fused SwiGLU (no --num-experts, no --no-fused-swiglu)")
    if args.tiny:
        args.hidden, args.ffn, args.heads, args.seq, args.micro_batch = 128, 352, 4, 64, 2
        args.num_query_groups = 2 if args.num_query_groups else None
        args.warmup, args.iters = 1, 2
    if args.int8_attention:
        from megatron_int8.megatron.policy import int8_attention_problems

        head_dim = args.kv_channels or args.hidden // args.heads
        problems = int8_attention_problems(head_dim, 0.0)
        if problems:
            p.error("--int8-attention: " + "; ".join(text for _, text in problems))
    return args


def setup(device: str):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_int8.megatron.compat import apply_cpu_compat, model_parallel_seed

    apply_cpu_compat()
    if not torch.distributed.is_initialized():
        store = tempfile.mktemp(prefix="bench_layer_pg_")
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo",
                                             init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_seed(1234)


def fp8_skip_reason(args):
    """Why the FP8 peer cannot run in this benchmark (None if it can)."""
    if args.no_fp8:
        return "--no-fp8"
    if args.device != "cuda":
        return "FP8 GEMMs need a CUDA GPU (--device cpu)"
    from megatron_int8.peers.fp8 import fp8_unavailable_reason

    return fp8_unavailable_reason()


# recipe field: row label (each an argparse flag of the same name)
RECIPE_OPTIONS = {"int8_swiglu_input": "swiglu-in:int8", "int8_norm_input": "norm-in:int8",
                  "int8_attention": "attention:int8"}


def option_rows(args) -> dict:
    """{row name: recipe fields set}: one INT8 row per recipe option asked for, and one with all when several
    (INT8 attention's label and fields name its scores)."""
    def label(field):
        scores = f"/scores:{args.int8_attention_scores}" if field == "int8_attention" else ""
        return RECIPE_OPTIONS[field] + scores

    def fields(field):
        scores = {"int8_attention_scores": args.int8_attention_scores} if field == "int8_attention" else {}
        return {field: True, **scores}

    chosen = [field for field in RECIPE_OPTIONS if getattr(args, field)]
    rows = {f"INT8 {label(field)}": fields(field) for field in chosen}
    if len(chosen) > 1:
        together = {name: value for field in chosen for name, value in fields(field).items()}
        rows["INT8 " + ",".join(label(field) for field in chosen)] = together
    return rows


def build_layers(args, skipped):
    """{row name: layer}; FP8 rows that cannot be built are left out, their reason in `skipped`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_int8.recipe import Int8Recipe
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    dtype = torch.bfloat16
    moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
               moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0) if args.num_experts else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, **moe, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=dtype,
        use_cpu_initialization=args.device == "cpu", bias_activation_fusion=True, bias_dropout_fusion=True)
    # our specs' dense MLPs run megatron_int8.ops.swiglu through the activation module slot (as the trainer does);
    # megatron's stock spec has no such module and keeps its fused SwiGLU
    stock_config = config
    if args.fused_swiglu and not args.num_experts:
        config = dataclasses.replace(config, use_te_activation_func=True, bias_activation_fusion=False)
    recipe = Int8Recipe(granularity=args.granularity, backend=args.backend, check_finite=args.check_finite,
                        cache_weights=not args.no_weight_cache, cache_dgrad_weight=args.cache_dgrad_weight)
    experts = args.num_experts or None
    grouped = bool(experts and args.moe_grouped_gemm)
    specs = {"INT8": get_gpt_int8_layer_spec(recipe=recipe, int8=True, num_experts=experts, moe_grouped_gemm=grouped),
             "BF16": get_gpt_int8_layer_spec(recipe=recipe, int8=False, num_experts=experts)}
    for name, options in option_rows(args).items():
        specs[name] = get_gpt_int8_layer_spec(recipe=dataclasses.replace(recipe, **options), int8=True,
                                              num_experts=experts, moe_grouped_gemm=grouped)
    if grouped:
        specs["INT8 per-expert"] = get_gpt_int8_layer_spec(recipe=recipe, int8=True, num_experts=experts)
    fp8_specs = {}
    reason = fp8_skip_reason(args)
    if reason is None:
        for compiled in (False, True) if args.fp8_compile else (False,):
            name = f"FP8 torchao {args.fp8_recipe}" + (" compiled" if compiled else "")
            fp8_specs[name] = get_gpt_int8_layer_spec(fp8_recipe=args.fp8_recipe, fp8_compile=compiled,
                                                      num_experts=experts)
    else:
        skipped["FP8 torchao " + args.fp8_recipe] = reason
    specs.update(fp8_specs)
    if not args.no_stock:
        specs["BF16 stock local spec"] = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
    layers = {}
    for name, spec in specs.items():
        try:
            layer_config = stock_config if name == "BF16 stock local spec" else config
            layers[name] = build_module(spec, config=layer_config, layer_number=1).to(device=args.device,
                                                                                    dtype=dtype)
        except (ImportError, RuntimeError, ValueError) as err:
            if name not in fp8_specs:
                raise
            skipped[name] = f"{type(err).__name__}: {err}"
    return layers


def new_step(args) -> None:
    """Start an iteration as a new optimizer step (the weights quantized again), unless --cache-weights keeps them."""
    from megatron_int8.ops.linear import invalidate_weight_caches

    if not args.cache_weights:
        invalidate_weight_caches()


def time_layer(layer, name, args) -> float:
    """Mean ms of one forward + backward."""
    x, mask = _layer_input(args, name)
    grad = torch.randn_like(x)

    def step():
        new_step(args)
        out, _ = layer(x, attention_mask=mask)
        out.backward(grad)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.cuda_graph:
        step = _graphed(layer, x, grad, mask, args)
    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync()
    return (time.perf_counter() - start) * 1e3 / args.iters


def _layer_input(args, name):
    """(x, attention mask) for one forward: megatron's stock spec builds its default mask on "cuda"."""
    x = torch.randn(args.seq, args.micro_batch, args.hidden, device=args.device, dtype=torch.bfloat16,
                    requires_grad=True)
    mask = None
    if args.device == "cpu" and name.startswith("BF16 stock"):
        mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), 1)[None, None]
    return x, mask


def saved_tensor_bytes(layer, name, args) -> int:
    """Bytes of the tensors one forward saves for backward (autograd's saved_tensors_hooks, any device):
    each distinct storage once, the layer's parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x, mask = _layer_input(args, name)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x, attention_mask=mask)
    del out
    return sum(storages.values())


def layer_memory(layer, args):
    """(saved, peak) in MiB for one eager forward + backward on CUDA: what the forward leaves allocated
    beyond its output (the tensors kept for backward), and the highest allocation above the start. The weight
    caches the timing built (held between steps, as by the trainer) stay out of both; with --no-weight-cache the
    weights' quantization is inside."""
    x = torch.randn(args.seq, args.micro_batch, args.hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    grad = torch.randn_like(x)
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, _ = layer(x)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - start - out.untyped_storage().nbytes()
    out.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    del out
    layer.zero_grad(set_to_none=True)
    return saved / 2**20, peak / 2**20


def _graphed(layer, x, grad, mask, args):
    """One forward + backward captured in a CUDA graph, after eager warm-up on a side stream (autotuning,
    kernel builds and the weight cache happen there). The gradients are set to None before the capture, so
    each replay writes them afresh, the work the eager loop times (which sets them to None every step); with
    gradients left in place, every replay would add into them, kernels the eager loop does not run and the
    trainer's INT8 linears fuse into their wgrad GEMMs. Without --cache-weights the graph quantizes the
    weights itself (the cache is invalidated before the capture)."""
    def body():
        out, _ = layer(x, attention_mask=mask)
        out.backward(grad)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(args.warmup, 2)):
            new_step(args)
            body()
    torch.cuda.current_stream().wait_stream(side)
    new_step(args)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def profile_layers(layers, args) -> str:
    """Where each layer's GPU time goes (INT8, then BF16): kernels by time per step over 3 eager steps (the
    timed step's work: weights quantized as the timing mode does, gradients set to None). On CPU: torch's
    operator table of the INT8 layer."""
    from torch.profiler import ProfilerActivity, profile

    steps = 3
    x = torch.randn(args.seq, args.micro_batch, args.hidden, device=args.device, dtype=torch.bfloat16,
                    requires_grad=True)
    cuda = args.device == "cuda"
    text = []
    for name in ("INT8", "BF16") if cuda else ("INT8",):
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(steps):
                new_step(args)
                out, _ = layers[name](x)
                out.backward(torch.ones_like(out))
                layers[name].zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
        if not cuda:
            text.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
            continue
        kernels = sorted(((e.device_time_total / steps / 1e3, e.count // steps, e.key)
                          for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                         reverse=True)
        total = sum(ms for ms, _, _ in kernels)
        text += [f"{name}: {total:.3f} ms of GPU kernels per step", "", "| kernel | ms / step | share | launches |",
                 "|---|---|---|---|"]
        text += [f"| {key[:90]} | {ms:.3f} | {100 * ms / total:.1f}% | {n} |" for ms, n, key in kernels[:25]]
        text.append("")
    return "\n".join(text)


def _weight_cache_state(args) -> str:
    if args.no_weight_cache:
        return "off (Q(W) and Q(W)^T quantized apart every iteration)"
    kept = "kept across iterations" if args.cache_weights else "invalidated every iteration (one step per iteration)"
    return kept + ("" if args.cache_dgrad_weight else ", Q(W) only (Q(W)^T quantized every iteration)")


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available (use --device cpu --tiny)")
    if args.cuda_graph and args.device != "cuda":
        raise SystemExit("--cuda-graph needs --device cuda")
    setup(args.device)
    from megatron_int8.dispatch import resolve_backend_name
    from megatron_int8.recipe import Int8Recipe

    skipped = {}
    layers = build_layers(args, skipped)
    times, memory, saved_bytes = {}, {}, {}
    for name, layer in layers.items():
        try:  # a row gets its time and its memory, or is skipped whole
            ms = time_layer(layer, name, args)
            if args.device == "cuda":
                memory[name] = layer_memory(layer, args)
            saved_bytes[name] = saved_tensor_bytes(layer, name, args)
            times[name] = ms
        except Exception as err:  # an FP8 row (e.g. torch.compile) must not cost the others
            if not name.startswith("FP8"):
                raise
            skipped[name] = f"{type(err).__name__}: {str(err)[:300]}"
    backend = resolve_backend_name(torch.device(args.device), Int8Recipe(backend=args.backend))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    mlp = (f"{args.num_experts} experts (top-{args.topk}) of ffn {args.ffn}"
           + (", INT8 experts grouped" if args.moe_grouped_gemm else "") if args.num_experts else f"ffn {args.ffn}")
    heads = (f"{args.heads} heads" + (f" ({args.num_query_groups} KV groups)" if args.num_query_groups else "")
             + (f" of dim {args.kv_channels}" if args.kv_channels else ""))
    lines = [
        f"Transformer layer fwd+bwd: hidden {args.hidden}, {mlp}, {heads}, SwiGLU, RMSNorm, "
        f"micro-batch {args.micro_batch} x seq {args.seq}, bf16, {device_name}; INT8 {args.granularity}-wise, "
        f"backend {backend}, weight cache {_weight_cache_state(args)}, "
        f"finite check {args.check_finite}" + (", CUDA-graphed" if args.cuda_graph else ", eager") + (f"; FP8 peer: torchao float8 {args.fp8_recipe} (dynamic scales, "
        "fprop/dgrad/wgrad FP8, weights cast every iteration)" if any(n.startswith("FP8") for n in times) else ""),
        "",
        "| spec | ms / iter | speedup vs BF16 | saved for backward MiB (bytes / token) | fwd+bwd peak MiB | "
        "saved tensors bytes / token |",
        "|---|---|---|---|---|---|",
    ]
    tokens = args.seq * args.micro_batch
    for name, ms in times.items():
        cells = [name, f"{ms:.2f}", f"{times['BF16'] / ms:.2f}x", "n/a", "n/a", f"{saved_bytes[name] / tokens:.0f}"]
        if name in memory:
            saved, peak = memory[name]
            cells[3:5] = [f"{saved:.1f} ({saved * 2**20 / tokens:.0f})", f"{peak:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if skipped:
        lines += [""] + [f"{name}: skipped ({reason})" for name, reason in skipped.items()]
    table = "\n".join(lines)
    # the saved-tensors column changed the table's columns: a new CSV (benchmarks/results/layer.csv has the old ones)
    common.record_tables("layer_saved_tensors", table, smoke=args.tiny or args.device != "cuda")
    if args.profile:  # printed and in $OUT/bench_layer.md, not recorded: a diagnosis, not a result
        table += "\n\n" + profile_layers(layers, args)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_layer.md"), "w") as f:
            f.write(table + "\n")
    return table


if __name__ == "__main__":
    from megatron_int8.training.model import destroy_distributed

    try:
        main()
    finally:
        destroy_distributed()
