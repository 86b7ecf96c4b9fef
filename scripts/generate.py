#!/usr/bin/env python3
"""Sample text from a checkpoint of the trainer (megatron-core's static KV cache, one process, CPU or GPU).

    python3 scripts/generate.py --load runs/tiny/checkpoints --prompt "def main(" [--max-new-tokens 64]
        [--temperature 0.8 --top-p 0.9 --seed 1] [--int8 | --bf16-linears] [--bf16] [--ckpt-step N]

Greedy by default (--temperature 0). The linears run as the checkpoint's run trained them (INT8 with
--int8-linear) unless --int8 / --bf16-linears says otherwise; --bf16 runs the model in BF16. The prompt and
the new tokens must fit the model's context (its --max-position-embeddings): a longer request is an error.
"""
import argparse
import math
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the --save directory of a training run")
    parser.add_argument("--ckpt-step", type=int, default=None, help="the iteration to load (default: the latest)")
    parser.add_argument("--prompt", required=True, help="the text to continue (a checkpoint trained on mock data, with "
                                                         "its NullTokenizer, takes space-separated token ids)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="(default: 64, or fewer where the model's context leaves less room after the prompt)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                                 "whose probabilities reach this (default: 1)")
    parser.add_argument("--seed", type=int, default=None, help="with --temperature > 0: the sampling seed (default: 0)")
    linears = parser.add_mutually_exclusive_group()
    linears.add_argument("--int8", dest="int8", action="store_true", default=None, help="INT8 linears")
    linears.add_argument("--bf16-linears", dest="int8", action="store_false", help="BF16 (high-precision) linears")
    parser.add_argument("--bf16", action="store_true", default=None, help="run the model in BF16")
    parser.add_argument("--tokenizer-model", default=None, help="where the checkpoint's tokenizer is, if moved")
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("--prompt is empty: give the text to continue")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed is not None and not 0 <= args.seed < 2 ** 64:  # torch's generator failed once the model was loaded
        parser.error(f"--seed must be in [0, 2**64), got {args.seed}")
    if args.temperature == 0 and (args.top_p != 1.0 or args.seed is not None):
        parser.error("--top-p and --seed apply to sampling: give --temperature > 0 (0 decodes greedily)")

    from megatron_int8.training.known_warnings import filter_known_warnings

    filter_known_warnings()
    from megatron_int8.training.cpu import install_cpu_optimizer_support

    install_cpu_optimizer_support()
    from megatron_int8.training.args import ArgumentError
    from megatron_int8.training.checkpoint import CheckpointError
    from megatron_int8.training.data import build_tokenizer
    from megatron_int8.training.inference import generate, inference_arguments, load_for_inference
    from megatron_int8.training.safe_load import UnsafeCheckpointError

    overrides = dict(int8=args.int8, bf16=args.bf16, tokenizer_model=args.tokenizer_model, ckpt_step=args.ckpt_step)
    try:
        recorded = inference_arguments(args.load, **overrides)  # before the model: the checks need no weights
        tokenizer = build_tokenizer(recorded)
        try:
            prompt = tokenizer.tokenize(args.prompt)
        except ValueError:  # megatron's NullTokenizer reads space-separated ids
            if recorded.tokenizer_type != "NullTokenizer":
                raise
            raise ArgumentError(f"--prompt {args.prompt!r}: the checkpoint was trained on mock data (NullTokenizer), "
                                "whose prompt is space-separated token ids, e.g. --prompt '1 2 3'") from None
        outside = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]  # a NullTokenizer reads any integer
        if outside:
            raise ArgumentError(f"--prompt {args.prompt!r}: token id {outside[0]} is not in the checkpoint's "
                                f"vocabulary (ids 0 to {tokenizer.vocab_size - 1})")
        context = recorded.max_position_embeddings
        room = context - len(prompt)
        if room <= 0:
            raise ArgumentError(f"--prompt: its {len(prompt)} tokens fill the model's {context}-token context: give "
                                "a shorter prompt")
        if args.max_new_tokens is None:
            args.max_new_tokens = min(64, room)
        elif args.max_new_tokens > room:
            raise ArgumentError(f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(prompt)} tokens and the "
                                f"new ones exceed the model's {context}-token context; give --max-new-tokens {room} "
                                "or less")
        model, margs, tokenizer = load_for_inference(args.load, log=lambda m: None, **overrides)
    except (ArgumentError, CheckpointError, UnsafeCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if getattr(margs, "moe_expert_capacity_factor", None) is not None:
        print(f"note: trained with --moe-expert-capacity-factor {margs.moe_expert_capacity_factor}: an expert's "
              "capacity counts the tokens of one forward pass, so the prompt's pass may drop tokens and the "
              "one-token passes after it drop none; the tokens differ from full forward passes'", file=sys.stderr)
    new = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   eod=tokenizer.eod, vocab_size=tokenizer.vocab_size, seed=args.seed or 0)
    print(tokenizer.detokenize(prompt + [t for t in new if t != tokenizer.eod]))
    linears = "INT8" if margs.int8_linear else "BF16"
    print(f"[{len(new)} tokens, iteration {margs.iteration}, {linears} linears, "
          f"{'greedy' if args.temperature <= 0 else f'temperature {args.temperature}, top-p {args.top_p}'}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
