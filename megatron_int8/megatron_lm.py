"""Hooks for an upstream Megatron-LM checkout (tag core_v0.16.1) and its `pretrain_gpt.py`.

`patches/megatron-lm-core_v0.16.1.patch` (docs/megatron-lm.md) makes two edits that call into here:
  pretrain_gpt.py:   extra_args_provider=add_int8_args(<the provider it had, e.g. ModelOpt's>)
  gpt_builders.py:   with --int8-linear, transformer_layer_spec = get_gpt_int8_spec_from_args(...)

`python -m megatron_int8.megatron_lm CONFIG.yaml` prints this project's YAML as Megatron-LM flags, one
per line, plus the flags a machine without Transformer Engine / APEX needs (the launchers use it).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional

from .megatron.cli import add_int8_arguments, policy_from_args

# Flags of this project's trainer that Megatron-LM's pretrain_gpt.py does not have.
TRAINER_ONLY_KEYS = frozenset({"log_jsonl"})
SUPPORTED_MEGATRON_CORE = "0.16"


def add_int8_args(chained_provider: Optional[Callable] = None) -> Callable:
    """An `extra_args_provider` that runs `chained_provider` (if any) and then adds the --int8-* flags."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if chained_provider is not None:
            parser = chained_provider(parser)
        return add_int8_arguments(parser)

    return provider


def get_gpt_int8_spec_from_args(args, config, vp_stage: Optional[int] = None):
    """The INT8 decoder block spec of this pipeline (and virtual pipeline) stage, from Megatron-LM args.

    Covers dense and MoE GPT layers; per-layer precision follows the --int8-* policy flags.
    """
    import megatron.core

    from .megatron.spec import get_gpt_int8_block_spec

    if not megatron.core.__version__.startswith(SUPPORTED_MEGATRON_CORE):
        raise RuntimeError(f"megatron-int8 supports megatron-core {SUPPORTED_MEGATRON_CORE}.x (Megatron-LM "
                           f"core_v0.16.1), found {megatron.core.__version__}")
    unsupported = [flag for flag, on in (
        ("--multi-latent-attention", getattr(args, "multi_latent_attention", False)),
        ("--experimental-attention-variant", getattr(args, "experimental_attention_variant", None)),
        ("--heterogeneous-layers-config-path", getattr(args, "heterogeneous_layers_config_path", None)),
        ("--spec", getattr(args, "spec", None)),
    ) if on]
    if unsupported:
        raise ValueError(f"--int8-linear does not support {', '.join(unsupported)}")
    return get_gpt_int8_block_spec(config, policy_from_args(args), vp_stage=vp_stage,
                                   normalization=args.normalization, qk_l2_norm=getattr(args, "qk_l2_norm", False))


def yaml_to_argv(path: str) -> List[str]:
    """A config YAML as command-line flags: `true` -> bare flag, `false`/null -> omitted, lists -> values.

    Keys are checked against this trainer's flags first (typos fail with suggestions); keys that only
    this trainer has are dropped.
    """
    import yaml

    from .training.args import build_parser, load_yaml_defaults

    load_yaml_defaults(path, build_parser())  # validates every key and value
    with open(path, encoding="utf-8") as f:
        content = yaml.safe_load(f) or {}
    argv: List[str] = []
    for key, value in content.items():
        name = str(key).lstrip("-").replace("_", "-")
        if name.replace("-", "_") in TRAINER_ONLY_KEYS or value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, list):
            argv += [f"--{name}"] + [str(v) for v in value]
        else:
            argv += [f"--{name}", str(value)]
    return argv


def environment_argv() -> List[str]:
    """Flags Megatron-LM needs where Transformer Engine or APEX's fused wgrad extension is missing
    (its defaults assume both)."""
    import importlib.util

    argv = []
    if importlib.util.find_spec("transformer_engine") is None:
        argv += ["--transformer-impl", "local", "--no-rope-fusion"]
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        argv.append("--no-gradient-accumulation-fusion")
    return argv


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Print a megatron-int8 YAML config as Megatron-LM flags.")
    parser.add_argument("config", help="YAML file (configs/*.yaml)")
    parser.add_argument("--no-environment-flags", action="store_true",
                        help="omit the flags for a machine without Transformer Engine / APEX")
    args = parser.parse_args(argv)
    from .training.args import ArgumentError

    try:
        flags = yaml_to_argv(args.config)
    except ArgumentError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.no_environment_flags:
        flags += environment_argv()
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
