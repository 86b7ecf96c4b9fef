"""INT8 GPT specs: the six target architectures at tiny width build and train, the BF16 baseline
spec, checkpoint interchange with BF16 models, and SDPA attention vs megatron's DotProductAttention."""
import pytest
import torch
from mcore_helpers import assert_layers_bit_identical, outlier_tensor, query_norm_layer_pair, single_process_megatron, \
    submodules_of, tiny_config

from megatron_int8.megatron.policy import Int8Policy
from megatron_int8.recipe import Int8Recipe
from repo_paths import BENCHMARKS, ROOT

# Tiny stand-ins of the targets (see docs / research notes): what distinguishes each architecture
# is kept (MHA/GQA, head_dim != hidden/heads, qk-norm, tied embeddings, RoPE base and scaling, MoE).
ARCHITECTURES = {
    "llama2-7b": (dict(num_attention_heads=4), dict(rotary_base=10000)),
    "llama2-13b": (dict(hidden_size=80, num_attention_heads=5, ffn_hidden_size=216), dict(rotary_base=10000)),
    "llama3.1-8b": (dict(num_attention_heads=4, num_query_groups=2, ffn_hidden_size=224),
                    dict(rotary_base=500000, rope_scaling=True)),
    "qwen3-4b": (dict(hidden_size=48, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                      qk_layernorm=True, layernorm_epsilon=1e-6),
                 dict(rotary_base=1000000, share_embeddings_and_output_weights=True)),
    "qwen3-8b": (dict(num_attention_heads=4, num_query_groups=2, qk_layernorm=True, layernorm_epsilon=1e-6,
                      ffn_hidden_size=192), dict(rotary_base=1000000)),
    "mixtral-8x7b-8l": (dict(num_attention_heads=4, num_query_groups=2, num_moe_experts=8, moe_router_topk=2,
                             moe_ffn_hidden_size=96, moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall"),
                        dict(rotary_base=1000000)),
}
VOCAB, SEQ, BATCH = 96, 16, 2


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


def _gpt(config, policy, **model_kw):
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    model_kw.setdefault("share_embeddings_and_output_weights", False)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, policy),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope", **model_kw)


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(BATCH, -1)


def _linears(model):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architecture_builds_and_trains(arch):
    from megatron_int8.megatron.layers import Int8LinearMixin

    torch.manual_seed(0)
    config_kw, model_kw = ARCHITECTURES[arch]
    config = tiny_config(**config_kw)
    model = _gpt(config, Int8Policy(recipe=Int8Recipe(backend="reference")), **model_kw)
    for name, linear in _linears(model).items():
        in_layer = ".layers." in name
        assert isinstance(linear, Int8LinearMixin) == in_layer and (not in_layer or linear.int8), name
    if config.num_moe_experts:
        assert sum("local_experts" in n for n in _linears(model)) == 2 * 8 * config.num_layers
    for name, linear in _linears(model).items():  # experts' token counts vary: no per-shape GEMM tuning
        if ".layers." in name:
            assert linear.int8_recipe.autotune == ("local_experts" not in name), name
    tokens, labels, positions = _batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(tokens, positions, None, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


def test_bf16_baseline_has_same_modules_and_no_int8():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = tiny_config(qk_layernorm=True, num_query_groups=2)
    int8_model = _gpt(config, Int8Policy())
    bf16_model = _gpt(config, Int8Policy(enabled=False))
    types = lambda m: [(n, type(x)) for n, x in m.named_modules()]  # noqa: E731
    assert types(int8_model) == types(bf16_model)
    assert not any(getattr(m, "int8", False) for m in bf16_model.modules())
    layer = next(m for m in bf16_model.modules() if isinstance(m, TransformerLayer))
    assert type(layer.self_attention.core_attention).__name__ in ("SDPAttention", "TEDotProductAttention")


def test_bf16_modules_and_first_last_policy_in_spec():
    from megatron_int8.megatron.spec import get_gpt_int8_layer_specs

    config = tiny_config(num_layers=4, num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1, 1, 0])
    policy = Int8Policy(first_last_layers_bf16=True, num_layers_at_end_in_bf16=0,
                        bf16_modules=("linear_proj", "shared_experts", "linear_fc2"))
    specs = get_gpt_int8_layer_specs(config, policy)
    attn = [s.submodules.self_attention.submodules for s in specs]
    assert [a.linear_qkv.params["int8"] for a in attn] == [False, True, True, True]
    assert not any(a.linear_proj.params["int8"] for a in attn)
    moe = submodules_of(specs[1].submodules.mlp)
    experts = submodules_of(moe.experts)
    assert experts.linear_fc1.params["int8"] and not experts.linear_fc2.params["int8"]
    assert not submodules_of(moe.shared_experts).linear_fc1.params["int8"]
    assert submodules_of(specs[3].submodules.mlp).linear_fc1.params["int8"]


def test_swiglu_writes_maxima_only_for_an_int8_linear():
    """The dense MLP's SwiGLU writes its outputs' maxima while fc1 or fc2 quantizes; with both kept in BF16
    by `bf16_modules` (or the whole layer BF16), nothing would read them, so it writes none."""
    from megatron_int8.megatron.spec import get_gpt_int8_layer_specs

    config = tiny_config(num_layers=3)

    def emits(policy):
        return [submodules_of(s.submodules.mlp).activation_func.params["emit_maxima"]
                for s in get_gpt_int8_layer_specs(config, policy)]

    assert emits(Int8Policy()) == [True, True, True]
    assert emits(Int8Policy(bf16_modules=("linear_fc2",))) == [True, True, True]  # fc1's gradient maxima
    assert emits(Int8Policy(bf16_modules=("linear_fc1", "linear_fc2"))) == [False, False, False]
    assert emits(Int8Policy(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                            num_layers_at_end_in_bf16=1)) == [False, True, False]


def test_checkpoints_interchange_with_bf16(tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = tiny_config(num_query_groups=2)
    torch.manual_seed(1)
    bf16 = _gpt(config, Int8Policy(enabled=False))
    torch.manual_seed(2)
    int8 = _gpt(config, Int8Policy())
    stock = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    assert list(bf16.state_dict()) == list(int8.state_dict()) == list(stock.state_dict())
    int8.load_state_dict(bf16.state_dict(), strict=True)
    stock.load_state_dict(int8.state_dict(), strict=True)

    # megatron dist_checkpointing: BF16 -> INT8 -> BF16 (same sharded keys, incl. the norm key map).
    (tmp_path / "bf16").mkdir()
    (tmp_path / "int8").mkdir()
    torch.manual_seed(3)
    bf16 = _gpt(config, Int8Policy(enabled=False))
    dist_checkpointing.save(bf16.sharded_state_dict(), str(tmp_path / "bf16"))
    int8 = _gpt(config, Int8Policy())
    int8.load_state_dict(dist_checkpointing.load(int8.sharded_state_dict(), str(tmp_path / "bf16")))
    for (name, a), b in zip(bf16.state_dict().items(), int8.state_dict().values()):
        assert a is None and b is None or torch.equal(a, b), name
    dist_checkpointing.save(int8.sharded_state_dict(), str(tmp_path / "int8"))
    back = _gpt(config, Int8Policy(enabled=False))
    back.load_state_dict(dist_checkpointing.load(back.sharded_state_dict(), str(tmp_path / "int8")))
    tokens, labels, positions = _batch()
    bf16.eval(), back.eval()
    assert torch.equal(bf16(tokens, positions, None, labels=labels), back(tokens, positions, None, labels=labels))


def _attention_pair(config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_int8.megatron.attention import SDPAttention

    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return SDPAttention(**kw), DotProductAttention(**kw)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_sdpa_attention_matches_dot_product_attention(groups):
    config = tiny_config(num_attention_heads=4, num_query_groups=groups, kv_channels=16)
    sdpa, reference = _attention_pair(config)
    gen = torch.Generator().manual_seed(groups)
    sq, b = 12, 2
    q = torch.randn(sq, b, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(sq, b, groups, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(sq, b, groups, 16, generator=gen, dtype=torch.float64)
    causal = torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1)[None, None]
    padding = causal | (torch.arange(sq) >= torch.tensor([sq, sq - 3])[:, None])[:, None, None, :]
    cases = [(None, causal), (causal, causal), (padding, padding)]  # (SDPA mask, reference mask)
    for sdpa_mask, ref_mask in cases:
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = sdpa(*inputs, sdpa_mask)
        ref = reference(*ref_inputs, ref_mask)
        assert out.shape == (sq, b, 4 * 16)
        torch.testing.assert_close(out, ref)  # float64 on both sides
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        out.backward(g)
        ref.backward(g)
        for got, want in zip(inputs, ref_inputs):
            torch.testing.assert_close(got.grad, want.grad)


def test_sdpa_attention_dropout_uses_model_parallel_rng():
    config = tiny_config(attention_dropout=0.5)
    sdpa, _ = _attention_pair(config)
    q, k, v = (torch.randn(8, 2, 4, 16) for _ in range(3))
    sdpa.eval()
    assert torch.equal(sdpa(q, k, v, None), sdpa(q, k, v, None))
    sdpa.train()
    assert not torch.equal(sdpa(q, k, v, None), sdpa(q, k, v, None))


@pytest.mark.parametrize("groups,qk_norm,int8", [(2, True, True), (2, True, False), (4, True, False),
                                                (1, True, False), (2, False, False)])
def test_query_norm_in_place_matches_megatron_self_attention(groups, qk_norm, int8):
    """QueryNormInPlaceSelfAttention against megatron's SelfAttention in the same layer: bit-identical outputs
    and gradients, and its query norm reads the heads in place (a strided view) where megatron's reads a copy."""
    gen = torch.Generator().manual_seed(groups)
    config = tiny_config(num_attention_heads=4, num_query_groups=groups, kv_channels=16, qk_layernorm=qk_norm,
                         layernorm_epsilon=1e-6)
    ours, stock, contiguous = query_norm_layer_pair(config, int8, gen)
    x0 = outlier_tensor(12, 2, 64, generator=gen)
    g0 = torch.randn(12, 2, 64, generator=gen)
    assert_layers_bit_identical(ours, stock, x0, g0)
    if qk_norm:  # megatron copies the query heads when 1 < groups < heads; ours always reads them in place
        assert contiguous == {"ours": [False], "stock": [1 < groups < 4]}


@pytest.mark.slow  # end to end: the benchmark script in a subprocess
@pytest.mark.parametrize("moe", [False, True])
def test_bench_layer_cpu_smoke(tmp_path, moe):
    """benchmarks/bench_layer.py end to end on tiny shapes (the GPU run uses the same code path), dense and
    MoE (4 experts, GQA, grouped INT8 experts next to per-expert ones)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, OUT=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
    extra = ["--num-experts", "4", "--num-query-groups", "2", "--moe-grouped-gemm", "--granularity", "row"] if moe else []
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_layer.py"), "--device", "cpu",
                             "--tiny", *extra], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "bench_layer.md").read_text()
    assert ("4 experts (top-2)" in table) == moe
    for name in ("| INT8 |", "| BF16 |", "| BF16 stock local spec |"):
        assert name in table
    assert "| n/a | n/a |" in table  # memory columns: CUDA only
    assert ("| INT8 per-expert |" in table) == moe


def test_layer_specs_refuse_what_they_would_ignore():
    """The per-layer specs (upstream Megatron-LM's route builds only those) refuse --int8-swiglu-input where
    megatron never runs this package's SwiGLU module, and a normalization other than the config's."""
    from megatron_int8.megatron.spec import get_gpt_int8_layer_specs

    swiglu_input = Int8Policy(recipe=Int8Recipe(int8_swiglu_input=True))
    config = tiny_config(num_layers=2, gated_linear_unit=True, use_te_activation_func=False)
    with pytest.raises(ValueError, match="--int8-swiglu-input keeps the input .*--use-te-activation-func"):
        get_gpt_int8_layer_specs(config, swiglu_input)
    assert len(get_gpt_int8_layer_specs(tiny_config(num_layers=2, gated_linear_unit=True,
                                                    use_te_activation_func=True), swiglu_input)) == 2
    with pytest.raises(ValueError, match="normalization='LayerNorm': the layers' norms follow config.normalization"):
        get_gpt_int8_layer_specs(tiny_config(num_layers=2), Int8Policy(), normalization="LayerNorm")
