"""validate_args: derived defaults filled as Megatron-LM fills them, and inconsistent settings rejected.

It runs before anything expensive, so that a bad layout or a missing file fails in the first second with a
message that names the fix; a value the YAML set is named with its file (parsing.origin). The data files'
contents and the vocabulary are checked once the tokenizer is built (data.py).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import List, Optional

from ..megatron.cli import INT8_ATTENTION_NEEDS_INT8_LINEAR
from ..megatron.policy import int8_attention_problems
from ..recipe import DEFAULT_ATTENTION_SCORES
from .data import check_tokenizer_file
from .errors import ArgumentError
from .flags import TOKENIZER_TYPES, build_parser
from .health import per_gemm_limits
from .parsing import origin

OPTIMIZER_STATE_DTYPES = ("fp32", "bf16", "int8")  # what the precision-aware optimizer stores


def _require(args, names: List[str]) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        raise ArgumentError(f"missing required argument(s): {', '.join(missing)}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require_finite(args: argparse.Namespace, names, positive: bool) -> None:
    """Each setting finite and positive (or >= 0): NaN passes a plain "< 0" test (--clip-grad nan turned clipping
    off, a NaN epsilon or loss coefficient reached the model)."""
    for name in names:
        value = getattr(args, name)
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            raise ArgumentError(f"{_flag(name)} {value}{origin(args, name)}: must be "
                                f"{'a positive number' if positive else '>= 0'}")


def _validate_numbers(args: argparse.Namespace) -> None:
    """Sizes, rates and seeds that megatron or torch would reject only after the model is built (or, for some,
    never: --vocab-size 0 trained on one token, --recompute-num-layers 0 looped forever)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "global_batch_size", "kv_channels", "ffn_hidden_size", "moe_ffn_hidden_size", "vocab_size",
                 "num_experts", "recompute_num_layers", "make_vocab_size_divisible_by",
                 "distributed_timeout_minutes"):
        value = getattr(args, name)
        if value is not None and value <= 0 and not (name == "train_iters" and args.skip_train):
            raise ArgumentError(f"{_flag(name)} {value}{origin(args, name)}: must be positive")
    if args.group_query_attention and args.num_query_groups <= 0:
        raise ArgumentError(f"--num-query-groups {args.num_query_groups}{origin(args, 'num_query_groups')}: must be "
                            "positive")
    if args.num_workers < 0:
        raise ArgumentError(f"--num-workers {args.num_workers}{origin(args, 'num_workers')}: must be >= 0")
    for name in ("seed", "data_seed"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 2 ** 32:
            raise ArgumentError(f"{_flag(name)} {value}{origin(args, name)}: must be in [0, 2**32) (numpy's seeds)")
    last_stage_seed = args.seed + 100 * (args.pipeline_model_parallel_size - 1)  # model.set_random_seed's
    if last_stage_seed >= 2 ** 32:
        raise ArgumentError(f"--seed {args.seed}{origin(args, 'seed')}: pipeline stage k seeds with seed + 100 k, "
                            f"so it must be below 2**32 - {100 * (args.pipeline_model_parallel_size - 1)}")
    for name in ("attention_dropout", "hidden_dropout"):
        value = getattr(args, name)
        if not 0 <= value <= 1:  # NaN fails too
            raise ArgumentError(f"{_flag(name)} {value}{origin(args, name)}: must be in [0, 1]")
    # the RoPE and norm numbers reached the model unchecked: NaN in the first step's gradients (a base or scaling
    # factor of 0, a negative epsilon), no rotation at all (--rotary-percent 0), or a NaN loss (aux-loss coefficient)
    _require_finite(args, ("init_method_std", "rotary_base", "rope_scaling_factor"), positive=True)
    _require_finite(args, ("norm_epsilon", "moe_aux_loss_coeff"), positive=False)
    if not 0 < args.rotary_percent <= 1:
        raise ArgumentError(f"--rotary-percent {args.rotary_percent}{origin(args, 'rotary_percent')}: must be in "
                            "(0, 1], the fraction of each head's dimensions that RoPE rotates")


def _validate_moe_capacity(args: argparse.Namespace) -> None:
    """megatron's expert capacity (--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity), refused here
    where megatron's TransformerConfig would fail later or quietly read a negative factor as none."""
    factor, pad = args.moe_expert_capacity_factor, args.moe_pad_expert_input_to_capacity
    if args.num_experts is None:
        given = [flag for flag, on in (("--moe-expert-capacity-factor", factor is not None),
                                       ("--moe-pad-expert-input-to-capacity", pad)) if on]
        if given:
            raise ArgumentError(f"{' and '.join(given)}: {'they apply' if len(given) > 1 else 'it applies'} to MoE "
                                "layers only: give --num-experts N")
        return
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        raise ArgumentError(f"--moe-expert-capacity-factor {factor}{origin(args, 'moe_expert_capacity_factor')}: "
                            "must be a positive number (tokens per expert as a multiple of an even share)")
    if pad and factor is None:
        raise ArgumentError("--moe-pad-expert-input-to-capacity pads every expert's input to its capacity: it needs "
                            "--moe-expert-capacity-factor F")
    if factor is not None and args.moe_router_load_balancing_type == "sinkhorn":
        raise ArgumentError(f"--moe-expert-capacity-factor needs --moe-router-load-balancing-type aux_loss, "
                            f"seq_aux_loss or none, not sinkhorn"
                            f"{origin(args, 'moe_router_load_balancing_type')} (megatron drops tokens by the "
                            "auxiliary-loss routers' probabilities)")


def _moe_graph_problem(args) -> Optional[str]:
    """Why a captured step cannot hold this run's MoE layers, or None.

    Dropless routing sends each expert a different number of tokens every step, and the dispatcher and the experts
    size their buffers from those counts, which the host reads: a replay would reuse the capture's sizes. With every
    expert's input padded to a fixed capacity the sizes are the same at every step, and the alltoall dispatcher and
    the experts take them from shapes (`megatron.experts.padded_expert_capacity`); megatron's allgather dispatcher
    still copies its counts to the host (`.cpu()` in its dispatch, megatron-core 0.16.1 and 0.19.2)."""
    if args.num_experts is None:
        return None
    if args.moe_expert_capacity_factor is None or not args.moe_pad_expert_input_to_capacity:
        return ("MoE layers (--num-experts) route a different number of tokens to each expert every step; give "
                "every expert a fixed capacity with --moe-expert-capacity-factor F "
                "--moe-pad-expert-input-to-capacity (tokens beyond F x an even share are dropped, the rest padded)")
    if args.moe_token_dispatcher_type != "alltoall":
        return (f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} copies its token counts to the host "
                "every step; use alltoall")
    return None


def _validate_cuda_graph(args: argparse.Namespace) -> None:
    """--cuda-graph-impl local replays one captured step: nothing in it may depend on the host at run time."""
    if args.cuda_graph_impl == "none":
        return
    import torch

    if args.cuda_graph_warmup_steps < 1:
        raise ArgumentError(f"--cuda-graph-warmup-steps must be >= 1 (autotuning and compilation run eagerly), "
                            f"got {args.cuda_graph_warmup_steps}")
    reasons = {
        "--int8-grad-rounding stochastic draws its seeds on the host at every call":
            getattr(args, "int8_grad_rounding", "nearest") == "stochastic",
        "--int8-check-finite immediate synchronizes with the host inside the step":
            getattr(args, "int8_check_finite", "deferred") == "immediate",
        "--fp8-peer is not supported": getattr(args, "fp8_peer", None) is not None,
        "it needs a CUDA GPU": not torch.cuda.is_available(),
    }
    problems = [_moe_graph_problem(args)] + [reason for reason, applies in reasons.items() if applies]
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ArgumentError(f"--cuda-graph-impl local: {problem}")


def _settle_skip_train(args: argparse.Namespace) -> None:
    """--skip-train evaluates a checkpoint: it needs --load and evaluation batches, loads no optimizer state,
    and no schedule; Megatron-LM's rules."""
    if not args.load:
        raise ArgumentError("--skip-train evaluates a checkpoint: give --load DIR")
    if args.eval_iters <= 0:
        raise ArgumentError("--skip-train evaluates --eval-iters batches per split: give --eval-iters > 0")
    args.no_load_optim = True
    args.save = None  # nothing is trained, so nothing is saved (nor on a signal)
    args.exit_signal_handler = False
    args.train_iters = args.train_iters if args.train_iters is not None else 0
    args.lr = args.lr if args.lr is not None else 0.0


def _changed_settings(args: argparse.Namespace, defaults: argparse.ArgumentParser, prefix: str, exclude=()) -> list:
    """The flags of `prefix` whose values differ from the parser's defaults (given, or set by the config)."""
    return [f"--{name.replace('_', '-')}" for name in sorted(vars(args))
            if name.startswith(prefix) and name not in exclude and getattr(args, name) != defaults.get_default(name)]


def _warn_silent_choices(args: argparse.Namespace) -> None:
    """A note for settings that are valid but probably not what was meant."""
    defaults = build_parser()
    # settings a switch turns on, set without it: each was read and dropped without a word
    for changed, without in ((_changed_settings(args, defaults, "moe_") if args.num_experts is None else [],
                              "--num-experts (the model is dense)"),
                             (_changed_settings(args, defaults, "profile_") if not args.profile else [],
                              "--profile (nothing is profiled)")):
        if changed:
            print(f"note: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect without {without}",
                  flush=True)
    if not args.int8_linear:
        changed = _changed_settings(args, defaults, "int8_", exclude=("int8_linear", "int8_precision_table"))
        if changed:
            print(f"note: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect without "
                  "--int8-linear (the linears run in BF16)", flush=True)
    elif args.int8_granularity == "tensor" and args.int8_grad_rounding == "nearest":
        print("warning: --int8-granularity tensor with --int8-grad-rounding nearest: one scale per gradient "
              "tensor rounds most of its entries to zero, and training diverged from BF16 in docs/convergence.md; "
              "use --int8-grad-rounding stochastic, or row granularity (the default)", flush=True)


def _validate_schedule(args: argparse.Namespace, decay_given: bool) -> None:
    """The optimizer's and the LR schedule's numbers, each error naming where a value came from."""
    _require_finite(args, ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad", "lr_warmup_iters"),
                    positive=False)
    if args.lr == 0:
        raise ArgumentError(f"--lr 0{origin(args, 'lr')}: must be positive (a learning rate of 0 trains nothing: the "
                            "weights stay as they are)")
    if args.lr_warmup_init > args.lr:
        raise ArgumentError(f"--lr-warmup-init {args.lr_warmup_init}{origin(args, 'lr_warmup_init')} is above --lr "
                            f"{args.lr}{origin(args, 'lr')}: the warm-up rises from it to --lr; give --lr-warmup-init "
                            "<= --lr")
    for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
        if not 0 <= getattr(args, name) < 1:
            raise ArgumentError(f"{_flag(name)} {getattr(args, name)}{origin(args, name)}: must be in [0, 1)")
    if not (math.isfinite(args.adam_eps) and args.adam_eps > 0):
        raise ArgumentError(f"--adam-eps {args.adam_eps}{origin(args, 'adam_eps')}: must be positive")
    if args.lr_decay_iters <= 0:
        raise ArgumentError(f"--lr-decay-iters {args.lr_decay_iters}{origin(args, 'lr_decay_iters')}: must be "
                            "positive")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        decay = (f"--lr-decay-iters {args.lr_decay_iters}{origin(args, 'lr_decay_iters')}" if decay_given else
                 f"--train-iters {args.train_iters}{origin(args, 'train_iters')} (the default --lr-decay-iters)")
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters}{origin(args, 'lr_warmup_iters')} must be "
                            f"below {decay}: give --lr-warmup-iters below {args.lr_decay_iters}, or a longer "
                            "schedule")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr}{origin(args, 'min_lr')} is above --lr {args.lr}"
                            f"{origin(args, 'lr')}: give --min-lr <= --lr")


def _validate_int8_health(args: argparse.Namespace) -> None:
    if args.int8_stats_interval < 0:
        raise ArgumentError(f"--int8-stats-interval must be >= 0, got {args.int8_stats_interval}")
    if args.int8_stats_interval and not args.int8_linear:
        raise ArgumentError("--int8-stats-interval measures INT8 linears: it needs --int8-linear")
    if args.int8_auto_fallback and not args.int8_stats_interval:
        raise ArgumentError("--int8-auto-fallback decides from the statistics: it needs --int8-stats-interval N")
    try:  # the thresholds' own rule
        per_gemm_limits("--int8-fallback-max-rel-err", args.int8_fallback_max_rel_err, math.inf)
        per_gemm_limits("--int8-fallback-max-underflow", args.int8_fallback_max_underflow, 1.0)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    if args.int8_fallback_patience < 1:
        raise ArgumentError(f"--int8-fallback-patience must be >= 1, got {args.int8_fallback_patience}")
    if not args.int8_fallback_max_attention_rel_err > 0:
        raise ArgumentError(f"--int8-fallback-max-attention-rel-err must be positive, got "
                            f"{args.int8_fallback_max_attention_rel_err}")


def _validate_int8_modules(args: argparse.Namespace) -> None:
    """What the INT8 model's build or first step would refuse (the backend, the memory options' modules), and
    the layer counts that only apply with --int8-first-last-layers-bf16."""
    if not args.int8_linear:
        return
    import torch

    from ..dispatch import resolve_backend_name
    from ..recipe import Int8Recipe

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolve_backend_name(device, Int8Recipe(backend=args.int8_backend))
    except (ImportError, ValueError) as err:
        from ..dispatch import ENV_BACKEND

        given = (f"{ENV_BACKEND}={os.environ[ENV_BACKEND].strip()}" if os.environ.get(ENV_BACKEND, "").strip()
                 else f"--int8-backend {args.int8_backend}")
        raise ArgumentError(f"{given}: {err}; the backend 'auto' picks what runs here") from None
    if args.int8_swiglu_input and not (args.swiglu and args.fused_swiglu and args.num_experts is None):
        raise ArgumentError("--int8-swiglu-input keeps the input of the fused SwiGLU of dense MLPs: it needs "
                            "--swiglu, no --no-fused-swiglu and no --num-experts")
    if args.int8_norm_input and args.normalization != "RMSNorm":
        raise ArgumentError(f"--int8-norm-input keeps the RMSNorms' input in INT8: it needs --normalization "
                            f"RMSNorm, got {args.normalization}")
    if not args.int8_first_last_layers_bf16:
        given = [f"--int8-num-layers-at-{end}-in-bf16" for end in ("start", "end")
                 if getattr(args, f"int8_num_layers_at_{end}_in_bf16") != 1]
        if given:
            print(f"note: {' and '.join(given)} apply with --int8-first-last-layers-bf16 only: every layer runs "
                  "INT8", flush=True)


def _validate_int8_attention(args: argparse.Namespace) -> None:
    """--int8-attention serves causal self-attention only: what it cannot serve fails here, in one line, never
    by a silent fallback to BF16 attention."""
    scores = getattr(args, "int8_attention_scores", None)
    if scores is not None and not args.int8_attention:
        raise ArgumentError(f"--int8-attention-scores {scores} sets the INT8 attention's scores: it needs "
                            "--int8-attention")
    if not args.int8_attention:
        return
    if scores is None:  # the checkpoint then records which scores ran, whatever a later default
        args.int8_attention_scores = DEFAULT_ATTENTION_SCORES
    if not args.int8_linear:
        raise ArgumentError(INT8_ATTENTION_NEEDS_INT8_LINEAR)
    dests = {"head_dim": "kv_channels", "attention_dropout": "attention_dropout",  # the flags that set them
             "reset_attention_mask": "reset_attention_mask"}
    problems = [text + origin(args, dests[what]) for what, text in
                int8_attention_problems(args.kv_channels, args.attention_dropout, args.reset_attention_mask)]
    if problems:
        raise ArgumentError("--int8-attention: " + "; ".join(problems))


def _validate_optimizer_precision(args: argparse.Namespace) -> None:
    """The precision-aware optimizer's flags, as Megatron-LM checks them, and what this one does not do."""
    given = {name: getattr(args, name) for name in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype")
               if getattr(args, name) != "fp32"}
    if args.store_param_remainders:
        given["store_param_remainders"] = True
    if not args.use_precision_aware_optimizer:
        if given:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
            raise ArgumentError(f"{flags} needs --use-precision-aware-optimizer")
        return
    if args.optimizer != "adam":
        raise ArgumentError(f"--use-precision-aware-optimizer (its fp32/bf16/int8 moments and remainders) is an "
                            f"AdamW; --optimizer {args.optimizer} is not supported with it")
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(args, name) not in OPTIMIZER_STATE_DTYPES:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)}: this trainer's precision-aware "
                                f"optimizer stores {', '.join(OPTIMIZER_STATE_DTYPES)} (Megatron-LM's fp16 and fp8 "
                                "need Transformer Engine)")
    if args.main_params_dtype != "fp32":
        raise ArgumentError(f"--main-params-dtype {args.main_params_dtype} is not supported: the master weights "
                            "are fp32, or exact in 2 bytes with --store-param-remainders")
    if args.store_param_remainders and not args.bf16:
        raise ArgumentError("--store-param-remainders needs --bf16: the remainder is the 16 bits an fp32 master "
                            "weight has beyond its bf16 parameter")
    if args.store_param_remainders and not args.use_distributed_optimizer:
        raise ArgumentError("--store-param-remainders needs --use-distributed-optimizer: without it megatron keeps "
                            "its own fp32 main params as the master weights")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill derived defaults (as Megatron-LM does) and reject inconsistent settings; returns args.

    Checks of the flags themselves, the tokenizer file's presence and the output paths; the data files and the
    vocabulary are checked in `data.py`.
    """
    if args.skip_train:
        _settle_skip_train(args)
    _require(args, ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size", "train_iters", "lr"])
    _validate_numbers(args)
    if args.manual_gc_interval < 0:
        raise ArgumentError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.manual_gc_interval and not args.manual_gc:
        raise ArgumentError("--manual-gc-interval needs --manual-gc")
    _validate_moe_capacity(args)
    _validate_cuda_graph(args)
    if args.data_seed is None:
        args.data_seed = args.seed

    # Model shape.
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                            f"{args.max_position_embeddings}")
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            raise ArgumentError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                                f"{args.num_attention_heads}; set --kv-channels (the head dim) explicitly")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        if args.num_query_groups != 1:
            print(f"note: --num-query-groups {args.num_query_groups} has no effect without --group-query-attention "
                  f"(every one of the {args.num_attention_heads} heads gets its own keys and values)", flush=True)
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--num-query-groups {args.num_query_groups}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.num_experts is not None:
        if args.add_bias_linear and args.expert_model_parallel_size == 1:
            raise ArgumentError("--num-experts without expert parallelism needs --disable-bias-linear: megatron-core's "
                                "experts then add their output bias in place into a view, which fails at the first "
                                "step (Mixtral-class MoE has no biases)")
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        if not 1 <= args.moe_router_topk <= args.num_experts:
            raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts "
                                f"{args.num_experts}]")
    if args.use_rope_scaling and args.position_embedding_type != "rope":
        raise ArgumentError("--use-rope-scaling needs --position-embedding-type rope")
    rotary_dim = int(args.kv_channels * args.rotary_percent)
    if args.position_embedding_type == "rope" and (rotary_dim < 2 or rotary_dim % 2):
        raise ArgumentError(f"RoPE rotates pairs of channels, so the rotated part of the head must be even: "
                            f"--kv-channels {args.kv_channels} x --rotary-percent {args.rotary_percent} gives "
                            f"{rotary_dim}")

    # Parallel layout.
    tp, pp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.expert_model_parallel_size)
    if world_size % (tp * pp):
        raise ArgumentError(f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) "
                            "parallel size")
    args.data_parallel_size = world_size // (tp * pp)
    if args.num_attention_heads % tp:
        raise ArgumentError(f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
                            f"{args.num_attention_heads}")
    if args.num_query_groups % tp:
        raise ArgumentError(f"--tensor-model-parallel-size {tp} does not divide the {args.num_query_groups} "
                            "query groups (--num-query-groups)")
    if args.ffn_hidden_size % tp:
        raise ArgumentError(f"--tensor-model-parallel-size {tp} does not divide --ffn-hidden-size "
                            f"{args.ffn_hidden_size}")
    if args.num_layers % pp:
        raise ArgumentError(f"--pipeline-model-parallel-size {pp} does not divide --num-layers {args.num_layers}")
    if ep > 1:
        if args.num_experts is None or args.num_experts % ep:
            raise ArgumentError(f"--expert-model-parallel-size {ep} must divide --num-experts {args.num_experts}")
        if args.data_parallel_size % ep:
            raise ArgumentError(f"--expert-model-parallel-size {ep} must divide the data-parallel size "
                                f"{args.data_parallel_size} (world {world_size} / TP {tp} / PP {pp})")
    if args.sequence_parallel and tp == 1:
        print("note: --sequence-parallel needs tensor parallelism; disabled at TP=1", flush=True)
        args.sequence_parallel = False
    if args.cross_entropy_loss_fusion and not args.bf16:
        raise ArgumentError("--cross-entropy-loss-fusion needs --bf16: megatron's fused cross entropy returns "
                            "bf16 logit gradients whatever the logits' dtype")
    if args.fused_adam and args.optimizer != "adam":
        raise ArgumentError("--fused-adam needs --optimizer adam")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ArgumentError("--use-distributed-optimizer needs --optimizer adam (megatron's distributed optimizer "
                            "shards Adam's state only)")
    _validate_optimizer_precision(args)
    if args.cross_entropy_loss_fusion is None or args.fused_adam is None:
        # fused kernels pay off on the GPU; on the CPU (tests) compiling the cross entropy costs more than it saves
        import torch

        on_gpu = torch.cuda.is_available()
        if args.cross_entropy_loss_fusion is None:
            args.cross_entropy_loss_fusion = on_gpu and args.bf16  # its logit gradients are always bf16
        if args.fused_adam is None:  # 36 ms (5-6%) off a graphed Llama2-7B 8-layer step on an H100
            args.fused_adam = on_gpu and args.optimizer == "adam"
    if args.distributed_backend == "nccl" and not _cuda_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA GPUs, and this process sees none; on the CPU the "
                            "trainer uses gloo (the default without the flag)")
    if args.tp_comm_overlap and not args.sequence_parallel:
        raise ArgumentError("--tp-comm-overlap needs --sequence-parallel (and tensor parallelism)")
    if args.tp_comm_overlap and args.fp8_peer is not None:
        raise ArgumentError("--tp-comm-overlap is implemented by the INT8/BF16 linears, not by the FP8 peer's")
    if args.num_experts is not None and ep > 1 and tp > 1 and not args.sequence_parallel:
        raise ArgumentError("MoE with expert and tensor parallelism needs --sequence-parallel")
    if args.fp8_peer is not None:
        if args.int8_linear:
            raise ArgumentError("--int8-linear and --fp8-peer are mutually exclusive: the FP8 peer replaces "
                                "the INT8 linears; give one of them")
        if tp > 1:
            raise ArgumentError(f"--fp8-peer supports --tensor-model-parallel-size 1 only (a one-GPU benchmark "
                                f"peer), got {tp}")
    elif args.fp8_peer_compile:
        raise ArgumentError("--fp8-peer-compile needs --fp8-peer")
    _validate_int8_health(args)
    _validate_int8_modules(args)
    _validate_int8_attention(args)

    # Batch.
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_micro_batches = args.global_batch_size // per_step

    # Schedule (none to check with --skip-train: no optimizer step).
    decay_given = args.lr_decay_iters is not None
    if not decay_given:
        args.lr_decay_iters = args.train_iters
    if not args.skip_train:
        _validate_schedule(args, decay_given)
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ArgumentError("--recompute-granularity full needs --recompute-method uniform|block")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ArgumentError("--recompute-method only applies with --recompute-granularity full")
    if args.recompute_num_layers is not None and args.recompute_method is None:
        raise ArgumentError("--recompute-num-layers applies with --recompute-granularity full --recompute-method "
                            "uniform|block")
    if args.recompute_method is not None and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    stage_layers = args.num_layers // args.pipeline_model_parallel_size
    if args.recompute_method == "uniform" and stage_layers % args.recompute_num_layers:
        raise ArgumentError(f"--recompute-method uniform recomputes chunks of --recompute-num-layers "
                            f"{args.recompute_num_layers}, which must divide the {stage_layers} layers of each pipeline "
                            "stage (--recompute-method block recomputes that many layers of each stage, any number)")
    for name in ("log_interval", "eval_interval", "save_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.eval_iters < 0:
        raise ArgumentError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.save_retain_interval is not None and args.save_retain_interval <= 0:
        raise ArgumentError(f"--save-retain-interval must be positive, got {args.save_retain_interval}")
    if args.save_retain_interval is not None and args.save_interval and args.save_retain_interval % args.save_interval:
        raise ArgumentError(f"--save-retain-interval {args.save_retain_interval} must be a multiple of "
                            f"--save-interval {args.save_interval} (only saved iterations can be retained)")
    if args.most_recent_k == 0 or args.most_recent_k < -1:
        raise ArgumentError(f"--most-recent-k must be >= 1, or -1 to keep every checkpoint; got {args.most_recent_k}")
    if args.ckpt_step is not None and not args.load:
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} picks a checkpoint of --load: give --load DIR")
    if args.exit_signal_handler and not args.save:
        raise ArgumentError("--exit-signal-handler saves a checkpoint before it exits: give --save DIR")
    if args.save_interval and not args.save and not args.skip_train and not origin(args, "save_interval"):
        # (a config's interval is the recipe's, for runs that save; one given on the command line meant to save)
        print(f"note: --save-interval {args.save_interval} without --save: no checkpoint is saved", flush=True)
    if args.exit_interval is not None and not args.save and not args.skip_train:
        print(f"note: --exit-interval {args.exit_interval} without --save: the run stops at an iteration divisible "
              "by it without saving a checkpoint", flush=True)
    _warn_silent_choices(args)
    if args.profile:
        if not 1 <= args.profile_step_start < args.profile_step_end <= args.train_iters + 1:
            raise ArgumentError(f"--profile-step-start {args.profile_step_start} / --profile-step-end "
                                f"{args.profile_step_end}: need 1 <= start < end <= --train-iters + 1 "
                                f"({args.train_iters + 1}); iterations start .. end - 1 are profiled")
        bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
        if bad:
            raise ArgumentError(f"--profile-ranks {bad}: not ranks of this {world_size}-process run")

    # Data and tokenizer presence (contents are checked once the tokenizer is built).
    if args.mock_data:
        if args.tokenizer_type is None:
            args.tokenizer_type = "NullTokenizer"
        if args.data_path:
            print(f"note: --mock-data trains on random tokens: --data-path {' '.join(args.data_path)} is not read",
                  flush=True)
    elif not args.data_path:
        raise ArgumentError("no training data: give --data-path PREFIX (of PREFIX.bin/.idx) or --mock-data")
    if args.tokenizer_type is None:
        raise ArgumentError(f"--tokenizer-type is required (one of {', '.join(TOKENIZER_TYPES)})")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
    elif args.tokenizer_model is None:
        hint = (", or with --mock-data --tokenizer-type NullTokenizer --vocab-size V (token ids, no tokenizer file)"
                if args.mock_data else "")
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type}{origin(args, 'tokenizer_type')} needs "
                            f"--tokenizer-model{hint}")
    elif not os.path.exists(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model}: no such file")
    else:  # a directory, a corpus or the other family's file is named here, before megatron is imported
        check_tokenizer_file(args.tokenizer_type, args.tokenizer_model)
    if args.eod_token is not None and args.tokenizer_type != "HuggingFaceTokenizer":
        print(f"note: --eod-token {args.eod_token} has no effect with --tokenizer-type {args.tokenizer_type} (it "
              "names a Hugging Face tokenizer's end of document)", flush=True)
    _validate_paths(args)
    if args.save is not None and args.log_jsonl is None:
        args.log_jsonl = os.path.join(args.save, "train_log.jsonl")
    return args


def nearest_existing(path: str) -> str:
    """`path`, or the nearest of its parent folders that exists: where making its folders starts (a file there
    stops them)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def unwritable_reason(path: str) -> Optional[str]:
    """Why the folder `path` (made where missing) cannot be written, or None. A folder is made and removed in its
    nearest existing parent: os.access knows neither read-only mounts nor what root may not do (/proc)."""
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatron_int8_write_check_", dir=existing))
    except OSError as err:
        return f"nothing can be written in {existing} ({err.strerror})"
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _validate_paths(args: argparse.Namespace) -> None:
    """Output paths of the right kind and writable, before anything is built: a --save that cannot be written
    failed at the first save, after the training it was to keep."""
    for name in ("save", "load", "tensorboard_dir", "data_cache_path", "profile_dir"):
        path = getattr(args, name)
        if path is None or (name == "profile_dir" and not args.profile):
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            raise ArgumentError(f"{_flag(name)} {path}{origin(args, name)} is a file; it takes a directory")
        reason = unwritable_reason(path) if name != "load" else None  # the others are written
        if reason:
            raise ArgumentError(f"{_flag(name)} {path}{origin(args, name)}: {reason}")
    if args.log_jsonl is not None:
        if os.path.isdir(args.log_jsonl):
            raise ArgumentError(f"--log-jsonl {args.log_jsonl}{origin(args, 'log_jsonl')} is a directory; it takes a "
                                f"file name, e.g. --log-jsonl {os.path.join(args.log_jsonl, 'train_log.jsonl')}")
        reason = unwritable_reason(os.path.dirname(os.path.abspath(args.log_jsonl)))
        if reason:
            raise ArgumentError(f"--log-jsonl {args.log_jsonl}{origin(args, 'log_jsonl')}: {reason}")
