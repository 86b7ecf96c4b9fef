"""The pretraining loop: setup, train steps through megatron's pipeline schedules, evaluation, saves."""
from __future__ import annotations

import gc
import signal
import time
from functools import partial
from typing import Optional

import torch

from ..megatron.cli import policy_from_args
from ..megatron.precision_table import print_precision_table
from ..ops import shape_policy
from ..reference import raise_if_nonfinite
from .args import ArgumentError, pad_vocab_size
from .checkpoint import (CheckpointError, check_architecture_before_build, check_rng_file_before_build,
                         check_save_target, load_checkpoint, read_saved_arguments, save_checkpoint)
from .cpu import training_device
from .cuda_graph import GraphedForwardBackward, use_side_stream
from .data import (build_data_iterator, build_datasets, build_tokenizer, check_data, dataset_sizes, rank_sampler,
                   split_shares)
from .health import RunHealth
from .memory import format_bytes_per_parameter
from .metrics import StepPhases, TrainingLogger, perplexity
from .model import (build_config, build_model, build_optimizer, configure_torch_adam, initialize_distributed,
                    set_random_seed, settle_grad_reduce_overlap, unwrap)
from .profiling import StepProfiler


def _log(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def _needs_data() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses and token count: megatron's schedules divide by both counts."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch through this pipeline stage (megatron's `forward_step_func` contract)."""
    if not _needs_data():  # middle pipeline stages receive activations, not tokens
        return model(None, None, None), partial(loss_func, None)
    batch = next(data_iterator)
    device = training_device()
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _reduce_loss(losses_reduced) -> float:
    """Token-weighted mean loss over the global batch, known on every rank."""
    from megatron.core import parallel_state

    total = torch.zeros(2, dtype=torch.float64, device=training_device())
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for item in losses_reduced:
            total += item["lm loss"].to(total)
    torch.distributed.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


def _raise_if_grads_nonfinite(model) -> None:
    """DDP's check_for_nan_in_grad, once per step: the largest |gradient| of every gradient buffer, Inf/NaN
    anywhere on any rank stops all ranks before the update. One reduction pass over the buffers (DDP's
    check reads them as often) and one host sync per step, where DDP's syncs twice per bucket inside the
    backward (a GPU-idle gap each) and could not run inside a CUDA graph. It runs after the gradient
    reduction, so it does not say which rank produced the Inf/NaN."""
    largest = [torch.linalg.vector_norm(buffer.grad_data, float("inf"))  # a NaN propagates through max
               for chunk in model for buffer in chunk.buffers + chunk.expert_parallel_buffers]
    if not largest:
        return
    bad = torch.stack(largest).isfinite().logical_not().any().to(torch.float32)
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    if bad.item():
        raise FloatingPointError("Inf or NaN in the gradients (checked after the backward, before the "
                                 "optimizer update)")


def train_step(forward_backward, data_iterator, model, optimizer, scheduler, args,
               phases: Optional[StepPhases] = None):
    """One optimizer step; `phases` (if given) times its parts."""
    phases = phases or StepPhases()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=False)
    phases.mark("forward_backward")
    raise_if_nonfinite()  # INT8 inputs with Inf/NaN (deferred check): stop before the update, naming them
    _raise_if_grads_nonfinite(model)
    phases.mark("nonfinite_check")
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=1)  # the schedule counts optimizer steps (build_optimizer)
    phases.mark("optimizer")
    loss = _reduce_loss(losses)
    phases.mark("loss_reduce")
    return loss, grad_norm, not update_successful


def validation_batches(dataset, args, split: str = "validation"):
    """The first --eval-iters global batches of `dataset`, afresh at every evaluation: each one scores the same
    tokens, so a checkpoint's loss in training's log equals what --skip-train reports for it."""
    return build_data_iterator(dataset, 0, args, split) if _needs_data() else None


def evaluate(forward_backward, data_iterator, model, args) -> float:
    for chunk in model:
        chunk.eval()
    items = []
    with torch.no_grad():
        for _ in range(args.eval_iters):
            items += forward_backward(
                forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=True)
    for chunk in model:
        chunk.train()
    return _reduce_loss(items)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C without --exit-signal-handler; its text says where training stood and how to resume."""


class ExitSignals:
    """SIGINT (Ctrl-C), and SIGTERM with --exit-signal-handler, set a flag that the loop reads after each
    iteration: with --exit-signal-handler it then saves and exits (all ranks agree on the flag, so that they
    stop after the same iteration); without it, it stops there without saving. A second signal interrupts at
    once (a step that hangs). Raising in the handler instead would let the interrupt land anywhere, also
    inside a finalizer or a fork hook (e.g. while a checkpoint's writer process starts), where Python prints
    it with a traceback and drops it."""

    def __init__(self, save_first: bool):
        self.save_first = save_first
        self.signals = (signal.SIGTERM, signal.SIGINT) if save_first else (signal.SIGINT,)
        self.received = 0
        self._previous = {}

    def __enter__(self):
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def check(self) -> str:
        """After an iteration: the signal's name if any rank received one and saves first ('' if none; collective);
        KeyboardInterrupt after Ctrl-C without --exit-signal-handler."""
        if not self.save_first:
            if self.received:
                raise KeyboardInterrupt
            return ""
        flag = torch.tensor([float(self.received)], device=training_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else ""


def evaluate_splits(forward_backward, datasets: dict, model, args, iteration: int) -> dict:
    """--skip-train: loss and perplexity of --eval-iters batches of each split that has data."""
    results = {}
    for name, dataset in datasets.items():
        if dataset is None:
            _log(f" {name} split: none (--split {args.split!r} gives it no share, or it has no documents)")
            continue
        loss = evaluate(forward_backward, validation_batches(dataset, args, name), model, args)
        results[name] = loss
        _log(f" {name} loss at iteration {iteration} ({args.eval_iters} batches of {args.global_batch_size}) | "
             f"lm loss: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E}")
    return results


def check_evaluation_data(args) -> None:
    """--skip-train scores the documents the checkpoint's run held out only with the split it trained with: with
    another --split the validation and test splits would cover documents it trained on."""
    try:
        saved = read_saved_arguments(args.load, getattr(args, "ckpt_step", None))
    except CheckpointError as error:
        raise ArgumentError(str(error)) from None
    then = getattr(saved, "split", None)
    if then is not None and not args.mock_data and split_shares(args.split) != split_shares(then):
        raise ArgumentError(f"--split {args.split!r} is not the {then!r} the checkpoint trained with: its validation "
                            f"and test splits would hold documents it trained on; evaluate with --split {then!r} "
                            "(for a test split, train with one from the start)")


def _wire_megatron_config(config, model, optimizer, args) -> None:
    """What megatron's schedules call back into: loss scaling, grad finalization, grad-sync overlap."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync
        config.grad_sync_func = model[0].start_grad_sync


def pretrain(args) -> dict:
    """Train per `args` (from `args.parse_args`, then `args.validate_args`, as `megatron_int8.pretrain` does before
    it imports this module); returns {"iteration", "loss", "valid_loss"} ({"iteration", "valid_loss",
    "test_loss"} with --skip-train)."""
    try:
        policy = policy_from_args(args)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    if policy.fp8_peer is not None:
        from ..peers.fp8 import fp8_unavailable_reason

        reason = fp8_unavailable_reason()
        if reason:
            raise ArgumentError(f"--fp8-peer: {reason}")
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_save_target(args)
    if args.skip_train:
        check_evaluation_data(args)
    tokenizer = build_tokenizer(args)
    args.padded_vocab_size = pad_vocab_size(tokenizer.vocab_size, args)
    args.tokenizer_vocab_size = tokenizer.vocab_size  # recorded in checkpoints: generation and export check it
    try:
        check_architecture_before_build(args)
    except CheckpointError as error:
        raise ArgumentError(str(error)) from None
    if not args.mock_data:
        check_data(args, tokenizer, dataset_sizes(args))

    initialize_distributed(args)
    try:
        check_rng_file_before_build(args)  # needs the process groups: the RNG file depends on the parallel layout
    except CheckpointError as error:
        raise ArgumentError(str(error)) from None
    if args.cuda_graph_impl != "none":
        use_side_stream()  # before any autograd node exists: see cuda_graph.py
    set_random_seed(args.seed, cuda_graph_safe=args.cuda_graph_impl != "none")
    world_size = args.data_parallel_size * args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    _log(f"world size {world_size}: TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}, "
         f"DP {args.data_parallel_size}, EP {args.expert_model_parallel_size}; global batch "
         f"{args.global_batch_size} = micro {args.micro_batch_size} x DP {args.data_parallel_size} x "
         f"{args.num_micro_batches} micro-batches; device {training_device()}")
    _log(f"tokenizer {args.tokenizer_type}: {tokenizer.vocab_size} tokens, padded to {args.padded_vocab_size}")
    config = build_config(args, _log)
    settle_grad_reduce_overlap(args, _log)
    model = build_model(args, config, policy, args.padded_vocab_size, _log)
    num_params = sum(p.numel() for p in unwrap(model)[0].parameters())
    _log(f"model: {num_params / 1e6:.2f} M parameters on rank 0; {policy.describe()}")
    print_precision_table(unwrap(model), policy, print_fn=_log, full=args.int8_precision_table)
    if args.skip_train:
        health = RunHealth(args, unwrap(model))  # the checkpoint's fallback moves apply to evaluation too
        iteration, _ = load_checkpoint(args, model, None, None, _log, health.fallback)
        if iteration == 0:
            raise ArgumentError(f"--skip-train: no checkpoint in --load {args.load}")
        health.after_load(_log)
        _, valid_ds, test_ds = build_datasets(args, tokenizer)
        losses = evaluate_splits(get_forward_backward_func(), {"validation": valid_ds, "test": test_ds}, model, args,
                                 iteration)
        return {"iteration": iteration, "valid_loss": losses.get("validation"), "test_loss": losses.get("test")}
    optimizer, scheduler = build_optimizer(args, model, _log)
    _log(format_bytes_per_parameter(args, unwrap(model)))
    _wire_megatron_config(config, model, optimizer, args)
    health = RunHealth(args, unwrap(model))

    iteration, consumed_samples = 0, 0
    if args.load:
        iteration, consumed_samples = load_checkpoint(args, model, optimizer, scheduler, _log, health.fallback)
        if configure_torch_adam(optimizer, fused=args.fused_adam):
            _log("optimizer: the loaded Adam param groups set back to this run's implementation ("
                 + ("fused" if args.fused_adam else "torch's default") + ")")
    if health.after_load(_log):
        print_precision_table(unwrap(model), policy, print_fn=_log, full=args.int8_precision_table)
    train_ds, valid_ds, _ = build_datasets(args, tokenizer)
    needs_data = _needs_data()
    train_iterator = build_data_iterator(train_ds, consumed_samples, args) if needs_data else None
    if args.eval_iters > 0 and valid_ds is not None and needs_data:
        rank_sampler(valid_ds, 0, args, "validation")  # too small for one step: fails now, not at the first evaluation

    logger = TrainingLogger(args, args.padded_vocab_size, iteration, torch.distributed.get_rank() == 0, _log)
    forward_backward = get_forward_backward_func()
    if args.cuda_graph_impl != "none":
        forward_backward = GraphedForwardBackward(forward_backward, args.cuda_graph_warmup_steps)
        _log(f"CUDA graph: each step's forward and backward captured after {args.cuda_graph_warmup_steps} eager "
             "steps, then replayed")
        shape_policy.set_timer(shape_policy.launch_free_timer)  # replays pay no launches: nor may the timing
    for chunk in model:
        chunk.train()
    profiler = StepProfiler.from_args(args, torch.distributed.get_rank(), partial(print, flush=True))
    if profiler is not None and args.profile_step_start <= iteration:
        _log(f"--profile: iterations {args.profile_step_start}-{args.profile_step_end - 1} ran before this "
             f"resumed run (from iteration {iteration}); nothing is profiled")
    _log(f"training from iteration {iteration} to {args.train_iters}"
         + (" (nothing to do: pass a larger --train-iters to train further)" if iteration >= args.train_iters else ""))
    if args.manual_gc:  # collect setup's garbage, freeze its survivors out of later scans, then only collect on request
        gc.collect()
        gc.freeze()
        gc.disable()
    progress = {"iteration": iteration, "saved": (iteration, args.load) if iteration else None}
    exit_signals = ExitSignals(save_first=args.exit_signal_handler)
    try:
        with exit_signals:
            loss, valid_loss, iteration = _train(args, forward_backward, train_iterator, valid_ds, model, optimizer,
                                                 scheduler, logger, profiler, progress, exit_signals, consumed_samples,
                                                 health)
    except KeyboardInterrupt:
        saved, root = progress["saved"] or (None, None)
        last = (f"the last checkpoint is iteration {saved} in {root}; resume with --load {root}" if saved
                else "no checkpoint saved")
        raise Interrupted(f"interrupted after iteration {progress['iteration']} ({last}; --exit-signal-handler "
                          "saves on Ctrl-C or SIGTERM before exiting)") from None
    finally:
        health.close()
        logger.close()  # also on a divergence or an interrupt: TensorBoard's queued events are written
        if args.manual_gc:
            gc.unfreeze()
            gc.enable()
            gc.collect()
    if parallel_state.model_parallel_is_initialized():
        torch.distributed.barrier()
    return {"iteration": iteration, "loss": loss, "valid_loss": valid_loss}


def _train(args, forward_backward, train_iterator, valid_ds, model, optimizer, scheduler, logger, profiler, progress,
           exit_signals, consumed_samples, health: RunHealth):
    """The iterations; returns (last loss, last validation loss, iteration). `progress` follows the iteration
    and the last save, for the message of an interrupt."""
    loss = valid_loss = None
    iteration = progress["iteration"]
    carried_summary = ""  # the health summary of checks a save read between log lines, for the next log line
    while iteration < args.train_iters:
        if profiler is not None:
            profiler.before_iteration(iteration + 1)
        if health.before_step(iteration + 1) and isinstance(forward_backward, GraphedForwardBackward):
            forward_backward.run_next_eagerly()  # the probes run in Python: not inside a replayed graph
        start = time.time()
        phases = StepPhases()
        loss, grad_norm, skipped = train_step(forward_backward, train_iterator, model, optimizer, scheduler, args,
                                              phases)
        iteration += 1
        progress["iteration"] = iteration
        consumed_samples += args.global_batch_size
        if args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()  # in the step time: it is part of what training costs
            phases.mark("manual_gc")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        phases.mark("final_sync")
        signal_name = exit_signals.check()
        exiting = bool(signal_name) or (args.exit_interval is not None and iteration % args.exit_interval == 0)
        last = exiting or iteration == args.train_iters  # the run's last iteration: its log line and checks too
        saving = bool(args.save) and (last or bool(args.save_interval and iteration % args.save_interval == 0))
        health_summary = moved = None
        # a save takes the checks armed since the last log line first, so that its streaks are those of this step
        # (a resume from it then decides as this run does)
        log_line = iteration % args.log_interval == 0 or last
        if health.monitor is not None and (log_line or saving):
            health_summary, moved = health.at_log_line(logger)
            phases.mark("int8_health")
        health_summary = health_summary or carried_summary
        carried_summary = "" if log_line else health_summary
        logger.training_step(iteration, consumed_samples, loss, optimizer.param_groups[0]["lr"],
                             grad_norm, skipped, time.time() - start, phases, health_summary or "", last=last)
        if moved:
            print_precision_table(unwrap(model), print_fn=_log, full=args.int8_precision_table)
            if isinstance(forward_backward, GraphedForwardBackward):
                forward_backward.recapture()  # the captured step runs the old recipes
        paused = time.time()  # profiler reports, evaluation and saves: outside the step time
        if profiler is not None:
            profiler.after_iteration(iteration)
        if valid_ds is not None and args.eval_iters > 0 and (
                iteration % args.eval_interval == 0 or iteration == args.train_iters):
            valid_loss = evaluate(forward_backward, validation_batches(valid_ds, args), model, args)
            logger.validation(iteration, valid_loss)
        if saving:
            save_checkpoint(args, iteration, consumed_samples, model, optimizer, scheduler, _log, health.fallback)
            progress["saved"] = (iteration, args.save)
        logger.pause_interval(time.time() - paused)
        if signal_name:
            _log(f"{signal_name} received: stopped after iteration {iteration} of {args.train_iters}, checkpoint "
                 f"saved to {args.save}; resume with --load {args.save}")
            break
        if exiting and iteration < args.train_iters:
            _log(f"exiting at iteration {iteration} (--exit-interval {args.exit_interval})")
            break
    return loss, valid_loss, iteration
