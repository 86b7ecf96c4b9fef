"""benchmarks/bench_layer.py on CPU: the saved-tensor count of a tiny Llama-style layer, INT8 with and without the
SwiGLU's and the norms' inputs kept in INT8, and its INT8-attention row; the weight quantizations of its modes."""
import math

import pytest

from mcore_helpers import single_process_megatron
from repo_paths import BENCHMARKS


def test_int8_memory_options_save_the_expected_bytes_per_token(monkeypatch):
    """With int8_swiglu_input the layer keeps fc1's output (2F values per token) as int8 with one fp32 scale per
    1 x 128 block of each half instead of BF16: 4F - (2F + 8 ceil(F / 128)) bytes per token fewer, exactly, and
    nothing else changes (F = 352: 680 of the tiny layer's bytes per token). With int8_norm_input too, each of
    the two norms keeps H + 4 ceil(H / 128) + 4 bytes per token (int8 copy, block scales, rstd); on a GPU that
    replaces x and rstd (2H + 4), on CPU torch's composite RMSNorm keeps fp32 copies, so more goes."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    args = bench_layer.parse_args(["--device", "cpu", "--tiny", "--no-stock", "--no-fp8", "--int8-swiglu-input",
                                   "--int8-norm-input", "--backend", "reference"])
    swiglu, norm, both = "INT8 swiglu-in:int8", "INT8 norm-in:int8", "INT8 swiglu-in:int8,norm-in:int8"
    assert list(bench_layer.option_rows(args)) == [swiglu, norm, both]
    with single_process_megatron():
        layers = bench_layer.build_layers(args, {})
        assert layers[swiglu].mlp.activation_func.int8_copy and not layers["INT8"].mlp.activation_func.int8_copy
        assert layers[norm].input_layernorm.int8_copy and layers[both].pre_mlp_layernorm.int8_copy
        assert not layers[swiglu].input_layernorm.int8_copy and not layers["BF16"].pre_mlp_layernorm.int8_copy
        saved = {name: bench_layer.saved_tensor_bytes(layers[name], name, args)
                 for name in ("INT8", swiglu, norm, both, "BF16")}
    tokens, F, H = args.seq * args.micro_batch, args.ffn, args.hidden
    drop_per_token = 4 * F - (2 * F + 8 * math.ceil(F / 128))
    assert drop_per_token == 680
    assert saved["INT8"] - saved[swiglu] == tokens * drop_per_token
    assert saved[norm] - saved[both] == tokens * drop_per_token
    gpu_norm_drop = 2 * ((2 * H + 4) - (H + 4 * math.ceil(H / 128) + 4))
    assert saved["INT8"] - saved[norm] >= tokens * gpu_norm_drop
    # the INT8 linears already keep int8 inputs: the INT8 layer keeps less than BF16's
    assert saved["INT8"] < saved["BF16"]


def test_int8_swiglu_input_needs_the_fused_dense_swiglu(monkeypatch):
    """The SwiGLU option has nothing to act on without the fused dense SwiGLU: a usage error."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    for extra in (["--num-experts", "4"], ["--no-fused-swiglu"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(["--device", "cpu", "--tiny", "--int8-swiglu-input", *extra])


def test_int8_attention_row_runs_int8_attention_beside_the_int8_linears(monkeypatch):
    """--int8-attention adds one row whose core attention runs the INT8 op (the other rows keep BF16 SDPA) and whose
    forward + backward runs; the INT8 attention changes the layer's output, by less than a tenth of its size."""
    import torch
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    args = bench_layer.parse_args(["--device", "cpu", "--tiny", "--kv-channels", "64", "--no-stock", "--no-fp8",
                                   "--int8-attention", "--backend", "reference"])
    row = "INT8 attention:int8/scores:bf16"
    assert list(bench_layer.option_rows(args)) == [row]
    with single_process_megatron():
        layers = bench_layer.build_layers(args, {})
        assert layers[row].self_attention.core_attention.int8_attention
        assert layers[row].self_attention.core_attention.int8_attention_config.scores == "bf16"
        assert not layers["INT8"].self_attention.core_attention.int8_attention
        layers[row].load_state_dict(layers["INT8"].state_dict())
        x, _ = bench_layer._layer_input(args, row)
        x = x.detach().float().mul(3).to(x.dtype)  # non-trivial attention scores
        outputs = {}
        for name in ("INT8", row):
            leaf = x.clone().requires_grad_(True)
            out = layers[name](leaf, attention_mask=None)[0]
            out.float().square().sum().backward()
            assert torch.isfinite(leaf.grad).all()
            outputs[name] = out.detach().double()
    change = (outputs[row] - outputs["INT8"]).norm() / outputs["INT8"].norm()
    assert 0 < change < 0.1
    with pytest.raises(SystemExit):  # the tiny layer's head dim, 32: a usage error before anything is built
        bench_layer.parse_args(["--device", "cpu", "--tiny", "--int8-attention"])


@pytest.mark.parametrize("mode, per_step, first_step", [
    ([], [(True, True)] * 4, None),  # default: every iteration a new step, both forms in one pass
    (["--no-weight-cache"], [(True, False)] * 4 + [(False, True)] * 4, None),  # Q(W), then Q(W)^T in backward
    (["--cache-weights"], [], [(True, True)] * 4),  # only the first iteration quantizes
])
def test_bench_layer_weight_quantization_per_iteration(monkeypatch, mode, per_step, first_step):
    """bench_layer's weight modes quantize each linear's weight as they say: by default once per iteration with
    Q(W) and Q(W)^T from one pass (the trainer's step of one micro-batch), with --no-weight-cache twice (forward
    and backward apart), with --cache-weights in the first iteration only."""
    from megatron_int8.reference import ReferenceBackend

    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    calls = []
    quantize = ReferenceBackend.quantize

    def counting(self, x, **kw):
        if kw["weight"]:
            calls.append((kw["rowwise"], kw["columnwise"]))
        return quantize(self, x, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", counting)
    args = bench_layer.parse_args(["--device", "cpu", "--tiny", "--no-fp8", "--no-stock", "--backend", "reference",
                                   *mode])
    args.warmup, args.iters = 1, 2
    with single_process_megatron():
        layer = bench_layer.build_layers(args, {})["INT8"]
        bench_layer.time_layer(layer, "INT8", args)
    steps = args.warmup + args.iters
    expected = (first_step or []) + per_step * steps
    assert sorted(calls) == sorted(expected), calls


def test_weight_modes_that_contradict_are_refused(monkeypatch, capsys):
    """--cache-weights with --no-weight-cache, and --no-dgrad-weight-cache with nothing cached, are errors."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    for argv, said in ((["--cache-weights", "--no-weight-cache"], "not allowed with argument"),
                       (["--no-weight-cache", "--no-dgrad-weight-cache"], "no Q(W) is cached either")):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(["--device", "cpu", "--tiny", *argv])
        assert said in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--seq", "--iters", "--micro-batch"])
def test_a_zero_size_is_refused_also_under_tiny(monkeypatch, capsys, flag):
    """--tiny sets its own sizes, but the command recorded beside its rows says what was asked: 0 is refused."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    with pytest.raises(SystemExit) as exit_info:
        bench_layer.parse_args(["--device", "cpu", "--tiny", flag, "0"])
    assert exit_info.value.code == 2 and f"argument {flag}: must be an integer >= 1, got 0" in capsys.readouterr().err
