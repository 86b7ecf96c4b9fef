"""INT8 attention in the megatron layers on a CUDA GPU (the Triton kernels; skipped without CUDA): SDPAttention
with `--int8-attention` runs the kernels, within the op's float64 bounds, at seq 1024-2048 with GQA and head dims
64 and 128; a KV-cached decoding step (one query over the cache, unmasked) on the kernels; the health probe's
values against float64; a tiny bf16 GPT with INT8 attention training.

    python3 -m pytest -q -m gpu tests/megatron/test_int8_attention_layer_gpu.py

The data, bounds and float64 references are tests/attention_cases.py's; the layer helpers
tests/megatron/test_int8_attention_layer.py's."""
import math

import pytest
import torch
from attention_cases import attention_inputs, grads64, int8_attention_bounds
from mcore_helpers import adam_losses, single_process_megatron, tiny_config
from test_int8_attention_layer import _attention, assert_layer_runs_the_op, probe_against_float64

from megatron_int8.megatron.policy import Int8Policy
from megatron_int8.ops.int8_attention import DEFAULT_CONFIG, Int8AttentionConfig, int8_attention
from megatron_int8.recipe import Int8Recipe

pytestmark = pytest.mark.gpu
ON_KERNELS = Int8Recipe(int8_attention=True)  # backend auto: the Triton kernels on CUDA


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    pytest.importorskip("triton")
    with single_process_megatron():
        yield


@pytest.mark.parametrize("scores", ["bf16", "int8"])
@pytest.mark.parametrize("heads,groups,seq,head_dim", [(16, 4, 2048, 128), (8, 2, 1500, 64)])
def test_layer_runs_the_kernels_within_the_ops_bounds(heads, groups, seq, head_dim, scores):
    """The layer's O and gradients are the kernels' own on the same data (bit for bit: the launches take the
    layer's strided views as they are) and within the op's float64 bounds, with either scores."""
    q, k, v, do = attention_inputs(1, heads, groups, seq, head_dim, seed=seq, device="cuda")
    recipe = Int8Recipe(int8_attention=True, int8_attention_scores=scores)
    assert_layer_runs_the_op(_attention(heads, groups, head_dim, recipe=recipe), q, k, v, do, "triton",
                             Int8AttentionConfig(scores=scores))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decoding_step_on_the_kernels(head_dim):
    """One query over 1500 cached keys (unmasked, Sq = 1 in a 128-query tile): the kernels' O within the float64
    bound, and at most a fifth of the PyTorch path's own error away from it."""
    q, k, v, do = attention_inputs(2, 8, 2, 1500, head_dim, seed=head_dim, device="cuda")
    layer = _attention(8, 2, head_dim, recipe=ON_KERNELS)
    step = layer(*(t.permute(2, 0, 1, 3) for t in (q[:, :, -1:], k, v)), None)
    got = step.view(1, 2, 8, head_dim).permute(1, 2, 0, 3)
    scale = 1 / math.sqrt(head_dim)
    exact = grads64(q[:, :, -1:], k, v, do[:, :, -1:], False, scale)[0]
    bound = int8_attention_bounds(q[:, :, -1:], k, v, do[:, :, -1:], got, False, scale, DEFAULT_CONFIG)[0]
    assert ((got.double() - exact).abs() <= bound).all()
    path = int8_attention(q[:, :, -1:], k, v, causal=False, backend="reference")
    assert (got.double() - path.double()).norm() <= 0.2 * (path.double() - exact).norm()


def test_probe_on_the_kernels():
    """The probe's values on CUDA at seq 4096 (8 of 32 heads, 8 key/value heads) against float64 on its sample."""
    values, expected = probe_against_float64(32, 8, 4096, 128, 11, device="cuda", recipe=ON_KERNELS)
    assert expected.max() < 0.1, expected
    torch.testing.assert_close(values, expected, rtol=1e-3, atol=0)


def _tiny_gpt(recipe):
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    torch.manual_seed(0)
    config = tiny_config(hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=64,
                         params_dtype=torch.bfloat16, bf16=True)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, Int8Policy(recipe=recipe)),
                    vocab_size=128, max_sequence_length=256, position_embedding_type="rope").cuda().bfloat16()


def test_tiny_gpt_with_int8_attention_trains_on_gpu():
    """Six Adam steps on one batch of 4 x 256 tokens: the INT8-attention model's first loss within 0.5% of the same
    model's with BF16 attention (same weights: only the attention differs), and its loss falls by more than 0.1."""
    tokens = torch.randint(0, 128, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = [adam_losses(_tiny_gpt(recipe), tokens) for recipe in (Int8Recipe(), ON_KERNELS)]
    bf16, int8 = runs
    assert all(math.isfinite(x) for x in int8) and abs(int8[0] - bf16[0]) <= 5e-3 * bf16[0], runs
    assert int8[-1] < int8[0] - 0.1, runs
