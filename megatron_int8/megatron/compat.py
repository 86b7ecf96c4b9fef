"""Run megatron-core models on a CPU-only torch build (gloo), for CI and development.

megatron-core assumes CUDA in a few places that a CPU model actually reaches:
- `torch.cuda.current_device()` is used as a `device=` argument (RoPE, all-gather buffers, grad
  buffers): on CPU it answers "cpu";
- the model-parallel RNG tracker seeds and forks the CUDA generator (attention dropout, activation
  recompute): on CPU a tracker over torch's CPU generator replaces it;
- `torch.cuda.synchronize/empty_cache` and streams (pipeline p2p, dist_checkpointing): no-ops;
- the MoE all-to-all dispatcher passes split sizes as tensors, which only become host lists on
  GPU (`maybe_move_tensor_to_cpu`); on CPU `all_to_all_single` gets lists;
- `WrappedTorchNorm` refuses sequence parallelism: `SequenceParallelNorm` accepts it.

Independently of the device, `apply_no_te_compat()` fixes a megatron-core 0.16.1 bug that breaks
every MoE router without Transformer Engine (see its docstring); the MoE specs call it.

`apply_cpu_compat()` is idempotent and does nothing when CUDA is available, so the same code path
serves CPU tests and GPU runs.

**Versions.** megatron-core 0.16.1 through 0.19.x are supported. Every difference between them that this package
meets is handled here, each under the version that introduced it (`MCORE_VERSION`, `mcore_at_least`); the layers,
specs and trainer call these helpers and never test a version themselves.
"""
from __future__ import annotations

import contextlib

import torch

from ..ops.rms_norm import FusedRMSNorm

_APPLIED_FLAG = "_megatron_int8_cpu_compat"

OLDEST_SUPPORTED = (0, 16, 1)
FIRST_UNSUPPORTED = (0, 20, 0)


def _installed_version() -> tuple:
    from megatron.core import package_info

    return (int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH))


MCORE_VERSION = _installed_version()


def check_supported(version: tuple = MCORE_VERSION) -> None:
    """Refuse a megatron-core outside the tested range with one line naming it and the range."""
    if not OLDEST_SUPPORTED <= tuple(version) < FIRST_UNSUPPORTED:
        found, oldest = ".".join(map(str, version)), ".".join(map(str, OLDEST_SUPPORTED))
        pin = f">={oldest},<{FIRST_UNSUPPORTED[0]}.{FIRST_UNSUPPORTED[1]}"
        raise ImportError(f"megatron-int8 supports megatron-core {pin}; found {found}: "
                          f"pip install 'megatron-core{pin}'")


check_supported()


def mcore_at_least(major: int, minor: int, patch: int = 0) -> bool:
    return MCORE_VERSION >= (major, minor, patch)


# Keywords that megatron-core passes to a linear's local GEMM call (`_forward_impl`) beyond those of 0.16, with the
# value that leaves the feature off and what the feature is.
LINEAR_GEMM_OPTIONS = {
    "gtp_remat_size": (1, "0.19: generalized tensor-parallel weight rematerialization (gtp_weight_remat_size)"),
}


def check_linear_gemm_options(layer: str, options: dict) -> None:
    """An INT8 linear runs a newer keyword's feature only at its "off" value: anything else is refused by name."""
    for name, value in options.items():
        if name not in LINEAR_GEMM_OPTIONS:
            raise TypeError(f"{layer}._forward_impl: unknown keyword {name!r} from megatron-core "
                            f"{'.'.join(map(str, MCORE_VERSION))}")
        off, feature = LINEAR_GEMM_OPTIONS[name]
        if value != off:
            raise NotImplementedError(f"{layer}: {name}={value!r} is not supported in INT8 ({feature})")


def null_tokenizer_metadata() -> dict:
    """`MegatronTokenizer.from_pretrained` metadata of the NullTokenizer (mock data): its library is "null-text"
    from 0.17 (0.16: "null"; 0.17 asks for a tokenizer path for any other name)."""
    return {"library": "null-text" if mcore_at_least(0, 17) else "null", "model_type": "gpt"}


def read_states_through_optimizer(distributed_optimizer) -> None:
    """From 0.17, `DistributedOptimizer._get_main_param_and_optimizer_states` skips an optimizer's states that are
    not tensors, and this package's INT8 moments (`ops.adamw.BlockQuantized`) are not: this optimizer instance
    reads every state through its inner optimizer's `get_unscaled_state`, as 0.16 does."""
    if not mcore_at_least(0, 17):
        return

    def main_param_and_optimizer_states(model_param):
        group_index, group_order = distributed_optimizer.model_param_group_index_map[model_param]
        inner = distributed_optimizer.optimizer
        shard = inner.param_groups[group_index]["params"][group_order]
        tensors = {key: inner.get_unscaled_state(shard, key) for key in inner.state[shard]}
        tensors["param"] = tensors.pop("master_param")
        return tensors

    distributed_optimizer._get_main_param_and_optimizer_states = main_param_and_optimizer_states


def experts_spec(module: type, submodules):
    """What `BackendSpecProvider.grouped_mlp_modules` returns: from 0.17 one builder of the experts (a ModuleSpec
    is callable); 0.16 takes the class and its submodules apart and sets their activation itself."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if mcore_at_least(0, 17):
        return ModuleSpec(module=module, submodules=submodules)
    return module, submodules


class _NullEvent:
    """Stands in for torch.cuda.Event: CPU work is already complete when recorded."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's named RNG streams (model-parallel, expert-parallel, ...) on torch's CPU generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _with_list_split_sizes(all_to_all_single):
    def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = lambda sizes: sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes  # noqa: E731
        return all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes),
                                 *args, **kwargs)

    return wrapper


def apply_no_te_compat() -> None:
    """Without Transformer Engine, megatron-core 0.16.1's `RouterGatingLinearFunction` reads the
    never-defined name `te_general_gemm` (moe_utils.py:1192) unless the router runs in fp64: define
    it as None, which selects the existing torch fallback. No effect when TE is installed."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_cpu_compat() -> None:
    """Make a CPU-only process able to build, train, recompute and checkpoint megatron-core models.

    No effect when CUDA is available (except `apply_no_te_compat`); calling it again is a no-op.
    """
    apply_no_te_compat()
    if torch.cuda.is_available() or getattr(torch.cuda, _APPLIED_FLAG, False):
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # every megatron call site passes it as device=...
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.Event = _NullEvent
    main_stream = _NullStream()
    torch.cuda.current_stream = lambda *args, **kwargs: main_stream
    torch.cuda.default_stream = lambda *args, **kwargs: main_stream

    torch.distributed.all_to_all_single = _with_list_split_sizes(torch.distributed.all_to_all_single)

    tracker_class = _make_cpu_rng_tracker_class()
    # Any later (re)initialization of the tracker builds the CPU one too.
    mrandom.CudaRNGStatesTracker = tracker_class
    mrandom._CUDA_RNG_STATE_TRACKER = tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute snapshots and restores the "device" generator: on CPU that is torch's.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    setattr(torch.cuda, _APPLIED_FLAG, True)


def model_parallel_seed(seed: int, cuda_graph_safe: bool = False) -> None:
    """Seed torch and megatron's model-parallel RNG streams (megatron's offsets), on CPU or GPU.

    Call after `parallel_state.initialize_model_parallel`. `cuda_graph_safe`: the streams are generators
    that a captured CUDA graph can register (GPU only).
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    apply_cpu_compat()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graph_safe)


class SequenceParallelNorm:
    """RMSNorm / LayerNorm (per `config.normalization`) that also works under sequence parallelism.
    RMSNorm is `FusedRMSNorm` (torch's module, with a Triton kernel on CUDA).

    Same constructor as megatron's `WrappedTorchNorm` and the same parameters (state-dict keys
    `weight` [, `bias`]). Under SP every TP rank sees different tokens, so the norm's parameter
    gradients differ per rank: the parameters are tagged `sequence_parallel`, which makes
    `finalize_model_grads` all-reduce them over the TP group, as it does for TENorm.
    """

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,  # apex kernel choice; no meaning for torch norms
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
        int8_copy: bool = False,  # RMSNorm: keep the input's INT8 copy for backward (recipe int8_norm_input)
    ):
        if int8_copy and config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelNorm: an INT8 input copy needs RMSNorm, not {config.normalization}")
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("SequenceParallelNorm: zero-centered gamma is not supported (use TENorm)")
        if config.memory_efficient_layer_norm:
            raise ValueError("SequenceParallelNorm: memory_efficient_layer_norm needs apex")
        if config.normalization == "RMSNorm":
            norm = FusedRMSNorm(hidden_size, eps=eps, int8_copy=int8_copy)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"SequenceParallelNorm: unsupported normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
