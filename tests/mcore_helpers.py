"""Shared helpers for the megatron-core integration tests: distributed setup and INT8 error bounds."""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import tempfile
import traceback
import warnings

import torch
import torch.multiprocessing as mp

FP32_EPS = 2.0**-24
QMAX = 127


def nearest_recipe(**kw):
    """Tensorwise scales (what qgemm_bound assumes unless told otherwise) and round-to-nearest gradients:
    the deterministic recipe these tests compare runs and bounds with (stochastic rounding draws random
    numbers, and its error is up to a full step)."""
    from megatron_int8.recipe import Int8Recipe

    return Int8Recipe(**{"granularity": "tensor", "grad_rounding": "nearest", **kw})


# ----------------------------------------------------------------------------- error bounds


def _half_step(x_abs_upper: torch.Tensor, granularity: str) -> torch.Tensor:
    """Upper bound of half a quantization step for an operand [R, K] (K = contraction axis)."""
    if granularity == "tensor":
        return (x_abs_upper.max() / (2 * QMAX)).expand_as(x_abs_upper)
    if granularity == "row":
        return (x_abs_upper.amax(dim=1, keepdim=True) / (2 * QMAX)).expand_as(x_abs_upper)
    raise ValueError(granularity)


def qgemm_bound(a, b, ea=None, eb=None, granularity="tensor"):
    """Bound on |Q(a~) Q(b~)^T - a b^T| for exact operands a [R, K], b [N, K] (float64) and
    perturbed inputs with |a~ - a| <= ea, |b~ - b| <= eb. Round-to-nearest moves each element by at
    most half a step, scale/2 = amax/254, and amax(a~) <= max(|a| + ea); fp32 output rounding adds
    a few ulps of |a~||b~|^T."""
    ea = torch.zeros_like(a) if ea is None else ea
    eb = torch.zeros_like(b) if eb is None else eb
    a_up, b_up = a.abs() + ea, b.abs() + eb
    da = ea + _half_step(a_up, granularity)
    db = eb + _half_step(b_up, granularity)
    bound = da @ b.abs().T + a.abs() @ db.T + da @ db.T
    return bound + 8 * FP32_EPS * ((a_up + da) @ (b_up + db).T)


# -------------------------------------------------------------------- FP8 (torchao) bounds

# mantissa bits, largest finite value, spacing of the subnormals (= the smallest subnormal)
FP8_FORMATS = {"e4m3": (3, 448.0, 2.0**-9), "e5m2": (2, 57344.0, 2.0**-16)}
# operand formats (input, weight, output gradient) of torchao's recipes
FP8_RECIPE_FORMATS = {"tensorwise": ("e4m3", "e4m3", "e5m2"), "rowwise": ("e4m3", "e4m3", "e4m3")}


def fp8_scale(x, fmt: str, rowwise: bool) -> torch.Tensor:
    """torchao's dynamic scale of a GEMM operand x [R, K] (K = contraction axis): fmax / amax in fp32, over
    the tensor (tensorwise) or per row (rowwise, rounded down to a power of two); as float64."""
    _, fmax, _ = FP8_FORMATS[fmt]
    x = x.double().abs()
    amax = x.amax(dim=1, keepdim=True) if rowwise else x.max()
    scale = (fmax / amax.clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale.double()


def fp8_operand_error(x, fmt: str, rowwise: bool) -> torch.Tensor:
    """Elementwise bound on |Q(x) - x| (dequantized, in x's units). Round to nearest moves x*s by at most
    half a step: 2^-(m+1) |x*s| for a normal number (m mantissa bits: 2^-4 for e4m3, 2^-3 for e5m2), half
    the subnormal spacing below; x*s is formed in fp32 first (2^-24 relative, bounded by 2^-22 here)."""
    m, _, subnormal = FP8_FORMATS[fmt]
    return (2.0 ** -(m + 1) + 2.0**-22) * x.double().abs() + (subnormal / 2) / fp8_scale(x, fmt, rowwise)


def fp8_gemm_bound(a, b, fmt_a: str, fmt_b: str, *, rowwise: bool, fast_accum: bool) -> torch.Tensor:
    """Elementwise bound on |Q(a) Q(b)^T - a b^T| for a [R, K], b [N, K]: the quantization terms
    da |b|^T + |a| db^T + da db^T, plus accumulation: K additions with relative error u each, u = 2^-13
    under `use_fast_accum` (Hopper's FP8 accumulator keeps about 14 bits), else 2^-23 (fp32)."""
    da, db = fp8_operand_error(a, fmt_a, rowwise), fp8_operand_error(b, fmt_b, rowwise)
    A, B = a.double().abs(), b.double().abs()
    u = 2.0**-13 if fast_accum else 2.0**-23
    return da @ B.T + A @ db.T + da @ db.T + a.shape[1] * u * ((A + da) @ (B + db).T)


def fp8_gemm_mean_square_error(a, b, fmt_a: str, fmt_b: str, *, rowwise: bool) -> float:
    """Expected sum over the output of the squared error of Q(a) Q(b)^T, rounding errors independent and
    uniform within their step (variance step^2 / 12, step <= 2^-m |x| for normals, the subnormal spacing
    below). Gross errors (a wrong scale, a dropped operand) exceed it by orders of magnitude, while the
    worst-case `fp8_gemm_bound` grows with K x the mean magnitude and cannot see them."""
    def variance(x, fmt):
        m, _, subnormal = FP8_FORMATS[fmt]
        return (2.0**-m) ** 2 / 12 * x.double() ** 2 + (subnormal / fp8_scale(x, fmt, rowwise)) ** 2 / 12

    va, vb = variance(a, fmt_a), variance(b, fmt_b)
    a2, b2 = a.double() ** 2, b.double() ** 2
    return (va @ b2.T + a2 @ vb.T + va @ vb.T).sum().item()


def fp8_linear_checks(x, w, g, out, x_grad, w_grad, recipe: str, fast_accum_fprop: bool = True):
    """(name, got, exact, elementwise bound, expected squared error) for a linear's fprop, dgrad and wgrad
    in FP8: x [M, K] input, w [N, K] weight, g [M, N] output gradient (the exact operands, any float dtype)."""
    f_in, f_w, f_go = FP8_RECIPE_FORMATS[recipe]
    rowwise = recipe == "rowwise"
    x, w, g = x.double(), w.double(), g.double()
    gemms = [("fprop", out, x, w, f_in, f_w, fast_accum_fprop),
             ("dgrad", x_grad, g, w.T.contiguous(), f_go, f_w, False),
             ("wgrad", w_grad, g.T.contiguous(), x.T.contiguous(), f_go, f_in, False)]
    return [(name, got.double(), a @ b.T, fp8_gemm_bound(a, b, fa, fb, rowwise=rowwise, fast_accum=fast),
             fp8_gemm_mean_square_error(a, b, fa, fb, rowwise=rowwise))
            for name, got, a, b, fa, fb, fast in gemms]


def assert_fp8_linear_within_bounds(checks, out_rel: float):
    """Each GEMM within its elementwise bound (plus `out_rel` relative rounding of the output), and its
    total squared error within 4x the expected one (twice the RMS)."""
    for name, got, exact, bound, mean_square in checks:
        slack = bound + out_rel * (exact.abs() + bound)
        err = (got - exact).abs()
        worst = (err / slack).max().item()
        assert worst <= 1.0, f"{name}: error exceeds the FP8 bound by {worst:.3f}x"
        expected = mean_square + (out_rel**2 / 3) * exact.pow(2).sum().item()
        ratio = err.pow(2).sum().item() / expected
        assert ratio <= 4.0, f"{name}: squared error {ratio:.2f}x the expected FP8 rounding error"


# ------------------------------------------------------------------------- megatron setup


def rank_device(rank: int, device: str = "cpu") -> torch.device:
    """The device a test rank computes on: the CPU, or one GPU per rank (cuda:rank) for `device="cuda"`."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return torch.device("cuda", rank % torch.cuda.device_count())


def init_megatron(world_size=1, rank=0, init_file=None, *, tp=1, pp=1, ep=1, vpp=None, seed=1234, device="cpu"):
    """Process group + megatron model parallel state, seeded. `device="cpu"`: gloo, CPU tensors (also a
    single process on a GPU machine); `device="cuda"`: NCCL with rank r on cuda:r (set as current device)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_int8.megatron.compat import apply_cpu_compat, model_parallel_seed

    dev = rank_device(rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    apply_cpu_compat()
    if not torch.distributed.is_initialized():
        if init_file is None:
            init_file = tempfile.mktemp(prefix="mi8_pg_")
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                             init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep)
    model_parallel_seed(seed)


def teardown_megatron():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def single_process_megatron(**kwargs):
    """World size 1 for an in-process test; tears down what it created."""
    created = not torch.distributed.is_initialized()
    init_megatron(**kwargs)
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


def _worker(rank, world_size, init_file, fn, args, timeout, errors):
    faulthandler.dump_traceback_later(timeout, exit=True)  # a hung collective prints stacks and dies
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, init_file, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        with contextlib.suppress(Exception):
            teardown_megatron()


def run_distributed(fn, world_size, *args, timeout=150):
    """Run fn(rank, world_size, init_file, *args) in `world_size` spawned processes (file rendezvous, so
    no port can collide; fn picks gloo or NCCL through init_megatron); raise with the child's traceback
    on failure or timeout."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    fd, init_file = tempfile.mkstemp(prefix="mi8_pg_")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, timeout, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout + 30)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    messages = []
    while not errors.empty():
        rank, tb = errors.get()
        messages.append(f"--- rank {rank} ---\n{tb}")
    if alive or messages or any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"distributed test failed (exit codes {[p.exitcode for p in procs]}, "
                             f"{len(alive)} hung)\n" + "\n".join(messages))


def tiny_config(**overrides):
    """A small llama-style TransformerConfig for CPU tests (fp32, CPU init => TP-invariant weights)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
              gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
              add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0,
              attention_dropout=0.0, init_method_std=0.02)
    kw.update(overrides)
    return TransformerConfig(**kw)


# ----------------------------------------------------------------------------- specs across versions


def submodules_of(spec):
    """The submodules of a spec: a ModuleSpec's, or from 0.17 a builder's (`functools.partial(cls, submodules=...)`,
    which megatron-core uses for MLPs and MoE layers)."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def build_spec(spec, *args, **kwargs):
    """Build a module from a spec: a ModuleSpec or class through megatron's `build_module`, a builder (0.17's
    `functools.partial` specs of MLPs and MoE layers) by calling it."""
    from megatron.core.transformer.spec_utils import build_module

    if isinstance(spec, functools.partial):
        return spec(*args, **kwargs)
    return build_module(spec, *args, **kwargs)


def build_layer_mlp(spec, config):
    """A layer spec's `mlp` built as TransformerLayer builds it (the tests build MLPs alone): 0.19's
    builders (`MLP.as_mlp_submodule`, MoELayer) take the layer's process groups and MTP flag; a ModuleSpec'd MLP
    takes the TP group, a MoE layer the process groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLP

    groups = ProcessGroupCollection.use_mpu_process_groups()
    if isinstance(spec, functools.partial):
        return spec(config=config, pg_collection=groups, is_mtp_layer=False)
    if spec.module is MLP:
        return build_spec(spec, config=config, tp_group=groups.tp)
    return build_spec(spec, config=config, pg_collection=groups)


def adam_losses(model, tokens, steps: int = 6, lr: float = 1e-2) -> list:
    """Losses of `steps` Adam steps of a GPTModel on one batch of token rows (inputs tokens[:, :-1], labels
    tokens[:, 1:]), the tiny models' training check."""
    positions = torch.arange(tokens.shape[1] - 1, device=tokens.device).expand(tokens.shape[0], -1)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def outlier_tensor(*shape, generator=None, outliers=4, scale=20.0, dtype=torch.float32):
    """Gaussian data with a few large entries (the INT8 failure mode that tensorwise scales must survive)."""
    x = torch.randn(*shape, generator=generator, dtype=dtype)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (outliers,), generator=generator)
    flat[idx] = flat[idx].sign() * scale
    return x


def assert_layers_bit_identical(first, second, x0, g0):
    """Two megatron layers returning (output, bias) give bit-identical outputs, input gradients and
    parameter gradients (same names) for input x0 and output gradient g0; every gradient is non-zero."""
    results = []
    for layer in (first, second):
        x = x0.clone().requires_grad_(True)
        out, _ = layer(x)
        out.backward(g0)
        results.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = results
    assert torch.isfinite(out_a).all() and out_a.abs().sum() > 0
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(grad, grads_b[name]), name


def query_norm_layer_pair(config, int8: bool, generator, device="cpu", granularity="row"):
    """(ours, stock, contiguous): two TransformerLayers of this package's spec with the same outlier weights,
    `ours` with its QueryNormInPlaceSelfAttention and `stock` with megatron's SelfAttention; `contiguous`
    maps each to whether its query norm's inputs were contiguous (forward hooks, one entry per call). Under
    tensor parallelism every rank gets the same local weights, which is all the comparison needs."""
    import dataclasses

    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    spec = get_gpt_int8_layer_spec(qk_layernorm=config.qk_layernorm, recipe=nearest_recipe(granularity=granularity),
                                   int8=int8)
    attention = dataclasses.replace(spec.submodules.self_attention, module=SelfAttention)
    stock_spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
    ours = build_module(spec, config=config, layer_number=1).to(device)
    stock = build_module(stock_spec, config=config, layer_number=1).to(device)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(outlier_tensor(*p.shape, generator=generator, scale=4.0) * 0.1 + (p.dim() == 1))
    stock.load_state_dict(ours.state_dict())
    contiguous = {"ours": [], "stock": []}
    for name, layer in (("ours", ours), ("stock", stock)):
        norm = layer.self_attention.q_layernorm
        if norm is not None:
            norm.register_forward_hook(lambda m, inputs, out, name=name: contiguous[name].append(inputs[0].is_contiguous()))
    return ours, stock, contiguous


def split_qkv_both_ways(mixed, norms, grads, groups: int, head: int):
    """[fused, separate]: attention._SplitQKVNormed on the fused QKV tensor `mixed`, then the same split as views
    with the two FusedRMSNorm modules `norms` run separately (autograd's backward). Each is [query, key, value,
    gradient of mixed, gradients of the two norm weights] for output gradients `grads`. The fused value must
    be a view of its input."""
    from megatron_int8.megatron.attention import _qkv_parts, _SplitQKVNormed

    results = []
    for fused in (True, False):
        leaf = mixed.detach().requires_grad_(True)
        for n in norms:
            n.weight.grad = None
        if fused:
            outs = _SplitQKVNormed.apply(leaf, norms[0].weight, norms[1].weight, 1e-6, 1e-6, groups, head)
            assert outs[2]._base is leaf  # the value is a view, no copy
        else:
            q_in, k_in, v = _qkv_parts(leaf, groups, head)
            outs = (norms[0](q_in).flatten(2, 3), norms[1](k_in), v)
        torch.autograd.backward(outs, grads)
        results.append([o.detach() for o in outs] + [leaf.grad] + [n.weight.grad.clone() for n in norms])
    return results
