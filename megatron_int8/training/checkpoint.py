"""Atomic dist_checkpointing saves and exact resume (model, optimizer, LR schedule, RNG, data position).

Layout under --save:
  iter_0000100/                       one complete checkpoint (megatron dist_checkpointing format)
      rng/rank_00000.pt               per-rank RNG states (python, numpy, torch, CUDA, megatron tracker)
  latest_checkpointed_iteration.txt   the tracker: written last, atomically (os.replace)

A save is written to `.tmp_iter_*` and renamed into place only when every rank has finished, so a
run killed mid-save leaves the previous checkpoint and the tracker untouched.

The INT8 and BF16 specs have identical state dicts, so either can resume the other's checkpoint.

megatron-core's DistributedOptimizer, with torch's Adam (no Apex / Transformer Engine: on CPU, and
on GPUs without them), cannot resume as is: a fresh optimizer has no state to describe, loading
copies into leaf tensors that require grad, and every parameter's Adam `step` comes back as one
shared tensor that each parameter's update then increments. `_prime_distributed_optimizers`,
the `no_grad` load and `_restore_adam_steps` address these three.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Optional, Tuple

import numpy as np
import torch

TRACKER_FILE = "latest_checkpointed_iteration.txt"
DISTOPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# Arguments that fix the parameter shapes: a mismatch on load is a user error, reported by name.
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "num_experts", "moe_ffn_hidden_size", "padded_vocab_size",
                     "untie_embeddings_and_output_weights", "qk_layernorm", "swiglu", "normalization",
                     "add_bias_linear", "position_embedding_type")


def _rank() -> int:
    return torch.distributed.get_rank()


def _barrier() -> None:
    torch.distributed.barrier()


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"{path}: expected an iteration number, found {text!r}") from None


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _inner_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed_over_torch_adam(optimizer) -> bool:
    """A DistributedOptimizer on torch's Adam (no Apex/TE fused Adam): the case with the faults."""
    from megatron.core.optimizer import distrib_optimizer

    return isinstance(optimizer, distrib_optimizer.DistributedOptimizer) and not distrib_optimizer.HAVE_APEX_OR_TE


def _adam_steps(optimizer) -> list:
    """The Adam step count of each inner torch optimizer (None where it has no state yet)."""
    steps = []
    for opt in _inner_optimizers(optimizer):
        states = getattr(opt, "optimizer", opt).state.values()
        values = {float(s["step"]) for s in states if "step" in s}
        steps.append(values.pop() if len(values) == 1 else None)
    return steps


def _prime_distributed_optimizers(optimizer) -> None:
    """Give a fresh DistributedOptimizer zero Adam state, which its sharded_state_dict needs to exist."""
    for opt in _inner_optimizers(optimizer):
        if _is_distributed_over_torch_adam(opt) and len(opt.optimizer.state) == 0:
            opt.init_state_fn(opt.optimizer, opt.config)
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    opt.optimizer.state[param].setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer, steps: list) -> None:
    """One `step` tensor per parameter again, at the saved count."""
    for opt, step in zip(_inner_optimizers(optimizer), steps):
        if step is None or not _is_distributed_over_torch_adam(opt):
            continue
        for state in getattr(opt, "optimizer", opt).state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _sharded_state_dict(model_chunks, optimizer, scheduler, *, with_optimizer: bool, is_loading: bool) -> dict:
    from .model import unwrap

    models = unwrap(model_chunks)
    state = {"model": models[0].sharded_state_dict(prefix="", metadata=DISTOPT_METADATA)}
    if with_optimizer:
        if is_loading:
            _prime_distributed_optimizers(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=DISTOPT_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save_checkpoint(args, iteration: int, consumed_samples: int, model_chunks, optimizer, scheduler, log) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    from megatron.core import dist_checkpointing

    root = args.save
    final, tmp = checkpoint_dir(root, iteration), os.path.join(root, f".tmp_iter_{iteration:07d}")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of saves killed midway
            if name.startswith(".tmp_iter_"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = _sharded_state_dict(model_chunks, optimizer, scheduler, with_optimizer=True, is_loading=False)
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    state["adam_steps"] = _adam_steps(optimizer)
    state["world_size"] = torch.distributed.get_world_size()
    state["args"] = {name: getattr(args, name, None) for name in ARCHITECTURE_ARGS}
    dist_checkpointing.save(state, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"))
    _barrier()
    if _rank() == 0:
        replaced = final + ".replaced"
        if os.path.exists(final):  # the same iteration saved again (e.g. by a resumed run)
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _atomic_write(os.path.join(root, TRACKER_FILE), str(iteration))
        shutil.rmtree(replaced, ignore_errors=True)
    _barrier()
    log(f"saved checkpoint at iteration {iteration} to {final}")
    return final


def _check_architecture(saved: dict, args) -> None:
    from .args import ArgumentError

    diffs = [f"{name}: checkpoint {saved[name]!r}, now {getattr(args, name, None)!r}"
             for name in ARCHITECTURE_ARGS if name in saved and saved[name] != getattr(args, name, None)]
    if diffs:
        raise ArgumentError("checkpoint does not match the model arguments: " + "; ".join(diffs))


def load_checkpoint(args, model_chunks, optimizer, scheduler, log) -> Tuple[int, int]:
    """Resume from --load; returns (iteration, consumed_samples), (0, 0) when there is no checkpoint."""
    from megatron.core import dist_checkpointing

    from ..linear import invalidate_weight_caches
    from .model import unwrap

    iteration = read_tracker(args.load)
    if iteration is None:
        log(f"no checkpoint in {args.load} ({TRACKER_FILE} missing): starting from scratch")
        return 0, 0
    directory = checkpoint_dir(args.load, iteration)
    if not os.path.isdir(directory) and os.path.isdir(directory + ".replaced"):
        directory += ".replaced"  # a re-save of this iteration was interrupted mid-rename
    if not os.path.isdir(directory):
        raise RuntimeError(f"{args.load}/{TRACKER_FILE} names iteration {iteration} but {directory} is missing")
    common = dist_checkpointing.load_common_state_dict(directory)
    _check_architecture(common.get("args", {}), args)
    with_optimizer = not args.no_load_optim
    state = _sharded_state_dict(model_chunks, optimizer, scheduler, with_optimizer=with_optimizer, is_loading=True)
    with torch.no_grad():  # the distributed optimizer copies into views of leaf parameters
        loaded = dist_checkpointing.load(state, directory)
        unwrap(model_chunks)[0].load_state_dict(loaded["model"], strict=True)
        if with_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer, common.get("adam_steps", []))
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
    invalidate_weight_caches()  # loaded weights must not reuse INT8 quantizations of the old ones
    rng_file = os.path.join(directory, "rng", f"rank_{_rank():05d}.pt")
    if not args.no_load_rng:
        if common.get("world_size") == torch.distributed.get_world_size() and os.path.isfile(rng_file):
            _set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log("note: checkpoint written with another world size: RNG states not restored")
    log(f"loaded checkpoint {directory} (iteration {iteration}, consumed samples {common['consumed_samples']})")
    return iteration, int(common["consumed_samples"])
