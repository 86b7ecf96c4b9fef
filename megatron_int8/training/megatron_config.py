"""What validated arguments describe in megatron-core's terms: the TransformerConfig and the padded vocabulary."""
from __future__ import annotations

from ..reference import padded_length


def pad_vocab_size(vocab_size: int, args) -> int:
    """Megatron-LM's padding: a multiple of --make-vocab-size-divisible-by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return padded_length(vocab_size, multiple)


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
    # megatron's per-layer graphs are not used (--cuda-graph-impl local is this trainer's); its default "full" scope
    # only prints a deprecation warning at every start. 0.19 names the field cuda_graph_modules (and deprecates
    # cuda_graph_scope); 0.16-0.18 cuda_graph_scope.
    for field in ("cuda_graph_modules", "cuda_graph_scope"):
        if field in TransformerConfig.__dataclass_fields__:
            kwargs[field] = []
            break
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
            # a checkpoint's recorded arguments (inference, export) may predate these two flags: dropless then
            moe_expert_capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
            moe_pad_expert_input_to_capacity=getattr(args, "moe_pad_expert_input_to_capacity", False),
        )
    kwargs.update(overrides)
    if args.swiglu and args.num_experts is None and getattr(args, "fused_swiglu", True):
        # the MLP's activation module slot (megatron_int8.ops.swiglu; the spec fills it), which this flag opens
        kwargs.update(use_te_activation_func=True, bias_activation_fusion=False)
    return TransformerConfig(**kwargs)
