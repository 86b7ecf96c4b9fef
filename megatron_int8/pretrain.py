"""Pretrain a GPT model with megatron-core and INT8 linears.

    python -m megatron_int8.pretrain --config configs/tiny.yaml --int8-linear ...
    torchrun --nproc-per-node 8 -m megatron_int8.pretrain --config configs/llama3.1_8b.yaml ...

Flags follow Megatron-LM's `pretrain_gpt.py` (see `--help`); `--config FILE.yaml` takes the same
names as keys. Also installed as the `megatron-int8-pretrain` console script.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Before anything imports megatron: on a CPU-only machine megatron's optimizer modules are loaded
    # with their CUDA device literals rewritten (no effect with CUDA).
    from megatron_int8.training.known_warnings import filter_known_warnings

    filter_known_warnings()
    from megatron_int8.training.cpu import install_cpu_optimizer_support

    install_cpu_optimizer_support()
    from megatron_int8.training.args import ArgumentError, parse_args, validate_args

    try:
        # the flags are checked before megatron and the trainer are imported, so a wrong one is named in a moment
        args = validate_args(parse_args(argv), int(os.environ.get("WORLD_SIZE", "1")))
    except ArgumentError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted before training started", file=sys.stderr, flush=True)
        return 130
    from megatron_int8.training.checkpoint import CheckpointError
    from megatron_int8.training.loop import Interrupted, pretrain
    from megatron_int8.training.safe_load import UnsafeCheckpointError

    try:
        pretrain(args)
    except (ArgumentError, CheckpointError, UnsafeCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as err:  # one line, not the traceback of wherever Ctrl-C landed
        print(str(err) if isinstance(err, Interrupted) else "interrupted before training started", file=sys.stderr,
              flush=True)
        return 130
    finally:
        from megatron_int8.training.model import destroy_distributed

        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
