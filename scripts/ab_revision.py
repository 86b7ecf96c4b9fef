"""The working tree's int8_linear against another git revision's, in one process: bit-exactness, then
host and wall time per fwd+bwd. Host-path changes are A/B'd this way because separate processes on the
lent GPUs varied by up to 0.45 ms per call, more than the changes measured (docs/benchmarks.md).

    python3 scripts/ab_revision.py prepare REV DIR   # here, with git: REV's package as DIR/megatron_int8_base
    python3 scripts/ab_revision.py run DIR [--tokens 4096] [--rounds 7] [--out FILE.json]   # on the GPU

`run`:
1. Bit-exactness: y, dX and dW (or main_grad, with gradient-accumulation fusion) of both revisions
   (bench_direct_launch.fwd_bwd) compared with torch.equal, for the tensor, row and block recipes on two
   shapes, three calls each on fresh inputs with outliers (so cached plans and weight quantizations are
   reused); failures exit non-zero.
2. Timing: Llama2-13B's per-rank linears at TP 4 and TP 2 (scripts/profile_linear_host.py), the default
   recipe, base / working tree / BF16 F.linear alternating over `--rounds` rounds (the first variant
   rotates). Wall: the median of 40 synchronized calls per round. Host: 20 calls enqueued behind a
   sleeping GPU (under the launch queue's depth, which longer loops fill).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASE_NAME = "megatron_int8_base"


def prepare(rev: str, out_dir: str) -> None:
    """REV's megatron_int8 package, renamed so that it imports beside the working tree's."""
    target = os.path.join(out_dir, BASE_NAME)
    if os.path.exists(target):
        raise SystemExit(f"{target} exists: remove it or choose another directory")
    os.makedirs(out_dir, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "megatron_int8"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out_dir], input=archive, check=True)
    os.rename(os.path.join(out_dir, "megatron_int8"), target)
    for folder, _, files in os.walk(target):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace("megatron_int8", BASE_NAME))
    print(f"{rev} -> {target}")


def check_exact(new, base, torch, dev: str) -> int:
    shapes = [(4096, 1280, 5120), (1000, 768, 2304)] if dev == "cuda" else [(37, 32, 53)]
    # the Triton kernels: on the GPU, or under TRITON_INTERPRET=1 on the CPU ("auto" would pick the reference there)
    backend = "triton" if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    sys.path.insert(0, HERE)
    from bench_direct_launch import fwd_bwd

    failures = 0
    for granularity in ("tensor", "row", "block"):
        for tokens, n_in, n_out in shapes:
            for fused in (False, True):
                w0 = (torch.randn(n_out, n_in, device=dev) * 0.02).bfloat16()
                weights = {mod: w0.clone().requires_grad_(True) for mod in (new, base)}
                for call in range(3):
                    x0 = torch.randn(tokens, n_in, device=dev).bfloat16()
                    x0[3 % tokens, 5 % n_in] = 40.0
                    dy = torch.randn(tokens, n_out, device=dev).bfloat16()
                    dy[7 % tokens, 1] = -30.0
                    got = {mod: fwd_bwd(x0, weights[mod], dy, mod.Int8Recipe(granularity=granularity,
                                                                            backend=backend), fused, package=mod)
                           for mod in (new, base)}
                    for what, a, b in zip(("y", "dX", "dW"), got[new], got[base]):
                        if not torch.equal(a, b):
                            failures += 1
                            print(f"MISMATCH {granularity} {tokens}x{n_in}->{n_out} fused={fused} call {call} "
                                  f"{what}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}")
    print(f"bit-exactness ({backend} backend): {failures} mismatches")
    return failures


def time_host(new, base, torch, tokens: int, rounds: int) -> dict:
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from profile_linear_host import SHAPES

    variants = {"base": lambda x, w: base.int8_linear(x, w, None, base.DEFAULT_RECIPE),
                "new": lambda x, w: new.int8_linear(x, w, None, new.DEFAULT_RECIPE),
                "bf16": lambda x, w: F.linear(x, w)}
    names = list(variants)
    results = {}
    print("| linear | base wall ms | new wall ms | BF16 wall ms | base host ms | new host ms | BF16 host ms |"
          " new vs base (wall) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, n_in, n_out in [s for s in SHAPES if not s[0].startswith("TP1")]:
        x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        w = (torch.randn(n_out, n_in, device="cuda") * 0.02).bfloat16().requires_grad_(True)
        dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)

        def loop(fn, n):
            for _ in range(n):
                fn(x, w).backward(dy)
                x.grad = w.grad = None

        for fn in variants.values():
            loop(fn, 5)
        torch.cuda.synchronize()
        wall = {k: [] for k in names}
        host = {k: [] for k in names}
        for r in range(rounds):
            for k in names[r % 3:] + names[:r % 3]:
                t0 = time.perf_counter()
                loop(variants[k], 40)
                torch.cuda.synchronize()
                wall[k].append((time.perf_counter() - t0) / 40 * 1e3)
                torch.cuda._sleep(int(1e9))
                t0 = time.perf_counter()
                loop(variants[k], 20)
                host[k].append((time.perf_counter() - t0) / 20 * 1e3)
                torch.cuda.synchronize()
        res = {k: {"wall_ms": statistics.median(wall[k]), "host_ms": statistics.median(host[k])} for k in names}
        results[label] = res
        b, n, f = res["base"], res["new"], res["bf16"]
        print(f"| {label} | {b['wall_ms']:.3f} | {n['wall_ms']:.3f} | {f['wall_ms']:.3f} | {b['host_ms']:.3f} | "
              f"{n['host_ms']:.3f} | {f['host_ms']:.3f} | {b['wall_ms'] / n['wall_ms']:.2f}x |", flush=True)
    return results


def run(base_dir: str, tokens: int, rounds: int, out: str) -> None:
    if not os.path.isdir(os.path.join(base_dir, BASE_NAME)):
        raise SystemExit(f"no {BASE_NAME} under {base_dir}: run `ab_revision.py prepare REV {base_dir}` first")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, base_dir)
    import torch

    new, base = importlib.import_module("megatron_int8"), importlib.import_module(BASE_NAME)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    failures = check_exact(new, base, torch, dev)
    results = {"tokens": tokens, "mismatches": failures}
    if dev == "cuda":
        results["timing"] = time_host(new, base, torch, tokens, rounds)
    else:
        print("no GPU: timing skipped")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    if failures:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="extract a revision's package as megatron_int8_base")
    pp.add_argument("rev")
    pp.add_argument("dir")
    pr = sub.add_parser("run", help="bit-exactness, then timing on the GPU")
    pr.add_argument("dir")
    pr.add_argument("--tokens", type=int, default=4096)
    pr.add_argument("--rounds", type=int, default=7)
    pr.add_argument("--out", default="")
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.rev, args.dir)
    else:
        run(args.dir, args.tokens, args.rounds, args.out)


if __name__ == "__main__":
    main()
