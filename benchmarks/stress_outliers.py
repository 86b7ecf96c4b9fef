#!/usr/bin/env python3
"""Outlier stress test: the long-run SwiGLU failure in minutes, and what the health statistics, the auto
fallback and the Smooth-SwiGLU guard do about it (issue #47; docs/numerics.md).

A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, untied; the parity model's shape by default,
configs/parity_125m.yaml) in plain PyTorch around this package's ops (int8_linear, swiglu): no megatron-core
needed. It learns a synthetic Markov language (each token has a few likely successors). Four runs start
from the same weights on the same batches:
  bf16      every linear in BF16 (the reference)
  int8      INT8 linears (row scales), health statistics on, no fallback
  fallback  INT8 with the auto fallback (training.health.AutoFallback)
  guard     INT8 with the Smooth-SwiGLU guard on fc2 (Int8Recipe.smooth_swiglu)
Outliers are injected the same way in every run: after each optimizer step, in the MLP of every layer
(`--inject-layers`), the up-projection rows of a few SwiGLU channels are scaled up and fc2's matching columns
down by the same factor, so those channels of fc2's input grow geometrically to `--growth` (1000x) while the
function stays the same (up to rounding). What changes is what INT8 sees: fc2's input gets outlier channels
(its fprop suffers under per-token scales) and fc1's weight outlier rows (its dgrad suffers under
per-input-channel scales).

Writes to --output-dir: stress.jsonl (losses, statistics checks, fallback events), table.md (printed too)
and stress.png. The table gives each run's departure from BF16's loss (windowed means), the first step at
which it exceeds 1%, the first statistics check that crossed a fallback threshold, and the fallbacks.

    python3 benchmarks/stress_outliers.py --output-dir runs/stress                 # one GPU, parity shape
    python3 benchmarks/stress_outliers.py --size tiny --steps 12 --device cpu --output-dir /tmp/stress
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time

import common  # noqa: F401  (first: the repository on sys.path)
import torch
import torch.nn.functional as F

from megatron_int8.ops.health import GEMMS, LinearProbe, values_by_name
from megatron_int8.ops.linear import int8_linear
from megatron_int8.ops.swiglu import swiglu
from megatron_int8.recipe import Int8Recipe
from megatron_int8.training.health import AutoFallback, FallbackThresholds, recipe_mode

SIZES = {  # parity: configs/parity_125m.yaml's decoder
    "parity": dict(layers=12, hidden=768, ffn=2048, heads=12, groups=4, seq=1024, batch=8, vocab=8192),
    "small": dict(layers=4, hidden=512, ffn=1408, heads=8, groups=4, seq=512, batch=8, vocab=4096),
    "tiny": dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, seq=64, batch=4, vocab=256),
}
RUNS = ("bf16", "int8", "fallback", "guard")
DEPARTURE = 0.01  # the 1% the targets are stated in


class Linear(torch.nn.Module):
    """fp32 master weight, BF16 compute: F.linear, or int8_linear with `recipe` (and a health probe)."""

    def __init__(self, d_in: int, d_out: int, std: float, name: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) * std)
        self.name = name
        self.recipe = None  # None: BF16
        self.built_recipe = None
        self.probe = None

    def forward(self, x):
        w = self.weight.to(x.dtype)
        if self.recipe is None:
            return F.linear(x, w)
        return int8_linear(x, w, recipe=self.recipe, probe=self.probe)


class RMSNorm(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5) * self.weight).to(torch.bfloat16)


def rope(x, cos, sin):
    """Rotate-half RoPE over the head dim of x [batch, heads, seq, d] (fp32 math)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, cfg: dict, index: int, std: float):
        super().__init__()
        h, heads, groups, ffn = cfg["hidden"], cfg["heads"], cfg["groups"], cfg["ffn"]
        self.heads, self.groups, self.d = heads, groups, h // heads
        out_std = std / math.sqrt(2 * cfg["layers"])
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        prefix = f"layer{index + 1}"
        self.qkv = Linear(h, (heads + 2 * groups) * self.d, std, f"{prefix}.self_attention.linear_qkv")
        self.proj = Linear(heads * self.d, h, out_std, f"{prefix}.self_attention.linear_proj")
        self.fc1 = Linear(h, 2 * ffn, std, f"{prefix}.mlp.linear_fc1")
        self.fc2 = Linear(ffn, h, out_std, f"{prefix}.mlp.linear_fc2")

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, -1, self.d).transpose(1, 2).split(
            [self.heads, self.groups, self.groups], dim=1)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.heads // self.groups
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, S, -1))
        h = self.fc1(self.norm2(x))
        return x + self.fc2(swiglu(h, emit_maxima=self.fc2.recipe is not None))


class Model(torch.nn.Module):
    def __init__(self, cfg: dict, std: float = 0.02):
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.randn(cfg["vocab"], cfg["hidden"]) * std)
        self.blocks = torch.nn.ModuleList(Block(cfg, i, std) for i in range(cfg["layers"]))
        self.norm = RMSNorm(cfg["hidden"])
        self.output = torch.nn.Parameter(torch.randn(cfg["vocab"], cfg["hidden"]) * std)  # BF16, as the trainer's
        d = cfg["hidden"] // cfg["heads"]
        freqs = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(cfg["seq"]).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, labels):
        x = self.embedding[tokens].to(torch.bfloat16)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = F.linear(self.norm(x), self.output.to(torch.bfloat16)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))

    def linears(self):
        return {m.name: m for m in self.modules() if isinstance(m, Linear)}


def markov_batches(cfg: dict, steps: int, seed: int, device) -> torch.Tensor:
    """[steps, batch, seq + 1] tokens: each token is followed by one of 4 fixed successors (10% uniform
    noise), so the loss can fall from log(vocab) towards about log(4)."""
    g = torch.Generator().manual_seed(seed)
    V, n = cfg["vocab"], steps * cfg["batch"]
    successors = torch.randint(V, (V, 4), generator=g)
    tokens = torch.empty(n, cfg["seq"] + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(V, (n,), generator=g)
    for t in range(1, cfg["seq"] + 1):
        pick = successors[tokens[:, t - 1], torch.randint(4, (n,), generator=g)]
        noise = torch.rand(n, generator=g) < 0.1
        tokens[:, t] = torch.where(noise, torch.randint(V, (n,), generator=g), pick)
    return tokens.view(steps, cfg["batch"], -1).to(device)


def growth_at(step: int, args) -> float:
    """The injected channels' growth after optimizer step `step`: 1 until --inject-start, geometric up to
    --growth at --inject-end, then constant."""
    start, end = int(args.inject_start * args.steps), int(args.inject_end * args.steps)
    if step <= start:
        return 1.0
    return args.growth ** (min(step - start, end - start) / max(end - start, 1))


@torch.no_grad()
def inject(model: Model, args, channels, step: int) -> None:
    """Scale the chosen SwiGLU channels of the injected layers by growth(step) / growth(step - 1): their
    up-projection rows up, fc2's columns down (the function is unchanged)."""
    factor = growth_at(step, args) / growth_at(step - 1, args)
    if factor == 1.0:
        return
    for number in args.inject_layers:
        block = model.blocks[number - 1]
        ffn = block.fc2.weight.shape[1]
        block.fc1.weight[ffn + channels] *= factor  # x = [gate | up]: the up half
        block.fc2.weight[:, channels] /= factor


def crossing(values: dict, thresholds: FallbackThresholds):
    """The GEMMs of one check over a fallback threshold."""
    return [g for g in GEMMS if thresholds.crossed(g, values)]


def train(run: str, cfg: dict, init_state: dict, batches, args, device, log):
    """One run; returns {"loss": [...], "checks": [...], "events": [...], "flag": (step, linear, gemms)}."""
    torch.manual_seed(args.seed)
    model = Model(cfg).to(device)
    model.load_state_dict(init_state)
    thresholds = FallbackThresholds(tuple(args.max_rel_err), args.max_underflow, args.patience)
    fallback = AutoFallback(thresholds, enabled=run == "fallback")
    linears = model.linears()
    if run != "bf16":
        base = Int8Recipe(granularity=args.granularity)
        for name, linear in linears.items():
            guard = run == "guard" and name.endswith("linear_fc2")
            linear.recipe = linear.built_recipe = dataclasses.replace(base, smooth_swiglu=guard)
            linear.probe = LinearProbe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    channels = torch.tensor(args.channels, device=device) % cfg["ffn"]
    result = {"loss": [], "checks": [], "events": [], "flag": None}
    start = time.time()
    for step in range(1, args.steps + 1):
        stats_step = run != "bf16" and step % args.stats_interval == 0
        if stats_step:
            for linear in linears.values():
                if linear.probe is not None:
                    linear.probe.arm()
        loss = model(batches[step - 1][:, :-1], batches[step - 1][:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        inject(model, args, channels, step)
        result["loss"].append(loss.item())
        if stats_step:
            check = {name: values_by_name(vs[-1]) for name, linear in linears.items()
                     if linear.probe is not None and (vs := linear.probe.take())}
            result["checks"].append((step, check))
            flagged = {name: crossing(v, thresholds) for name, v in check.items() if crossing(v, thresholds)}
            if flagged and result["flag"] is None:
                name = max(flagged, key=lambda n: max(check[n].get(f"{g}/rel_err", 0) for g in flagged[n]))
                result["flag"] = (step, name, flagged[name])
            for name, values in check.items():
                for event in fallback.check(step, name, recipe_mode(linears[name].built_recipe), values):
                    linear = linears[name]
                    linear.recipe = dataclasses.replace(linear.built_recipe, **fallback.moved[name]["mode"])
                    result["events"].append(event)
                    log(f"  [{run}] step {step}: fallback {name} {event['gemm']}: {event['change']} "
                        f"({event['reason']})")
        if step % args.log_interval == 0 or step == args.steps:
            log(f"  [{run}] step {step}/{args.steps} loss {loss.item():.4f} growth {growth_at(step, args):.1f}x "
                f"({time.time() - start:.1f} s)")
    result["seconds"] = time.time() - start
    return result


def windowed(values, window):
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def departures(loss, reference, window):
    """Relative departure of a run's windowed mean loss from the reference's, per step."""
    a, b = windowed(loss, window), windowed(reference, window)
    return [x / y - 1 for x, y in zip(a, b)]


def summary_rows(results, args):
    """One dict per run: the table's figures (also the results CSV's rows)."""
    reference = results["bf16"]["loss"]
    rows = []
    for run, r in results.items():
        dep = departures(r["loss"], reference, args.window)
        rows.append({
            "size": args.size, "steps": args.steps, "growth": args.growth, "run": run,
            "final_loss": sum(r["loss"][-args.window:]) / len(r["loss"][-args.window:]),
            "final_departure": dep[-1], "max_departure": max(dep),
            "first_step_over_1pct": next((i + 1 for i, d in enumerate(dep) if d > DEPARTURE), None),
            "first_flag_step": r["flag"][0] if r["flag"] else None,
            "first_flag": f"{r['flag'][1]} {'/'.join(r['flag'][2])}" if r["flag"] else "",
            "fallbacks": "; ".join(f"{e['iteration']}: {e['linear']} {e['gemm']} {e['change']}"
                                   for e in r["events"]),
            "seconds": round(r["seconds"], 1)})
    return rows


def summary_table(rows) -> str:
    dash = lambda v: "-" if v in (None, "") else v  # noqa: E731
    lines = ["| run | final loss | departure from BF16 (last window) | max departure | first step > 1% | "
             "first health flag (step: linear, GEMMs) | fallbacks (step: linear GEMM change) | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = f"{r['first_flag_step']}: {r['first_flag']}" if r["first_flag_step"] else "-"
        lines.append(f"| {r['run']} | {r['final_loss']:.4f} | {100 * r['final_departure']:+.2f}% | "
                     f"{100 * r['max_departure']:+.2f}% | {dash(r['first_step_over_1pct'])} | {flag} | "
                     f"{dash(r['fallbacks'])} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def plot(results, args, path, watched) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    steps = list(range(1, args.steps + 1))
    reference = results["bf16"]["loss"]
    colors = {"int8": "tab:red", "fallback": "tab:blue", "guard": "tab:green"}
    for run, color in colors.items():
        if run not in results:
            continue
        r = results[run]
        top.plot(steps, [100 * d for d in departures(r["loss"], reference, args.window)], color=color, label=run)
        if r["flag"]:
            top.axvline(r["flag"][0], color=color, linestyle=":", linewidth=1)
        for e in r["events"]:
            top.axvline(e["iteration"], color=color, linestyle="--", linewidth=1)
        checks = [(s, c[watched].get("fprop/rel_err", math.nan)) for s, c in r["checks"] if watched in c]
        if checks:
            bottom.plot(*zip(*checks), color=color, marker=".", label=f"{run}: {watched} fprop rel_err")
    top.axhline(100 * DEPARTURE, color="gray", linewidth=0.8)
    top.set_ylabel(f"loss departure from BF16 (%; {args.window}-step means)")
    top.set_title("INT8 under growing SwiGLU outliers (dotted: first health flag; dashed: fallback)")
    top.legend()
    bottom.set_yscale("log")
    bottom.axhline(FallbackThresholds(tuple(args.max_rel_err)).max_rel_err[0], color="gray", linewidth=0.8)
    bottom.set_ylabel("sampled relative error")
    bottom.set_xlabel("step")
    twin = bottom.twinx()
    twin.plot(steps, [growth_at(s, args) for s in steps], color="black", linestyle="--", linewidth=0.8)
    twin.set_yscale("log")
    twin.set_ylabel("injected channel growth (x)")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="parity")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--granularity", choices=("tensor", "row", "block"), default="row")
    parser.add_argument("--growth", type=float, default=1000.0, help="final growth of the injected channels")
    parser.add_argument("--inject-start", type=float, default=0.2, help="fraction of the steps")
    parser.add_argument("--inject-end", type=float, default=0.7, help="fraction of the steps")
    parser.add_argument("--inject-layers", type=int, nargs="+", default=None,
                        help="1-based layers whose SwiGLU channels grow (default: all)")
    parser.add_argument("--channels", type=int, nargs="+", default=[3, 77, 301, 1029],
                        help="SwiGLU channels that grow (modulo the MLP width)")
    parser.add_argument("--stats-interval", type=int, default=10)
    parser.add_argument("--max-rel-err", type=float, nargs="+", default=list(FallbackThresholds.max_rel_err),
                        help="fprop dgrad wgrad, or one for all")
    parser.add_argument("--max-underflow", type=float, default=FallbackThresholds.max_underflow)
    parser.add_argument("--patience", type=int, default=FallbackThresholds.patience)
    parser.add_argument("--window", type=int, default=20, help="steps per windowed mean loss")
    parser.add_argument("--log-interval", type=int, default=50)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--results-dir", default=None,
                        help="where benchmarks/common.append_results writes stress_outliers.csv (default: $OUT or "
                             "benchmarks/results)")
    args = parser.parse_args(argv)
    if "bf16" not in args.runs:
        parser.error("--runs needs bf16: departures are measured from it")
    if not 0 <= args.inject_start < args.inject_end <= 1:
        parser.error("need 0 <= --inject-start < --inject-end <= 1")
    cfg = SIZES[args.size]
    args.inject_layers = args.inject_layers or list(range(1, cfg["layers"] + 1))
    if not all(1 <= n <= cfg["layers"] for n in args.inject_layers):
        parser.error(f"--inject-layers: layers are 1 .. {cfg['layers']}")
    device = torch.device(args.device)
    os.makedirs(args.output_dir, exist_ok=True)
    log = lambda text: print(text, flush=True)  # noqa: E731
    log(f"stress test: {args.size} {cfg}, {args.steps} steps, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in Model(cfg).state_dict().items()}
    batches = markov_batches(cfg, args.steps, args.seed, device)
    results = {}
    for run in args.runs:
        log(f"run {run}")
        results[run] = train(run, cfg, init_state, batches, args, device, log)
    watched = f"layer{args.inject_layers[len(args.inject_layers) // 2]}.mlp.linear_fc2"
    with open(os.path.join(args.output_dir, "stress.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"args": vars(args), "model": cfg, "injected": watched}) + "\n")
        for run, r in results.items():
            for step, loss in enumerate(r["loss"], 1):
                f.write(json.dumps({"run": run, "iteration": step, "lm_loss": loss}) + "\n")
            for step, check in r["checks"]:
                f.write(json.dumps({"run": run, "iteration": step, "int8_health": check}) + "\n")
            for event in r["events"]:
                f.write(json.dumps({"run": run, "iteration": event["iteration"], "int8_fallback": event}) + "\n")
    rows = summary_rows(results, args)
    table = summary_table(rows)
    common.append_results("stress_outliers", rows, directory=args.results_dir)
    with open(os.path.join(args.output_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    log(table)
    plot(results, args, os.path.join(args.output_dir, "stress.png"), watched)
    log(f"wrote {args.output_dir}/stress.jsonl, table.md, stress.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
