"""Command line and YAML arguments, named as Megatron-LM's, plus their validation.

Flags carry Megatron-LM's names and defaults so that a command line (or a YAML file of the same keys)
moves between this trainer and upstream `pretrain_gpt.py` unchanged. `--config FILE.yaml` sets
defaults; flags given on the command line override them. Validation runs before anything expensive,
so a bad layout or a missing file fails in the first second with a message that names the fix.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import yaml

from ..megatron.cli import add_int8_arguments
from ..megatron.policy import FP8_RECIPES
from .health import per_gemm_limits

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
OPTIMIZER_STATE_DTYPES = ("fp32", "bf16", "int8")  # what the precision-aware optimizer stores
STATE_DTYPE_CHOICES = ("fp32", "fp16", "bf16", "fp8", "int8")  # Megatron-LM's choices, and int8
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "NullTokenizer")


class ArgumentError(ValueError):
    """A user-facing configuration error; the trainer prints it without a traceback."""


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Width of the residual stream.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Default: 4*hidden, or Megatron's 2/3 rule rounded to 64 with --swiglu.")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Query heads per layer.")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups key/value heads.")
    g.add_argument("--num-query-groups", type=int, default=1, help="Key/value heads with --group-query-attention.")
    g.add_argument("--kv-channels", type=int, default=None, help="Head dim; default hidden/heads.")
    g.add_argument("--seq-length", type=int, default=None, help="Tokens per training sample.")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="Default: --seq-length.")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"], help="Positions: learned table, rotary, or none.")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base frequency (theta).")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's dimensions that RoPE rotates.")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1 RoPE scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="With --use-rope-scaling: the Llama-3.1 scaling factor.")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false",
                   help="Rotate q and k with megatron's unfused PyTorch ops instead of the fused kernel "
                        "(megatron_int8.ops.rope, or Transformer Engine's when installed).")
    g.add_argument("--cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion", action="store_true",
                   default=None, help="megatron's fused vocab-parallel cross entropy (torch.compile'd; its "
                                      "logit gradients are bf16, so it needs --bf16). Default: on with CUDA "
                                      "and --bf16, else off.")
    g.add_argument("--no-cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion", action="store_false",
                   help="megatron's unfused cross entropy (about ten fp32 passes over the logits).")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="The layers' norm.")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norms.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLPs (gated SiLU) instead of GELU.")
    g.add_argument("--no-fused-swiglu", dest="fused_swiglu", action="store_false",
                   help="Dense SwiGLU MLPs: megatron's own SwiGLU (torch.compile'd on CUDA) instead of "
                        "megatron_int8.ops.swiglu (one Triton kernel each way, handing its outputs' maxima to the "
                        "INT8 linears so that they skip an amax pass); grouped MoE experts: megatron's "
                        "weighted SwiGLU instead of megatron_int8.ops.swiglu.weighted_swiglu.")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="No biases in the linear layers.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="A separate output layer instead of the input embedding's transpose.")
    g.add_argument("--qk-layernorm", action="store_true", help="Normalize queries and keys per head (Qwen3).")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on the attention probabilities.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on the residual branches.")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Standard deviation of the weights' normal initialization.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this (x TP size).")
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="Mixture of experts: experts per MoE layer (default: dense MLPs).")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Default: --ffn-hidden-size.")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to.")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], help="The router's load-balancing loss.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Weight of the load-balancing loss.")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="Run each rank's experts as grouped GEMMs.")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"],
                   help="How tokens reach their experts' ranks.")


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="GPUs each layer's tensors are split over.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="Pipeline stages the layers are split into.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="Ranks the experts are spread over.")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Split the norms' and dropouts' activations over the tensor-parallel ranks.")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="Pipeline the sequence-parallel all-gathers and reduce-scatters with the linears' GEMMs "
                        "(INT8 and BF16 linears alike; needs --sequence-parallel).")
    g.add_argument("--disable-tp-comm-overlap-ag", action="store_false", dest="tp_comm_overlap_ag",
                   help="With --tp-comm-overlap: leave the all-gathers unpipelined.")
    g.add_argument("--disable-tp-comm-overlap-rs", action="store_false", dest="tp_comm_overlap_rs",
                   help="With --tp-comm-overlap: leave the output reduce-scatters unpipelined.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard the optimizer state over the data-parallel ranks (ZeRO-1).")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Overlap the data-parallel gradient reduction with the backward.")
    g.add_argument("--no-overlap-grad-reduce", action="store_false", dest="overlap_grad_reduce",
                   help="Turn off an overlap_grad_reduce set in the YAML.")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="Default: nccl with CUDA, gloo without.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="Timeout of the collectives.")


def _add_training_arguments(parser: argparse.ArgumentParser, common) -> None:
    g = parser.add_argument_group("training")
    common.add_argument("--micro-batch-size", type=int, default=None,
                        help="Samples per forward/backward pass on each rank.")
    common.add_argument("--global-batch-size", type=int, default=None, help="Default: micro x data-parallel.")
    common.add_argument("--train-iters", type=int, default=None,
                   help="Optimizer steps to train for (on resume: the total, counting those done).")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Save a checkpoint and exit after an iteration divisible by this.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM or SIGINT (Ctrl-C): finish the current iteration, save a checkpoint to --save "
                        "and exit with a one-line summary (all ranks stop at the same iteration).")
    g.add_argument("--skip-train", action="store_true",
                   help="No training: load --load's checkpoint (weights only), evaluate --eval-iters batches of the "
                        "validation and test splits, print their loss and perplexity, and exit.")
    common.add_argument("--bf16", action="store_true", help="BF16 parameters and activations (fp32 master weights).")
    g.add_argument("--seed", type=int, default=1234,
                   help="Seeds the initialization and, unless --data-seed is given, the data order.")
    g.add_argument("--data-seed", type=int, default=None,
                   help="Seeds the data order alone (megatron's sample shuffle). Two runs with the same --data-seed "
                        "and different --seed see the same batches from different initializations: the run-to-run "
                        "noise of a loss comparison (default: --seed).")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="Activation recomputation: whole layers (full) or the attention core (selective).")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="With --recompute-granularity full: which layers.")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="With --recompute-method: layers per recomputed block (uniform) or recomputed (block).")
    g.add_argument("--cuda-graph-impl", default="none", choices=["none", "local"],
                   help="local: after --cuda-graph-warmup-steps eager steps, capture a training step's forward and "
                        "backward over all its micro-batches, with their TP/PP/DP communication, as one CUDA graph "
                        "(the idea of megatron-core's FullCudaGraphWrapper) and replay it on every later step, so "
                        "the host no longer launches kernels one by one. For host-bound layouts (INT8 at TP 4, "
                        "micro-batch 1). GPU only; dense models, deferred finite check, nearest rounding.")
    g.add_argument("--cuda-graph-scope", default="full_iteration", choices=["full_iteration"],
                   help="What --cuda-graph-impl local captures: the whole forward/backward of a step (the only scope "
                        "this trainer supports).")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="Eager training steps (and validation passes) before the graph is captured: Triton "
                        "autotuning and compilation must happen outside it.")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="Without APEX's fused_weight_gradient_mlp_cuda it is disabled automatically.")
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                   help="The optimizer (adam is AdamW: decoupled weight decay).")
    common.add_argument("--lr", type=float, default=None, help="Peak learning rate, reached after the warm-up.")
    g.add_argument("--min-lr", type=float, default=0.0, help="The learning rate the decay ends at.")
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES,
                   help="Decay after the warm-up, over --lr-decay-iters.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="Iterations of linear warm-up from --lr-warmup-init to --lr.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="The learning rate the warm-up starts at.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Clip the global gradient norm to this (0: off).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon.")
    g.add_argument("--fused-adam", dest="fused_adam", action="store_true", default=None,
                   help="Where megatron falls back to torch's Adam/AdamW (no Transformer Engine or APEX), run "
                        "torch's fused implementation (one kernel per parameter group) instead of foreach. "
                        "Default: on with CUDA and --optimizer adam, else off.")
    g.add_argument("--no-fused-adam", dest="fused_adam", action="store_false",
                   help="torch's foreach Adam/AdamW (megatron's fallback as it stands).")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="With --optimizer sgd: momentum.")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron-LM's flag, without Transformer Engine: this package's AdamW (one fused kernel "
                        "per parameter) with the state precisions below; docs/training.md, 'Optimizer states'.")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=STATE_DTYPE_CHOICES,
                   help="Adam's first moment: fp32, bf16 or int8 (blocks of 128, power-of-two scales). Needs "
                        "--use-precision-aware-optimizer.")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=STATE_DTYPE_CHOICES,
                   help="Adam's second moment: fp32, bf16 or int8 (sqrt(v) in blocks of 128). Needs "
                        "--use-precision-aware-optimizer.")
    g.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"],
                   help="The master weights' dtype; fp32 only here (Megatron-LM's fp16 is not supported).")
    g.add_argument("--store-param-remainders", action="store_true",
                   help="Keep each fp32 master weight as its bf16 parameter plus an int16 remainder: exact, 2 "
                        "bytes instead of 4. Needs --use-precision-aware-optimizer, --use-distributed-optimizer "
                        "and --bf16.")


def _add_data_arguments(parser: argparse.ArgumentParser, common) -> None:
    g = parser.add_argument_group("data and tokenizer")
    common.add_argument("--data-path", nargs="*", default=None,
                   help="Prefix of a .bin/.idx pair, or 'W1 PREFIX1 W2 PREFIX2 ...' for a blend.")
    g.add_argument("--split", default="969, 30, 1", help="Train, validation, test proportions.")
    common.add_argument("--mock-data", action="store_true", help="Random tokens (needs --vocab-size).")
    g.add_argument("--data-cache-path", default=None, help="Where GPTDataset writes its index cache.")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="Restart the position ids after each end-of-document token.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="Mask attention across documents within a sample.")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on the end-of-document tokens.")
    common.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="The tokenizer family of --tokenizer-model.")
    common.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model, or a tokenizer.json (or its directory) for HuggingFaceTokenizer.")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer size; with a real tokenizer, a check that it has this many tokens.")
    g.add_argument("--eod-token", default=None,
                   help="HuggingFaceTokenizer: the end-of-document token, where the tokenizer names no EOS token "
                        "(default: tokenizer_config.json's eos_token).")


def _add_logging_checkpoint_arguments(parser: argparse.ArgumentParser, common) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between validation evaluations.")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="Validation batches per evaluation (the same batches each time).")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--log-jsonl", default=None,
                   help="JSON-lines log of every iteration (default: SAVE/train_log.jsonl when --save is set).")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler over iterations --profile-step-start .. --profile-step-end - 1 on "
                        "--profile-ranks: a chrome trace, a summary, and the GPU busy share in the log.")
    g.add_argument("--profile-step-start", type=int, default=10, help="With --profile: first profiled iteration.")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="With --profile: the iteration after the last profiled one.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="With --profile: the ranks that profile.")
    g.add_argument("--profile-dir", default="profile", help="Where --profile writes (default: ./profile).")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's automatic garbage collection off during training (as Megatron-LM's flag "
                        "does): its pauses stall every rank of a tensor-parallel group at the next collective. "
                        "The objects alive after setup are frozen out of later collections (gc.freeze), and "
                        "unreachable reference cycles are freed only by --manual-gc-interval collections and at "
                        "the end.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: a full collection every N iterations (0: none until training ends).")
    g = parser.add_argument_group("checkpointing")
    common.add_argument("--save", default=None,
                   help="Directory for checkpoints (created; one subfolder per saved iteration).")
    common.add_argument("--load", default=None,
                   help="Resume from the latest checkpoint in this --save directory. --load equal to --save on a "
                        "run's first start begins at iteration 0; anywhere else a folder without a checkpoint is an "
                        "error.")
    g.add_argument("--save-interval", type=int, default=None,
                   help="Iterations between checkpoints (the last iteration and exits always save).")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="Keep the checkpoints of iterations divisible by this, and the latest; delete the others "
                        "after each save (a multiple of --save-interval).")
    g.add_argument("--most-recent-k", type=int, default=-1,
                   help="Keep the K latest checkpoints, deleting older ones after each save (-1: keep all). With "
                        "--save-retain-interval, a checkpoint either keeps stays.")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Load the checkpoint of this iteration from --load instead of the latest (e.g. the one "
                        "before a damaged checkpoint); resuming into the same --save replaces the later ones.")
    g.add_argument("--no-load-optim", action="store_true", help="Load only the model weights.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not restore the RNG states from the checkpoint.")


def _add_int8_health_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("INT8 health and automatic fallback (docs/numerics.md)")
    g.add_argument("--int8-stats-interval", type=int, default=0,
                   help="Every N iterations, measure each INT8 linear's quantization health (its operands' amax, "
                        "crest factor, kurtosis, underflow and saturation; each GEMM's relative error on a sample "
                        "of tokens) on the step's first micro-batch; read at the log lines (one host sync), "
                        "written to the JSONL log and TensorBoard. 0 (the default): off.")
    g.add_argument("--int8-auto-fallback", action="store_true",
                   help="With --int8-stats-interval: a GEMM of a linear whose error or underflow crosses its "
                        "threshold on --int8-fallback-patience consecutive checks moves to a safer mode: tensorwise "
                        "scales become row scales (the linear's), row or block scales send that GEMM to high "
                        "precision. Moves are logged, shown in the precision table and kept in checkpoints.")
    g.add_argument("--int8-fallback-max-rel-err", type=float, nargs="+", default=[0.1, 0.1, 1.0],
                   metavar="LIMIT", help="Auto-fallback thresholds on the GEMMs' sampled relative errors: fprop "
                                        "dgrad wgrad, or one for all (default: %(default)s).")
    g.add_argument("--int8-fallback-max-underflow", type=float, nargs="+", default=[0.7, 0.7, 0.9], metavar="LIMIT",
                   help="Auto-fallback thresholds on the fraction of a GEMM operand's nonzero elements that "
                        "quantize to zero: fprop dgrad wgrad, or one for all (default: %(default)s; wgrad's "
                        "operands, scaled per channel over the tokens, underflow more as training goes on: "
                        "docs/numerics.md).")
    g.add_argument("--int8-fallback-patience", type=int, default=3,
                   help="Consecutive statistics checks over a threshold before a GEMM moves (default: %(default)s).")
    g.add_argument("--int8-reset-fallback", action="store_true",
                   help="On resume, drop the fallback moves stored in the checkpoint: every linear runs its "
                        "recipe as configured again.")


def _add_fp8_peer_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FP8 peer (benchmarks: torchao float8 on the same model)")
    g.add_argument("--fp8-peer", choices=FP8_RECIPES, default=None,
                   help="Run the transformer layers' linears as torchao float8 GEMMs with this dynamic scaling "
                        "recipe instead of INT8 or BF16 (needs torchao and a GPU of compute capability >= 8.9; "
                        "tensor-parallel size 1; not with --int8-linear).")
    g.add_argument("--fp8-peer-compile", action="store_true",
                   help="With --fp8-peer: torch.compile each dense linear's casts + GEMM (torchao's fast path; "
                        "expert linears stay eager).")


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is argparse.SUPPRESS or not action.option_strings or "default" in text.lower():
            return text
        return f"{text} (default: {action.default})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-int8-pretrain", usage="%(prog)s [--config FILE.yaml] [flags]", formatter_class=_HelpFormatter,
        description="Pretrain a GPT model with megatron-core and INT8 linears. Flags follow Megatron-LM's; the "
                    "common ones come first, the rest by topic, and the --no-X forms that undo a switch last.",
        allow_abbrev=False,
    )
    common = parser.add_argument_group("common flags")
    common.add_argument("--config", default=None,
                        help="YAML file whose keys are these flags' names (dashes or underscores); "
                             "command-line flags override it.")
    _add_model_arguments(parser)
    _add_parallel_arguments(parser)
    _add_training_arguments(parser, common)
    _add_data_arguments(parser, common)
    _add_logging_checkpoint_arguments(parser, common)
    add_int8_arguments(parser)
    _move_to_group(parser, "--int8-linear", common)
    _add_int8_health_arguments(parser)
    _add_fp8_peer_arguments(parser)
    _add_negations(parser)
    return parser


def _move_to_group(parser: argparse.ArgumentParser, option: str, group) -> None:
    """List a flag defined elsewhere (megatron.cli's --int8-linear) under `group` in --help."""
    action = next(a for a in parser._actions if option in a.option_strings)
    for other in parser._action_groups:
        if action in other._group_actions:
            other._group_actions.remove(action)
    group._group_actions.append(action)


def _negation(option: str) -> str:
    """--x -> --no-x, --no-x -> --x, --disable-x -> --enable-x, --x-no-y -> --x-y."""
    for prefix, opposite in (("--no-", "--"), ("--disable-", "--enable-")):
        if option.startswith(prefix):
            return opposite + option[len(prefix):]
    return option.replace("-no-", "-", 1) if "-no-" in option else "--no-" + option[2:]


def _add_negations(parser: argparse.ArgumentParser) -> None:
    """Every on/off flag gets its opposite (restoring the built-in default), unless it has one already, so
    that a switch a YAML file turns on (or off) can be set back from the command line."""
    group = parser.add_argument_group("undo a switch (e.g. one set in --config): the built-in default again")
    taken = {option for action in parser._actions for option in action.option_strings}
    covered = {}  # dest -> whether a flag of each value exists
    for action in parser._actions:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or (
                isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool)):
            covered.setdefault(action.dest, set()).add(action.const)
    for action in list(parser._actions):
        if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue
        if covered[action.dest] >= {True, False}:
            continue  # a pair already (e.g. --fused-adam / --no-fused-adam)
        option = next(o for o in action.option_strings if o.startswith("--"))
        opposite = _negation(option)
        if opposite in taken:
            continue
        group.add_argument(opposite, dest=action.dest, action="store_const", const=not action.const,
                           default=action.default, help=f"Undo {option}.")
        taken.add(opposite)


# ------------------------------------------------------------------------------------------ YAML


def _option_actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """Every long option name without its dashes, underscored ('num_layers'), mapped to its action."""
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option[2:].replace("-", "_")] = action
    return actions


def _yaml_value(key: str, value, action: argparse.Action):
    """A YAML value converted to what argparse would have stored for the equivalent flag."""
    if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):  # on/off flags
        if not isinstance(value, bool):
            raise ArgumentError(f"config key '{key}': expected true or false, got {value!r}")
        # `disable_bias_linear: true` means the flag is given, which stores its `const`.
        return action.const if value else action.default
    if value is None:
        return None
    if action.nargs in ("*", "+"):
        values = value if isinstance(value, list) else str(value).split()
        return [_convert(key, v, action) for v in values]
    if isinstance(value, (list, dict)):
        raise ArgumentError(f"config key '{key}': expected a single value, got {value!r}")
    return _convert(key, value, action)


def _convert(key: str, value, action: argparse.Action):
    if action.type is not None:
        try:
            value = action.type(value)
        except (TypeError, ValueError):
            raise ArgumentError(f"config key '{key}': cannot convert {value!r} with {action.type.__name__}") from None
    elif not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ArgumentError(f"config key '{key}': {value!r} is not one of {list(action.choices)}")
    return value


def load_yaml_defaults(path: str, parser: argparse.ArgumentParser) -> Dict[str, object]:
    """Parser defaults (dest -> value) from a YAML file; unknown keys fail with the closest names."""
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            content = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise ArgumentError(f"--config {path}: not valid YAML: {err}") from None
    if not isinstance(content, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    actions = _option_actions(parser)
    defaults, errors = {}, []
    for raw_key, value in content.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        action = actions.get(key)
        if action is None or key == "config":
            close = difflib.get_close_matches(key, list(actions), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            errors.append(f"unknown key '{raw_key}'{hint}")
            continue
        defaults[action.dest] = _yaml_value(str(raw_key), value, action)
    if errors:
        raise ArgumentError(f"--config {path}: " + "; ".join(errors))
    return defaults


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse YAML (--config) then the command line over it; does not validate (see validate_args)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    from_yaml = load_yaml_defaults(known.config, parser) if known.config else {}
    parser.set_defaults(**from_yaml)
    args = parser.parse_args(argv)
    # which values the YAML set (not the command line), so that an error about one can say where it came from
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    on_command_line = {action.dest for action in parser._actions if given & set(action.option_strings)}
    args.from_config = {dest: known.config for dest in from_yaml if dest not in on_command_line}
    return args


def origin(args, dest: str) -> str:
    """' (from --config FILE)' where the YAML set this value, else ''."""
    path = getattr(args, "from_config", {}).get(dest)
    return f" (from --config {path})" if path else ""


# ------------------------------------------------------------------------------------ validation


def _require(args, names: List[str]) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        raise ArgumentError(f"missing required argument(s): {', '.join(missing)}")


def _validate_cuda_graph(args: argparse.Namespace) -> None:
    """--cuda-graph-impl local replays one captured step: nothing in it may depend on the host at run time."""
    if args.cuda_graph_impl == "none":
        return
    import torch

    if args.cuda_graph_warmup_steps < 1:
        raise ArgumentError(f"--cuda-graph-warmup-steps must be >= 1 (autotuning and compilation run eagerly), "
                            f"got {args.cuda_graph_warmup_steps}")
    reasons = {
        "MoE layers (--num-experts) route a different number of tokens to each expert every step":
            args.num_experts is not None,
        "--int8-grad-rounding stochastic draws its seeds on the host at every call":
            getattr(args, "int8_grad_rounding", "nearest") == "stochastic",
        "--int8-check-finite immediate synchronizes with the host inside the step":
            getattr(args, "int8_check_finite", "deferred") == "immediate",
        "--fp8-peer is not supported": getattr(args, "fp8_peer", None) is not None,
        "it needs a CUDA GPU": not torch.cuda.is_available(),
    }
    for reason, applies in reasons.items():
        if applies:
            raise ArgumentError(f"--cuda-graph-impl local: {reason}")


def _settle_skip_train(args: argparse.Namespace) -> None:
    """--skip-train evaluates a checkpoint: it needs --load and evaluation batches, loads no optimizer state,
    and no schedule; Megatron-LM's rules."""
    if not args.load:
        raise ArgumentError("--skip-train evaluates a checkpoint: give --load DIR")
    if args.eval_iters <= 0:
        raise ArgumentError("--skip-train evaluates --eval-iters batches per split: give --eval-iters > 0")
    args.no_load_optim = True
    args.save = None  # nothing is trained, so nothing is saved
    args.train_iters = args.train_iters if args.train_iters is not None else 0
    args.lr = args.lr if args.lr is not None else 0.0


def _warn_silent_choices(args: argparse.Namespace) -> None:
    """A note for settings that are valid but probably not what was meant."""
    if not args.int8_linear:
        defaults = build_parser()
        changed = [f"--{name.replace('_', '-')}" for name in sorted(vars(args))
                   if name.startswith("int8_") and name not in ("int8_linear", "int8_precision_table")
                   and getattr(args, name) != defaults.get_default(name)]
        if changed:
            print(f"note: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect without "
                  "--int8-linear (the linears run in BF16)", flush=True)
    elif args.int8_granularity == "tensor" and args.int8_grad_rounding == "nearest":
        print("warning: --int8-granularity tensor with --int8-grad-rounding nearest: one scale per gradient "
              "tensor rounds most of its entries to zero, and training diverged from BF16 in docs/convergence.md; "
              "use --int8-grad-rounding stochastic, or row granularity (the default)", flush=True)


def _validate_schedule(args: argparse.Namespace, decay_given: bool) -> None:
    """The optimizer's and the LR schedule's numbers, each error naming where a value came from."""
    for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad", "lr_warmup_iters"):
        if getattr(args, name) < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)}{origin(args, name)}: must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)}{origin(args, name)}: must be in "
                                "[0, 1)")
    if args.adam_eps <= 0:
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

    Checks that need no files or tokenizer: data files and vocab are checked in `data.py`.
    """
    if args.skip_train:
        _settle_skip_train(args)
    _require(args, ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size", "train_iters", "lr"])
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size"):
        if getattr(args, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.manual_gc_interval < 0:
        raise ArgumentError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.manual_gc_interval and not args.manual_gc:
        raise ArgumentError("--manual-gc-interval needs --manual-gc")
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
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--num-query-groups {args.num_query_groups}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.num_experts is not None:
        if args.moe_ffn_hidden_size is None:
            args.moe_ffn_hidden_size = args.ffn_hidden_size
        if not 1 <= args.moe_router_topk <= args.num_experts:
            raise ArgumentError(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts "
                                f"{args.num_experts}]")
    if args.use_rope_scaling and args.position_embedding_type != "rope":
        raise ArgumentError("--use-rope-scaling needs --position-embedding-type rope")

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
    _validate_optimizer_precision(args)
    if args.cross_entropy_loss_fusion is None or args.fused_adam is None:
        # fused kernels pay off on the GPU; on the CPU (tests) compiling the cross entropy costs more than it saves
        import torch

        on_gpu = torch.cuda.is_available()
        if args.cross_entropy_loss_fusion is None:
            args.cross_entropy_loss_fusion = on_gpu and args.bf16  # its logit gradients are always bf16
        if args.fused_adam is None:  # 36 ms (5-6%) off a graphed Llama2-7B 8-layer step on an H100
            args.fused_adam = on_gpu and args.optimizer == "adam"
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
    if args.recompute_method is not None and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    for name in ("log_interval", "eval_interval", "save_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.eval_iters < 0:
        raise ArgumentError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.save_retain_interval is not None and args.save_interval and args.save_retain_interval % args.save_interval:
        raise ArgumentError(f"--save-retain-interval {args.save_retain_interval} must be a multiple of "
                            f"--save-interval {args.save_interval} (only saved iterations can be retained)")
    if args.most_recent_k == 0 or args.most_recent_k < -1:
        raise ArgumentError(f"--most-recent-k must be >= 1, or -1 to keep every checkpoint; got {args.most_recent_k}")
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
    elif not args.data_path:
        raise ArgumentError("no training data: give --data-path PREFIX (of PREFIX.bin/.idx) or --mock-data")
    if args.tokenizer_type is None:
        raise ArgumentError(f"--tokenizer-type is required (one of {', '.join(TOKENIZER_TYPES)})")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size")
    elif args.tokenizer_model is None:
        raise ArgumentError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    elif not os.path.exists(args.tokenizer_model):
        raise ArgumentError(f"--tokenizer-model {args.tokenizer_model}: no such file")
    _validate_paths(args)
    if args.save is not None and args.log_jsonl is None:
        args.log_jsonl = os.path.join(args.save, "train_log.jsonl")
    return args


def _validate_paths(args: argparse.Namespace) -> None:
    """Output paths of the right kind, before anything is built."""
    for name in ("save", "load", "tensorboard_dir", "data_cache_path"):
        path = getattr(args, name)
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ArgumentError(f"--{name.replace('_', '-')} {path}{origin(args, name)} is a file; it takes a "
                                "directory")
    if args.log_jsonl is not None:
        if os.path.isdir(args.log_jsonl):
            raise ArgumentError(f"--log-jsonl {args.log_jsonl}{origin(args, 'log_jsonl')} is a directory; it takes a "
                                f"file name, e.g. --log-jsonl {os.path.join(args.log_jsonl, 'train_log.jsonl')}")
        parent = os.path.dirname(os.path.abspath(args.log_jsonl))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ArgumentError(f"--log-jsonl {args.log_jsonl}: {parent} is a file, not a directory")


def pad_vocab_size(vocab_size: int, args) -> int:
    """Megatron-LM's padding: a multiple of --make-vocab-size-divisible-by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def transformer_config_from_args(args, **overrides):
    """The TransformerConfig these (validated) arguments describe."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=args.swiglu,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        cross_entropy_loss_fusion=bool(args.cross_entropy_loss_fusion),
        cross_entropy_fusion_impl="native",
        tp_comm_overlap=args.tp_comm_overlap,
        tp_comm_overlap_ag=args.tp_comm_overlap_ag,
        tp_comm_overlap_rs=args.tp_comm_overlap_rs,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deallocate_pipeline_outputs=True,
        variable_seq_lengths=False,
        # megatron synchronizes the device after each batched P2P exchange (a guard for an old PyTorch race):
        # a host sync that a captured step (--cuda-graph-impl local) cannot contain
        batch_p2p_sync=args.cuda_graph_impl == "none",
    )
    if "cuda_graph_scope" in TransformerConfig.__dataclass_fields__:
        # megatron's per-layer graphs are not used (--cuda-graph-impl local is this trainer's); its default "full"
        # scope only prints a deprecation warning at every start
        kwargs.update(cuda_graph_scope=[])
    if args.position_embedding_type == "rope" and args.apply_rope_fusion:
        from ..ops.rope import install as install_fused_rope

        kwargs.update(apply_rope_fusion=install_fused_rope())
    if args.num_experts is not None:
        kwargs.update(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        )
    kwargs.update(overrides)
    if args.swiglu and args.num_experts is None and getattr(args, "fused_swiglu", True):
        # the MLP's activation module slot (megatron_int8.ops.swiglu; the spec fills it), which this flag opens
        kwargs.update(use_te_activation_func=True, bias_activation_fusion=False)
    return TransformerConfig(**kwargs)
