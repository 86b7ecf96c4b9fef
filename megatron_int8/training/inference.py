"""A trained checkpoint as a model to run: loading it on one process, and sampling text from it.

`load_for_inference` rebuilds the model from the arguments the checkpoint records (any TP/PP/EP layout it
was saved at: dist_checkpointing reshards to one process) with INT8 or BF16 linears, and `generate` samples
with megatron-core's static KV cache: the prompt in one forward pass, then one token per pass.
"""
from __future__ import annotations

import argparse
import atexit
import os
from typing import List, Optional

import torch

# what a one-process inference run changes in the recorded arguments
SINGLE_PROCESS = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                      sequence_parallel=False, tp_comm_overlap=False, overlap_grad_reduce=False,
                      use_distributed_optimizer=False, cuda_graph_impl="none", recompute_granularity=None,
                      recompute_method=None, recompute_num_layers=None, fp8_peer=None, fp8_peer_compile=False,
                      data_parallel_size=1, no_load_optim=True, no_load_rng=True, skip_train=False,
                      distributed_backend=None, profile=False, manual_gc=False, int8_all_gather=False,
                      # the fallback moves run as training left them: a resume's reset is not redone at load, and
                      # nothing is measured (inference takes no fallback decisions)
                      int8_reset_fallback=False, int8_stats_interval=0)


def inference_arguments(load: str, *, int8: Optional[bool] = None, bf16: Optional[bool] = None,
                        tokenizer_model: Optional[str] = None, ckpt_step: Optional[int] = None) -> argparse.Namespace:
    """The checkpoint's recorded arguments (of iteration `ckpt_step`, default the latest), set up for one process;
    int8/bf16 None keep the recorded choice."""
    from .checkpoint import CheckpointError, check_checkpoint_files, latest_checkpoint_dir, read_saved_arguments

    check_checkpoint_files(latest_checkpoint_dir(load, ckpt_step))
    args = read_saved_arguments(load, ckpt_step)
    saved_tp = args.tensor_model_parallel_size
    vars(args).update(SINGLE_PROCESS, load=load, save=None, ckpt_step=ckpt_step)
    if int8 is not None:
        args.int8_linear = int8
    if bf16 is not None:
        args.bf16 = bf16
    if tokenizer_model is not None:
        args.tokenizer_model = tokenizer_model
    if tokenizer_model is not None and not os.path.exists(tokenizer_model):  # not the checkpoint's: say so
        raise CheckpointError(f"--tokenizer-model {tokenizer_model}: no such file")
    if args.tokenizer_type != "NullTokenizer" and not os.path.exists(args.tokenizer_model or ""):
        raise CheckpointError(f"the checkpoint's tokenizer {args.tokenizer_model} is not here: pass "
                              "--tokenizer-model PATH")
    if args.tokenizer_type != "NullTokenizer":
        check_tokenizer_fits(args, saved_tp, given=tokenizer_model is not None)
    return args


def check_tokenizer_fits(args, saved_tp: int, given: bool) -> None:
    """CheckpointError where the tokenizer is not the one the checkpoint trained with, as far as its size tells: its
    vocabulary against the one recorded (checkpoints since it was), else its padded size against the embedding's
    rows. Another tokenizer would index past the embedding, or decode the ids into other text."""
    from .checkpoint import CheckpointError
    from .data import build_tokenizer
    from .megatron_config import pad_vocab_size

    vocab = build_tokenizer(args).vocab_size
    recorded = getattr(args, "tokenizer_vocab_size", None)
    padded = pad_vocab_size(vocab, argparse.Namespace(make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                                      tensor_model_parallel_size=saved_tp))
    if (recorded is not None and vocab != recorded) or padded != args.padded_vocab_size:
        what = (f"{recorded} tokens" if recorded is not None else
                f"{args.padded_vocab_size} embedding rows (the vocabulary padded at TP {saved_tp})")
        source = f"--tokenizer-model {args.tokenizer_model}" if given else f"the tokenizer {args.tokenizer_model}"
        raise CheckpointError(f"{source} has {vocab} tokens, and the checkpoint trained with {what}: not its "
                              "tokenizer; pass the one it trained with (--tokenizer-model PATH)")


def load_for_inference(load: str, log=print, **overrides):
    """(model, args, tokenizer): the latest checkpoint under `load` as a GPTModel in eval mode, on this
    process alone (a world of one is initialized if none is)."""
    from ..megatron.cli import policy_from_args
    from .checkpoint import load_checkpoint
    from .data import build_tokenizer
    from .health import RunHealth
    from .model import build_config, build_model, destroy_distributed, initialize_distributed, set_random_seed, unwrap

    args = inference_arguments(load, **overrides)
    tokenizer = build_tokenizer(args)
    if not torch.distributed.is_initialized():
        initialize_distributed(args)
        atexit.register(destroy_distributed)  # the world this call made ends with the process (generate, export)
    set_random_seed(args.seed)  # megatron's layers draw their (overwritten) init from its RNG streams, on GPU too
    config = build_config(args, lambda message: None)
    chunks = build_model(args, config, policy_from_args(args), args.padded_vocab_size, lambda message: None)
    health = RunHealth(args, unwrap(chunks))  # GEMMs the auto-fallback moved to finer scales or BF16 stay there
    iteration, _ = load_checkpoint(args, chunks, None, None, log, health.fallback)
    health.after_load(log)
    model = unwrap(chunks)[0]
    model.eval()
    args.iteration = iteration
    return model, args, tokenizer


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """Greedy (temperature 0) or nucleus sampling from [batch, vocab] logits."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # keep the smallest set reaching top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return order.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: List[int], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             eod: Optional[int] = None, vocab_size: Optional[int] = None, seed: int = 0) -> List[int]:
    """Token ids after `prompt_ids` (stopping at `eod`), with megatron-core's static KV cache: each new token
    costs one forward pass over that token alone. Padded vocabulary entries are never drawn."""
    from megatron.core.inference.contexts import StaticInferenceContext

    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    limit = model.max_sequence_length
    total = min(len(prompt_ids) + max_new_tokens, limit)
    if len(prompt_ids) >= total:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's sequence limit is {limit}")
    device = next(model.parameters()).device
    context = StaticInferenceContext(max_batch_size=1, max_sequence_length=total)
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: List[int] = []
    step_input, start = tokens, 0
    while tokens.shape[1] < total:
        positions = torch.arange(start, tokens.shape[1], device=device).unsqueeze(0)
        logits = model(step_input, positions, None, inference_context=context, runtime_gather_output=True)[:, -1, :]
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        token = _next_token(logits, temperature, top_p, generator)
        context.sequence_len_offset += step_input.shape[1]
        new.append(int(token))
        if eod is not None and new[-1] == eod:
            break
        tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
        step_input, start = token.view(1, 1), tokens.shape[1] - 1
    return new
