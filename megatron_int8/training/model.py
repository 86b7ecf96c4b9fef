"""Process groups, the GPT model (INT8 or BF16 spec), DDP, megatron's optimizer and LR schedule."""
from __future__ import annotations

import datetime
import os
import random
import socket
from typing import List

import numpy as np
import torch

from ..megatron.compat import apply_cpu_compat, model_parallel_seed
from .args import transformer_config_from_args


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_distributed(args) -> None:
    """torch.distributed (NCCL on GPU, gloo on CPU) and megatron's TP/PP/DP/EP groups.

    A plain `python -m megatron_int8.pretrain` (no torchrun) runs as a world of one.
    """
    from megatron.core import parallel_state

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        apply_cpu_compat()
    backend = args.distributed_backend or ("nccl" if use_cuda else "gloo")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def destroy_distributed() -> None:
    """Tear down the process groups this process made; NCCL warns of leaked resources at exit otherwise."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def set_random_seed(seed: int, cuda_graph_safe: bool = False) -> None:
    """Megatron-LM's seeding: one seed per pipeline stage, megatron's TP/EP streams on top."""
    from megatron.core import parallel_state

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    model_parallel_seed(seed, cuda_graph_safe)


def fused_wgrad_available() -> bool:
    """Whether APEX's fused weight-gradient extension (gradient_accumulation_fusion) is installed."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def build_config(args, log):
    """TransformerConfig for this run. Gradient-accumulation fusion: megatron's own linears need APEX for it.
    Without APEX the config turns it off, and `build_model` turns it back on where this package computes
    the weight gradients (`args.fuse_wgrad_without_apex`, see `fuse_wgrad`): an INT8 wgrad GEMM adds into
    main_grad in its epilogue, a BF16 one through cuBLAS (ops.main_grad.hp_wgrad_into), as APEX would."""
    requested = args.gradient_accumulation_fusion or getattr(args, "fuse_wgrad_without_apex", False)  # idempotent
    args.fuse_wgrad_without_apex = False
    if requested and not fused_wgrad_available():
        args.fuse_wgrad_without_apex = True
        log("note: gradient accumulation fusion on for the transformer layers' linears, the output layer and "
            "the word embedding without APEX (INT8 and BF16 wgrad GEMMs add into main_grad, the embedding its "
            "tokens' rows)")
        args.gradient_accumulation_fusion = False
    on_gpu = torch.cuda.is_available()
    # megatron compiles its fused SwiGLU with torch.compile: seconds of CPU compile time for no gain there.
    config = transformer_config_from_args(args, use_cpu_initialization=not on_gpu,
                                          bias_activation_fusion=args.swiglu and on_gpu)
    if config.use_te_activation_func:  # set by transformer_config_from_args for dense SwiGLU models
        log("note: SwiGLU fused (megatron_int8.ops.swiglu, a Triton kernel on CUDA that hands its outputs' maxima "
            "to the INT8 linears; --no-fused-swiglu for megatron's)")
    if config.apply_rope_fusion:
        from megatron.core.models.common.embeddings import rope_utils

        from ..ops.rope import fused_rope

        ours = rope_utils.fused_apply_rotary_pos_emb is fused_rope
        whose = "megatron_int8.ops.rope, a Triton kernel on CUDA" if ours else "Transformer Engine"
        log(f"note: RoPE fused ({whose}; --no-rope-fusion for megatron's unfused ops)")
    if config.cross_entropy_loss_fusion:
        from ..ops.cross_entropy import install as install_fused_cross_entropy

        ours = config.cross_entropy_fusion_impl == "native" and install_fused_cross_entropy()
        whose = ("megatron's native path calling megatron_int8.ops.cross_entropy, a Triton kernel on CUDA" if ours
                 else f"megatron's {config.cross_entropy_fusion_impl} fused_vocab_parallel_cross_entropy")
        log(f"note: cross entropy fused ({whose}; --no-cross-entropy-loss-fusion for the unfused ops)")
    if config.tp_comm_overlap:
        parts = [name for name, on in (("all-gathers", config.tp_comm_overlap_ag),
                                       ("reduce-scatters", config.tp_comm_overlap_rs)) if on]
        log("note: tp-comm-overlap: sequence-parallel " + (" and ".join(parts) or "collectives: none")
            + " pipelined with the linears' GEMMs (megatron_int8.ops.linear)")
    return config


def fuse_wgrad(model: torch.nn.Module) -> None:
    """Gradient-accumulation fusion without APEX for `model` (a GPTModel): on every linear of this package,
    INT8 or BF16 (megatron reads the layer's flag at each forward), and on the output layer and the word
    embedding, which become this package's classes (layers.fuse_output_layer_wgrad,
    embedding.fuse_embedding_wgrad). Their [vocab, hidden] gradients then never exist in bf16: per
    micro-batch the output layer's GEMM adds into main_grad, the embedding its tokens' rows.

    Tied weights on one pipeline stage: megatron marks the shared weight `zero_out_wgrad` so that its DDP
    hook adds the summed weight.grad despite its output layer's fused placeholder. Here both gradients are
    in main_grad already: the mark goes, the output layer returns the one placeholder DDP's hook needs, and
    the embedding returns none."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

    from ..ops.embedding import fuse_embedding_wgrad
    from ..megatron.layers import Int8LinearMixin, fuse_output_layer_wgrad

    for module in model.modules():
        if isinstance(module, Int8LinearMixin):
            module.gradient_accumulation_fusion = True
    output = getattr(model, "output_layer", None)
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if type(output) is ColumnParallelLinear:
        fuse_output_layer_wgrad(output)
    if not isinstance(embedding, VocabParallelEmbedding):
        return
    tied_here = output is not None and output.weight is None  # the output layer multiplies by this weight
    if tied_here and not (isinstance(output, Int8LinearMixin) and output.gradient_accumulation_fusion):
        return  # an output layer of another kind returns weight.grad: the embedding's must join it there
    fuse_embedding_wgrad(embedding, placeholder=not tied_here)
    if tied_here:
        embedding.weight.zero_out_wgrad = False


def settle_grad_reduce_overlap(args, log) -> None:
    """overlap_grad_reduce off where no gradient is communicated (data-parallel and expert data-parallel
    size 1): there it only adds a reduce-scatter call per bucket inside the backward, each a GPU-idle gap on
    the host's side (6 ms per step in a 2-layer Mixtral profile, 2026-11-22)."""
    from megatron.core import parallel_state

    if not args.overlap_grad_reduce:
        return
    sizes = (parallel_state.get_data_parallel_world_size(with_context_parallel=True),
             parallel_state.get_expert_data_parallel_world_size() if args.num_experts else 1)
    if sizes == (1, 1):
        args.overlap_grad_reduce = False
        log("note: overlap_grad_reduce off: data-parallel size 1, no gradient communication to overlap")


def _settle_expert_swiglu(model: torch.nn.Module, fused: bool, log) -> None:
    """--no-fused-swiglu sends the grouped experts to megatron's weighted SwiGLU; a note says where ours runs."""
    from ..megatron.experts import Int8GroupedMLP

    grouped = [m for m in model.modules() if isinstance(m, Int8GroupedMLP) and m.grouped_problem is None]
    for module in grouped:
        module.fused_swiglu = module.fused_swiglu and fused
    if any(m.fused_swiglu for m in grouped):
        log("note: the grouped experts' weighted SwiGLU fused (megatron_int8.ops.swiglu.weighted_swiglu, a Triton "
            "kernel each way on CUDA; --no-fused-swiglu for megatron's)")


def build_model(args, config, policy, padded_vocab_size: int, log=print) -> List[torch.nn.Module]:
    """[DDP(Float16Module?(GPTModel))] for this pipeline stage, on the current device."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
    from megatron.core.transformer.module import Float16Module

    from ..megatron.spec import get_gpt_int8_block_spec

    if policy.fp8_peer is not None:
        from ..peers import fp8  # noqa: F401  (registers the FP8 peer's linears with the spec)
    spec = get_gpt_int8_block_spec(config, policy)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )
    _settle_expert_swiglu(model, args.fused_swiglu, log)
    for param in model.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if getattr(args, "fuse_wgrad_without_apex", False):
        fuse_wgrad(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # DDP's check syncs with the host twice per bucket, inside the backward; the loop checks once per step
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return [model]


def inner_optimizers(optimizer) -> list:
    """The optimizers megatron chains (ChainedOptimizer), or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _torch_adams(optimizer) -> list:
    """The torch Adam/AdamW instances inside megatron's optimizer (its fallback without TE or APEX); not the
    precision-aware AdamW, a subclass of torch's only to pass megatron's type check."""
    from ..megatron.optimizer import PrecisionAwareAdamW

    return [o.optimizer for o in inner_optimizers(optimizer)
            if isinstance(getattr(o, "optimizer", None), (torch.optim.Adam, torch.optim.AdamW))
            and not isinstance(o.optimizer, PrecisionAwareAdamW)]


def adam_step(param: torch.Tensor, group: dict, count) -> torch.Tensor:
    """A torch Adam `step` counter (a number, or a counter to move) where the group's implementation reads
    it: on the parameter's device for the fused (or capturable) kernels, on the CPU otherwise; fp32."""
    device = param.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    if isinstance(count, torch.Tensor):
        return count.to(device=device, dtype=torch.float32)
    return torch.tensor(float(count), dtype=torch.float32, device=device)


def configure_torch_adam(optimizer, fused: bool) -> bool:
    """Make megatron's torch Adam/AdamW fallback run torch's fused kernels (`fused`), or its default
    implementation, with every existing `step` counter where that implementation reads it. Call it after
    building the optimizer and again after loading a checkpoint: loading restores the saved param groups,
    with the implementation of the run that saved them. Returns whether any param group changed."""
    changed = False
    for opt in _torch_adams(optimizer):
        for group in opt.param_groups:
            want = (True, False) if fused else (None, None if group.get("fused") else group.get("foreach"))
            if (group.get("fused"), group.get("foreach")) != want:
                group["fused"], group["foreach"] = want
                changed = True
            for param in group["params"]:
                state = opt.state.get(param)
                if state and "step" in state:
                    state["step"] = adam_step(param, group, state["step"])
    return changed


def build_optimizer(args, model_chunks, log):
    """megatron's optimizer (mixed precision, optional distributed optimizer) and LR/WD schedule."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    if args.use_precision_aware_optimizer:
        from ..megatron.optimizer import build_precision_aware_optimizer

        optimizer = build_precision_aware_optimizer(
            config, model_chunks, exp_avg_dtype=args.exp_avg_dtype, exp_avg_sq_dtype=args.exp_avg_sq_dtype,
            store_param_remainders=args.store_param_remainders)
        log(f"optimizer: precision-aware AdamW (megatron_int8.megatron.optimizer): exp_avg {args.exp_avg_dtype}, "
            f"exp_avg_sq {args.exp_avg_sq_dtype}, master weights "
            + ("bf16 parameter + int16 remainder" if args.store_param_remainders else "fp32")
            + ("; one fused Triton kernel per parameter" if torch.cuda.is_available() else "; PyTorch reference step"))
    else:
        optimizer = get_megatron_optimizer(config, model_chunks)
    if args.fused_adam and not args.use_precision_aware_optimizer:
        if _torch_adams(optimizer):
            configure_torch_adam(optimizer, fused=True)
            log("optimizer: torch's fused Adam kernels (--no-fused-adam for foreach)")
        else:
            log("note: torch's fused Adam not applied: the optimizer is not torch's Adam/AdamW (Transformer "
                "Engine or APEX provide their own fused one)")
    inner = [type(o).__name__ for o in inner_optimizers(optimizer)]
    base = {type(getattr(o, "optimizer", o)).__module__.split(".")[0] for o in inner_optimizers(optimizer)}
    where = "" if torch.cuda.is_available() else " (CPU: megatron's CUDA-only device literals rewritten to CPU)"
    log(f"optimizer: {'/'.join(sorted(set(inner)))} over {'/'.join(sorted(base))} {args.optimizer}{where}")
    # The schedule counts optimizer steps, as its flags do (megatron's counts samples, iterations x batch: a resume
    # with another --global-batch-size would put the LR off the iteration schedule the flags ask for)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def unwrap(model_chunks) -> List[torch.nn.Module]:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model_chunks))

