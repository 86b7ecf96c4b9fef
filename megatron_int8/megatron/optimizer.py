"""A precision-aware AdamW for megatron-core without Transformer Engine (Megatron-LM's
--use-precision-aware-optimizer, --exp-avg-dtype, --exp-avg-sq-dtype, --main-params-dtype and
store_param_remainders), on ops/adamw.py's fused step.

megatron-core 0.16.1 implements the precision-aware optimizer in its DistributedOptimizer, for Transformer
Engine's FusedAdam only (OptimizerConfig refuses the flag without it). `PrecisionAwareAdamW` offers the
part of FusedAdam's interface that megatron calls, so megatron's own code paths run unchanged:

- With --use-distributed-optimizer (`build_precision_aware_optimizer` sets megatron's precision-aware
  switches): megatron allocates no fp32 main params; the optimizer receives the bf16 parameter shards,
  reads the reduce-scattered fp32 gradients from `decoupled_grad` (megatron's clipping and Inf/NaN checks
  read them there too), holds the master weight (fp32, or the int16 remainder of the bf16 shard), and
  writes the bf16 shard, which megatron then all-gathers. Checkpoints go through `get_unscaled_state` /
  `set_scaled_state`: megatron saves fp32 values in its usual layout, so every format, resharding across
  TP/DP sizes, and loading an fp32-state checkpoint into INT8 states (or the reverse) work as for torch's
  AdamW; power-of-two block scales make the fp32 round trip exact.
- Without it (megatron's Float16OptimizerWithFloat16Params): megatron keeps its fp32 main params and
  copies them to the bf16 params; the optimizer updates the fp32 main params in place and holds the
  moments compressed. Remainders need the distributed optimizer (megatron's fp32 main params there are
  the master weights: 4 bytes, allocated by megatron).
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch

from ..ops.adamw import (STATE_DTYPES, AdamWScalars, BlockQuantized, adamw_step, merge_remainder, moment_to_fp32,
                         new_moment, split_remainder, store_moment)
from .compat import read_states_through_optimizer

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# what megatron's dp_reshardable load hands set_scaled_state beside the states (a bool per bucket entry)
MEGATRON_BOOKKEEPING = ("padding",)


class PrecisionAwareAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay) with fp32, bf16 or INT8 moments and an fp32 or remainder master weight.

    A subclass of torch's AdamW only so that megatron's DistributedOptimizer accepts it; it shares none of
    its code. master_weights: the params are bf16 model (shards) and the optimizer keeps their master
    weights; otherwise the params are fp32 masters updated in place. use_decoupled_grad: gradients are read
    from `param.decoupled_grad` (fp32) instead of `.grad`."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *,
                 exp_avg_dtype: str = "fp32", exp_avg_sq_dtype: str = "fp32", master_weights: bool = False,
                 store_param_remainders: bool = False, use_decoupled_grad: bool = False):
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in STATE_DTYPES:
                raise ValueError(f"{name} {dtype!r}: expected one of {', '.join(STATE_DTYPES)}")
        if store_param_remainders and not master_weights:
            raise ValueError("store_param_remainders needs master_weights (the optimizer holding the master "
                             "weights of bf16 parameters)")
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                                          weight_decay=weight_decay))
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.master_weights, self.store_param_remainders = master_weights, store_param_remainders
        self.use_decoupled_grad = use_decoupled_grad
        for group in self.param_groups:
            for param in group["params"]:
                self._check_param(param)

    def _check_param(self, param: torch.Tensor) -> None:
        if self.master_weights:
            if self.store_param_remainders and param.dtype != torch.bfloat16:
                raise ValueError(f"--store-param-remainders needs bf16 parameters (--bf16), got {param.dtype}: "
                                 "the remainder is the 16 bits an fp32 master weight has beyond its bf16 value")
            if param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"precision-aware AdamW: unsupported parameter dtype {param.dtype}")
        elif param.dtype != torch.float32:
            raise ValueError(f"precision-aware AdamW without master weights updates fp32 parameters, got {param.dtype}")
        if not param.is_contiguous():
            raise ValueError("precision-aware AdamW needs contiguous parameters")

    # --- state -------------------------------------------------------------------------------------------

    def initialize_state(self, param: torch.Tensor) -> None:
        """Zero moments, step 0, and (master_weights) the master weight from the parameter's value."""
        numel, device = param.numel(), param.device
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = new_moment(numel, self.exp_avg_dtype, False, device)
        state["exp_avg_sq"] = new_moment(numel, self.exp_avg_sq_dtype, True, device)
        if self.master_weights:
            state["master_param"] = self._new_master(param)

    def _new_master(self, param: torch.Tensor) -> torch.Tensor:
        """The master weight of the parameter's current value: its int16 remainder (zero), the fp32
        parameter itself (megatron hands fp32 parameters' shards over as they are), or an fp32 copy."""
        flat = param.detach().view(-1)
        if self.store_param_remainders:
            return torch.zeros(flat.numel(), dtype=torch.int16, device=flat.device)
        return flat if flat.dtype == torch.float32 else flat.float()

    def reload_masters(self) -> None:
        """Master weights of the parameters' current values (after the weights alone were loaded): megatron's
        reload_model_params leaves the precision-aware optimizer's masters to the optimizer."""
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if state and "master_param" in state:
                    master = self._new_master(param)
                    if master.data_ptr() != state["master_param"].data_ptr():
                        state["master_param"].copy_(master)

    def initialize_all_states(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if not self.state.get(param):
                    self.initialize_state(param)

    def get_unscaled_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """A state as fp32 values, flat (megatron's DistributedOptimizer saves these); 'step' as stored."""
        state = self.state[param]
        if key == "step":
            return state["step"]
        if key in MOMENT_KEYS:
            return moment_to_fp32(state[key])
        if key == "master_param":
            master = state["master_param"]
            if master.dtype == torch.int16:
                return merge_remainder(param.detach().reshape(-1), master).clone()
            return master.clone()
        raise KeyError(f"precision-aware AdamW has no state {key!r}")

    def set_scaled_state(self, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """Set a state from values (fp32, flat or the parameter's shape), in this optimizer's format. The
        master weight also sets the bf16 parameter (its high half, for remainders)."""
        if key in MEGATRON_BOOKKEEPING:
            return
        state = self.state[param]
        if not state:
            self.initialize_state(param)
        if key == "step":
            state["step"] = value.detach().to(device="cpu", dtype=torch.float32).clone()
        elif key in MOMENT_KEYS:
            store_moment(state[key], value.float())
        elif key == "master_param":
            self._set_master(param, value)
        else:
            raise KeyError(f"precision-aware AdamW has no state {key!r}")

    def _set_master(self, param: torch.Tensor, value: torch.Tensor) -> None:
        flat = param.detach().view(-1)
        value = value.detach().reshape(-1)
        if value.numel() != flat.numel():
            raise ValueError(f"master weight of {value.numel()} elements for a parameter of {flat.numel()}")
        master = self.state[param]["master_param"]
        if value.dtype == torch.int16:  # a remainder, of this parameter's bf16 value
            value = merge_remainder(flat, value.to(flat.device))
        value = value.to(device=flat.device, dtype=torch.float32)
        if master.dtype == torch.int16:
            high, remainder = split_remainder(value.contiguous())
            flat.copy_(high)
            master.copy_(remainder)
        else:
            master.copy_(value)
            flat.copy_(value)

    # --- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self):
        """torch's layout. Without master weights (megatron's Float16 optimizer saves these tensors in the
        parameters' shapes) the moments come as fp32 tensors; with them (megatron's DistributedOptimizer
        reads the values through get_unscaled_state and only hands this back to load_state_dict) as stored."""
        state_dict = super().state_dict()
        if not self.master_weights:
            params = [p for g in self.param_groups for p in g["params"]]
            state_dict["state"] = {  # new dicts: torch's state_dict shares the live ones
                index: {key: moment_to_fp32(value).view(params[index].shape) if key in MOMENT_KEYS else value
                        for key, value in state.items()}
                for index, state in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        """Load torch's layout: moments as fp32/bf16 tensors of any shape or as stored, 'master_param' as
        fp32 or as an int16 remainder; each is converted to this optimizer's formats (a state already in
        them is taken as is)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded optimizer state does not match this optimizer's parameter groups")
        saved_state = state_dict["state"]
        new_state = {}
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for index, param in zip(saved["params"], group["params"]):
                if index in saved_state:
                    new_state[param] = self._converted(param, saved_state[index])
        self.state.clear()
        self.state.update(new_state)

    def _converted(self, param: torch.Tensor, saved: dict) -> dict:
        ours = {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype}
        state = {}
        for key, value in saved.items():
            if key == "step":
                state["step"] = torch.as_tensor(value).detach().to(device="cpu", dtype=torch.float32).clone()
            elif key in MOMENT_KEYS:
                if _in_format(value, ours[key], param.numel()):
                    state[key] = value
                else:
                    state[key] = new_moment(param.numel(), ours[key], key == "exp_avg_sq", param.device)
                    store_moment(state[key], moment_to_fp32(value).to(param.device))
            elif key == "master_param":
                state["master_param"] = value
            else:
                raise KeyError(f"precision-aware AdamW: unknown optimizer state {key!r} in the loaded state")
        if not self.master_weights:
            if "master_param" in state:
                raise ValueError("a state with master weights loaded into an optimizer without them")
            return state
        value = state.pop("master_param", None)
        state["master_param"] = master = self._new_master(param)
        if value is None:  # saved without master weights: the parameter's value is the master
            return state
        if value.dtype == master.dtype and value.numel() == master.numel() and value.device == master.device \
                and master.data_ptr() != param.data_ptr():
            state["master_param"] = value  # already this optimizer's form: no copy
            if value.dtype == torch.int16:
                return state  # the remainder of the parameter's current bf16 value
        self.state[param] = state
        try:
            self._set_master(param, value)
        finally:
            del self.state[param]
        return state

    # --- the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("precision-aware AdamW takes no closure")
        scalars: Dict[tuple, AdamWScalars] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if not state:
                    self.initialize_state(param)
                state["step"] += 1
                key = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], int(state["step"]))
                if key not in scalars:
                    scalars[key] = AdamWScalars.of(lr=key[0], beta1=beta1, beta2=beta2, eps=key[3],
                                                   weight_decay=key[4], step=key[5])
                adamw_step(param.detach().view(-1), grad.detach().reshape(-1), state["exp_avg"], state["exp_avg_sq"],
                           scalars[key], state.get("master_param"))


def _in_format(value, dtype: str, numel: int) -> bool:
    if dtype == "int8":
        return isinstance(value, BlockQuantized) and value.numel() == numel
    return isinstance(value, torch.Tensor) and value.dtype == STATE_DTYPES[dtype] and value.dim() == 1 \
        and value.numel() == numel


@contextlib.contextmanager
def _megatron_builds(factory):
    """While get_megatron_optimizer runs: its Adam is `factory` (megatron passes FusedAdam's keywords), and
    its Transformer Engine version checks answer 'too old' instead of failing on a missing TE."""
    import megatron.core.optimizer as mcore_optimizer

    names = ("USING_PYTORCH_OPTIMIZER", "Adam", "is_te_min_version")
    saved = {name: getattr(mcore_optimizer, name) for name in names}
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = False
    mcore_optimizer.Adam = factory
    mcore_optimizer.is_te_min_version = lambda *args, **kwargs: False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mcore_optimizer, name, value)


def build_precision_aware_optimizer(config, model_chunks, *, exp_avg_dtype: str, exp_avg_sq_dtype: str,
                                    store_param_remainders: bool):
    """megatron's optimizer (DistributedOptimizer or Float16OptimizerWithFloat16Params, as
    config.use_distributed_optimizer says) over PrecisionAwareAdamW.

    config: megatron's OptimizerConfig for Adam, built without the precision-aware switch (its check
    looks for Transformer Engine); this sets megatron's switches where megatron reads them."""
    from megatron.core.optimizer import get_megatron_optimizer

    if config.optimizer != "adam":
        raise ValueError(f"the precision-aware optimizer is an AdamW; --optimizer {config.optimizer} has none")
    if not config.decoupled_weight_decay:
        raise ValueError("the precision-aware optimizer implements AdamW (decoupled weight decay) only")
    options = dict(exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype)
    if not config.use_distributed_optimizer:
        if store_param_remainders:
            raise ValueError("--store-param-remainders needs --use-distributed-optimizer: without it megatron "
                             "keeps its own fp32 main params as the master weights")
        optimizer = get_megatron_optimizer(config, model_chunks)
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            torch_adam = inner.optimizer
            if torch_adam is None:
                continue
            groups = [dict(g) for g in torch_adam.param_groups]
            inner.optimizer = PrecisionAwareAdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                                  eps=config.adam_eps, weight_decay=config.weight_decay, **options)
            inner.init_state_fn = lambda opt, config=None: opt.initialize_all_states()
        return optimizer

    def factory(params, *, lr, weight_decay, betas, eps, adam_w_mode=True, master_weights=False,
                use_decoupled_grad=False, master_weight_dtype=torch.float32, **megatron_dtypes):
        if not adam_w_mode:
            raise ValueError("the precision-aware optimizer implements AdamW (decoupled weight decay) only")
        if master_weight_dtype != torch.float32:
            raise ValueError(f"master weight dtype {master_weight_dtype}: only fp32 (or its remainder) is supported")
        return PrecisionAwareAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                   master_weights=master_weights, use_decoupled_grad=use_decoupled_grad,
                                   store_param_remainders=store_param_remainders and master_weights, **options)

    # megatron's DistributedOptimizer hands the optimizer the bf16 shards (no fp32 main params) and the
    # gradients as `decoupled_grad` where these two are set; its dummy states for a fresh load stay fp32
    # (config.exp_avg_dtype), which load_state_dict converts.
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = store_param_remainders
    with _megatron_builds(factory):
        optimizer = get_megatron_optimizer(config, model_chunks)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(getattr(inner, "optimizer", None), PrecisionAwareAdamW):
            read_states_through_optimizer(inner)
    return optimizer


def precision_aware_optimizers(optimizer) -> list:
    """The PrecisionAwareAdamW instances inside megatron's optimizer."""
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(getattr(inner, "optimizer", None), PrecisionAwareAdamW)]
