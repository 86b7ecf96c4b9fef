"""INT8 attention in the megatron layers (`--int8-attention`, Int8Recipe.int8_attention) on CPU, the PyTorch path:
SDPAttention runs `int8_attention` on its [b, h, s, d] views within the op's float64 bounds, GQA and head dims 64
and 128, a KV-cached decoding step too; the spec puts it in the INT8 layers only, with unchanged state dicts; what
it cannot serve is refused naming the flag; KV-cached generation picks the tokens full recomputation picks; the
health probe measures what it says, and the auto fallback moves a layer's attention to BF16 SDPA, through a
checkpoint's fallback state. The bounds and data are the op's tests'
(tests/attention_cases.py)."""
import math

import pytest
import torch
from attention_cases import assert_within_bounds, attention_inputs, grads64, int8_attention_bounds
from mcore_helpers import single_process_megatron, tiny_config

from megatron_int8.megatron.policy import Int8Policy
from megatron_int8.ops.int8_attention import DEFAULT_CONFIG, Int8AttentionConfig, int8_attention
from megatron_int8.recipe import Int8Recipe

# INT8 scores, the coarser ones, in most tests here (their bounds are the wider test of the layer's plumbing); the
# default recipe's BF16 scores in test_default_recipe_runs_the_op_with_bf16_scores
INT8_ATTENTION = Int8Recipe(backend="reference", int8_attention=True, int8_attention_scores="int8")
INT8_SCORES = Int8AttentionConfig(scores="int8")


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


def _attention(heads, groups, head_dim, recipe=INT8_ATTENTION, **config):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_int8.megatron.attention import SDPAttention

    config = tiny_config(num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, **config)
    return SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        recipe=recipe)


def _layer_layout(*tensors):
    """[b, h, s, d] -> megatron's [s, b, h, d], as leaves."""
    return [t.permute(2, 0, 1, 3).contiguous().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("heads,groups,seq,head_dim,seed", [(4, 2, 160, 64, 0), (2, 2, 130, 128, 1),
                                                           (4, 1, 200, 64, 2)])
def test_layer_runs_the_op_within_its_float64_bounds(heads, groups, seq, head_dim, seed):
    """O and the gradients of q, k, v through SDPAttention equal int8_attention's on the same data (so the layer runs
    the INT8 op, not SDPA) and sit within the op's elementwise bounds of float64 attention."""
    q, k, v, do = attention_inputs(2, heads, groups, seq, head_dim, seed)
    assert_layer_runs_the_op(_attention(heads, groups, head_dim), q, k, v, do, "reference")


def assert_layer_runs_the_op(layer, q, k, v, do, backend, config=INT8_SCORES):
    """The layer's O and q, k, v gradients (on megatron's [s, b, h, d] views of [b, h, s, d] q, k, v) equal
    `int8_attention`'s with `backend` and `config` bit for bit, and sit within the op's elementwise bounds of
    float64."""
    b, heads, seq, head_dim = q.shape
    leaves = _layer_layout(q, k, v)
    out = layer(*leaves, None)
    assert out.shape == (seq, b, heads * head_dim) and out.dtype == torch.bfloat16
    out.backward(do.permute(2, 0, 1, 3).reshape(out.shape))
    got = [out.detach().view(seq, b, heads, head_dim).permute(1, 2, 0, 3)]
    got += [t.grad.permute(1, 2, 0, 3) for t in leaves]

    op_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    op_out = int8_attention(*op_leaves, causal=True, config=config, backend=backend)
    op_out.backward(do)
    for x, y in zip(got, [op_out.detach()] + [t.grad for t in op_leaves]):
        assert torch.equal(x, y)

    scale = 1 / math.sqrt(head_dim)
    bounds = int8_attention_bounds(q, k, v, do, got[0], True, scale, config)
    assert_within_bounds(got, grads64(q, k, v, do, True, scale), bounds, [torch.bfloat16] * 4,
                         f"layer h={heads}/{k.shape[1]} s={seq} d={head_dim} scores={config.scores}")


def test_default_recipe_runs_the_op_with_bf16_scores():
    """Int8Recipe(int8_attention=True) scores from BF16 Q and K: the layer equals int8_attention with its default
    config (scores="bf16") bit for bit, within that config's bounds, and differs from the INT8 scores."""
    recipe = Int8Recipe(backend="reference", int8_attention=True)
    assert recipe.int8_attention_scores == "bf16" and DEFAULT_CONFIG.scores == "bf16"
    q, k, v, do = attention_inputs(2, 4, 2, 160, 64, 15)
    layer = _attention(4, 2, 64, recipe=recipe)
    assert "scores=bf16" in repr(layer)
    assert_layer_runs_the_op(layer, q, k, v, do, "reference", DEFAULT_CONFIG)
    out = layer(*_layer_layout(q, k, v), None)
    assert not torch.equal(out, _attention(4, 2, 64)(*_layer_layout(q, k, v), None))


def test_decoding_step_attends_every_cached_key():
    """One query over a KV cache (megatron's static inference context): the op without a causal mask, within the
    float64 bounds; the prompt's pass (sq == sk) is causal."""
    q, k, v, do = attention_inputs(1, 4, 2, 97, 64, 3)
    layer = _attention(4, 2, 64)
    step = layer(*(t.permute(2, 0, 1, 3) for t in (q[:, :, -1:], k, v)), None)
    want = int8_attention(q[:, :, -1:], k, v, causal=False, backend="reference", config=INT8_SCORES)
    assert torch.equal(step.view(1, 1, 4, 64).permute(1, 2, 0, 3), want)
    exact = grads64(q[:, :, -1:], k, v, do[:, :, -1:], False, 1 / 8)[0]
    bound = int8_attention_bounds(q[:, :, -1:], k, v, do[:, :, -1:], want, False, 1 / 8, INT8_SCORES)[0]
    assert ((want.double() - exact).abs() <= bound).all()


def test_refusals_name_the_flag():
    """Attention dropout, head dims other than 64 and 128, sliding windows: refused when the layer is built; a mask
    tensor or a chunk of queries over a longer cache when it is called. Each message names --int8-attention."""
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match=r"^--int8-attention: attention dropout 0.1: .* give --attention-dropout 0"):
        _attention(4, 2, 64, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"^--int8-attention: head dim 32 \(--kv-channels.*take 64 or 128"):
        _attention(4, 2, 32)
    with pytest.raises(NotImplementedError, match=r"^--int8-attention \(SDPAttention\): sliding-window"):
        _attention(4, 2, 64, window_size=(16, 0))
    assert _attention(4, 2, 32, recipe=Int8Recipe(backend="reference")).int8_attention is False  # BF16: any head dim
    layer = _attention(4, 2, 64)
    q, k, v = (torch.randn(8, 1, n, 64) for n in (4, 2, 2))
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)[None, None]
    with pytest.raises(NotImplementedError, match=r"^--int8-attention: a mask tensor .*--no-create-attention-mask"):
        layer(q, k, v, mask)
    with pytest.raises(NotImplementedError, match=r"^--int8-attention: causal attention of 4 queries over 8 keys"):
        layer(q[:4], k, v, None)
    with pytest.raises(NotImplementedError, match=r"^--int8-attention: no_mask attention"):
        layer(q, k, v, None, attn_mask_type=AttnMaskType.no_mask)


def _gpt(policy, num_layers=4):
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    config = tiny_config(num_layers=num_layers, hidden_size=128, num_attention_heads=2, num_query_groups=1,
                         kv_channels=64)
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, policy), vocab_size=96,
                    max_sequence_length=32, position_embedding_type="rope")


def _core_attentions(model):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [layer.self_attention.core_attention for layer in model.modules() if isinstance(layer, TransformerLayer)]


def test_spec_puts_int8_attention_in_the_int8_layers_and_keeps_state_dicts():
    """INT8 attention in the INT8 layers only (the first/last BF16 layers and the BF16 baseline keep BF16
    attention; bf16_modules, which name linears, leave it), and the state dict (keys, shapes) is the BF16 model's."""
    recipe = Int8Recipe(backend="reference", int8_attention=True)
    policy = Int8Policy(recipe=recipe, first_last_layers_bf16=True, bf16_modules=("linear_qkv",))
    model = _gpt(policy)
    assert [a.int8_attention for a in _core_attentions(model)] == [False, True, True, False]
    assert not any(a.int8_attention for a in _core_attentions(_gpt(Int8Policy(enabled=False, recipe=recipe))))
    baseline = _gpt(Int8Policy(enabled=False))
    shapes = lambda m: {k: getattr(v, "shape", None) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(model) == shapes(baseline)
    assert policy.describe().startswith("int8[row,fprop/dgrad/wgrad,attn:int8/scores:bf16]")


def test_precision_table_has_a_row_per_int8_attention_and_follows_a_fallback():
    """Each core attention built for INT8 has its own row (int8, or bf16 with the fallback's note once moved);
    the linears' rows describe their GEMMs only (the policy's title names attn:int8)."""
    from megatron_int8.megatron.precision_table import precision_table_rows

    recipe = Int8Recipe(backend="reference", int8_attention=True)
    model = _gpt(Int8Policy(recipe=recipe, first_last_layers_bf16=True))

    def attention_rows():
        return [(r[1], r[4], r[5]) for r in precision_table_rows(model) if r[2].endswith("core_attention")]

    assert attention_rows() == [("2", "int8", "int8_attention, scores bf16"), ("3", "int8", "int8_attention, scores bf16")]
    linears = [r for r in precision_table_rows(model) if not r[2].endswith("core_attention")]
    assert any(r[4] == "int8" for r in linears) and all("attn" not in r[5] for r in linears)
    moved = _core_attentions(model)[1]
    moved.int8_attention, moved.int8_fallback_note = False, "at iteration 7: attention/rel_err 0.2 > 0.1"
    assert attention_rows() == [
        ("2", "bf16", "int8_attention, scores bf16 (fallback at iteration 7: attention/rel_err 0.2 > 0.1)"),
        ("3", "int8", "int8_attention, scores bf16")]
    scored = _gpt(Int8Policy(recipe=INT8_ATTENTION))  # INT8 scores
    rows = precision_table_rows(scored)
    assert {r[5] for r in rows if r[2].endswith("core_attention")} == {"int8_attention, scores int8"}
    assert all("attn" not in r[5] and "scores" not in r[5] for r in rows if not r[2].endswith("core_attention"))


def probe_against_float64(heads, groups, seq, head_dim, seed, device="cpu", recipe=INT8_ATTENTION):
    """(AttentionProbe's values from an INT8 SDPAttention's armed training forward, the same two errors computed
    here in float64 on the probe's sample: the output's error of the op's own O, and the scores' error of Q and
    smoothed K quantized per token). Also checks that only an armed forward that records autograd is measured."""
    from megatron_int8.ops.health import AttentionProbe, sample_heads, sample_rows
    from megatron_int8.ops.int8_attention import quantize_rows

    q, k, v, _ = attention_inputs(2, heads, groups, seq, head_dim, seed, device=device)
    bf16_scores = recipe.int8_attention_scores == "bf16"
    layer = _attention(heads, groups, head_dim, recipe=recipe)
    layer.int8_probe = probe = AttentionProbe()
    leaves = _layer_layout(q, k, v)
    with torch.no_grad():  # an evaluation forward is not measured
        layer(*leaves, None)
    assert probe.take() == []
    probe.arm()
    out = layer(*leaves, None)
    (values,) = probe.take()
    assert not probe.armed

    rows, picked = sample_rows(seq, 1), sample_heads(heads, device)
    scale = 1 / math.sqrt(head_dim)
    mask = torch.arange(rows.stop, device=device)[None, :] > torch.arange(rows.start, rows.stop, device=device)[:, None]
    q64, k64, v64 = (t[0].double().repeat_interleave(heads // t.shape[1], dim=0)[picked] for t in (q, k, v))
    k64 = k64 - k64.mean(dim=1, keepdim=True)
    s = scale * q64[:, rows] @ k64[:, :rows.stop].transpose(-1, -2)
    o64 = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v64[:, :rows.stop]
    o = out.detach().view(seq, 2, heads, head_dim)[rows, 0].transpose(0, 1)[picked].double()
    out_err = ((o - o64).norm() / o64.norm()).item()
    if bf16_scores:  # Q and smoothed K rounded to bf16
        s_int8 = scale * q64[:, rows].bfloat16().double() @ k64[:, :rows.stop].bfloat16().double().transpose(-1, -2)
    else:
        (q_int, q_s), (k_int, k_s) = quantize_rows(q64[:, rows].float()), quantize_rows(k64[:, :rows.stop].float())
        s_int8 = scale * (q_int * q_s).double() @ (k_int * k_s).double().transpose(-1, -2)
    qk_err = ((s_int8 - s).masked_fill(mask, 0).norm() / s.masked_fill(mask, 0).norm()).item()
    return values.double().cpu(), torch.tensor([qk_err, out_err], dtype=torch.float64)


def test_kv_cached_generation_matches_full_recomputation():
    """training.inference.generate through megatron's static KV cache (the prompt's pass causal, then one query per
    step, which megatron calls with no mask) picks the same greedy tokens as recomputing the whole sequence."""
    from megatron_int8.training.inference import generate

    model = _gpt(Int8Policy(recipe=INT8_ATTENTION), num_layers=2).eval()
    assert all(a.int8_attention for a in _core_attentions(model))
    prompt = [5, 7, 9, 11, 13]
    cached = generate(model, prompt, 8)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)
            tokens.append(int(logits[0, -1].argmax()))
    assert cached == tokens[len(prompt):]


def test_probe_measures_the_output_and_score_errors():
    """AttentionProbe's two values (every head of 4, SAMPLE_ROWS queries from the middle of 300) equal the errors
    computed in float64 on its sample to 1e-3 of themselves (the probe's references are fp32); the sampled heads
    spread over the key/value heads."""
    from megatron_int8.ops.health import SAMPLE_ROWS, sample_heads, sample_rows

    assert sample_rows(300, 1) == slice(44, 44 + SAMPLE_ROWS)
    assert sample_heads(4, "cpu").tolist() == [0, 1, 2, 3]
    assert sample_heads(32, "cpu").tolist() == list(range(0, 32, 4))  # Llama2-7B: 8 of 32, one per 4
    # 12 heads over 4 key/value heads (groups of 3): the sample meets every key/value head (it once took heads 0-7,
    # of key/value heads 0-2 only)
    assert sample_heads(12, "cpu").tolist() == [0, 1, 3, 4, 6, 7, 9, 10]
    assert {h // 3 for h in sample_heads(12, "cpu").tolist()} == {0, 1, 2, 3}
    values, expected = probe_against_float64(4, 2, 300, 64, 4)
    assert 1e-3 < expected.min() and expected.max() < 0.05, expected
    torch.testing.assert_close(values, expected, rtol=1e-3, atol=0)
    # with BF16 scores the probe measures those: their error is BF16's rounding, far below the INT8 scores'
    import dataclasses

    recipe = dataclasses.replace(INT8_ATTENTION, int8_attention_scores="bf16")
    bf16_values, bf16_expected = probe_against_float64(4, 2, 300, 64, 4, recipe=recipe)
    torch.testing.assert_close(bf16_values, bf16_expected, rtol=1e-2, atol=0)
    assert bf16_expected[0] < expected[0] / 4 and bf16_expected[1] < expected[1], (bf16_expected, expected)


def test_auto_fallback_moves_a_layers_attention_to_bf16():
    """A statistics step measures every INT8 attention (and linear); an attention output error over its limit moves
    that layer's attention to BF16 SDPA (the same output as a BF16 layer's), logged as an event; the move survives
    the fallback state's round trip into a fresh model, and --int8-reset-fallback's reset undoes it."""
    from megatron_int8.megatron.attention import SDPAttention
    from megatron_int8.training.health import (AutoFallback, FallbackThresholds, HealthMonitor, apply_fallback,
                                               describe_mode, int8_attentions, int8_linears, summarize)

    model = _gpt(Int8Policy(recipe=INT8_ATTENTION), num_layers=2)
    attentions = int8_attentions(model)
    assert sorted(attentions) == ["layer1.self_attention.core_attention", "layer2.self_attention.core_attention"]
    # every attention crosses a limit of 1e-9 at every check; the linears' limits are out of reach
    fallback = AutoFallback(FallbackThresholds(max_rel_err=1e9, max_underflow=1.0, patience=2,
                                               max_attention_rel_err=1e-9))
    monitor = HealthMonitor(int8_linears(model), 1, fallback, attentions)
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, -1)
    events = []
    for iteration in (1, 2):
        monitor.before_step(iteration)
        model(tokens, positions, None, labels=tokens).mean().backward()
        checks = monitor.collect()
        by_unit = checks[0][1]
        for name in attentions:
            assert set(by_unit[name]) == {"qk/rel_err", "attention/rel_err"}
            assert 0 < by_unit[name]["attention/rel_err"] < 0.1
        assert "attention rel_err" in summarize(checks)
        events += monitor.decide(checks)
    assert [(e["iteration"], e["linear"], e["gemm"], e["change"]) for e in events] == [
        (2, name, "attention", "INT8 -> BF16 attention") for name in sorted(attentions)]
    assert "on 2 consecutive checks" in events[0]["reason"]
    assert not any(a.int8_attention for a in attentions.values())
    assert all(a.int8_attention_built and "INT8 -> BF16 attention" in a.int8_fallback_note for a in attentions.values())
    # the moved layer runs BF16 SDPA: a BF16 layer's output
    layer = attentions["layer1.self_attention.core_attention"]
    q, k, v = (torch.randn(16, 1, n, 64, dtype=torch.bfloat16) for n in (2, 1, 1))
    bf16 = SDPAttention(config=layer.config, layer_number=1, attn_mask_type=layer.attn_mask_type,
                        attention_type="self")
    assert torch.equal(layer(q, k, v, None), bf16(q, k, v, None))
    monitor.close()
    assert layer.int8_probe is None

    state = fallback.state_dict()
    resumed = AutoFallback()
    resumed.load_state_dict(state)
    fresh = _gpt(Int8Policy(recipe=INT8_ATTENTION), num_layers=2)
    fresh_attentions = int8_attentions(fresh)
    assert sorted(apply_fallback(int8_linears(fresh), resumed, fresh_attentions)) == sorted(attentions)
    assert not any(a.int8_attention for a in fresh_attentions.values())
    assert describe_mode(resumed.moved["layer2.self_attention.core_attention"]["mode"]) == "BF16 attention (SDPA)"
    resumed.reset()
    assert sorted(apply_fallback(int8_linears(fresh), resumed, fresh_attentions)) == sorted(attentions)
    assert all(a.int8_attention for a in fresh_attentions.values())
