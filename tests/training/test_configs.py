"""The six model YAMLs: faithful architecture fields at full size (validated for 8 GPUs), and each one
building and running its model at tiny width through the trainer's own config and model code."""
import gc
import os

import pytest
import torch
from mcore_helpers import single_process_megatron

from megatron_int8.megatron.cli import policy_from_args
from megatron_int8.training.args import parse_args, validate_args
from repo_paths import CONFIGS


# layers, hidden, ffn, heads, query groups, head dim, qk-norm, tied, rope base, rope scaling, eps,
# experts, top-k, tokenizer vocabulary
EXPECTED = {
    "llama2_7b": (32, 4096, 11008, 32, 32, 128, False, False, 10000, False, 1e-5, None, None, 32000),
    "llama2_13b": (40, 5120, 13824, 40, 40, 128, False, False, 10000, False, 1e-5, None, None, 32000),
    "llama3.1_8b": (32, 4096, 14336, 32, 8, 128, False, False, 500000, True, 1e-5, None, None, 128256),
    "qwen3_4b": (36, 2560, 9728, 32, 8, 128, True, True, 1000000, False, 1e-6, None, None, 151669),
    "qwen3_8b": (36, 4096, 12288, 32, 8, 128, True, False, 1000000, False, 1e-6, None, None, 151669),
    "mixtral_8x7b_8l": (8, 4096, 14336, 32, 8, 128, False, False, 1000000, False, 1e-5, 8, 2, 32000),
}
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--moe-ffn-hidden-size", "96",
        "--kv-channels", "16", "--seq-length", "32", "--max-position-embeddings", "64",
        "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
        "--global-batch-size", "1", "--micro-batch-size", "1", "--int8-linear", "--int8-backend", "reference"]


def _yaml(name):
    return os.path.join(CONFIGS, name + ".yaml")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_full_size_architecture(name):
    args = validate_args(parse_args(["--config", _yaml(name), "--mock-data", "--tokenizer-type", "NullTokenizer"]),
                         world_size=8)
    (layers, hidden, ffn, heads, groups, head_dim, qk_norm, tied, base, scaling, eps,
     experts, topk, vocab) = EXPECTED[name]
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (layers, hidden, ffn, heads)
    assert (args.num_query_groups, args.kv_channels, args.qk_layernorm) == (groups, head_dim, qk_norm)
    assert args.untie_embeddings_and_output_weights == (not tied)
    assert (args.rotary_base, args.use_rope_scaling, args.norm_epsilon) == (base, scaling, eps)
    assert (args.num_experts, args.moe_router_topk if experts else None) == (experts, topk)
    assert args.vocab_size == vocab
    assert args.normalization == "RMSNorm" and args.swiglu and not args.add_bias_linear
    assert args.position_embedding_type == "rope" and args.bf16
    assert args.seq_length <= args.max_position_embeddings
    assert args.data_parallel_size * args.tensor_model_parallel_size * args.pipeline_model_parallel_size == 8
    if name.startswith("qwen3"):
        from megatron_int8.training.args import pad_vocab_size

        for tp in (1, 2, 4, 8):  # HF's 151936 embedding rows at every TP size
            args.tensor_model_parallel_size = tp
            assert pad_vocab_size(151669, args) == 151936


@pytest.fixture(scope="module")
def megatron_world():
    with single_process_megatron():
        yield


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builds_at_tiny_width(name, megatron_world):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_int8.ops.embedding import MainGradEmbedding
    from megatron_int8.megatron.layers import Int8LinearMixin
    from megatron_int8.training.model import build_config, build_model, fused_wgrad_available, unwrap

    args = validate_args(parse_args(["--config", _yaml(name)] + TINY), world_size=1)
    args.padded_vocab_size = 256
    config = build_config(args, log=lambda message: None)
    wrapped = build_model(args, config, policy_from_args(args), args.padded_vocab_size)
    # DDP's gradient hooks live as long as its wrapper: held here, and a collection now shows they survive it
    gc.collect()
    model = unwrap(wrapped)[0]
    (_, _, _, heads, groups, _, qk_norm, tied, base, scaling, _, experts, topk, _) = EXPECTED[name]
    attention = model.decoder.layers[0].self_attention
    assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (heads, groups, 16)
    assert attention.linear_qkv.weight.shape[0] == (heads + 2 * groups) * 16
    # no query norm: IdentityOp in megatron-core 0.16, None in 0.19
    assert (attention.q_layernorm is not None and not isinstance(attention.q_layernorm, IdentityOp)) == qk_norm
    assert model.share_embeddings_and_output_weights == tied
    inv_freq = model.rotary_pos_emb.inv_freq.double().cpu()
    plain = 1.0 / base ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    if scaling:  # Llama-3.1: the lowest frequencies are divided by the factor 8, the highest kept
        assert inv_freq[0] == pytest.approx(plain[0]) and inv_freq[-1] == pytest.approx(plain[-1] / 8)
    else:
        assert torch.allclose(inv_freq, plain)
    mlp = model.decoder.layers[0].mlp
    if experts:
        from megatron_int8.megatron.experts import Int8GroupedMLP

        assert isinstance(mlp, MoELayer) and mlp.router.topk == topk and len(mlp.experts.local_experts) == experts
        assert isinstance(mlp.experts, Int8GroupedMLP) and mlp.experts.grouped_problem is None  # the YAML's grouped GEMM
    linears = [m for m in model.decoder.modules() if isinstance(m, Int8LinearMixin)]
    assert linears and all(m.int8 for m in linears)
    assert not getattr(model.output_layer, "int8", False)  # BF16 by the policy, whichever class computes it
    device = model.embedding.word_embeddings.weight.device  # the GPU where there is one
    tokens = torch.randint(0, 200, (1, 32), device=device)
    loss = model(tokens, torch.arange(32, device=device)[None], None, labels=tokens)
    assert loss.shape == (1, 32) and torch.isfinite(loss.float()).all()
    # gradient-accumulation fusion: the layers' linears, the output layer and (without APEX, ours) the embedding
    assert all(m.gradient_accumulation_fusion for m in linears)
    assert model.output_layer.gradient_accumulation_fusion
    embedding = model.embedding.word_embeddings
    assert isinstance(embedding, MainGradEmbedding) != fused_wgrad_available()
    loss.float().mean().backward()
    qkv = attention.linear_qkv.weight
    assert qkv.grad_added_to_main_grad and qkv.main_grad.abs().sum() > 0
    assert embedding.weight.grad is None and embedding.weight.main_grad[tokens.unique()].abs().sum(1).gt(0).all()
    if experts:  # the grouped experts' wgrads too (an expert without tokens adds nothing, but is marked)
        fc1 = [e.linear_fc1.weight for e in mlp.experts.local_experts]
        assert all(w.grad_added_to_main_grad for w in fc1) and any(w.main_grad.abs().sum() > 0 for w in fc1)
    _check_flops_formula(model, args, experts, topk)


def _check_flops_formula(model, args, experts, topk):
    """The logged model FLOPs equal 6 x tokens x (weights a token meets + causal attention), with
    the weights counted from the built model (MoE: top-k of the experts, plus the router)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_int8.training.metrics import model_flops_per_iteration

    weights_per_token = 0.0
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            weight = module.weight if module.weight is not None else model.embedding.word_embeddings.weight
            weights_per_token += weight.numel() * (topk / experts if ".local_experts." in name else 1)
        elif name.endswith("mlp.router"):
            weights_per_token += module.weight.numel()
    attention = args.num_layers * args.seq_length * args.num_attention_heads * args.kv_channels
    expected = 6 * args.global_batch_size * args.seq_length * (weights_per_token + attention)
    assert model_flops_per_iteration(args, args.padded_vocab_size) == pytest.approx(expected)
