"""The trainer's flags, named as Megatron-LM's, grouped for --help with the common ones first.

Flags carry Megatron-LM's names and defaults so that a command line (or a YAML file of the same keys)
moves between this trainer and upstream `pretrain_gpt.py` unchanged. Every on/off flag gets its opposite,
so that a switch a YAML file sets can be undone on the command line.
"""
from __future__ import annotations

import argparse

from ..megatron.cli import add_int8_arguments
from ..megatron.policy import FP8_RECIPES

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
STATE_DTYPE_CHOICES = ("fp32", "fp16", "bf16", "fp8", "int8")  # Megatron-LM's choices, and int8
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "NullTokenizer")


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
                   default=None, help="the fused vocab-parallel cross entropy in megatron's native slot "
                                      "(megatron_int8.ops.cross_entropy: one Triton pass on CUDA, PyTorch ops on "
                                      "CPU; its logit gradients are bf16, so it needs --bf16). Default: on with "
                                      "CUDA and --bf16, else off.")
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
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Tokens each expert takes per step, as a multiple of an even share (tokens x topk / "
                        "experts); the token-expert pairs beyond it are dropped (default: none dropped).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor): fixed "
                        "shapes, which --cuda-graph-impl local needs for MoE layers.")


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
                   help="Exit after an iteration divisible by this, saving a checkpoint first (to --save; "
                        "without it nothing is saved).")
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
                        "micro-batch 1). GPU only; dense models, or MoE padded to capacity "
                        "(--moe-pad-expert-input-to-capacity); not with --int8-check-finite immediate, "
                        "--int8-grad-rounding stochastic or --fp8-peer.")
    g.add_argument("--cuda-graph-scope", default="full_iteration", choices=["full_iteration"],
                   help="What --cuda-graph-impl local captures: the whole forward/backward of a step (the only scope "
                        "this trainer supports).")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="Eager training steps (and validation passes) before the graph is captured: Triton "
                        "autotuning and compilation must happen outside it.")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="Each weight gradient written to .grad and then added into main_grad, instead of the wgrad "
                        "GEMM adding into main_grad itself (this package does that without APEX).")
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
                   help="Adam's first moment: fp32, bf16 or int8 (blocks of 128, power-of-two scales); "
                        "Megatron-LM's fp16 and fp8 are refused here. Needs --use-precision-aware-optimizer.")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=STATE_DTYPE_CHOICES,
                   help="Adam's second moment: fp32, bf16 or int8 (sqrt(v) in blocks of 128); Megatron-LM's "
                        "fp16 and fp8 are refused here. Needs --use-precision-aware-optimizer.")
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
                        "before a damaged checkpoint). Resuming into the same --save leaves the later ones there "
                        "until this run saves those iterations again.")
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
    g.add_argument("--int8-fallback-max-attention-rel-err", type=float, default=0.1, metavar="LIMIT",
                   help="Auto-fallback threshold of an --int8-attention layer: the sampled relative error of its "
                        "output against fp32 attention; over it on --int8-fallback-patience consecutive checks, "
                        "that layer's attention moves to BF16 (default: %(default)s).")
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


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool)


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already states it: an on/off flag says whether what
    it sets is the default (nothing where the setting is automatic, which its partner's help explains)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is argparse.SUPPRESS or not action.option_strings or "default" in text.lower():
            return text
        if _is_switch(action):
            if action.default is None:
                return text
            return f"{text} ({'the default' if action.default == action.const else 'off by default'})"
        return f"{text} (default: {action.default if action.default != '' else 'none'})"


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
    _share_switch_defaults(parser)
    return parser


def _share_switch_defaults(parser: argparse.ArgumentParser) -> None:
    """Every flag of a setting carries the setting's default (argparse takes the first flag's; a store_false
    flag's own is True), so that --help can say whether each flag is in effect by default."""
    first = {}
    for action in parser._actions:
        first.setdefault(action.dest, action.default)
    for action in parser._actions:
        if _is_switch(action):
            action.default = first[action.dest]


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
        if _is_switch(action):
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
