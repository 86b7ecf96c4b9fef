"""A Hugging Face transformers LlamaForCausalLM of about 1.1B parameters (TinyLlama-1.1B's shape: a config and
random init, no downloads) trained a few steps on one GPU: INT8 (convert_to_int8_training) vs BF16, tokens/s,
eager and compiled.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_hf_llama.py [--seq 2048] [--micro-batch 4] [--iters 10]
    PYTHONUNBUFFERED=1 python3 benchmarks/bench_hf_llama.py --shape-policy auto    # BF16 where INT8 loses

A step is forward (no KV cache), backward and AdamW on bf16 parameters, random token ids. "compiled" compiles
each decoder layer (`layer.compile()`, the regional compilation torchtitan uses: one compilation serves every
layer); --full-compile compiles the whole model instead (minutes longer). Appends to
benchmarks/results/hf_llama.csv ($OUT/hf_llama.csv on the GPU machine). About 3 minutes on an H100.
"""
from __future__ import annotations

import argparse

import torch

import common  # noqa: F401  (puts the repository on sys.path)
from common import append_results, positive_int, require_cuda, time_ms

from megatron_int8 import Int8Recipe, convert_to_int8_training  # noqa: E402

VARIANTS = ("bf16 eager", "int8 eager", "bf16 compiled", "int8 compiled")


def build(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    with torch.device("cuda"):  # random init on the GPU: seconds instead of a minute on the host
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--full-compile", action="store_true")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--shape-policy", choices=("int8", "auto"), default="int8",
                   help="the INT8 runs' Int8Recipe.shape_policy; auto labels them 'int8-auto' (a first eager step "
                        "times each shape, before any compile)")
    opts = p.parse_args(argv)
    require_cuda(__file__)
    # a layer that recompiles past Dynamo's limit runs eager from then on, silently: a "compiled" figure must not
    # hold eager layers (the KV cache of a default forward made every layer recompile, so that all but 8 ran eager)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    ids = torch.randint(0, 32000, (opts.micro_batch, opts.seq), device="cuda")
    tokens = ids.numel()
    result = {}
    for variant in opts.variants:
        precision, mode = variant.split()
        model = build()
        if precision == "int8":
            convert_to_int8_training(model, Int8Recipe(shape_policy=opts.shape_policy))
            if opts.shape_policy == "auto":
                variant = f"int8-auto {mode}"
                # decides per shape; compiled graphs reuse it
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                model.zero_grad(set_to_none=True)
        n_params = sum(p.numel() for p in model.parameters())
        if mode == "compiled":
            if opts.full_compile:
                model.compile()
            else:
                for layer in model.model.layers:
                    layer.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = time_ms(step, warmup=3, iters=opts.iters)
        result[variant] = tokens / (ms / 1e3)
        print(f"{variant}: {ms:.1f} ms per step, {result[variant]:.0f} tokens/s ({n_params / 1e9:.2f}B parameters)",
              flush=True)
        del model, opt
        torch.cuda.empty_cache()
    lines = ["| variant | tokens/s | vs BF16, same mode |", "|---|---|---|"]
    rows = []
    for v, tps in result.items():
        ref = result.get(f"bf16 {v.split()[1]}")
        ratio = tps / ref if ref else None  # None: BF16 of the same mode was not run in this process
        lines.append(f"| {v} | {tps:.0f} | {f'{ratio:.3f}x' if ratio else 'n/a'} |")
        rows.append({"variant": v, "seq": opts.seq, "micro_batch": opts.micro_batch, "full_compile": opts.full_compile,
                     "tokens_per_s": round(tps), "vs_bf16": round(ratio, 4) if ratio else ""})
    print(f"\nLlamaForCausalLM ~1.1B, micro-batch {opts.micro_batch} x {opts.seq}, {torch.cuda.get_device_name()}\n"
          + "\n".join(lines))
    append_results("hf_llama", rows)


if __name__ == "__main__":
    main()
