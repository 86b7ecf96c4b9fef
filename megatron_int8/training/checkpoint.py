"""Atomic dist_checkpointing saves and exact resume (model, optimizer, LR schedule, RNG, data position).

Layout under --save:
  iter_0000100/                       one complete checkpoint (megatron dist_checkpointing format)
      common.pt                       iteration, data position, and the run's arguments as an
                                      argparse.Namespace (as upstream Megatron-LM stores them); from
                                      megatron-core 0.19 this common state is an object inside the shards
      rng/rank_00000.pt               per-rank RNG states (python, numpy, torch, CUDA, megatron tracker),
                                      tensors and plain values only
  latest_checkpointed_iteration.txt   the tracker: written last, atomically (os.replace)

Loading reads nothing but tensors and allowlisted types (safe_load.py). Retention (after each save):
--save-retain-interval R keeps the checkpoints at multiples of R and the latest (Megatron-LM's flag);
--most-recent-k K keeps the K latest (megatron's CheckpointConfig.most_recent_k); with both, either keeps.

A save is written to `.tmp_iter_*` and renamed into place only when every rank has finished, so a
run killed mid-save leaves the previous checkpoint and the tracker untouched.

The INT8 and BF16 specs have identical state dicts, so either can resume the other's checkpoint.

The distributed optimizer (--use-distributed-optimizer) is saved in one of two megatron formats
(`distrib_optim_sharding_type`), recorded in the checkpoint's common state as `distopt_sharding_type`
with the parallel layout it was written at (`parallel_layout`):
  fully_reshardable  the default: Adam state in model space (one tensor of each parameter's global
                     shape per state), gathered over data-parallel ranks on DP rank 0 at save (gloo).
                     Loads at any TP/PP/DP; every rank reads the whole state of its model-parallel
                     shard (3 fp32 values per parameter) into host memory while loading.
  dp_reshardable     MEGATRON_INT8_DISTOPT_FORMAT=dp_reshardable: each rank writes its flat bucket
                     shards, no gather. Loads only at the same TP/PP/EP/CP layout (any DP size).
A load that cannot read the optimizer state fails and names `--no-load-optim` (weights only); it
never drops the state silently. Checkpoints from before the record are dp_reshardable.

megatron-core's DistributedOptimizer, with torch's Adam (no Apex / Transformer Engine: on CPU, and
on GPUs without them), cannot resume as is: a fresh optimizer has no state to describe, loading
copies into leaf tensors that require grad, and every parameter's Adam `step` comes back as one
shared tensor that each parameter's update then increments. `_prime_distributed_optimizers`,
the `no_grad` load and `_restore_adam_steps` address these three. In the fully_reshardable format
a fourth: megatron 0.16.1 copies every key of a parameter's torch state from the checkpoint, `step`
included, which that format does not store per parameter (it is in the param groups), so the load
stops with KeyError 'step'; `_steps_set_aside` hides the steps for that copy.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
from contextlib import contextmanager
from typing import Optional, Tuple

import numpy as np
import torch

from ..dispatch import CHOICES, ENV_DISTOPT_FORMAT, env_choice
from ..megatron.cli import policy_from_args
from ..megatron.optimizer import precision_aware_optimizers
from .data import split_shares
from .errors import ArgumentError
from .model import adam_step, inner_optimizers
from .safe_load import UnsafeCheckpointError, load_tensors_file, weights_only_loading

TRACKER_FILE = "latest_checkpointed_iteration.txt"
DISTOPT_FORMATS = CHOICES[ENV_DISTOPT_FORMAT]  # the format of new saves; default fully_reshardable
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
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (missing, or a file cut short); the message names the file and a way out.
    The entry points print it in one line."""


def no_checkpoint_message(root: str) -> str:
    """Why `root` is no --load directory, and what to give instead."""
    name = os.path.basename(os.path.normpath(root))
    if re.fullmatch(r"iter_\d{7}", name):
        return (f"--load {root} is one checkpoint's folder; --load takes the --save directory above it: "
                f"--load {os.path.dirname(os.path.normpath(root))} (--ckpt-step {int(name[5:])} for this iteration)")
    found = saved_iterations(root)
    if found:
        return (f"--load {root}: {TRACKER_FILE} is missing (checkpoints of iteration(s) "
                f"{', '.join(map(str, found))} are there): name one with --ckpt-step {found[-1]}")
    return f"--load {root}: no checkpoint there ({TRACKER_FILE} missing): give the --save directory of a run"


def latest_checkpoint_dir(root: str, step: Optional[int] = None) -> str:
    """The directory of the checkpoint of iteration `step` under `root` (default: the one its tracker names)."""
    if step is not None and step < 0:  # else "iter_-000001 is missing"
        have = ", ".join(map(str, saved_iterations(root))) or "none"
        raise CheckpointError(f"--ckpt-step {step}: iterations count from 0 (saved iterations under {root}: {have})")
    iteration = read_tracker(root) if step is None else step
    if iteration is None:
        raise CheckpointError(no_checkpoint_message(root))
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory) and os.path.isdir(directory + ".replaced"):
        directory += ".replaced"  # a re-save of this iteration was interrupted mid-rename
    if not os.path.isdir(directory):
        have = ", ".join(map(str, saved_iterations(root))) or "none"
        source = f"--ckpt-step {step}" if step is not None else f"{root}/{TRACKER_FILE}"
        raise CheckpointError(f"{source} names iteration {iteration} but {directory} is missing (saved iterations: "
                              f"{have})")
    return directory


def _previous_hint(directory: str) -> str:
    """The way out of a damaged checkpoint: the iteration saved before it, by --ckpt-step."""
    root = os.path.dirname(os.path.normpath(directory))
    match = re.fullmatch(r"iter_(\d{7})(\.replaced)?", os.path.basename(os.path.normpath(directory)))
    earlier = [i for i in saved_iterations(root) if match is None or i < int(match.group(1))]
    if earlier:
        return f"load the previous checkpoint with --ckpt-step {earlier[-1]} (same --load)"
    return "no earlier checkpoint is saved there: train again, or restore the file from a copy"


def check_checkpoint_files(directory: str) -> None:
    """Every tensor file the checkpoint's index lists is there and long enough: a file cut short (a full disk, a
    copy interrupted) fails here by name, instead of as a bare EOFError deep inside torch's reader."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except Exception as error:  # a missing or cut .metadata: torch raises whatever its unpickling hits
        raise CheckpointError(f"{os.path.join(directory, '.metadata')} cannot be read ({type(error).__name__}): the "
                              f"checkpoint is damaged; {_previous_hint(directory)}") from None
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(directory, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size is None or size < length:
            what = "is missing" if size is None else f"is truncated ({size} bytes; its index needs {length})"
            raise CheckpointError(f"{path} {what}: the checkpoint is damaged; {_previous_hint(directory)}")


def _rng_file(directory: str, common: dict, layout: dict, log) -> Optional[str]:
    """This rank's RNG file in the checkpoint, or None (with a note) where the checkpoint was written by another world
    size or parallel layout: rank r's states then belong to another place in the model (upstream Megatron-LM skips
    them too when TP or PP change). A file that should be there and is not is a CheckpointError with the way out."""
    world, saved_layout = torch.distributed.get_world_size(), common.get("parallel_layout")
    other = None
    if common.get("world_size") != world:
        other = f"world size {common.get('world_size')} (this run: {world})"
    elif saved_layout is not None and saved_layout != layout:
        other = "parallel layout: " + ", ".join(f"{key} {saved_layout.get(key)} (this run: {value})"
                                                for key, value in layout.items() if saved_layout.get(key) != value)
    if other is not None:
        log(f"note: checkpoint written with another {other}: RNG states not restored")
        return None
    path = os.path.join(directory, "rng", f"rank_{_rank():05d}.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing (this rank's RNG states): the checkpoint is damaged; "
                              f"{_rng_way_out(directory)}")
    return path


def _rng_way_out(directory: str) -> str:
    return f"--no-load-rng resumes without them, or {_previous_hint(directory)}"


def _saved_rng_state(directory: str, common: dict, layout: dict, log) -> Optional[dict]:
    """This rank's RNG states from the checkpoint (None where `_rng_file` gives none), read before the weights so that
    a damaged file fails first."""
    path = _rng_file(directory, common, layout, log)
    if path is None:
        return None
    try:
        return load_tensors_file(path, allow_numpy_arrays=True)
    except UnsafeCheckpointError:
        raise  # a planted object: named as such
    except Exception as error:  # torch's reader fails on a damaged file with whatever it hits (EOFError, KeyError)
        raise CheckpointError(f"{path} cannot be read ({_first_line(error)}): the checkpoint is damaged; "
                              f"{_rng_way_out(directory)}") from None


def _resumed_dir(args) -> Optional[str]:
    """The checkpoint directory --load resumes (--ckpt-step's, else the latest); None where there is none yet (a first
    start, --load the same as --save) or no --load."""
    step = getattr(args, "ckpt_step", None)
    if not args.load or (step is None and read_tracker(args.load) is None):
        return None
    return latest_checkpoint_dir(args.load, step)


def check_rng_file_before_build(args) -> None:
    """This rank's RNG file, where the resume will restore it, once the process groups exist and before the model is
    built: a missing file is named in one line instead of after the build. (The layout's one model chunk: this trainer
    builds no virtual pipeline stages.)"""
    directory = None if args.no_load_rng else _resumed_dir(args)
    if directory is not None:
        _rng_file(directory, _load_common(directory), _parallel_layout(1), lambda _: None)


def _load_common(directory: str) -> dict:
    """The checkpoint's common state (weights_only), or a CheckpointError naming where it is stored."""
    from megatron.core import dist_checkpointing

    record = os.path.join(directory, "metadata.json")  # megatron's record of the format, read first
    try:
        with open(record, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as error:
        what = "is missing" if not os.path.isfile(record) else f"cannot be read ({_first_line(error)})"
        raise CheckpointError(f"{record} {what}: the checkpoint is damaged; {_previous_hint(directory)}") from None
    with weights_only_loading(directory):
        try:
            return dist_checkpointing.load_common_state_dict(directory)
        except (EOFError, RuntimeError, OSError) as error:
            if not isinstance(error, (EOFError, OSError)) and "PytorchStreamReader" not in str(error):
                raise
            legacy = os.path.join(directory, "common.pt")  # megatron-core 0.19 keeps it inside the shards instead
            where = legacy if os.path.isfile(legacy) else f"the common state in {directory}"
            raise CheckpointError(f"{where} cannot be read ({_first_line(error)}): the checkpoint is damaged; "
                                  f"{_previous_hint(directory)}") from None


def _first_line(error: BaseException) -> str:
    """An exception as `Type: its first sentence` (torch's reader errors run on for lines)."""
    text = (str(error).split(". ")[0].splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def read_saved_arguments(root: str, step: Optional[int] = None) -> argparse.Namespace:
    """The arguments of the run that wrote the checkpoint of iteration `step` (default: the latest) under `root`
    (weights_only load)."""
    directory = latest_checkpoint_dir(root, step)
    saved = _load_common(directory).get("args")
    if not isinstance(saved, argparse.Namespace):
        raise CheckpointError(f"{directory} records only the model shape, not the run's arguments (it was written "
                           "before they were saved): resume it once with this version (--load, --save, one more "
                           "iteration) to write a checkpoint that records them")
    return saved


def _atomic_write(path: str, text: str) -> None:
    """`path` holds `text` or what it held, whatever stops the write, and is durable once this returns."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(os.path.abspath(path)))  # the rename itself


def _fsync(path: str) -> None:
    """Flush a file's data, or a folder's entries (its renames and new names), to the disk. A file system that cannot
    sync a folder (some FUSE and network mounts: EINVAL, ENOTSUP) leaves its entries to its own durability."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if not (os.path.isdir(path) and error.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _fsync_tree(directory: str) -> None:
    """_fsync every file and folder under `directory`, the files of each folder before the folder."""
    for folder, _, files in os.walk(directory, topdown=False):
        for name in files:
            _fsync(os.path.join(folder, name))
        _fsync(folder)


def _rng_state() -> dict:
    """Tensors and plain values only, so that a weights_only load reads it (numpy's state as a tensor)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "random": random.getstate(),
        "numpy": {"algorithm": algorithm, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["algorithm"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _is_distributed_over_torch_adam(optimizer) -> bool:
    """A DistributedOptimizer on torch's Adam (no Apex/TE fused Adam): the case with the faults."""
    from megatron.core.optimizer import distrib_optimizer

    return isinstance(optimizer, distrib_optimizer.DistributedOptimizer) and not distrib_optimizer.HAVE_APEX_OR_TE


def _adam_steps(optimizer) -> list:
    """The Adam step count of each inner torch optimizer (None where it has no state yet)."""
    steps = []
    for opt in inner_optimizers(optimizer):
        states = getattr(opt, "optimizer", opt).state.values()
        values = {float(s["step"]) for s in states if "step" in s}
        steps.append(values.pop() if len(values) == 1 else None)
    return steps


def _prime_distributed_optimizers(optimizer) -> None:
    """Give a fresh DistributedOptimizer zero Adam state, which its sharded_state_dict needs to exist."""
    for opt in inner_optimizers(optimizer):
        if _is_distributed_over_torch_adam(opt) and len(opt.optimizer.state) == 0:
            opt.init_state_fn(opt.optimizer, opt.config)
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    opt.optimizer.state[param].setdefault("step", adam_step(param, group, 0))


def _sgd_state_to_load(optimizer, saved_momentum) -> None:
    """megatron-core builds SGD without the `init_state_fn` its sharded_state_dict calls on load (a TypeError on
    every resume of an SGD run): give it one that makes the state the checkpoint holds, a momentum buffer per
    parameter where its run had momentum (`saved_momentum`), so the buffers load; none where it had none."""
    def state_to_load(opt, config=None):
        for group in opt.param_groups if saved_momentum else ():
            for param in group["params"]:
                opt.state[param].setdefault("momentum_buffer", torch.zeros_like(param))

    for opt in inner_optimizers(optimizer):
        if isinstance(getattr(opt, "optimizer", None), torch.optim.SGD) and opt.init_state_fn is None:
            opt.init_state_fn = state_to_load


def _restore_adam_steps(optimizer, steps: list) -> None:
    """One `step` tensor per parameter again, at the saved count."""
    for opt, step in zip(inner_optimizers(optimizer), steps):
        if step is None or not _is_distributed_over_torch_adam(opt):
            continue
        torch_adam = getattr(opt, "optimizer", opt)
        for group in torch_adam.param_groups:
            for param in group["params"]:
                state = torch_adam.state.get(param)
                if state and "step" in state:
                    state["step"] = adam_step(param, group, step)


def _distopt_metadata(sharding_type: Optional[str]) -> dict:
    """megatron's sharded_state_dict metadata for this distributed-optimizer format (None: no DistOpt)."""
    if sharding_type is None:
        return {}
    # mem_efficient: the fully_reshardable gather runs over gloo into DP rank 0 only (the only rank that
    # writes it here), not into every rank's memory. avoid_prefix: keys of a chain of optimizers are the
    # model's parameter keys alone, not their index in the chain.
    return {"distrib_optim_sharding_type": sharding_type,
            "distrib_optim_fully_reshardable_mem_efficient": True,
            "chained_optim_avoid_prefix": True}


def _has_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return any(isinstance(opt, distrib_optimizer.DistributedOptimizer) for opt in inner_optimizers(optimizer))


def distopt_save_format() -> str:
    """The distributed optimizer format new checkpoints are written in ($MEGATRON_INT8_DISTOPT_FORMAT)."""
    return env_choice(ENV_DISTOPT_FORMAT)


distopt_save_format()  # a wrong $MEGATRON_INT8_DISTOPT_FORMAT fails at startup, not at the first save


def _parallel_layout(chunks: int) -> dict:
    """What the dp_reshardable format's bucket shards depend on, besides the DP size (chunks: model chunks)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "model_chunks": chunks,
            "dp": ps.get_data_parallel_world_size()}


def saved_distopt_format(common: dict) -> Optional[str]:
    """The distributed-optimizer format of a checkpoint (None: saved without the distributed optimizer)."""
    if "distopt_sharding_type" in common:
        return common["distopt_sharding_type"]

    def recorded(node):  # megatron's own record, in the optimizer's common state (older checkpoints)
        if isinstance(node, dict):
            if "param_state_sharding_type" in node:
                yield node["param_state_sharding_type"]
            for value in node.values():
                yield from recorded(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                yield from recorded(value)

    types = set(recorded(common.get("optimizer")))
    if len(types) > 1:
        raise CheckpointError(f"checkpoint records several distributed optimizer formats: {sorted(types)}")
    return types.pop() if types else None


def _saved_optimizer_count(common: dict) -> Optional[int]:
    """How many optimizers the checkpoint's ChainedOptimizer held (its common state: one dict, or one per index)."""
    node = common.get("optimizer")
    if not isinstance(node, dict) or not node:
        return None
    return len(node) if all(isinstance(k, int) for k in node) else 1


def check_optimizer_loadable(saved: Optional[str], common: dict, *, distributed: bool, layout: dict,
                             optimizers: int, directory: str) -> None:
    """Fail before any collective read when this run cannot take the checkpoint's optimizer state.

    saved: the checkpoint's distributed-optimizer format (None: it has a non-distributed optimizer);
    distributed, layout, optimizers: this run's optimizer kind, `_parallel_layout` and number of chained
    optimizers (megatron gives expert parameters an optimizer of their own when EP > 1)."""
    weights_only = "pass --no-load-optim to load the model weights only (fresh optimizer state)"
    if distributed != (saved is not None):
        was, now = ("with", "without") if saved is not None else ("without", "with")
        raise CheckpointError(f"{directory} was saved {was} --use-distributed-optimizer and this run is {now} it: "
                           f"its optimizer state cannot be loaded; resume {was} it, or {weights_only}")
    if saved is None:
        return
    if saved not in DISTOPT_FORMATS:
        raise CheckpointError(f"{directory}: distributed optimizer format {saved!r} is not one this trainer reads "
                           f"({', '.join(DISTOPT_FORMATS)}); {weights_only}")
    count = _saved_optimizer_count(common)
    if count is not None and count != optimizers:
        raise CheckpointError(f"{directory}: its optimizer state is split over {count} optimizer(s) and this run has "
                           f"{optimizers} (megatron gives expert parameters their own optimizer when the expert-"
                           f"parallel size is above 1): resume with expert parallelism on (EP > 1) or off as saved, "
                           f"or {weights_only}")
    saved_layout = common.get("parallel_layout")
    if saved == "dp_reshardable" and saved_layout is not None:
        diffs = [f"{k} {saved_layout[k]} -> {layout[k]}" for k in layout
                 if k != "dp" and k in saved_layout and saved_layout[k] != layout[k]]
        if diffs:
            raise CheckpointError(_dp_reshardable_message(directory, ", ".join(diffs)))


def _dp_reshardable_message(directory: str, what: str) -> str:
    return (f"{directory}: its distributed optimizer state is in megatron's dp_reshardable format, which loads "
            f"only at the layout it was saved at (any data-parallel size), and the layout changed ({what}). "
            f"Resume at the saved layout and save again (new saves are fully_reshardable unless "
            f"{ENV_DISTOPT_FORMAT} says otherwise), or pass --no-load-optim to load the model weights only")


@contextmanager
def _steps_set_aside(optimizer):
    """While megatron copies fully_reshardable state into torch Adam: no per-parameter `step` to copy.

    megatron-core 0.16.1's `_set_main_param_and_optimizer_states` copies every key of the torch state,
    and `load_parameter_state_from_fully_reshardable` leaves `step` out of what it copies from (it comes
    from the param groups, loaded just before): KeyError 'step'. The steps go back afterwards.
    """
    patched = []
    for opt in inner_optimizers(optimizer):
        if not _is_distributed_over_torch_adam(opt):
            continue
        original = opt.load_parameter_state_from_fully_reshardable

        def load(state_dict, _opt=opt, _original=original):
            torch_state = _opt.optimizer.state
            steps = {param: state.pop("step") for param, state in torch_state.items() if "step" in state}
            try:
                return _original(state_dict)
            finally:
                for param, step in steps.items():
                    torch_state[param]["step"] = step

        opt.load_parameter_state_from_fully_reshardable = load
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.load_parameter_state_from_fully_reshardable  # the class's method again


def _sharded_state_dict(model_chunks, optimizer, scheduler, *, with_optimizer: bool, is_loading: bool,
                        sharding_type: Optional[str] = None) -> dict:
    from .model import unwrap

    metadata = _distopt_metadata(sharding_type)
    models = unwrap(model_chunks)
    state = {"model": models[0].sharded_state_dict(prefix="", metadata=metadata)}
    if with_optimizer:
        if is_loading:
            _prime_distributed_optimizers(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        _common_steps_on_host(state["optimizer"])
        state["opt_param_scheduler"] = scheduler.state_dict() | {"num_steps_unit": "iterations"}
    return state


def _common_steps_on_host(state) -> None:
    """megatron-core keeps Adam's shared step (`common_step`) where torch's fused Adam holds it, on each rank's
    GPU. Its save-time check that every rank holds the same common state then compares rank 0's cuda:0 tensor
    with another rank's cuda:1 one, fails on the devices (not the values) and warns at every save of a
    data-parallel run ("Rank 1 common state dict differs ... common_step"). On the host the steps compare
    equal; loading moves them back (torch's Adam puts a fused step on its parameter's device)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "common_step" and isinstance(value, torch.Tensor):
                state[key] = value.cpu()
            else:
                _common_steps_on_host(value)


def save_checkpoint(args, iteration: int, consumed_samples: int, model_chunks, optimizer, scheduler, log,
                    fallback=None) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. `fallback`: the run's
    training.health.AutoFallback, whose moves (and streaks) the checkpoint keeps."""
    from megatron.core import dist_checkpointing

    root = args.save
    final, tmp = checkpoint_dir(root, iteration), os.path.join(root, f".tmp_iter_{iteration:07d}")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        remove_leftovers(root)
        os.makedirs(tmp)
    _barrier()
    sharding_type = distopt_save_format() if _has_distributed_optimizer(optimizer) else None
    state = _sharded_state_dict(model_chunks, optimizer, scheduler, with_optimizer=True, is_loading=False,
                                sharding_type=sharding_type)
    state["distopt_sharding_type"] = sharding_type  # how a later load reads the optimizer state
    state["parallel_layout"] = _parallel_layout(len(model_chunks))
    state["iteration"] = iteration
    state["consumed_samples"] = consumed_samples
    state["adam_steps"] = _adam_steps(optimizer)
    state["world_size"] = torch.distributed.get_world_size()
    state["args"] = saved_arguments(args)
    state["checkpoint_version"] = 3.0  # upstream Megatron-LM's current version number: it reads this key
    state["int8_fallback"] = fallback.state_dict() if fallback is not None else None
    dist_checkpointing.save(state, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    rng_file = os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt")
    torch.save(_rng_state(), rng_file)
    _fsync(rng_file)  # each rank its own file (on a shared file system, the node that wrote it)
    _barrier()
    if _rank() == 0:
        # durable before the tracker names it and retention deletes older ones: megatron fsyncs the shards and
        # their index, not common.pt, metadata.json or the folders
        _fsync_tree(tmp)
        replaced = final + ".replaced"
        if os.path.exists(final):  # the same iteration saved again (e.g. by a resumed run)
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        _fsync(root)
        _atomic_write(os.path.join(root, TRACKER_FILE), str(iteration))
        shutil.rmtree(replaced, ignore_errors=True)
        removed = apply_retention(root, iteration, getattr(args, "save_retain_interval", None),
                                  getattr(args, "most_recent_k", -1))
    _barrier()
    log(f"saved checkpoint at iteration {iteration} to {final}"
        + (f" (removed iteration(s) {', '.join(map(str, removed))}: retention)" if _rank() == 0 and removed else ""))
    return final


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def saved_arguments(args) -> argparse.Namespace:
    """The run's arguments of plain types, as the Namespace upstream Megatron-LM keeps in `common.pt`."""
    return argparse.Namespace(**{name: value for name, value in sorted(vars(args).items()) if _plain(value)})


def saved_iterations(root: str) -> list:
    """Iterations of the complete checkpoints under `root`, ascending."""
    found = [re.fullmatch(r"iter_(\d{7})", name) for name in os.listdir(root)] if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


DELETING = ".deleting"  # suffix of a checkpoint folder that retention is deleting


def remove_leftovers(root: str) -> None:
    """Delete what saves and deletions killed midway left under `root`: a save's temporary folder, a folder retention
    was deleting, and a replaced copy of an iteration saved again whose new folder is in place."""
    for name in os.listdir(root):
        stale_copy = name.endswith(".replaced") and os.path.isdir(os.path.join(root, name[:-len(".replaced")]))
        if name.startswith(".tmp_iter_") or name.endswith(DELETING) or stale_copy:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def apply_retention(root: str, latest: int, retain_interval: Optional[int], most_recent_k: int) -> list:
    """Delete the checkpoints older than `latest` that neither rule keeps; returns their iterations.

    retain_interval (Megatron-LM's --save-retain-interval): multiples of it are kept, and the latest;
    most_recent_k: the k latest are kept (-1: all). Neither given: everything is kept."""
    if retain_interval is None and most_recent_k < 0:
        return []
    keep_latest = most_recent_k if most_recent_k >= 0 else 1
    older = [i for i in saved_iterations(root) if i < latest]
    kept = set(older[max(0, len(older) - (keep_latest - 1)):]) if keep_latest > 1 else set()
    removed = [i for i in older if i not in kept and not (retain_interval is not None and i % retain_interval == 0)]
    for iteration in removed:  # renamed first: a deletion stopped midway leaves no folder that looks like a checkpoint
        doomed = checkpoint_dir(root, iteration) + DELETING
        shutil.rmtree(doomed, ignore_errors=True)  # an earlier deletion's remains, where the save's sweep missed them
        os.replace(checkpoint_dir(root, iteration), doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed


def check_save_target(args) -> None:
    """Refuse a run that would write over a --save holding checkpoints from an iteration it does not resume, a
    --load without a checkpoint (but for a first start, --load = --save), and a damaged checkpoint to load.

    Raises ArgumentError naming the way out: --load that directory, another --save, or --ckpt-step."""
    first_start = args.load and args.save and os.path.realpath(args.load) == os.path.realpath(args.save)
    if args.load and not first_start and not os.path.isdir(args.load):
        raise ArgumentError(f"--load {args.load}: no such directory")
    step = getattr(args, "ckpt_step", None)
    start = (step if step is not None else read_tracker(args.load)) if args.load else None
    saved = read_tracker(args.save) if args.save else None
    rewinds = first_start and step is not None  # its own --save from an earlier --ckpt-step: later ones replaced
    if saved is not None and not rewinds and (start is None or start < saved):
        source = (f"--load {args.load} holds iteration {start}" if start is not None else
                  f"--load {args.load} holds no checkpoint" if args.load else "no --load")
        raise ArgumentError(
            f"--save {args.save} already holds checkpoints (latest: iteration {saved}) and this run would start "
            f"{'from scratch' if start is None else f'at iteration {start}'} ({source}), writing over them and "
            f"their log. To continue that run: --load {args.save}. To start another run: a new --save directory.")
    if args.load and start is None and (not first_start or saved_iterations(args.load)):
        # a first start (--load is --save, still empty) begins at 0; anywhere else no checkpoint is an error
        raise ArgumentError(no_checkpoint_message(args.load))
    if args.load and start is not None:
        try:  # the checkpoint to load is whole: a damaged one fails before anything is built
            check_checkpoint_files(latest_checkpoint_dir(args.load, step))
        except CheckpointError as error:
            raise ArgumentError(str(error)) from None


def _saved_dict(saved_args) -> dict:
    """A checkpoint's recorded arguments as a dict (a Namespace, as upstream Megatron-LM stores them, or a dict);
    {} where it has none."""
    if isinstance(saved_args, argparse.Namespace):
        return vars(saved_args)
    return saved_args if isinstance(saved_args, dict) else {}


def _changed_flags(saved: dict, args, names) -> list:
    """'--flag then -> now' for each of `names` that the checkpoint's arguments record with another value."""
    return [f"--{name.replace('_', '-')} {saved[name]} -> {getattr(args, name, None)}" for name in names
            if name in saved and saved[name] != getattr(args, name, None)]


def _check_architecture(saved, args) -> None:
    saved = _saved_dict(saved)
    names = ARCHITECTURE_ARGS
    if getattr(args, "position_embedding_type", None) == "learned_absolute":
        names += ("max_position_embeddings",)  # the rows of the learned position table
    diffs = [f"{name}: checkpoint {saved[name]!r}, now {getattr(args, name, None)!r}"
             for name in names if name in saved and saved[name] != getattr(args, name, None)]
    if diffs:
        raise ArgumentError("checkpoint does not match the model arguments: " + "; ".join(diffs))


def _check_optimizer_kind(saved, args) -> None:
    """A resume that loads the optimizer state needs the optimizer that wrote it: another --optimizer has other
    state, and without the distributed optimizer --bf16 on or off is another megatron wrapper (fp32 master copies
    or none); megatron's load fails with a KeyError after the build. The distributed optimizer keeps the same
    state either way, and the precision-aware optimizer's moments convert (neither refused)."""
    saved = _saved_dict(saved)
    if args.no_load_optim or getattr(args, "skip_train", False):
        return
    diffs = _changed_flags(saved, args, ("optimizer",))
    distributed = saved.get("use_distributed_optimizer") or args.use_distributed_optimizer  # a change is refused later
    if "bf16" in saved and bool(saved["bf16"]) != bool(args.bf16) and not distributed:
        diffs.append(f"{'--bf16' if saved['bf16'] else 'no --bf16'} -> {'--bf16' if args.bf16 else 'no --bf16'}")
    if diffs:
        raise ArgumentError(f"the checkpoint's optimizer state is of another optimizer than this run's "
                            f"({'; '.join(diffs)}): resume with the checkpoint's flags, or pass --no-load-optim to "
                            f"load the model weights only (fresh optimizer state)")


def check_architecture_before_build(args) -> None:
    """The model flags (and the optimizer kind, where its state is loaded) against the checkpoint --load will
    resume (where one exists), before anything is built: a mismatch is one line naming each flag, not a failed
    load after the model and optimizer were built."""
    directory = _resumed_dir(args)
    if directory is None:
        return
    saved = _load_common(directory).get("args", {})
    _check_architecture(saved, args)
    _check_optimizer_kind(saved, args)


# The LR/WD schedule's flags: a resume follows the values given now (Megatron-LM's --override-opt_param-scheduler)
SCHEDULE_ARGS = ("lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "lr_warmup_init",
                 "weight_decay", "train_iters")


# The optimizer's own flags: a resume takes the values given now too (loaded param groups would keep the saved ones)
OPTIMIZER_ARGS = ("adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum")


def _this_runs_group_settings(args) -> dict:
    """Param-group keys that this run's flags set: the LR bounds (--lr, --min-lr) and the optimizer's constants."""
    return {"max_lr": args.lr, "min_lr": args.min_lr, "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_eps, "momentum": args.sgd_momentum}


def _take_this_runs_group_settings(optimizer_state, args) -> None:
    """The saved param groups' max_lr / min_lr, betas, eps and momentum set to this run's flags before they are
    loaded (each where the group has it).

    Loaded param groups replace the optimizer's, and what they carry overrides the scheduler's values and the
    optimizer's construction; megatron-core 0.19 also finds each saved group by its (max_lr, min_lr, ...) and
    refuses a checkpoint where they differ. Betas, eps and momentum are no part of that match."""
    if isinstance(optimizer_state, dict):
        for key, value in optimizer_state.items():
            if key == "param_groups" and isinstance(value, list):
                for group in value:
                    group.update({k: v for k, v in _this_runs_group_settings(args).items() if k in group})
            else:
                _take_this_runs_group_settings(value, args)
    elif isinstance(optimizer_state, (list, tuple)):
        for value in optimizer_state:
            _take_this_runs_group_settings(value, args)


# Model flags that change what the loaded weights compute, not their shapes: a resume may change them (a new RoPE
# base extends the context), but says so; each counts only where the model uses it
MODEL_FUNCTION_ARGS = {"norm_epsilon": None, "rotary_base": "rope", "rotary_percent": "rope",
                       "use_rope_scaling": "rope", "rope_scaling_factor": "rope scaling", "moe_router_topk": "moe"}


def model_change(saved_args, args) -> Optional[str]:
    """A note where this run's model computes otherwise with the checkpoint's weights than the run that trained
    them (None where the flags agree or the checkpoint predates them)."""
    saved = _saved_dict(saved_args)
    uses = {None: True, "rope": getattr(args, "position_embedding_type", None) == "rope",
            "rope scaling": getattr(args, "position_embedding_type", None) == "rope"
            and (getattr(args, "use_rope_scaling", False) or saved.get("use_rope_scaling")),
            "moe": bool(getattr(args, "num_experts", None))}
    changed = _changed_flags(saved, args, [name for name, needs in MODEL_FUNCTION_ARGS.items() if uses[needs]])
    if not changed:
        return None
    return (f"model: this run's flags, not the checkpoint's ({'; '.join(changed)}): the loaded weights were trained "
            f"under the checkpoint's values")


def precision_change(saved_args, args) -> Optional[str]:
    """A note where this run trains in other numerics than the run that wrote the checkpoint (allowed: a resume
    may switch precision, but says so, e.g. after a default changed); None where they agree or the checkpoint's
    arguments predate the flags."""
    try:
        before = policy_from_args(saved_args).describe()
    except (AttributeError, ValueError):
        return None
    now = policy_from_args(args).describe()
    return None if before == now else f"precision: this run's {now}, not the checkpoint's {before}"


# What decides which samples come next: a resume may change them (allowed, as Megatron-LM does), but says so
DATA_ARGS = ("data_path", "mock_data", "split", "seq_length", "global_batch_size")


def _data_seed(run: dict):
    """The seed of the data order: --data-seed, else --seed."""
    return run.get("data_seed") if run.get("data_seed") is not None else run.get("seed")


def data_change(saved_args, args) -> Optional[str]:
    """A note where this run reads other samples from here on than the checkpoint's run would have (None where the
    flags agree or the checkpoint predates them). A new global batch leaves the LR schedule as the iterations put
    it (it counts optimizer steps), which the note says."""
    saved = _saved_dict(saved_args)

    def same(name, then, now):
        if name == "split" and then is not None and now is not None:
            try:
                return split_shares(then) == split_shares(now)  # '98,2,0' is '98, 2'
            except ArgumentError:
                return then == now
        return then == now

    def shown(value):
        return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value

    changed = [f"--{name.replace('_', '-')} {shown(saved[name])} -> {shown(getattr(args, name, None))}"
               for name in DATA_ARGS if name in saved and not same(name, saved[name], getattr(args, name, None))]
    if "seed" in saved and _data_seed(saved) != _data_seed(vars(args)):
        changed.append(f"data order seed (--data-seed, else --seed) {_data_seed(saved)} -> {_data_seed(vars(args))}")
    if not changed:
        return None
    schedule = (" (the LR schedule counts iterations: it goes on from the checkpoint's iteration)"
                if "global_batch_size" in saved and saved["global_batch_size"] != args.global_batch_size else "")
    return (f"data: this run's flags, not the checkpoint's ({'; '.join(changed)}): the samples from here on differ "
            f"from those the checkpoint's run would have read{schedule}")


def _schedule_position(saved_state: Optional[dict], iteration: int) -> int:
    """The optimizer steps the checkpoint's schedule had taken: its own count where it counts steps; the
    checkpoint's iteration where it predates that (its count was megatron's, in samples)."""
    if saved_state and saved_state.get("num_steps_unit") == "iterations":
        return int(saved_state["num_steps"])
    return iteration


def follow_schedule_flags(scheduler, optimizer, saved_state: Optional[dict], iteration: int, saved_args, args,
                          log) -> None:
    """Put the scheduler at the checkpoint's step count on this run's schedule, and say what changed.

    megatron's OptimizerParamScheduler.load_state_dict keeps the checkpoint's max/min LR, warm-up, decay length
    and style (and the loaded param groups the checkpoint's max_lr/min_lr, unless _take_this_runs_group_settings
    set them): a run resumed with a longer --train-iters (or a new --lr) would silently follow the old schedule. Only
    the position is taken, in optimizer steps, so a new --global-batch-size leaves it where the iterations put it.
    The optimizer's betas, eps or momentum, where given anew, are said too."""
    scheduler.num_steps = 0
    scheduler.step(increment=_schedule_position(saved_state, iteration))
    saved = _saved_dict(saved_args)
    changed = _changed_flags(saved, args, SCHEDULE_ARGS)
    if changed:
        log(f"LR schedule: this run's flags, not the checkpoint's ({'; '.join(changed)}); learning rate now "
            f"{optimizer.param_groups[0]['lr']:.4E}")
    in_use = [name for name in OPTIMIZER_ARGS if name.startswith(args.optimizer)]
    changed = _changed_flags(saved, args, in_use)
    if changed:
        group = optimizer.param_groups[0]
        now = {k: group[k] for k in ("betas", "eps", "momentum") if k in group}
        log(f"optimizer: this run's flags, not the checkpoint's ({'; '.join(changed)}); now "
            + ", ".join(f"{k} {v}" for k, v in now.items()))


def load_checkpoint(args, model_chunks, optimizer, scheduler, log, fallback=None) -> Tuple[int, int]:
    """Resume from --load; returns (iteration, consumed_samples), (0, 0) when there is no checkpoint.
    `fallback` (a training.health.AutoFallback) gets the checkpoint's fallback state."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from ..ops.linear import invalidate_weight_caches
    from .model import unwrap

    directory = _resumed_dir(args)
    if directory is None:
        # check_save_target let it through: --load is --save, on the first start of a run
        log(f"no checkpoint in {args.load} yet (it is also --save): starting from iteration 0")
        return 0, 0
    common = _load_common(directory)
    iteration = int(common["iteration"])
    _check_architecture(common.get("args", {}), args)
    check_checkpoint_files(directory)
    layout = _parallel_layout(len(model_chunks))
    rng_state = None if args.no_load_rng else _saved_rng_state(directory, common, layout, log)
    if fallback is not None:
        fallback.load_state_dict(common.get("int8_fallback"))
        saved_ep = _saved_dict(common.get("args")).get("expert_model_parallel_size") or 1
        regrouped = fallback.regroup_experts(getattr(args, "num_experts", None) or 0, saved_ep,
                                             args.expert_model_parallel_size)
        if regrouped:
            log(f"int8 fallback: the checkpoint's expert moves, saved under expert parallelism {saved_ep}, apply to "
                f"the experts' slots under {args.expert_model_parallel_size}: {', '.join(regrouped)}")
    with_optimizer = not args.no_load_optim
    saved_format = saved_distopt_format(common)
    if with_optimizer:
        check_optimizer_loadable(saved_format, common, distributed=_has_distributed_optimizer(optimizer), layout=layout,
                                 optimizers=len(inner_optimizers(optimizer)), directory=directory)
        _sgd_state_to_load(optimizer, _saved_dict(common.get("args")).get("sgd_momentum", args.sgd_momentum))
    state = _sharded_state_dict(model_chunks, optimizer, scheduler, with_optimizer=with_optimizer, is_loading=True,
                                sharding_type=saved_format if with_optimizer else None)
    with torch.no_grad():  # the distributed optimizer copies into views of leaf parameters
        try:
            with weights_only_loading(directory):
                loaded = dist_checkpointing.load(state, directory)
        except (CheckpointingException, CheckpointException) as error:
            # dp_reshardable, saved before `parallel_layout` was recorded: megatron finds buckets of another size
            if with_optimizer and saved_format == "dp_reshardable" and "optimizer.distributed" in str(error):
                raise CheckpointError(_dp_reshardable_message(
                    directory, "its optimizer buckets do not match this run's: the error above")) from error
            raise
        unwrap(model_chunks)[0].load_state_dict(loaded["model"], strict=True)
        if not with_optimizer and optimizer is not None:
            # the weights alone (--no-load-optim): the optimizer's master weights were made from the initial
            # weights, and its first step would write them back over the loaded ones (as megatron-LM does)
            optimizer.reload_model_params()
            for inner in precision_aware_optimizers(optimizer):
                inner.reload_masters()
            if scheduler is not None:  # a fresh optimizer state, but the run goes on at the checkpoint's iteration:
                # so does its LR schedule (megatron-LM restarts the warm-up there, then decays past --train-iters)
                follow_schedule_flags(scheduler, optimizer, common.get("opt_param_scheduler"), iteration,
                                      common.get("args"), args, log)
        if with_optimizer:
            _take_this_runs_group_settings(loaded["optimizer"], args)
            with _steps_set_aside(optimizer):
                optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer, common.get("adam_steps", []))
            follow_schedule_flags(scheduler, optimizer, common.get("opt_param_scheduler"), iteration,
                                  common.get("args"), args, log)
    for change in (model_change(common.get("args"), args), precision_change(common.get("args"), args),
                   data_change(common.get("args"), args)):
        if change:
            log(change)
    invalidate_weight_caches()  # loaded weights must not reuse INT8 quantizations of the old ones
    if rng_state is not None:
        _set_rng_state(rng_state)
    if with_optimizer and saved_format is not None:
        log(f"optimizer state: distributed optimizer, {saved_format} format, Adam steps {_adam_steps(optimizer)}")
    log(f"loaded checkpoint {directory} (iteration {iteration}, consumed samples {common['consumed_samples']})")
    return iteration, int(common["consumed_samples"])
