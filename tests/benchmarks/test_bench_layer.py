"""benchmarks/bench_layer.py's saved-tensor count on CPU: a tiny Llama-style layer, INT8 with and without the
SwiGLU input kept in INT8."""
import math

import pytest

from mcore_helpers import single_process_megatron
from repo_paths import BENCHMARKS


def test_int8_swiglu_input_saves_the_expected_bytes_per_token(monkeypatch):
    """With int8_swiglu_input the layer keeps fc1's output (2F values per token) as int8 with one fp32 scale per
    1 x 128 block of each half instead of BF16: 4F - (2F + 8 ceil(F / 128)) bytes per token fewer, exactly, and
    nothing else changes (F = 352: 680 of the tiny layer's bytes per token)."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    args = bench_layer.parse_args(["--device", "cpu", "--tiny", "--no-stock", "--no-fp8", "--int8-swiglu-input",
                                   "--backend", "reference"])
    with single_process_megatron():
        layers = bench_layer.build_layers(args, {})
        assert layers[bench_layer.SWIGLU_INPUT_ROW].mlp.activation_func.int8_copy
        assert not layers["INT8"].mlp.activation_func.int8_copy
        saved = {name: bench_layer.saved_tensor_bytes(layers[name], name, args)
                 for name in ("INT8", bench_layer.SWIGLU_INPUT_ROW, "BF16")}
    tokens, F = args.seq * args.micro_batch, args.ffn
    drop_per_token = 4 * F - (2 * F + 8 * math.ceil(F / 128))
    assert drop_per_token == 680
    assert saved["INT8"] - saved[bench_layer.SWIGLU_INPUT_ROW] == tokens * drop_per_token
    # the INT8 linears already keep int8 inputs: the INT8 layer keeps less than BF16's
    assert saved["INT8"] < saved["BF16"]


def test_int8_swiglu_input_needs_the_fused_dense_swiglu(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_layer

    for extra in (["--num-experts", "4"], ["--no-fused-swiglu"]):
        with pytest.raises(SystemExit):
            bench_layer.parse_args(["--device", "cpu", "--tiny", "--int8-swiglu-input", *extra])
