#!/usr/bin/env python3
"""Convert a checkpoint of the trainer (any TP/PP/EP layout) to a Hugging Face transformers checkpoint.

    python3 scripts/export_hf.py --load runs/tiny/checkpoints --output runs/tiny/hf [--dtype bfloat16]

Writes config.json, model.safetensors, generation_config.json and the tokenizer (a SentencePiece model
is converted to tokenizer.json, which must encode a set of probe texts as SentencePiece does or the export
stops; needs `pip install transformers protobuf`; --no-tokenizer leaves it out). Llama2/Llama3.1
(LlamaForCausalLM), Qwen3 (Qwen3ForCausalLM) and Mixtral (MixtralForCausalLM); see
megatron_int8/training/export.py.
"""
import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the --save directory of a training run")
    parser.add_argument("--output", required=True, help="directory for the transformers checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokenizer-model", default=None, help="where the checkpoint's tokenizer is, if moved")
    parser.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                        help="export the model alone, no tokenizer files (the tokenizer is still read for the "
                             "special ids config.json names)")
    parser.add_argument("--ckpt-step", type=int, default=None, help="the iteration to export (default: the latest)")
    parser.add_argument("--force", action="store_true", help="write into an --output folder that is not empty "
                                                             "(its files of the same names are replaced)")
    args = parser.parse_args(argv)
    if os.path.isdir(args.output) and os.listdir(args.output) and not args.force:
        parser.error(f"--output {args.output} is not empty: give a new directory, or --force to write into it")

    from megatron_int8.training.known_warnings import filter_known_warnings

    filter_known_warnings()
    from megatron_int8.training.cpu import install_cpu_optimizer_support

    install_cpu_optimizer_support()
    from megatron_int8.training.args import ArgumentError
    from megatron_int8.training.checkpoint import CheckpointError
    from megatron_int8.training.export import ExportError, export_hf
    from megatron_int8.training.safe_load import UnsafeCheckpointError
    from megatron_int8.training.validation import nearest_existing, unwritable_reason

    existing = nearest_existing(args.output)  # before the weights load: the staging folder is made beside --output
    if not os.path.isdir(existing):
        print(f"error: --output {args.output}: {existing} is a file; the export writes a directory", file=sys.stderr)
        return 2
    for folder in (os.path.dirname(os.path.abspath(args.output)), args.output):  # the staging folder's, the output
        reason = unwritable_reason(folder)
        if reason:
            print(f"error: --output {args.output}: {reason}", file=sys.stderr)
            return 2
    try:
        export_hf(args.load, args.output, args.dtype, tokenizer_model=args.tokenizer_model, ckpt_step=args.ckpt_step,
                  tokenizer=args.tokenizer)
    except (ArgumentError, ExportError, CheckpointError, UnsafeCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
