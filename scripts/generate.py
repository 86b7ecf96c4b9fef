#!/usr/bin/env python3
"""Sample text from a checkpoint of the trainer (megatron-core's static KV cache, one process, CPU or GPU).

    python3 scripts/generate.py --load runs/tiny/checkpoints --prompt "def main(" [--max-new-tokens 64]
        [--temperature 0.8 --top-p 0.9 --seed 1] [--int8 | --bf16-linears] [--bf16]

Greedy by default (--temperature 0). The linears run as the checkpoint's run trained them (INT8 with
--int8-linear) unless --int8 / --bf16-linears says otherwise; --bf16 runs the model in BF16.
"""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the --save directory of a training run")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                                 "whose probabilities reach this")
    parser.add_argument("--seed", type=int, default=0)
    linears = parser.add_mutually_exclusive_group()
    linears.add_argument("--int8", dest="int8", action="store_true", default=None, help="INT8 linears")
    linears.add_argument("--bf16-linears", dest="int8", action="store_false", help="BF16 (high-precision) linears")
    parser.add_argument("--bf16", action="store_true", default=None, help="run the model in BF16")
    parser.add_argument("--tokenizer-model", default=None, help="where the checkpoint's tokenizer is, if moved")
    args = parser.parse_args(argv)
    if not 0.0 < args.top_p <= 1.0:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")

    from megatron_int8.training.cpu import install_cpu_optimizer_support

    install_cpu_optimizer_support()
    from megatron_int8.training.inference import generate, load_for_inference

    model, margs, tokenizer = load_for_inference(args.load, int8=args.int8, bf16=args.bf16,
                                                 tokenizer_model=args.tokenizer_model, log=lambda m: None)
    prompt = tokenizer.tokenize(args.prompt)
    new = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   eod=tokenizer.eod, vocab_size=tokenizer.vocab_size, seed=args.seed)
    print(tokenizer.detokenize(prompt + [t for t in new if t != tokenizer.eod]))
    linears = "INT8" if margs.int8_linear else "BF16"
    print(f"[{len(new)} tokens, iteration {margs.iteration}, {linears} linears, "
          f"{'greedy' if args.temperature <= 0 else f'temperature {args.temperature}, top-p {args.top_p}'}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
