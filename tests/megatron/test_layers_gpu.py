"""GPU checks of the megatron-core integration (skipped without CUDA): INT8 layers with the
default (Triton) backend in bf16 against float64 within scale-derived bounds, a tiny INT8 GPT
training on GPU, and the layer benchmark on tiny shapes. The FP8 peer (torchao float8; skipped
without torchao or below compute capability 8.9): its layers against float64 within bounds derived
from the e4m3/e5m2 steps, its gradients reaching megatron DDP's main_grad once, a tiny GPT with the
FP8 spec training, and its rows of the layer benchmark."""
import os
import subprocess
import sys

import pytest
import torch
from mcore_helpers import adam_losses, assert_fp8_linear_within_bounds, assert_layers_bit_identical, build_spec, \
    fp8_linear_checks, nearest_recipe, outlier_tensor, qgemm_bound, query_norm_layer_pair, single_process_megatron, \
    tiny_config
from repo_paths import BENCHMARKS, ROOT

pytestmark = pytest.mark.gpu
BF16_HALF_ULP = 2.0**-9  # relative rounding of a bf16 result


def _fp8_unavailable():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from megatron_int8.peers.fp8 import fp8_unavailable_reason

    return fp8_unavailable_reason()


FP8_UNAVAILABLE = _fp8_unavailable()
needs_fp8 = pytest.mark.skipif(FP8_UNAVAILABLE is not None, reason=f"FP8 peer unavailable: {FP8_UNAVAILABLE}")


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


def _run_on_outliers(layer, gen):
    """Give a 256 -> 384 layer outlier weights, run it forward and backward on a bf16 outlier batch of
    64 x 4 tokens; returns (x with its grad, the output gradient, the output)."""
    with torch.no_grad():
        layer.weight.copy_(outlier_tensor(384, 256, generator=gen, scale=8.0) * 0.05)
    x = outlier_tensor(64, 4, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    g = outlier_tensor(64, 4, 384, generator=gen).to("cuda", torch.bfloat16)
    out, _ = layer(x)
    out.backward(g)
    return x, g, out


def _run_bench_layer(tmp_path, *argv, timeout):
    """benchmarks/bench_layer.py ARGV in a subprocess with OUT=tmp_path; returns (its table file, its stdout)."""
    env = dict(os.environ, OUT=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
    result = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_layer.py"), *argv],
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return (tmp_path / "bench_layer.md").read_text(), result.stdout


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_int8_column_layer_on_gpu_within_bound(granularity):
    from megatron_int8.megatron.layers import Int8ColumnParallelLinear

    gen = torch.Generator().manual_seed(0)
    config = tiny_config(params_dtype=torch.bfloat16, bf16=True)
    layer = Int8ColumnParallelLinear(256, 384, config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
                                     recipe=nearest_recipe(granularity=granularity)).cuda()
    x, g, out = _run_on_outliers(layer, gen)
    x2, g2 = x.detach().double().reshape(-1, 256), g.double().reshape(-1, 384)
    w = layer.weight.detach().double()
    checks = [(out.detach().double().reshape(-1, 384), x2 @ w.T, qgemm_bound(x2, w, granularity=granularity)),
              (x.grad.double().reshape(-1, 256), g2 @ w, qgemm_bound(g2, w.T.contiguous(), granularity=granularity)),
              (layer.weight.grad.double(), g2.T @ x2,
               qgemm_bound(g2.T.contiguous(), x2.T.contiguous(), granularity=granularity))]
    for got, exact, bound in checks:
        assert ((got - exact).abs() <= bound + BF16_HALF_ULP * (exact.abs() + bound)).all()


def _tiny_gpt(policy):
    """A tiny bf16 GQA GPTModel on the GPU whose transformer layers follow `policy`."""
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    torch.manual_seed(0)
    config = tiny_config(num_query_groups=2, params_dtype=torch.bfloat16, bf16=True)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, policy),
                    vocab_size=128, max_sequence_length=64, position_embedding_type="rope").cuda().bfloat16()


def _assert_trains(model):
    """Six Adam steps on one random batch must lower the loss by more than 0.1."""
    losses = adam_losses(model, torch.randint(0, 128, (4, 65), device="cuda"))
    assert losses[-1] < losses[0] - 0.1, losses


def test_tiny_int8_gpt_trains_on_gpu():
    from megatron_int8.megatron.policy import Int8Policy

    _assert_trains(_tiny_gpt(Int8Policy()))


def test_bench_layer_tiny_on_gpu(tmp_path):
    table, _ = _run_bench_layer(tmp_path, "--tiny", timeout=300)
    assert "| INT8 |" in table
    saved, per_token, peak = {}, {}, {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("INT8", "BF16"):
            total, tokens = cells[3].split("(")  # "MiB (bytes per token)"
            saved[cells[0]], per_token[cells[0]] = float(total), float(tokens.rstrip(")"))
            peak[cells[0]] = float(cells[4])
    # the INT8 linears keep their inputs as int8: fewer bytes kept per token
    assert 0 < per_token["INT8"] < per_token["BF16"]
    # the peak holds what forward kept plus forward's output and backward's gradients on top
    assert all(peak[n] > saved[n] > 0 for n in saved)


def _moe_mlp_on_gpu(grouped: bool, config):
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    spec = get_gpt_int8_layer_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped,
                                   recipe=nearest_recipe(granularity="row"))
    return build_spec(spec.submodules.mlp, config=config).cuda()


def _graph_node_names(t: torch.Tensor) -> set:
    """The names of every autograd node behind t."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_query_norm_in_place_matches_megatron_self_attention_on_gpu(granularity, monkeypatch):
    """Qwen3-like GQA attention (8 query heads in 2 groups, head dim 128, q/k norms) in an INT8 layer: with the
    Triton norms reading the query and key heads in place from the fused QKV output, and their backward writing
    the QKV gradient in place (one _SplitQKVNormed node, no cat), outputs and gradients are bit-identical to
    megatron's SelfAttention, whose query norm reads a contiguous copy and whose split backward is a cat.
    Tensorwise, ours hands the QKV linear its gradient's amax (once per backward), stock's linear computes it:
    still bit-identical, so the handed amax is exact."""
    import megatron_int8.megatron.attention as attention

    gen = torch.Generator().manual_seed(5)
    config = tiny_config(hidden_size=256, num_attention_heads=8, num_query_groups=2, kv_channels=128,
                         qk_layernorm=True, layernorm_epsilon=1e-6, params_dtype=torch.bfloat16, bf16=True)
    ours, stock, contiguous = query_norm_layer_pair(config, True, gen, device="cuda", granularity=granularity)
    ours, stock = ours.bfloat16(), stock.bfloat16()  # as megatron's Float16Module casts them: bf16 norm weights
    x0 = outlier_tensor(128, 2, 256, generator=gen).to("cuda", torch.bfloat16)
    assert ours.self_attention.q_layernorm.runs_triton(x0) and stock.self_attention.q_layernorm.runs_triton(x0)
    g0 = outlier_tensor(128, 2, 256, generator=gen).to("cuda", torch.bfloat16)
    assert_layers_bit_identical(ours, stock, x0, g0)
    # ours never calls the norm modules (the fused node runs their kernels); stock's query norm reads a copy
    assert contiguous == {"ours": [], "stock": [True]}
    names = {which: _graph_node_names(layer(x0.clone().requires_grad_(True))[0]) for which, layer in
             (("ours", ours), ("stock", stock))}
    assert "_SplitQKVNormedBackward" in names["ours"] and "_SplitQKVNormedBackward" not in names["stock"]
    attached = []
    real = attention.attach_amax
    monkeypatch.setattr(attention, "attach_amax", lambda t, amax: real(t, attached.append((t, amax)) or amax))
    ours(x0.clone().requires_grad_(True))[0].backward(g0)
    assert len(attached) == (granularity == "tensor")
    for grad, amax in attached:
        assert torch.equal(amax, grad.float().abs().amax())


def test_split_qkv_normed_real_shape_on_gpu():
    """attention._SplitQKVNormed at one micro-batch of Qwen3-4B's attention (4096 x 2 tokens, 8 groups of 4
    query heads, head 128): bit-identical to the split plus separate Triton norms (autograd's cat in the
    backward), and within the float64 bounds of the norm on the query heads."""
    from int8_bounds import assert_rms_norm_close

    from mcore_helpers import split_qkv_both_ways

    from megatron_int8.megatron.attention import _qkv_parts
    from megatron_int8.ops.rms_norm import FusedRMSNorm

    S, B, G, P, D = 4096, 2, 8, 4, 128
    gen = torch.Generator().manual_seed(11)

    def data(rows, cols):
        return outlier_tensor(rows, cols, generator=gen, outliers=rows // 64).to("cuda", torch.bfloat16)

    mixed = data(S * B, G * (P + 2) * D).view(S, B, -1)
    norms = [FusedRMSNorm(D, eps=1e-6, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        for n in norms:
            n.weight.copy_(1 + torch.randn(D, device="cuda"))
    grads = [data(S * B * n, D).view(S, B, n, D) for n in (G * P, G, G)]
    results = split_qkv_both_ways(mixed, norms, grads, G, D)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    q_in = _qkv_parts(mixed, G, D)[0]
    assert_rms_norm_close(q_in, norms[0].weight.detach(), 1e-6, grads[0].view(q_in.shape),
                          results[0][0].view(q_in.shape), _qkv_parts(results[0][3], G, D)[0], results[0][4])


def test_grouped_moe_layer_equals_per_expert_layer_on_gpu():
    """Int8GroupedMLP (Triton grouped GEMM, segmented quantize, strided wgrad operands) against
    SequentialMLP's per-expert INT8 linears (whose bounds against float64 the tests above check): same
    int32 products and epilogues, so bit-identical outputs and gradients."""
    from megatron_int8.megatron.experts import Int8GroupedMLP

    gen = torch.Generator().manual_seed(21)
    config = tiny_config(hidden_size=256, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=384,
                         moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                         moe_aux_loss_coeff=0.0, params_dtype=torch.bfloat16, bf16=True)
    torch.manual_seed(0)
    seq = _moe_mlp_on_gpu(False, config)
    grp = _moe_mlp_on_gpu(True, config)
    assert isinstance(grp.experts, Int8GroupedMLP) and grp.experts.grouped_problem is None
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(outlier_tensor(*p.shape, generator=gen, scale=8.0) * 0.05)
    grp.load_state_dict(seq.state_dict())
    x0 = outlier_tensor(128, 4, 256, generator=gen).to("cuda", torch.bfloat16)
    g0 = outlier_tensor(128, 4, 256, generator=gen).to("cuda", torch.bfloat16)
    assert_layers_bit_identical(seq, grp, x0, g0)


def test_grouped_moe_fused_weighted_swiglu_on_gpu():
    """The grouped BF16 experts with megatron's activation fusion on, run twice: with megatron_int8's Triton
    weighted SwiGLU, and with megatron's torch.compile'd one (fused_swiglu off). Both compute in fp32 and round
    once to bf16, so the activations differ by at most one bf16 step (2^-7 relative) where the two sigmoids
    round differently. Output, input gradient and router gradient (through the probabilities) must agree in
    relative norm within 2^-6; a wrong weighting or probability gradient is off by O(1)."""
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    gen = torch.Generator().manual_seed(22)
    config = tiny_config(hidden_size=256, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=384,
                         moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                         moe_aux_loss_coeff=0.0, params_dtype=torch.bfloat16, bf16=True, moe_grouped_gemm=True,
                         bias_activation_fusion=True)
    spec = get_gpt_int8_layer_spec(num_experts=8, moe_grouped_gemm=True, int8=False)
    layer = build_spec(spec.submodules.mlp, config=config).cuda()
    assert layer.experts.fused_swiglu
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(outlier_tensor(*p.shape, generator=gen, scale=8.0) * 0.05)
    x0 = outlier_tensor(128, 4, 256, generator=gen).to("cuda", torch.bfloat16)
    g0 = outlier_tensor(128, 4, 256, generator=gen).to("cuda", torch.bfloat16)
    results = []
    for fused in (True, False):
        layer.experts.fused_swiglu = fused
        layer.zero_grad()
        x = x0.clone().requires_grad_(True)
        out, _ = layer(x)
        out.backward(g0)
        results.append((out.detach().float(), x.grad.float(), layer.router.weight.grad.float().clone()))
    for name, got, want in zip(("output", "input gradient", "router gradient"), *results):
        rel = (got - want).norm() / want.norm()
        assert want.norm() > 0 and rel < 2 ** -6, f"{name}: relative difference {rel:.3g}"


# ------------------------------------------------------------------------ FP8 peer (torchao float8)


def _fp8_layer(kind, in_f, out_f, recipe, config=None, **kw):
    from megatron_int8.peers.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    config = config or tiny_config(params_dtype=torch.bfloat16, bf16=True)
    extra = {} if kind == "column" else {"input_is_parallel": True, "skip_bias_add": False}
    cls = Fp8ColumnParallelLinear if kind == "column" else Fp8RowParallelLinear
    return cls(in_f, out_f, config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
               fp8_recipe=recipe, **extra, **kw).cuda()


@needs_fp8
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_fp8_layer_on_gpu_within_bound(kind, recipe, compile):
    """bf16 operands with outliers; each GEMM within the elementwise worst case (half an e4m3/e5m2 step
    per operand element: relative 2^-4 / 2^-3, plus the subnormal half-spacing; K x 2^-13 for fprop's
    fast accumulation; 3 bf16 roundings of the output) and its total squared error within 4x the
    expected rounding noise (which a wrong scale or operand would exceed)."""
    gen = torch.Generator().manual_seed(0)
    layer = _fp8_layer(kind, 256, 384, recipe, compile=compile)
    x, g, out = _run_on_outliers(layer, gen)
    assert out.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16
    checks = fp8_linear_checks(x.detach().reshape(-1, 256), layer.weight.detach(), g.reshape(-1, 384),
                               out.detach().reshape(-1, 384), x.grad.reshape(-1, 256), layer.weight.grad, recipe)
    assert_fp8_linear_within_bounds(checks, out_rel=3 * BF16_HALF_ULP)


@needs_fp8
def test_fp8_gradients_reach_ddp_main_grad_once_on_gpu():
    """With gradient_accumulation_fusion=True in the config: weight.grad goes to main_grad through megatron's
    DDP hook exactly once per micro-batch (no double count, nothing dropped), including a token count that
    needs padding to 16 (7 x 3 = 21) and an empty micro-batch (an expert without tokens)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = tiny_config(params_dtype=torch.bfloat16, bf16=True, gradient_accumulation_fusion=True)
    gen = torch.Generator().manual_seed(5)
    layer = _fp8_layer("column", 64, 48, "tensorwise", config=config)
    reference = _fp8_layer("column", 64, 48, "tensorwise")
    reference.load_state_dict(layer.state_dict())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
    ddp.zero_grad_buffer()
    expected = torch.zeros_like(layer.weight, dtype=torch.float32)
    for tokens in (7, 0, 16):
        x = torch.randn(tokens, 3, 64, generator=gen).to("cuda", torch.bfloat16)
        g = torch.randn(tokens, 3, 48, generator=gen).to("cuda", torch.bfloat16)
        out = ddp(x)[0]
        assert out.shape == (tokens, 3, 48)
        out.backward(g)
        assert layer.weight.grad is None and not layer.weight.grad_added_to_main_grad
        reference(x)[0].backward(g)
        expected += reference.weight.grad.float()
        reference.weight.grad = None
    assert expected.abs().sum() > 0
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tiny_fp8_gpt_trains_on_gpu(recipe):
    from megatron_int8.peers.fp8 import Fp8LinearMixin
    from megatron_int8.megatron.policy import Int8Policy

    model = _tiny_gpt(Int8Policy(enabled=False, fp8_peer=recipe))
    assert sum(isinstance(m, Fp8LinearMixin) for m in model.modules()) == 4 * model.config.num_layers
    _assert_trains(model)


@needs_fp8
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bench_layer_tiny_fp8_rows_on_gpu(tmp_path, moe):
    """The layer benchmark's FP8 rows, eager and compiled (MoE: 4 experts, token counts not multiples of 16)."""
    argv = ["--tiny", "--fp8-compile", "--no-stock"] + (["--num-experts", "4"] if moe else [])
    table, stdout = _run_bench_layer(tmp_path, *argv, timeout=600)
    assert "| FP8 torchao tensorwise |" in table and "| FP8 torchao tensorwise compiled |" in table, \
        table + stdout[-3000:]


def test_grouped_bf16_experts_on_gpu():
    """The BF16 baseline's grouped experts on the GPU (torch._grouped_mm on Hopper, else a matmul per expert):
    outputs, input gradients and the weight gradients added into fp32 main_grad against float64 per expert,
    within the fp32 accumulation bound plus a bf16 rounding; alignment rows zero; an empty expert's
    main_grad untouched. Mixtral-like width, ragged counts."""
    from megatron_int8.ops.grouped_linear import grouped_hp_linear
    from megatron_int8.reference import Segments

    gen = torch.Generator().manual_seed(22)
    counts, K, N = [300, 0, 45, 1000, 128], 512, 1024
    seg = Segments.for_counts(counts)
    ws = [(outlier_tensor(N, K, generator=gen) * 0.05).to("cuda", torch.bfloat16).requires_grad_(True)
          for _ in counts]
    for w in ws:
        w.main_grad = torch.zeros(N, K, device="cuda")
        w.grad_added_to_main_grad = False
    x = torch.zeros(seg.rows, K, device="cuda", dtype=torch.bfloat16)
    g = torch.zeros(seg.rows, N, device="cuda", dtype=torch.bfloat16)
    for e, c in enumerate(counts):
        lo = seg.offsets[e]
        if c:
            x[lo:lo + c] = outlier_tensor(c, K, generator=gen).to("cuda", torch.bfloat16)
            g[lo:lo + c] = outlier_tensor(c, N, generator=gen).to("cuda", torch.bfloat16)
    x.requires_grad_(True)
    out = grouped_hp_linear(x, seg, ws, fuse_wgrad=True)
    out.backward(g)
    eps = torch.finfo(torch.float32).eps  # with 2**-8: bf16's unit roundoff, one rounding of the result

    def within(got, a, b, depth, rounding):
        exact = a @ b
        bound = depth * eps * (a.abs() @ b.abs()) + rounding * exact.abs()
        return ((got.double() - exact).abs() <= bound).all().item()

    for e, (c, w) in enumerate(zip(counts, ws)):
        lo, hi = seg.bounds(e)
        if not c:
            assert torch.equal(w.main_grad, torch.zeros_like(w.main_grad))
            continue
        x64, g64, w64 = x[lo:hi].detach().double(), g[lo:hi].double(), w.detach().double()
        assert within(out[lo:lo + c], x64[:c], w64.T, K, 2.0**-8), e
        assert within(x.grad[lo:lo + c], g64[:c], w64, N, 2.0**-8), e
        assert within(w.main_grad, g64.T, x64, hi - lo, 0.0), e
        assert (out[lo + c:hi] == 0).all() and (x.grad[lo + c:hi] == 0).all(), e
    assert all(w.grad_added_to_main_grad for w in ws)
