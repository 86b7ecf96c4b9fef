"""INT8 attention (megatron_int8.ops.int8_attention) against BF16 `F.scaled_dot_product_attention` (flash and
cuDNN backends), causal, forward, backward and both, on one GPU; with the SNR of O, dQ, dK, dV against float64.

    python3 benchmarks/bench_attention.py                      # seq 4096 and 8192, batch 2, 32 heads (and 8 kv), d 128,
                                                               # INT8 attention with either scores
    python3 benchmarks/bench_attention.py --csv $OUT/attention.csv
    python3 benchmarks/bench_attention.py --scores int8 --tiles 128 64 128 32 128 128 64 --no-snr   # a tile point
    python3 benchmarks/bench_attention.py --seqs 8192 --kv-heads 8 --no-snr --profile   # INT8's time per kernel
    python3 benchmarks/bench_attention.py --seqs 4096 --kv-heads 8 --no-snr --sweep     # each kernel's tile choices
    python3 benchmarks/bench_attention.py --scores bf16     # only the default scores (Int8AttentionConfig.scores)

The INT8 impls are named by their scores: int8-bf16-scores (the default config) and int8-int8-scores (scores="int8";
rows of attention.csv written before the --scores option name it plain int8).

TFLOP/s count the causal half of the square: forward 2 products of 2 b h s^2 d / 2 flops each, backward 2.5x that
(five products), as FlashAttention reports. INT8 times include the quantization passes. Backward is timed from
one retained forward graph. "vs BF16" divides the faster BF16 backend's fwd+bwd time by INT8's. The SNR columns
are measured on batch element 0 and the first 4 query heads (their kv heads): float64 needs S^2 memory per head.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import output_file, positive_int, provenance, require_cuda, time_ms

from megatron_int8.ops.int8_attention import Int8AttentionConfig, int8_attention

SDPA_BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def make_inputs(batch, heads, kv_heads, seq, dim, seed=0, device="cuda", dtype=torch.bfloat16):
    """Activation-like q, k, v, dO: unit normal, k with a shared per-channel bias (what K smoothing removes)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, device=device, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, device=device, generator=g)
    k = k + torch.randn(1, kv_heads, 1, dim, device=device, generator=g)
    v = torch.randn(batch, kv_heads, seq, dim, device=device, generator=g)
    do = torch.randn(batch, heads, seq, dim, device=device, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


INT8_IMPLS = {"bf16": "int8-bf16-scores", "int8": "int8-int8-scores"}  # the INT8 impl of each scores


def impl_config(name, tiles=None):
    """The Int8AttentionConfig of an INT8 impl (INT8_IMPLS): the fields of --tiles where given, else the defaults
    for its scores (the forward's tile depends on them)."""
    scores = next(s for s, impl in INT8_IMPLS.items() if impl == name)
    return dataclasses.replace(tiles, scores=scores) if tiles else Int8AttentionConfig(scores=scores)


def attention_fn(name, tiles=None):
    """(q, k, v) -> O of an implementation: an INT8 impl at impl_config(name, tiles), or an SDPA backend, "+repeat"
    where it takes GQA through k and v repeated to every query head (inside the timed call, as a layer without
    native GQA pays it)."""
    if name.startswith("int8"):
        config = impl_config(name, tiles)
        return lambda q, k, v: int8_attention(q, k, v, causal=True, config=config)
    backend = SDPA_BACKENDS[name.removesuffix("+repeat")]

    def sdpa(q, k, v):
        group = q.shape[1] // k.shape[1]
        if name.endswith("+repeat"):
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return sdpa


def time_impl(fn, q, k, v, do, iters):
    """(fwd ms, bwd ms, fwd+bwd ms)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    fwd = time_ms(lambda: fn(*leaves), 3, iters)
    o = fn(*leaves)
    bwd = time_ms(lambda: torch.autograd.grad(o, leaves, do, retain_graph=True), 3, iters)
    both = time_ms(lambda: torch.autograd.grad(fn(*leaves), leaves, do), 3, iters)
    return fwd, bwd, both


def attention64(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def outputs(fn, q, k, v, do, dtype=None):
    leaves = [(t.to(dtype) if dtype else t).detach().requires_grad_(True) for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(do.to(o.dtype))
    return [o.detach()] + [t.grad for t in leaves]


def snr_db(x, ref):
    err = (x.double() - ref).pow(2).sum().item()
    return 10 * math.log10(ref.pow(2).sum().item() / err) if err > 0 else float("inf")


def snr_columns(names, q, k, v, do, tiles):
    """{impl: [SNR of O, dQ, dK, dV]} on a slice small enough for float64 (4 query heads, their kv heads)."""
    group = q.shape[1] // k.shape[1]
    hq = min(4, q.shape[1])
    hk = max(1, hq // group)
    q, k, v, do = q[:1, :hq], k[:1, :hk], v[:1, :hk], do[:1, :hq]
    exact = outputs(attention64, q, k, v, do, torch.float64)
    result = {}
    for name in names:
        got = outputs(attention_fn(name, tiles), q, k, v, do)
        result[name] = [snr_db(a, r) for a, r in zip(got, exact)]
        del got
    del exact
    torch.cuda.empty_cache()
    return result


def profile_int8(q, k, v, do, tiles, impl, steps=5):
    """An INT8 impl's fwd+bwd GPU time per kernel (quantize passes, forward, dK/dV, dQ), per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    fn = attention_fn(impl, tiles)
    torch.autograd.grad(fn(*leaves), leaves, do)  # compiled before the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.autograd.grad(fn(*leaves), leaves, do)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.device_time_total > 0]
    rows = sorted(((e.key, e.device_time_total / steps / 1e3, e.count // steps) for e in kernels), key=lambda r: -r[1])
    total = sum(ms for _, ms, _ in rows)
    print(f"\n{impl} fwd+bwd per step, by kernel ({total:.3f} ms of GPU time)")
    print("| kernel | ms | share | launches |\n|---|---|---|---|")
    for name, ms, count in rows:
        print(f"| {name[:70]} | {ms:.3f} | {100 * ms / total:.1f}% | {count} |")


# The tiles --sweep tries, each kernel's in turn with the others at the config's: (queries, keys) per forward step,
# per dK/dV step, and per dQ step. Warps follow the tiles (kernels.int8_attention.warps_for).
SWEEP = {"fwd": [(128, 64), (128, 128), (128, 32), (64, 64), (64, 128)],
         "bwd": [(64, 128), (32, 128), (128, 128), (64, 64), (32, 64)],
         "dq": [(128, 64), (128, 32), (64, 64), (64, 128), (128, 128)]}
SWEEP_FIELDS = {"fwd": ("fwd_block_m", "fwd_block_n"), "bwd": ("bwd_block_m", "bwd_block_n"),
                "dq": ("dq_block_m", "dq_block_n")}


def sweep_tiles(q, k, v, do, tiles, iters, impl):
    """Forward and backward ms of an INT8 impl at each tile choice of SWEEP (the tiles also set the scale groups of
    P^T and dS, so a new default needs the SNR columns and the GPU tests beside its speed)."""
    from triton.runtime.errors import OutOfResources

    print(f"\n{impl}\n| kernel | tiles (SWEEP_FIELDS) | fwd ms | bwd ms | fwd+bwd ms |\n|---|---|---|---|---|")
    base = impl_config(impl, tiles)
    best = (float("inf"), base)
    for kernel, choices in SWEEP.items():
        for tiles in choices:
            fields = dict(zip(SWEEP_FIELDS[kernel], tiles))
            try:
                config = dataclasses.replace(base, **fields)
            except ValueError:  # a combination the config refuses
                continue
            try:
                fwd, bwd, both = time_impl(attention_fn(impl, config), q, k, v, do, iters)
            except OutOfResources as e:  # tiles whose buffers exceed this GPU's shared memory
                print(f"| {kernel} | {tuple(fields.values())} | {str(e).splitlines()[0][:80]} | | |", flush=True)
                continue
            print(f"| {kernel} | {tuple(fields.values())} | {fwd:.3f} | {bwd:.3f} | {both:.3f} |", flush=True)
            best = min(best, (both, config), key=lambda b: b[0])
    cfg = best[1]
    print(f"\nfastest single change: --tiles {cfg.block} {cfg.fwd_block_m} {cfg.fwd_block_n} {cfg.bwd_block_m} "
          f"{cfg.bwd_block_n} {cfg.dq_block_m} {cfg.dq_block_n} ({best[0]:.3f} ms)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--no-snr", action="store_true", help="skip the float64 SNR columns")
    p.add_argument("--tiles", type=int, nargs=7, metavar=("BLOCK", "FWD_M", "FWD_N", "BWD_M", "BWD_N", "DQ_M", "DQ_N"),
                   help="Int8AttentionConfig fields in order, for every INT8 impl (default: the config's defaults "
                        "for each impl's scores)")
    p.add_argument("--profile", action="store_true",
                   help="also print each INT8 impl's GPU time per kernel at each shape")
    p.add_argument("--sweep", action="store_true",
                   help="also time each INT8 impl's kernels at each tile choice (SWEEP) at each shape")
    p.add_argument("--csv", type=output_file, help="also write the rows, with provenance, to this CSV file")
    p.add_argument("--scores", choices=("both", "bf16", "int8"), default="both",
                   help="INT8 attention's scores product to time (Int8AttentionConfig.scores; default both: "
                        "int8-bf16-scores, the default config, and int8-int8-scores)")
    opts = p.parse_args(argv)
    require_cuda(__file__)
    tiles = Int8AttentionConfig(*opts.tiles) if opts.tiles else None
    impls = tuple(impl for scores, impl in INT8_IMPLS.items() if opts.scores in ("both", scores))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, causal, batch {opts.batch}, "
          f"{opts.heads} heads, d {opts.dim}, bf16 in/out; INT8 tiles: "
          + "; ".join(f"{name} {impl_config(name, tiles)}" for name in impls))
    header = ["seq", "kv heads", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "bwd TFLOP/s",
              "fwd+bwd TFLOP/s", "vs BF16", "SNR O", "SNR dQ", "SNR dK", "SNR dV"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    rows = []
    for seq in opts.seqs:
        for kv_heads in opts.kv_heads:
            q, k, v, do = make_inputs(opts.batch, opts.heads, kv_heads, seq, opts.dim)
            fwd_flops = 4 * opts.batch * opts.heads * seq * seq * opts.dim / 2
            times = {}
            for name in ("sdpa-flash", "sdpa-cudnn") + impls:
                sdpa = not name.startswith("int8")
                for variant in (name, name + "+repeat") if sdpa and kv_heads != opts.heads else (name,):
                    try:
                        times[variant] = time_impl(attention_fn(variant, tiles), q, k, v, do, opts.iters)
                        break
                    except RuntimeError as e:  # a backend this torch/GPU does not run for these inputs
                        print(f"<!-- {variant} at seq {seq}, {kv_heads} kv heads: {str(e).splitlines()[0][:150]} -->")
                    finally:
                        torch.cuda.empty_cache()
            snr = {} if opts.no_snr else snr_columns(list(times), q, k, v, do, tiles)
            bf16_best = min((t[2] for n, t in times.items() if not n.startswith("int8")), default=float("nan"))
            for name, (fwd, bwd, both) in times.items():
                cells = snr.get(name, [float("nan")] * 4)
                row = {"seq": seq, "kv heads": kv_heads, "impl": name, "fwd ms": f"{fwd:.3f}", "bwd ms": f"{bwd:.3f}",
                       "fwd+bwd ms": f"{both:.3f}", "fwd TFLOP/s": f"{fwd_flops / fwd / 1e9:.0f}",
                       "bwd TFLOP/s": f"{2.5 * fwd_flops / bwd / 1e9:.0f}",
                       "fwd+bwd TFLOP/s": f"{3.5 * fwd_flops / both / 1e9:.0f}",
                       "vs BF16": f"{bf16_best / both:.2f}x",
                       **{f"SNR {t}": f"{c:.1f}" for t, c in zip(("O", "dQ", "dK", "dV"), cells)}}
                rows.append(row)
                print("| " + " | ".join(str(row[h]) for h in header) + " |", flush=True)
            if opts.profile:
                for impl in [name for name in times if name.startswith("int8")]:
                    profile_int8(q, k, v, do, tiles, impl)
            if opts.sweep:
                for impl in [name for name in times if name.startswith("int8")]:
                    sweep_tiles(q, k, v, do, tiles, opts.iters, impl)
            del q, k, v, do
            torch.cuda.empty_cache()
    if opts.csv:
        origin = provenance()
        with open(opts.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(origin) + header)
            writer.writeheader()
            writer.writerows({**origin, **row} for row in rows)
        print(f"wrote {opts.csv}")


if __name__ == "__main__":
    main()
