"""An MoE layer under padded expert capacity on a GPU (skipped without CUDA): what `--cuda-graph-impl local` needs
of it.

The whole layer as the trainer builds it for Mixtral (router with its load-balancing loss, alltoall dispatcher
dropping and padding every expert's input to capacity, grouped INT8 or BF16 experts with the fused weighted
SwiGLU), at a capacity that is a multiple of the 128-row alignment (factor 1.0: 128 rows per expert) and one that
is not (1.25: 160, padded to 256). After warm-up (Triton compiles and tunes, the layout tables reach the device
once, megatron allocates its load-balancing loss scale):
- one forward and backward runs under torch.cuda.set_sync_debug_mode("error"), the weight quantization
  included (caches invalidated, as before a capture): any device-to-host sync raises;
- the same step captured in a torch.cuda.CUDAGraph and replayed on new data gives bit-identical outputs and
  gradients to an eager step on that data. Same kernels on the same operands; the only atomics are megatron's
  scatter/index adds, which add at most two non-zero terms per element (top-2; padding rows carry probability 0
  and gradient 0), exact in any order, and the amax atomics, order-free.

Run: python3 -m pytest -q tests/megatron/test_moe_graph_gpu.py (and with the megatron-core 0.19 environment's
python). The CPU side (tests/megatron/test_moe_padded_capacity.py) checks the same layer's arithmetic against the
counted path and float64, and that it reads no device value on the host.
"""
import pytest
import torch
from mcore_helpers import build_spec, nearest_recipe, outlier_tensor, single_process_megatron, tiny_config

pytestmark = pytest.mark.gpu
E, H, FFN = 8, 256, 384
S, B = 128, 4  # 512 tokens, top-2 over 8 experts: capacity ceil(128 x factor) rows per expert

CASES = pytest.mark.parametrize("int8,capacity_factor", [(True, 1.0), (True, 1.25), (False, 1.25)],
                                ids=["int8-aligned", "int8-padded", "bf16-padded"])


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


def _padded_moe_layer(int8: bool, capacity_factor: float):
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    config = tiny_config(hidden_size=H, num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FFN,
                         moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                         moe_aux_loss_coeff=1e-2, moe_expert_capacity_factor=capacity_factor,
                         moe_pad_expert_input_to_capacity=True, moe_grouped_gemm=True, bias_activation_fusion=True,
                         params_dtype=torch.bfloat16, bf16=True)
    spec = get_gpt_int8_layer_spec(num_experts=E, moe_grouped_gemm=True, int8=int8,
                                   recipe=nearest_recipe(granularity="row"))
    layer = build_spec(spec.submodules.mlp, config=config).cuda()
    assert layer.experts.grouped_problem is None and layer.experts.fused_swiglu
    gen = torch.Generator().manual_seed(41)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(outlier_tensor(*p.shape, generator=gen, scale=8.0) * 0.05)
    return layer


def _batch(gen):
    """An input and an output gradient [S, B, H] in bf16, with outliers."""
    return tuple(outlier_tensor(S, B, H, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))


def _step(layer, x, grad):
    out, _ = layer(x)
    out.backward(grad)
    return out


def _eager(layer, x0, grad):
    """Output and gradients (input, each parameter) of one eager step from fresh gradients, the weights
    quantized anew."""
    from megatron_int8.ops.weight_cache import invalidate_weight_caches

    layer.zero_grad(set_to_none=True)
    invalidate_weight_caches()
    x = x0.clone().requires_grad_(True)
    out = _step(layer, x, grad)
    return {"output": out.detach(), "input gradient": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@CASES
def test_padded_moe_step_has_no_host_sync(int8, capacity_factor):
    from megatron_int8.ops.weight_cache import invalidate_weight_caches

    layer = _padded_moe_layer(int8, capacity_factor)
    x0, grad = _batch(torch.Generator().manual_seed(42))
    for _ in range(3):
        _eager(layer, x0, grad)
    invalidate_weight_caches()
    x = x0.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _step(layer, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and x.grad.abs().sum() > 0


@CASES
def test_padded_moe_step_replays_from_a_cuda_graph(int8, capacity_factor):
    from megatron_int8.ops.weight_cache import invalidate_weight_caches

    layer = _padded_moe_layer(int8, capacity_factor)
    gen = torch.Generator().manual_seed(43)
    x0, grad = _batch(gen)
    x = x0.clone().requires_grad_(True)
    side = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            _step(layer, x, grad)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    invalidate_weight_caches()  # the captured step quantizes its weights itself (as training/cuda_graph.py)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(layer, x, grad)
    # the graph writes these tensors at every replay (the eager steps below give the parameters new ones)
    replayed = {"output": out, "input gradient": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    outputs = []
    for _ in range(2):
        x_new, grad_new = _batch(gen)
        with torch.no_grad():
            x.copy_(x_new)
            grad.copy_(grad_new)
        graph.replay()
        got = {name: t.detach().clone() for name, t in replayed.items()}
        want = _eager(layer, x_new, grad_new)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.isfinite(value).all() and value.abs().sum() > 0, name
            assert torch.equal(got[name], value), f"{name}: the replay differs from eager"
        outputs.append(got["output"])
    assert not torch.equal(*outputs)  # each replay computed its own data
