"""RoPE forward + backward: megatron-core's unfused ops vs megatron_int8.ops.rope's Triton kernel (one GPU).

q and k are strided slices of a fused qkv output, as in megatron's attention; one row per shape. The
bytes column counts one read and one write of q (or k) in each direction, the least a RoPE can move.

    python benchmarks/bench_rope.py            # Llama2-13B at TP 2 and Llama3.1-8B (GQA), seq 4096 x mb 2
"""
from __future__ import annotations

import torch

from common import record_tables, time_ms, token_args

SHAPES = {  # name: (query heads, key/value groups, head dim) per tensor-parallel rank
    "llama2_13b-tp2": (20, 20, 128),
    "llama3.1_8b": (32, 8, 128),
}


def main(argv=None) -> None:
    opts = token_args(__doc__, "bench_rope.py", argv)
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_int8.ops.rope import fused_rope

    S, B = opts.seq, opts.micro_batch
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, seq {S} x micro-batch {B}, bf16, "
          f"q then k, forward + backward")
    lines = ["| shape | megatron unfused ms | fused ms | speedup | fused GB/s |", "|---|---|---|---|---|"]
    print("\n".join(lines))
    for name, (heads, groups, dim) in SHAPES.items():
        qkv = torch.randn(S, B, heads + 2 * groups, dim, device="cuda", dtype=torch.bfloat16)
        freqs = (torch.arange(S, device="cuda", dtype=torch.float32)[:, None]
                 * 10000.0 ** (-torch.arange(0, dim, 2, device="cuda") / dim)).repeat(1, 2)[:, None, None, :]
        grads = [torch.randn(S, B, n, dim, device="cuda", dtype=torch.bfloat16) for n in (heads, groups)]

        def step(apply):
            q = qkv[:, :, :heads].detach().requires_grad_(True)
            k = qkv[:, :, heads:heads + groups].detach().requires_grad_(True)
            torch.autograd.backward([apply(q, freqs), apply(k, freqs)], grads)

        unfused = time_ms(lambda: step(_apply_rotary_pos_emb_bshd), 5, opts.iters)
        fused = time_ms(lambda: step(fused_rope), 5, opts.iters)
        moved = 2 * 2 * S * B * (heads + groups) * dim * 2  # (read + write) x (fwd + bwd), 2 bytes each
        lines.append(f"| {name} | {unfused:.3f} | {fused:.3f} | {unfused / fused:.2f}x | {moved / fused / 1e6:.0f} |")
        print(lines[-1], flush=True)
    record_tables("rope", "\n".join(lines))


if __name__ == "__main__":
    main()
