"""MoE experts under megatron's padded expert capacity (`moe_expert_capacity_factor` +
`moe_pad_expert_input_to_capacity`), the mode in which an MoE training step can be captured in a CUDA graph.

Every local expert then receives the same number of rows, which `padded_expert_capacity` takes from the input's
shape instead of `tokens_per_expert`. Checked here: the dispatchers hand the experts exactly those counts; on the
same routing the padded path gives bit-identical outputs and gradients to the counted one (the same arithmetic
on the same rows) and, for high-precision experts, the float64 result within fp32 rounding; and it reads no
value computed on the device on the host, alone and inside the whole MoE layer with the alltoall dispatcher,
while the counted path, the allgather dispatcher and dropless routing do (so the check can fail).

How "reads no device value" is checked on a CPU: the tensors a GPU would hold (inputs, parameters, output
gradient) are marked, every ATen op run on a marked tensor marks its outputs and the tensors it writes (a
TorchDispatchMode, so autograd's backward ops are seen too), and a host read of a marked tensor fails: the ops
that read a value to the host (`aten._local_scalar_dense`, behind item/bool/int/float) or size their output
from data (nonzero, masked_select, unique, bincount, repeat_interleave without output_size), and the methods
that copy one out without an ATen op on a CPU tensor (tolist, numpy). A tensor built on the host and only read
there is not marked (megatron's drop-and-pad counts are such a tensor), and neither is one that autograd saved
and hands back after its Python object died: this check can miss a read, not invent one. The complete check is
tests/megatron/test_moe_graph_gpu.py, on a GPU under torch.cuda.set_sync_debug_mode("error") and in a CUDA graph.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from megatron_int8.recipe import Int8Recipe
from mcore_helpers import assert_layers_bit_identical, build_spec, init_megatron, outlier_tensor, run_distributed, \
    single_process_megatron, tiny_config

ROW = Int8Recipe(granularity="row", backend="reference")
E, H, FFN, TOPK = 4, 32, 48, 2

# ------------------------------------------------------------------------------------------- host reads

aten = torch.ops.aten
_SIZED_BY_DATA = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero,
                  aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.bincount}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_COPIED_OUT = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class HostRead(AssertionError):
    """A value computed from device tensors was read on the host (a device-to-host sync on a GPU)."""


def _reads_to_host(func, args, kwargs) -> bool:
    """Whether an ATen op reads its data on the host: a value, or the size of its output (a boolean mask as an
    index is a nonzero, run inside the kernel, below this mode)."""
    op = func.overloadpacket
    if op in _INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1]))
    return op in _SIZED_BY_DATA or (op is aten.repeat_interleave and kwargs.get("output_size") is None)


class _MarkDeviceValues(TorchDispatchMode):
    def __init__(self, marked: WeakIdKeyDictionary):
        super().__init__()
        self.marked = marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device_input = any(isinstance(t, torch.Tensor) and t in self.marked for t in tree_leaves((args, kwargs)))
        if device_input and _reads_to_host(func, args, kwargs):
            raise HostRead(f"{func} on a device value")
        out = func(*args, **kwargs)
        if device_input:
            written = [arg for spec, arg in zip(func._schema.arguments, args)
                       if spec.alias_info is not None and spec.alias_info.is_write]
            for t in tree_leaves(out) + written:
                if isinstance(t, torch.Tensor):
                    self.marked[t] = True
        return out


class _RefuseCopiesOut(TorchFunctionMode):
    def __init__(self, marked: WeakIdKeyDictionary):
        super().__init__()
        self.marked = marked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _COPIED_OUT and args and args[0] in self.marked:
            raise HostRead(f"Tensor.{func.__name__} on a device value")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(*device_tensors: torch.Tensor):
    """Fail with HostRead where the code inside reads on the host a value computed from `device_tensors`."""
    marked = WeakIdKeyDictionary()
    for t in device_tensors:
        marked[t] = True
    with _RefuseCopiesOut(marked), _MarkDeviceValues(marked):
        yield


def test_no_host_reads_catches_the_reads_a_gpu_would_sync_on():
    """The check itself: each way of reading a device value fails, forward and in a backward; host-built
    tensors and arithmetic on marked ones pass."""
    x = torch.randn(6, requires_grad=True)
    reads = [lambda: x.sum().item(), lambda: (x * 2).tolist(), lambda: bool((x > 0).any()), lambda: int(x.argmax()),
             lambda: x[x > 0], lambda: torch.repeat_interleave(torch.arange(6), (x > 0).long())]
    for read in reads:
        with pytest.raises(HostRead), no_host_reads(x):
            read()

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * float(g.abs().max())

    with pytest.raises(HostRead), no_host_reads(x):
        ReadsInBackward.apply(x).sum().backward()
    counts = torch.full((4,), 3)
    with no_host_reads(x):
        y = torch.cat([x, x.new_zeros(2)]) * 3
        assert counts.tolist() == [3] * 4 and y.shape == (8,)


# ---------------------------------------------------------------------------------------- the layers


def _config(padded: bool, capacity_factor: float = 1.25, dispatcher: str = "alltoall", grouped: bool = True,
            **overrides):
    capacity = dict(moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=True) if padded else {}
    return tiny_config(hidden_size=H, num_moe_experts=E, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
                       moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
                       moe_aux_loss_coeff=1e-2, moe_grouped_gemm=grouped, **capacity, **overrides)


def _moe_layer(config, int8: bool = True):
    from megatron_int8.megatron.spec import get_gpt_int8_layer_spec

    spec = get_gpt_int8_layer_spec(num_experts=E, moe_grouped_gemm=config.moe_grouped_gemm, recipe=ROW, int8=int8)
    return build_spec(spec.submodules.mlp, config=config)


def _outlier_parameters(layer, gen):
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(outlier_tensor(*p.shape, generator=gen, scale=8.0) * 0.05)


def _expert_inputs(capacity: int, gen):
    """What a dispatcher hands the experts under padded capacity: E blocks of `capacity` rows with outliers, the
    routing probabilities (a quarter exactly 0: the padding), and the counts megatron builds on the host."""
    hidden = outlier_tensor(E * capacity, H, generator=gen)
    probs = torch.rand(E * capacity, generator=gen)
    probs[torch.rand(E * capacity, generator=gen) < 0.25] = 0.0
    return hidden, probs, torch.full((E,), capacity, dtype=torch.long)


def _run_experts(experts, hidden, probs, tokens_per_expert, grad):
    """Output and gradients (input, probabilities, each parameter) of one forward and backward."""
    experts.zero_grad(set_to_none=True)
    x, p = hidden.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, bias = experts(x, tokens_per_expert, p)
    assert bias is None
    out.backward(grad)
    return {"output": out.detach(), "input gradient": x.grad, "probability gradient": p.grad,
            **{n: q.grad for n, q in experts.named_parameters()}}


def test_padded_expert_capacity_rule():
    from megatron_int8.megatron.experts import padded_expert_capacity

    assert padded_expert_capacity(_config(True), 120, 4) == 30
    assert padded_expert_capacity(_config(False), 120, 4) is None
    assert padded_expert_capacity(_config(False, moe_expert_capacity_factor=1.25), 120, 4) is None  # drops, no pad
    with pytest.raises(ValueError, match="moe_expert_capacity_factor"):  # megatron: no padding without a factor
        _config(False, moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match="split evenly"):
        padded_expert_capacity(_config(True), 121, 4)


def test_padded_layout_and_its_device_tables_are_kept():
    """A step captured in a CUDA graph reads the layout's device tables (strip owners, segment ends) by address:
    the layer keeps one layout per capacity, and each table is made once and owned by it (no shared cache that
    could evict it under a replay); equal layouts still compare and hash alike."""
    from megatron_int8.reference import Segments

    with single_process_megatron():
        experts = _moe_layer(_config(True)).experts
        counts = torch.full((E,), 40)
        first = experts._layout(torch.zeros(E * 40, H), counts)
        tables = first.segments.ends("cpu"), first.segments.strip_experts("cpu")
        again = experts._layout(torch.zeros(E * 40, H), counts)
        assert again is first and again.segments.ends("cpu") is tables[0]
        assert again.segments.strip_experts("cpu") is tables[1]
        assert experts._layout(torch.zeros(E * 24, H), counts) is not first  # another capacity, another layout
    assert tables[0].tolist() == list(first.segments.offsets[1:])
    twin = Segments(first.segments.offsets)
    assert twin == first.segments and hash(twin) == hash(first.segments) and twin.ends("cpu") is not tables[0]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_dispatchers_hand_the_experts_the_shape_counts(dispatcher, capacity_factor):
    """Through megatron's router and dispatcher, each expert receives megatron's capacity
    ceil(tokens * topk / experts * factor) rows, which is what padded_expert_capacity reads off the shape."""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from megatron_int8.megatron.experts import padded_expert_capacity

    gen = torch.Generator().manual_seed(31)
    seen = []
    with single_process_megatron():
        layer = _moe_layer(_config(True, capacity_factor, dispatcher))
        layer.experts.register_forward_pre_hook(
            lambda m, args: seen.append((args[0].shape[0], [int(c) for c in args[1].tolist()])))
        x = outlier_tensor(24, 2, H, generator=gen)
        out, _ = layer(x)
        assert torch.isfinite(out).all()
    rows, counts = seen[0]
    capacity = get_capacity(num_tokens=48 * TOPK, num_experts=E, capacity_factor=capacity_factor)
    assert counts == [capacity] * E and rows == E * capacity
    assert [padded_expert_capacity(layer.config, rows, E)] * E == counts


@pytest.mark.parametrize("fused_swiglu", [False, True], ids=["megatron-swiglu", "fused-swiglu"])
@pytest.mark.parametrize("capacity", [37, 128], ids=["padded-to-128", "aligned"])
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "fp32"])
def test_padded_experts_equal_counted_experts(int8, capacity, fused_swiglu):
    """On the same rows, the padded path (layout by reshape, counts from the shape) and the counted path (row
    table from tokens_per_expert) run the same arithmetic: bit-identical outputs and gradients, the zero-
    probability padding rows included."""
    gen = torch.Generator().manual_seed(32 + capacity + 2 * int8 + fused_swiglu)
    with single_process_megatron():
        padded = _moe_layer(_config(True, bias_activation_fusion=fused_swiglu), int8=int8).experts
        counted = _moe_layer(_config(False, bias_activation_fusion=fused_swiglu), int8=int8).experts
        assert padded.grouped_problem is None and padded.fused_swiglu == fused_swiglu
        _outlier_parameters(padded, gen)
        counted.load_state_dict(padded.state_dict())
        hidden, probs, tokens_per_expert = _expert_inputs(capacity, gen)
        grad = outlier_tensor(E * capacity, H, generator=gen)
        got = _run_experts(padded, hidden, probs, tokens_per_expert, grad)
        want = _run_experts(counted, hidden, probs, tokens_per_expert, grad)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert value.abs().sum() > 0, name
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("capacity", [37, 128], ids=["padded-to-128", "aligned"])
def test_padded_experts_against_float64(capacity):
    """fp32 experts under padded capacity against float64 megatron SwiGLU experts on the same blocks
    (y = p * W2 (silu(a) * b), [a | b] = W1 x): outputs and every gradient within 1e-5 of their largest
    element (fp32 rounding over contractions of 32-96 terms is ~1e-6; a row sent to the wrong expert, a
    padding row leaking into the output or a lost probability is O(1))."""
    gen = torch.Generator().manual_seed(33 + capacity)
    with single_process_megatron():
        experts = _moe_layer(_config(True), int8=False).experts
        _outlier_parameters(experts, gen)
        hidden, probs, tokens_per_expert = _expert_inputs(capacity, gen)
        grad = outlier_tensor(E * capacity, H, generator=gen)
        got = _run_experts(experts, hidden, probs, tokens_per_expert, grad)
        params = {n: q.detach().double().requires_grad_(True) for n, q in experts.named_parameters()}
    x, p = hidden.double().requires_grad_(True), probs.double().requires_grad_(True)
    outs = []
    for e in range(E):
        rows = slice(e * capacity, (e + 1) * capacity)
        a, b = (x[rows] @ params[f"local_experts.{e}.linear_fc1.weight"].T).chunk(2, dim=-1)
        outs.append((F.silu(a) * b * p[rows, None]) @ params[f"local_experts.{e}.linear_fc2.weight"].T)
    out = torch.cat(outs)
    out.backward(grad.double())
    want = {"output": out.detach(), "input gradient": x.grad, "probability gradient": p.grad,
            **{n: q.grad for n, q in params.items()}}
    assert got.keys() == want.keys()
    for name, value in want.items():
        scale = value.abs().max()
        assert scale > 0, name
        err = (got[name].double() - value).abs().max() / scale
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"


def test_padded_moe_layer_grouped_equals_sequential_experts():
    """The whole MoE layer under padded capacity (router dropping and padding, alltoall dispatcher): the
    grouped INT8 experts against megatron's SequentialMLP of the same INT8 linears, bit-identical outputs
    and gradients (router included, through the probabilities and the load-balancing loss)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_int8.megatron.experts import Int8GroupedMLP

    gen = torch.Generator().manual_seed(34)
    x0 = outlier_tensor(24, 2, H, generator=gen)
    g0 = outlier_tensor(24, 2, H, generator=gen)
    with single_process_megatron():
        sequential = _moe_layer(_config(True, grouped=False))
        grouped = _moe_layer(_config(True))
        assert type(sequential.experts) is SequentialMLP and isinstance(grouped.experts, Int8GroupedMLP)
        _outlier_parameters(sequential, gen)
        grouped.load_state_dict(sequential.state_dict())
        assert_layers_bit_identical(sequential, grouped, x0, g0)


def _padded_expert_parallel_worker(rank, world_size, init_file):
    from megatron.core.transformer.moe.moe_utils import get_capacity

    init_megatron(world_size, rank, init_file, ep=world_size)
    gen = torch.Generator().manual_seed(38)  # the same weights on both ranks, each rank its own tokens
    sequential = _moe_layer(_config(True, grouped=False, expert_model_parallel_size=world_size))
    grouped = _moe_layer(_config(True, expert_model_parallel_size=world_size))
    _outlier_parameters(sequential, gen)
    grouped.load_state_dict(sequential.state_dict())
    seen = []
    grouped.experts.register_forward_pre_hook(
        lambda m, args: seen.append((args[0].shape[0], [int(c) for c in args[1].tolist()])))
    gen.manual_seed(39 + rank)
    x0, g0 = outlier_tensor(24, 2, H, generator=gen), outlier_tensor(24, 2, H, generator=gen)
    assert_layers_bit_identical(sequential, grouped, x0, g0)
    local = E // world_size
    capacity = get_capacity(num_tokens=48 * TOPK, num_experts=E, capacity_factor=1.25)
    assert seen[0] == (local * capacity * world_size, [capacity * world_size] * local)
    x = x0.clone().requires_grad_(True)
    with no_host_reads(x, g0, *grouped.parameters()):
        out, _ = grouped(x)
        out.backward(g0)


@pytest.mark.slow  # multi-process
def test_padded_moe_layer_under_expert_parallelism():
    """EP 2 (alltoall between the ranks): each local expert receives capacity rows from each rank, which the
    shape gives; grouped = SequentialMLP bit for bit; no host read of a device value, exchanges included."""
    run_distributed(_padded_expert_parallel_worker, 2)


# ------------------------------------------------------------------------------------------ no host reads


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "fp32"])
def test_padded_experts_read_no_device_value(int8):
    """The grouped experts under padded capacity, forward and backward, with tokens_per_expert, the rows,
    the probabilities, the weights and the output gradient all device values: nothing is read on the host.
    The counted path reads tokens_per_expert (which is why it cannot be captured)."""
    gen = torch.Generator().manual_seed(35 + int8)
    with single_process_megatron():
        padded = _moe_layer(_config(True), int8=int8).experts
        counted = _moe_layer(_config(False), int8=int8).experts
        hidden, probs, tokens_per_expert = _expert_inputs(37, gen)
        grad = outlier_tensor(E * 37, H, generator=gen)
        x, p = hidden.requires_grad_(True), probs.requires_grad_(True)
        with no_host_reads(x, p, tokens_per_expert, grad, *padded.parameters()):
            out, _ = padded(x, tokens_per_expert, p)
            out.backward(grad)
        assert torch.isfinite(out).all() and x.grad.abs().sum() > 0 and p.grad.abs().sum() > 0
        with pytest.raises(HostRead, match="tolist"), no_host_reads(x, p, tokens_per_expert, *counted.parameters()):
            counted(x, tokens_per_expert, p)


@pytest.mark.parametrize("dispatcher,padded,grouped,sync_free", [
    ("alltoall", True, True, True),
    ("alltoall", True, False, True),  # SequentialMLP: it reads tokens_per_expert, built on the host here
    ("allgather", True, True, False),  # its counts are a device tensor: .cpu(), then masked_select (0.16) / .item()
    ("alltoall", False, True, False),  # dropless: the splits and counts are data
], ids=["alltoall-padded", "alltoall-padded-sequential", "allgather-padded", "alltoall-dropless"])
def test_moe_layer_reads_no_device_value(dispatcher, padded, grouped, sync_free):
    """The whole MoE layer (router with its load-balancing loss, dispatcher, INT8 experts), forward and
    backward, input, parameters and output gradient as device values: only the alltoall dispatcher with padded
    capacity reads none; the others read one (the rule --cuda-graph-impl local enforces)."""
    gen = torch.Generator().manual_seed(36)
    with single_process_megatron():
        layer = _moe_layer(_config(padded, dispatcher=dispatcher, grouped=grouped))
        _outlier_parameters(layer, gen)
        x = outlier_tensor(24, 2, H, generator=gen).requires_grad_(True)
        grad = outlier_tensor(24, 2, H, generator=gen)
        with contextlib.ExitStack() as stack:
            if not sync_free:
                stack.enter_context(pytest.raises(HostRead))
            stack.enter_context(no_host_reads(x, grad, *layer.parameters()))
            out, _ = layer(x)
            out.backward(grad)
        if sync_free:
            assert torch.isfinite(out).all() and x.grad.abs().sum() > 0
            assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in layer.parameters())
