"""benchmarks/bench_layer.py's saved-tensor count on CPU: a tiny Llama-style layer, INT8 with and without the
SwiGLU's and the norms' inputs kept in INT8."""
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
    assert list(bench_layer.memory_rows(args)) == [swiglu, norm, both]
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
