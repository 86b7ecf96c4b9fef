"""One plain-PyTorch Llama2-7B transformer layer (RMSNorm, RoPE, causal SDPA, SwiGLU), forward + backward at
micro-batch 2 x 4096, in BF16 / INT8 (convert_to_int8_training) / FP8 (torchao convert_to_float8_training,
tensorwise), eager and torch.compile'd (inductor, fullgraph=True for BF16 and INT8), on one GPU.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_compile_layer.py [--iters 20] [--variants ...]

Prints one markdown table (ms per fwd+bwd and speed relative to compiled BF16) and appends the rows to
benchmarks/results/compile_layer.csv ($OUT/compile_layer.csv on the GPU machine). FP8 is skipped, with a
note, where torchao does not import. About 3 minutes on an H100, most of it inductor compiling.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

import common  # noqa: F401  (puts the repository on sys.path)
from common import append_results, positive_int, require_cuda, time_ms

from megatron_int8 import convert_to_int8_training  # noqa: E402

HIDDEN, FFN, HEADS, SEQ, MICRO_BATCH = 4096, 11008, 32, 4096, 2
VARIANTS = ("bf16 eager", "bf16 compiled", "int8 eager", "int8 compiled", "fp8 compiled")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x, cos, sin):  # x [b, heads, s, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        d = HIDDEN // HEADS
        angles = torch.outer(torch.arange(SEQ).float(), 1e4 ** (-torch.arange(0, d, 2).float() / d))
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def forward(self, x):  # [b, s, h]
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4).unbind(0)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, HIDDEN))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def fp8_layer(layer):
    """torchao's float8 training (tensorwise) on the four linears, or None with a note."""
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as e:  # noqa: BLE001
        print(f"fp8 skipped: torchao does not import ({type(e).__name__}: {e})")
        return None
    return convert_to_float8_training(layer)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    opts = p.parse_args(argv)
    require_cuda(__file__)
    torch.manual_seed(0)
    base = LlamaLayer().to("cuda", torch.bfloat16)
    x = torch.randn(MICRO_BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    ms = {}
    for variant in opts.variants:
        precision, mode = variant.split()
        layer = copy.deepcopy(base)
        if precision == "int8":
            convert_to_int8_training(layer)
        elif precision == "fp8" and fp8_layer(layer) is None:
            continue
        run = torch.compile(layer, fullgraph=precision != "fp8") if mode == "compiled" else layer

        def step():
            run(x).backward(grad)
            x.grad = None
            layer.zero_grad(set_to_none=True)

        ms[variant] = time_ms(step, warmup=3, iters=opts.iters)
        print(f"{variant}: {ms[variant]:.2f} ms", flush=True)
    ref = ms.get("bf16 compiled")
    lines = ["| variant | ms per fwd+bwd | vs compiled BF16 |", "|---|---|---|"]
    lines += [f"| {v} | {t:.2f} | {ref / t:.3f}x |" if ref else f"| {v} | {t:.2f} | - |" for v, t in ms.items()]
    print(f"\nLlama2-7B layer, micro-batch {MICRO_BATCH} x {SEQ}, {torch.cuda.get_device_name()}\n" + "\n".join(lines))
    append_results("compile_layer", [{"variant": v, "ms": round(t, 3),
                                      "vs_compiled_bf16": round(ref / t, 4) if ref else ""} for v, t in ms.items()])


if __name__ == "__main__":
    main()
