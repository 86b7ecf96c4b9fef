"""Upstream Megatron-LM's `pretrain_gpt.py` with INT8 layers, through upstream's own `--spec` hook: no patch.

    python -m megatron_int8.megatron_lm run MEGATRON_LM/pretrain_gpt.py [Megatron-LM flags] --int8-linear [--int8-*]
    torchrun --nproc-per-node N -m megatron_int8.megatron_lm run MEGATRON_LM/pretrain_gpt.py ...

`run` takes the `--int8-*` flags (`--int8-attention` too) off the command line, keeps them for the layers, adds
`--spec megatron_int8.megatron_lm int8_layer_spec` where `--int8-linear` is given, and runs the script as `__main__`
(its folder first on sys.path, as `python pretrain_gpt.py` would). `int8_layer_spec` is a layer spec whose layer,
`Int8TransformerLayer`, picks its own submodules when megatron builds it: dense or MoE, INT8 or BF16, from the
config, its global layer number and the `--int8-*` policy, so one static spec serves every layer, pipeline stage
and tag that has `--spec` (core_v0.16.1 through core_v0.19.0 are tested). Given to upstream directly
(`--spec megatron_int8.megatron_lm int8_layer_spec`), it runs the default recipe and policy. The block's final
norm is upstream's (`LayerNormImpl`); the embedding, output layer and MTP layers stay BF16.

`python -m megatron_int8.megatron_lm CONFIG.yaml` prints this project's YAML as Megatron-LM flags, one
per line, plus the flags a machine without Transformer Engine / APEX needs (the launchers use it).
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Callable, List, Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from .megatron.cli import INT8_ATTENTION_NEEDS_INT8_LINEAR, add_int8_arguments, policy_from_args
from .megatron.policy import Int8Policy, int8_attention_problems

# Flags of this project's trainer that Megatron-LM's pretrain_gpt.py does not have.
TRAINER_ONLY_KEYS = frozenset({"log_jsonl"})
SPEC_FLAGS = ["--spec", "megatron_int8.megatron_lm", "int8_layer_spec"]
# Upstream flags whose layers the INT8 spec does not build (upstream's --spec takes precedence over them).
UNSUPPORTED_FLAGS = (("--multi-latent-attention", "multi_latent_attention"),
                     ("--experimental-attention-variant", "experimental_attention_variant"),
                     ("--heterogeneous-layers-config-path", "heterogeneous_layers_config_path"))

# Upstream's other low-precision linears (Transformer Engine FP8 / FP4, kitchen): the INT8 spec builds none of them,
# so the run would silently train INT8 or BF16 instead.
LOW_PRECISION_FLAGS = (("--fp8-format", "fp8"), ("--fp4-format", "fp4"), ("--use-kitchen", "use_kitchen"))

_run_args: Optional[argparse.Namespace] = None  # the --int8-* flags that `run` took off the command line


def add_int8_args(chained_provider: Optional[Callable] = None) -> Callable:
    """An `extra_args_provider` that runs `chained_provider` (if any) and then adds the --int8-* flags, for a
    script that builds its own parser (upstream's pretrain_gpt.py does not need it: use `run`)."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if chained_provider is not None:
            parser = chained_provider(parser)
        return add_int8_arguments(parser)

    return provider


def _int8_parser() -> argparse.ArgumentParser:
    return add_int8_arguments(argparse.ArgumentParser(prog="megatron_int8.megatron_lm run", allow_abbrev=False,
                                                      add_help=False))


def _upstream_args():
    """Megatron-LM's parsed arguments, or None outside a Megatron-LM run."""
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def int8_args() -> argparse.Namespace:
    """The --int8-* flags of this run: `run`'s, else upstream's parsed ones where its parser has them, else the
    defaults with --int8-linear (the spec was named, so INT8 was asked for)."""
    if _run_args is not None:
        return _run_args
    upstream = _upstream_args()
    if upstream is not None and hasattr(upstream, "int8_linear"):
        return upstream
    return _int8_parser().parse_args(["--int8-linear"])


def int8_policy(args) -> Int8Policy:
    """The policy of the --int8-* flags in `args`, --int8-attention included; ValueError for values it refuses."""
    if getattr(args, "int8_attention", False) and not args.int8_linear:
        raise ValueError(INT8_ATTENTION_NEEDS_INT8_LINEAR)
    return policy_from_args(args)


def _check_upstream_flags(args, policy: Int8Policy, config) -> None:
    """Upstream flags the INT8 spec does not serve, refused when the first layer is built. INT8 attention takes its
    causal mask from the layer: upstream's data loader must not hand it a mask tensor (its default does)."""
    if args is None:
        return
    given = [flag for flag, name in UNSUPPORTED_FLAGS if getattr(args, name, None)]
    given += [flag for flag, name in LOW_PRECISION_FLAGS if getattr(args, name, None)]
    if given:
        raise ValueError(f"megatron-int8's layer spec does not build the layers of {', '.join(given)}")
    if getattr(args, "fp16", False) and policy.enabled and policy.recipe.check_finite == "deferred":
        raise ValueError("--fp16 with --int8-check-finite deferred: a step the loss scaler skips for an overflow "
                         "leaves the quantize kernels' Inf/NaN marks unread, and the next step would stop on them; "
                         "give --int8-check-finite off (the loss scaler handles overflows), or --bf16")
    sharded = [flag for flag, field in (("--tensor-parallel-num-weight-shards", "gtp_weight_remat_size"),
                                        ("--expert-tensor-parallel-num-weight-shards", "expert_gtp_weight_remat_size"))
               if (getattr(config, field, 1) or 1) > 1]
    if sharded and policy.enabled:  # megatron-core 0.19's GTP: each rank keeps a slice of every weight
        raise ValueError(f"{' and '.join(sharded)} above the tensor-parallel size (megatron-core's GTP weight "
                         "sharding) with INT8 linears: their GEMMs take whole weights; give no more shards than "
                         "--tensor-model-parallel-size, or BF16 linears")
    graphs = getattr(args, "cuda_graph_impl", None) or "none"
    if graphs != "none" and policy.enabled:
        raise ValueError(f"--cuda-graph-impl {graphs} with INT8 linears: upstream's graphs are captured without this "
                         "package's knowledge, and whether an INT8 linear reuses its cached Q(W), and its stochastic "
                         "rounding seed, are decided on the host, so replays would keep the weights of the capture; "
                         "run without CUDA graphs here (this package's trainer graphs INT8 steps: "
                         "python -m megatron_int8.pretrain --cuda-graph-impl local)")
    if not policy.recipe.int8_attention:
        return
    problems = int8_attention_problems(config.kv_channels, config.attention_dropout,
                                       getattr(args, "reset_attention_mask", False))
    if problems:
        raise ValueError("--int8-attention: " + "; ".join(text for _, text in problems))
    if getattr(args, "create_attention_mask_in_dataloader", False):
        raise ValueError("--int8-attention takes the causal mask from the layer, not a mask tensor: give upstream "
                         "--no-create-attention-mask-in-dataloader")


class Int8TransformerLayer(TransformerLayer):
    """megatron's TransformerLayer with the submodules of this package's spec for its global layer number (dense
    or MoE per `config.moe_layer_freq`, INT8 or BF16 per the policy); `submodules` given by megatron is ignored."""

    def __init__(self, config, submodules=None, layer_number: int = 1, *args, **kwargs):
        from megatron.core import parallel_state
        from megatron.core.utils import get_pg_rank

        from .megatron.spec import get_gpt_int8_layer_specs

        policy = int8_policy(int8_args())
        _check_upstream_flags(_upstream_args(), policy, config)
        vp_stage, pg_collection = kwargs.get("vp_stage"), kwargs.get("pg_collection")
        pp_rank = (get_pg_rank(pg_collection.pp) if pg_collection is not None
                   else parallel_state.get_pipeline_model_parallel_rank())
        index = layer_number - 1 + get_transformer_layer_offset(config, vp_stage, pp_rank)
        spec = get_gpt_int8_layer_specs(config, policy, qk_l2_norm=config.qk_l2_norm)[index]
        super().__init__(config, spec.submodules, layer_number, *args, **kwargs)


int8_layer_spec = ModuleSpec(module=Int8TransformerLayer)


def get_gpt_int8_spec_from_args(args, config, vp_stage: Optional[int] = None):
    """The INT8 decoder block spec of this pipeline (and virtual pipeline) stage, from Megatron-LM-style args
    (for a script that builds GPTModel itself; `run` needs none of this)."""
    from .megatron.spec import get_gpt_int8_block_spec

    policy = int8_policy(args)
    _check_upstream_flags(args, policy, config)
    return get_gpt_int8_block_spec(config, policy, vp_stage=vp_stage,
                                   normalization=args.normalization, qk_l2_norm=getattr(args, "qk_l2_norm", False))


def check_nonfinite_before_each_step(policy: Int8Policy) -> Optional[object]:
    """With INT8 linears and check_finite "deferred" (the default), the quantize kernels only mark a tensor that
    held Inf/NaN; this package's trainer reads the marks once per step. Upstream's loop does not know them, so a
    hook before every optimizer step reads them, raising NonFiniteError naming the tensors (upstream would only
    see a NaN loss or gradient norm). Returns the hook's handle (None where there is nothing to check)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .reference import raise_if_nonfinite

    if not (policy.enabled and policy.recipe.check_finite == "deferred"):
        return None
    return register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: raise_if_nonfinite())


def run(argv: List[str]) -> None:
    """Run upstream's pretrain_gpt.py (argv[0]) with the rest of argv, the --int8-* flags taken out (see above)."""
    global _run_args
    if not argv or not argv[0].endswith(".py") or not os.path.isfile(argv[0]):
        raise SystemExit("usage: python -m megatron_int8.megatron_lm run MEGATRON_LM/pretrain_gpt.py [flags] "
                         f"--int8-linear [--int8-* flags]; {argv[0] if argv else 'no script'} is not a file")
    script = os.path.abspath(argv[0])
    flags, upstream_argv = _int8_parser().parse_known_args(argv[1:])
    try:
        policy = int8_policy(flags)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    check_nonfinite_before_each_step(policy)
    if flags.int8_linear:
        if "--spec" in upstream_argv:
            raise SystemExit("error: --int8-linear sets upstream's --spec to megatron-int8's layer spec; "
                             "drop --spec or --int8-linear")
        upstream_argv += SPEC_FLAGS
    _run_args = flags
    sys.argv = [script] + upstream_argv
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def yaml_to_argv(path: str) -> List[str]:
    """A config YAML as command-line flags: `true` -> the flag, `false` -> the flag that sets the opposite (none
    where that is the default, as the trainer reads it), null -> omitted, lists -> values.

    Keys are checked against this trainer's flags first (typos fail with suggestions); keys that only
    this trainer has are dropped.
    """
    import yaml

    from .training.args import build_parser, load_yaml_defaults
    from .training.parsing import _option_actions

    parser = build_parser()
    load_yaml_defaults(path, parser)  # validates every key and value
    actions = _option_actions(parser)
    with open(path, encoding="utf-8") as f:
        content = yaml.safe_load(f) or {}
    argv: List[str] = []
    for key, value in content.items():
        name = str(key).lstrip("-").replace("_", "-")
        if name.replace("-", "_") in TRAINER_ONLY_KEYS or value is None:
            continue
        if value is False:
            action = actions[name.replace("-", "_")]
            wanted = not action.const
            if wanted == parser.get_default(action.dest):
                continue
            argv.append(next(option for a in parser._actions if a.dest == action.dest and a.const is wanted
                             for option in a.option_strings))
        elif value is True:
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
    if importlib.util.find_spec("apex") is None:
        argv.append("--no-persist-layer-norm")  # upstream's torch final norm refuses it (APEX's kernel)
    return argv


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        run(argv[1:])
        return 0
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
    # through the importable module, so that upstream's --spec import finds the flags `run` kept there
    from megatron_int8.megatron_lm import main as importable_main

    sys.exit(importable_main())
