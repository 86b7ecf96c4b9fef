"""Multi-process (gloo, 2 ranks) tests: tensor/sequence parallel INT8 linears against TP=1 and
float64 within scale-derived bounds, expert parallel MoE, and the precision table under PP/VPP.
tests/test_parallel_gpu.py runs the same tensor/sequence-parallel worker on 2 GPUs (NCCL, Triton)."""
import collections
import re

import pytest
import torch
import torch.nn.functional as F
from megatron_int8.ops.backend import triton_available
from mcore_helpers import (assert_layers_bit_identical, build_spec, init_megatron, nearest_recipe, outlier_tensor,
                           qgemm_bound, query_norm_layer_pair, rank_device, run_distributed, tiny_config)

pytestmark = pytest.mark.slow

GELU_SLOPE = 1.1289  # max |gelu'(x)|
GELU_CURVATURE = 0.7979  # max |gelu''(x)| = 2 * phi(0)


def _chain_bounds(x, w1, w2, g):
    """Exact float64 fc1 -> gelu -> fc2 forward/backward and elementwise INT8 error bounds, by
    propagating each GEMM's quantization bound through the chain."""
    y1 = x @ w1.T
    b_y1 = qgemm_bound(x, w1)
    h = F.gelu(y1)
    e_h = GELU_SLOPE * b_y1
    y2 = h @ w2.T
    dh = g @ w2
    b_dh = qgemm_bound(g, w2.T.contiguous())
    dy1 = dh * torch.autograd.grad(F.gelu(y1.requires_grad_()).sum(), y1)[0]
    e_dy1 = GELU_SLOPE * b_dh + GELU_CURVATURE * (dh.abs() + b_dh) * b_y1
    exact = {"out": y2, "dx": dy1 @ w1, "dw1": dy1.T @ x, "dw2": g.T @ h}
    bound = {
        "out": qgemm_bound(h, w2, ea=e_h),
        "dx": qgemm_bound(dy1, w1.T.contiguous(), ea=e_dy1),
        "dw1": qgemm_bound(dy1.T.contiguous(), x.T.contiguous(), ea=e_dy1.T.contiguous()),
        "dw2": qgemm_bound(g.T.contiguous(), h.T.contiguous(), eb=e_h.T.contiguous()),
    }
    return exact, bound


def _tp1_int8_chain(x, w1, w2, g, device="cpu"):
    """The TP=1 INT8 model on full tensors (fp32 on `device`, round-to-nearest like the TP=2 layers);
    results on the CPU."""
    from megatron_int8.ops.linear import int8_linear

    x = x.to(device, torch.float32).requires_grad_(True)
    w1 = w1.to(device, torch.float32).requires_grad_(True)
    w2 = w2.to(device, torch.float32).requires_grad_(True)
    out = int8_linear(F.gelu(int8_linear(x, w1, recipe=nearest_recipe())), w2, recipe=nearest_recipe())
    out.backward(g.to(device, torch.float32))
    return {k: v.cpu() for k, v in {"out": out.detach(), "dx": x.grad, "dw1": w1.grad, "dw2": w2.grad}.items()}


def _gather(t, dim):
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def _record_gemm_backends():
    """Wrap both backends' GEMM: the returned list gets (backend name, device type) of every INT8 GEMM."""
    from megatron_int8.reference import ReferenceBackend

    classes = [ReferenceBackend]
    if triton_available():
        from megatron_int8.kernels import TritonBackend

        classes.append(TritonBackend)
    calls = []
    for cls in classes:
        def gemm(self, a, b, _original=cls.gemm, **kwargs):
            calls.append((self.name, a.data.device.type))
            return _original(self, a, b, **kwargs)
        cls.gemm = gemm
    return calls


def _record_pipelined_collectives():
    """Wrap linear's pipelined collectives: the returned list gets "gather" / "reduce_scatter" per call."""
    from megatron_int8.ops import linear

    calls = []
    for name, kind in (("gather_pipelined", "gather"), ("reduce_scatter_pipelined", "reduce_scatter")):
        def wrapped(*args, _original=getattr(linear, name), _kind=kind, **kwargs):
            calls.append(_kind)
            return _original(*args, **kwargs)
        setattr(linear, name, wrapped)
    return calls


def _tp_chain_worker(rank, world_size, init_file, device="cpu"):
    """fc1 -> gelu -> fc2 at TP=2 (+-SP), fp32, round-to-nearest: INT8 against float64, the TP=1 INT8
    chain and the high-precision layers, within the propagated scale bounds. `device="cuda"`: rank r on
    cuda:r, NCCL, the default (Triton) backend; the bounds are the same (fp32 in and out)."""
    from megatron_int8.dispatch import resolve_backend_name
    from megatron_int8.megatron.layers import Int8ColumnParallelLinear, Int8RowParallelLinear

    init_megatron(world_size, rank, init_file, tp=2, device=device)
    dev = rank_device(rank, device)
    torch.set_float32_matmul_precision("highest")  # the high-precision model in IEEE fp32 on GPU too (no TF32)
    expected_backend = resolve_backend_name(dev, nearest_recipe())
    assert dev.type == "cpu" or expected_backend == "triton", expected_backend
    gemm_calls = _record_gemm_backends()
    pipelined = _record_pipelined_collectives()
    hidden, ffn, seq, batch = 32, 64, 8, 2
    # tensorwise: with sequence parallelism the BF16 and the INT8 all-gather, and the collectives pipelined
    # with the GEMMs (tp_comm_overlap: the row-parallel reduce-scatter then runs inside the linear)
    for sequence_parallel, int8_gather, overlap in ((False, False, False), (True, False, False), (True, True, False),
                                                    (True, False, True)):
        recipe = nearest_recipe(int8_all_gather=int8_gather)
        models = {}
        for name, int8, fusion in (("int8", True, True), ("hp", False, False)):
            config = tiny_config(hidden_size=hidden, ffn_hidden_size=ffn, tensor_model_parallel_size=2,
                                 sequence_parallel=sequence_parallel, gradient_accumulation_fusion=fusion,
                                 tp_comm_overlap=overlap)
            torch.manual_seed(0)  # CPU init: the same full weights on every rank, for every model
            fc1 = Int8ColumnParallelLinear(hidden, ffn, config=config, init_method=torch.nn.init.xavier_normal_,
                                           bias=False, gather_output=False, int8=int8, recipe=recipe)
            fc2 = Int8RowParallelLinear(ffn, hidden, config=config, init_method=torch.nn.init.xavier_normal_,
                                        bias=False, input_is_parallel=True, skip_bias_add=False, int8=int8,
                                        recipe=recipe)
            models[name] = (fc1.to(dev), fc2.to(dev))
        gen = torch.Generator().manual_seed(42)
        with torch.no_grad():  # outliers in the weights, identical on both ranks before sharding
            w1_full = outlier_tensor(ffn, hidden, generator=gen, scale=6.0) * 0.1
            w2_full = outlier_tensor(hidden, ffn, generator=gen, scale=6.0) * 0.1
            for fc1, fc2 in models.values():
                fc1.weight.copy_(w1_full.chunk(2, 0)[rank])
                fc2.weight.copy_(w2_full.chunk(2, 1)[rank])
        for fc in models["int8"]:
            assert fc.weight.device == dev
            fc.weight.main_grad = torch.zeros_like(fc.weight)
            fc.weight.grad_added_to_main_grad = False

        exact_wgrad = {"dw1": 0, "dw2": 0}
        bound_wgrad = {"dw1": 0, "dw2": 0}
        tp1_wgrad = {"dw1": 0, "dw2": 0}
        for micro_batch in range(3):
            x_full = outlier_tensor(seq, batch, hidden, generator=gen)
            g_full = outlier_tensor(seq, batch, hidden, generator=gen)
            local = slice(rank * seq // 2, (rank + 1) * seq // 2) if sequence_parallel else slice(None)
            results = {}
            for name, (fc1, fc2) in models.items():
                x = x_full[local].to(dev, copy=True).requires_grad_(True)
                out = fc2(F.gelu(fc1(x)[0]))[0]
                out.backward(g_full[local].to(dev))
                assert out.device == dev and x.grad.device == dev
                full = (lambda t: _gather(t, 0)) if sequence_parallel else (lambda t: t)
                results[name] = {"out": full(out.detach()).reshape(-1, hidden).cpu(),
                                 "dx": full(x.grad).reshape(-1, hidden).cpu()}
            for fc in models["int8"]:
                fc.weight.grad, fc.weight.grad_added_to_main_grad = None, False

            x64, g64 = x_full.double().reshape(-1, hidden), g_full.double().reshape(-1, hidden)
            exact, bound = _chain_bounds(x64, w1_full.double(), w2_full.double(), g64)
            tp1 = _tp1_int8_chain(x64, w1_full.double(), w2_full.double(), g64, dev)
            for key in ("out", "dx"):
                tp2, hp = results["int8"][key].double(), results["hp"][key].double()
                assert ((tp2 - exact[key]).abs() <= bound[key]).all(), (sequence_parallel, overlap, micro_batch, key)
                assert ((tp1[key].double() - exact[key]).abs() <= bound[key]).all(), key
                assert ((tp2 - tp1[key].double()).abs() <= 2 * bound[key]).all(), key
                assert ((tp2 - hp).abs() <= bound[key] + (hp - exact[key]).abs()).all(), key  # vs BF16 model
                assert (tp2 - exact[key]).abs().max() > 0
            for key in exact_wgrad:
                exact_wgrad[key] = exact_wgrad[key] + exact[key]
                bound_wgrad[key] = bound_wgrad[key] + bound[key]
                tp1_wgrad[key] = tp1_wgrad[key] + tp1[key].double()

        # main_grad accumulated over the 3 micro-batches, gathered over TP.
        fc1, fc2 = models["int8"]
        hp1, hp2 = models["hp"]
        got = {"dw1": _gather(fc1.weight.main_grad, 0).double().cpu(),
               "dw2": _gather(fc2.weight.main_grad, 1).double().cpu()}
        hp = {"dw1": _gather(hp1.weight.grad, 0).double().cpu(), "dw2": _gather(hp2.weight.grad, 1).double().cpu()}
        for key in got:
            assert ((got[key] - exact_wgrad[key]).abs() <= bound_wgrad[key]).all(), (sequence_parallel, overlap, key)
            assert ((got[key] - tp1_wgrad[key]).abs() <= 2 * bound_wgrad[key]).all(), key
            assert ((got[key] - hp[key]).abs() <= bound_wgrad[key] + (hp[key] - exact_wgrad[key]).abs()).all(), key
        # every INT8 GEMM (TP=2 layers and the TP=1 chain) ran on this rank's device, with the expected backend
        assert gemm_calls and set(gemm_calls) == {(expected_backend, dev.type)}, set(gemm_calls)
        gemm_calls.clear()
        # with tp_comm_overlap every pipelined collective ran once per micro-batch (3) in each of the two
        # models: fc1's input gather and fc2's gradient gather (2 gathers), fc2's output reduce-scatter
        runs = 3 * 2 if overlap else 0
        expected = collections.Counter({"gather": 2 * runs, "reduce_scatter": runs})
        assert collections.Counter(pipelined) == +expected, collections.Counter(pipelined)
        pipelined.clear()


def test_tensor_and_sequence_parallel_match_tp1_and_fp64():
    run_distributed(_tp_chain_worker, 2)


def _moe_layer(config, grouped=False):
    """Tensorwise per-expert INT8 experts, or (grouped) row-wise ones run by Int8GroupedMLP."""
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    recipe = nearest_recipe(granularity="row") if grouped else nearest_recipe()
    spec = get_gpt_int8_layer_spec(num_experts=config.num_moe_experts, recipe=recipe, moe_grouped_gemm=grouped)
    layer = build_spec(spec.submodules.mlp, config=config)
    assert (getattr(layer.experts, "grouped_problem", "absent") is None) == grouped
    return layer


def _moe_worker(rank, world_size, init_file, grouped):
    from megatron.core import parallel_state

    from megatron_int8.megatron.layers import Int8ColumnParallelLinear

    moe = dict(hidden_size=32, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
               moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0)
    gen = torch.Generator().manual_seed(9)
    xs = [outlier_tensor(8, 2, 32, generator=gen) for _ in range(world_size)]
    gs = [outlier_tensor(8, 2, 32, generator=gen) for _ in range(world_size)]

    # EP=1 reference on all ranks' tokens at once (each expert sees the same token set as with EP=2).
    init_megatron(world_size, rank, init_file, ep=1)
    ref = _moe_layer(tiny_config(**moe), grouped)
    assert all(isinstance(m, Int8ColumnParallelLinear) and m.int8 for n, m in ref.named_modules() if n.endswith("fc1"))
    x = torch.cat(xs, 0).requires_grad_(True)
    out_ref, _ = ref(x)
    out_ref.backward(torch.cat(gs, 0))
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_state = {n: p.detach().clone() for n, p in ref.named_parameters()}

    parallel_state.destroy_model_parallel()
    init_megatron(world_size, rank, init_file, ep=2)
    layer = _moe_layer(tiny_config(expert_model_parallel_size=2, **moe), grouped)
    local_experts = 4 // world_size

    def global_name(name):
        return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{rank * local_experts + int(m.group(1))}.", name)

    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(ref_state[global_name(name)])
    x = xs[rank].clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(gs[rank])
    rows = slice(rank * 8, (rank + 1) * 8)
    # Same tokens per expert => same scales and INT8 products; only fp32 summation order may differ.
    tol = lambda ref_t: 16 * 2**-24 * ref_t.abs().max()  # noqa: E731
    torch.testing.assert_close(out, out_ref[rows].detach(), rtol=0, atol=tol(out_ref).item())
    for name, param in layer.named_parameters():
        if "experts" in name:  # expert grads: every token of every rank, so directly comparable
            expected = ref_grads[global_name(name)]
            torch.testing.assert_close(param.grad, expected, rtol=0, atol=tol(expected).item())
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped"])
def test_moe_expert_parallel_matches_ep1(grouped):
    run_distributed(_moe_worker, 2, grouped)


def _query_norm_tp_worker(rank, world_size, init_file):
    init_megatron(world_size, rank, init_file, tp=2)
    gen = torch.Generator().manual_seed(3)
    config = tiny_config(num_attention_heads=8, num_query_groups=4, kv_channels=8, qk_layernorm=True,
                         layernorm_epsilon=1e-6, tensor_model_parallel_size=2)
    ours, stock, contiguous = query_norm_layer_pair(config, True, gen)
    assert ours.self_attention.num_query_groups_per_partition == 2
    x0 = outlier_tensor(12, 2, 64, generator=gen)
    g0 = torch.randn(12, 2, 64, generator=gen)
    assert_layers_bit_identical(ours, stock, x0, g0)
    assert contiguous == {"ours": [False], "stock": [True]}  # 4 query heads in 2 groups per rank: megatron copies


def test_query_norm_in_place_matches_megatron_under_tensor_parallelism():
    """QueryNormInPlaceSelfAttention at TP=2 (each rank holds 2 of the 4 key/value groups and their query heads)
    against megatron's SelfAttention: bit-identical INT8 layer outputs and gradients on every rank."""
    run_distributed(_query_norm_tp_worker, 2)


def _pp_table_worker(rank, world_size, init_file):
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.megatron.policy import Int8Policy
    from megatron_int8.megatron.precision_table import print_precision_table
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    policy = Int8Policy(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    for num_layers, vpp in ((4, None), (8, 2)):
        init_megatron(world_size, rank, init_file, pp=2, vpp=vpp)
        config = tiny_config(num_layers=num_layers, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.bfloat16,
                             params_dtype=torch.bfloat16, bf16=True)
        chunks = []
        for vp_stage in range(vpp or 1):
            stage = None if vpp is None else vp_stage
            pre = rank == 0 and vp_stage == 0
            post = rank == 1 and vp_stage == (vpp or 1) - 1
            chunks.append(GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, policy, vp_stage=stage),
                                   vocab_size=64, max_sequence_length=16, pre_process=pre, post_process=post,
                                   vp_stage=stage))
        table = print_precision_table(chunks, policy, print_fn=lambda s: None, full=True)
        if rank != 0:
            assert table is None
            continue
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[3:]]
        layers = {}
        for layer, module, shape, precision, recipe in rows:
            layers.setdefault(layer, set()).add(precision)
        expected = {str(i): ({"bf16"} if i in (1, num_layers) else {"int8"}) for i in range(1, num_layers + 1)}
        expected.update(embedding={"bf16"}, output={"bf16"})
        assert layers == expected, table
        assert [r[0] for r in rows] == ["embedding"] + [str(i) for i in range(1, num_layers + 1) for _ in range(4)] + ["output"]


def test_precision_table_first_last_bf16_under_pp_and_vpp():
    run_distributed(_pp_table_worker, 2)
