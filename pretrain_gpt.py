"""Megatron-LM-style entry point: `torchrun ... pretrain_gpt.py <Megatron-LM flags> [--int8-linear]`.

A thin wrapper over `megatron_int8.pretrain` (the same trainer as `python -m megatron_int8.pretrain`).
"""
import sys

from megatron_int8.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
