"""The FP8 peer (torchao float8 linears) on CPU: the --fp8-peer flag and its checks, the spec (FP8 classes
for the transformer-layer linears only, same attention/norm/MLP modules as the INT8 and BF16 specs),
BF16-identical state-dict keys, and clear errors (TP>1, missing torchao, no FP8 GPU). Where torchao is
importable, torchao's emulation (dequantize + fp32 matmul) checks the numerics against float64 and the
gradient hand-off to megatron's DDP. The FP8 GEMMs themselves run in tests/test_layers_gpu.py."""
import csv
import dataclasses
import functools
import json
import os
import sys

import pytest
import torch
from mcore_helpers import assert_fp8_linear_within_bounds, fp8_linear_checks, outlier_tensor, single_process_megatron, \
    tiny_config

from megatron_int8.peers import fp8 as fp8_peer
from megatron_int8.megatron.cli import policy_from_args
from megatron_int8.megatron.policy import Int8Policy
from megatron_int8.megatron.precision_table import format_precision_table, precision_table_rows
from megatron_int8.training.args import ArgumentError, parse_args, validate_args
from repo_paths import BENCHMARKS

BASE_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def _torchao_importable() -> bool:
    try:
        fp8_peer.torchao_float8()
    except ImportError:
        return False
    return True


needs_torchao = pytest.mark.skipif(not _torchao_importable(), reason="torchao is not installed")


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


@pytest.fixture
def fake_fp8_device(monkeypatch):
    """Build FP8 layers without torchao or an FP8 GPU (nothing here runs their GEMMs)."""
    monkeypatch.setattr(fp8_peer, "torchao_float8", lambda: None)
    monkeypatch.setattr(fp8_peer, "check_fp8_device", lambda device=None: None)


# ------------------------------------------------------------------------------------ arguments


def test_fp8_peer_flag_reaches_the_policy():
    args = validate_args(parse_args(BASE_ARGS + ["--fp8-peer", "rowwise", "--fp8-peer-compile"]), 1)
    policy = policy_from_args(args)
    assert policy == Int8Policy(enabled=False, fp8_peer="rowwise", fp8_compile=True)
    assert "FP8 peer: torchao float8 rowwise" in policy.describe()
    assert policy_from_args(validate_args(parse_args(BASE_ARGS), 1)).fp8_peer is None


@pytest.mark.parametrize("extra, world, message", [
    (["--int8-linear", "--fp8-peer", "tensorwise"], 1, "mutually exclusive"),
    (["--fp8-peer", "tensorwise", "--tensor-model-parallel-size", "2"], 2, "tensor-model-parallel-size 1 only"),
    (["--fp8-peer-compile"], 1, "needs --fp8-peer"),
])
def test_fp8_peer_argument_errors(extra, world, message):
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(BASE_ARGS + extra), world)


def test_fp8_peer_bad_choice_and_policy_errors():
    with pytest.raises(SystemExit):
        parse_args(BASE_ARGS + ["--fp8-peer", "blockwise"])
    with pytest.raises(ValueError, match="mutually exclusive"):
        Int8Policy(enabled=True, fp8_peer="tensorwise")
    with pytest.raises(ValueError, match="fp8_peer must be None or one of"):
        Int8Policy(enabled=False, fp8_peer="delayed")


# ----------------------------------------------------------------------------------------- spec


def _modules(spec, path=""):
    """{path: (module class, params)} of every ModuleSpec in a spec tree (class path for plain types)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    found = {}
    if isinstance(spec, ModuleSpec):
        found[path] = (spec.module, dict(spec.params))
        if spec.submodules is not None:
            found.update(_modules(spec.submodules, path))
    elif isinstance(spec, functools.partial):  # megatron-core >= 0.17 builds MLPs and MoE layers from partials
        func = getattr(spec.func, "__self__", spec.func)  # MLP.as_mlp_submodule -> MLP
        found[path] = (func, {k: v for k, v in spec.keywords.items() if k != "submodules"})
        found.update(_modules(spec.keywords.get("submodules"), path))
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            found.update(_modules(getattr(spec, field.name), f"{path}.{field.name}"))
    elif isinstance(spec, (list, tuple)):
        for i, item in enumerate(spec):
            found.update(_modules(item, f"{path}[{i}]"))
    elif isinstance(spec, type):
        found[path] = (spec, {})
    return found


@pytest.mark.parametrize("moe", [False, True])
def test_spec_swaps_only_the_linears(moe):
    from megatron.core.transformer.mlp import MLP

    from megatron_int8.peers.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear
    from megatron_int8.megatron.layers import Int8ColumnParallelLinear, Int8RowParallelLinear
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    kw = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64) if moe else {}
    config = tiny_config(qk_layernorm=True, **kw)
    specs = {name: _modules(get_gpt_int8_block_spec(config, policy)) for name, policy in
             {"fp8": Int8Policy(enabled=False, fp8_peer="rowwise"), "int8": Int8Policy(),
              "bf16": Int8Policy(enabled=False)}.items()}
    assert specs["fp8"].keys() == specs["int8"].keys() == specs["bf16"].keys()
    int8_linears = (Int8ColumnParallelLinear, Int8RowParallelLinear)
    linear_paths = [p for p, (cls, _) in specs["int8"].items() if cls in int8_linears]
    assert len(linear_paths) == config.num_layers * (6 if moe else 4)  # MoE: routed and shared experts' spec
    for path, (cls, params) in specs["fp8"].items():
        if path in linear_paths:
            column = specs["int8"][path][0] is Int8ColumnParallelLinear
            assert cls is (Fp8ColumnParallelLinear if column else Fp8RowParallelLinear), path
            assert params == {"fp8_recipe": "rowwise", "compile": False}, path
        else:  # attention, norms, MLP / MoE modules: as in the INT8 and BF16 specs
            assert cls is specs["int8"][path][0] is specs["bf16"][path][0], path
        if path.endswith(".mlp") and not moe:
            assert cls is MLP, path


@pytest.mark.parametrize("moe", [False, True])
def test_model_precision_table_and_state_dict_keys(fake_fp8_device, moe):
    """Transformer-layer linears FP8, embedding and output layer high precision; the state dict (names,
    shapes) is the BF16 model's, so checkpoints interchange."""
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.peers.fp8 import Fp8LinearMixin
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    kw = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64) if moe else {}
    config = tiny_config(num_query_groups=2, **kw)
    models = {}
    policies = {"fp8": Int8Policy(enabled=False, fp8_peer="tensorwise"), "bf16": Int8Policy(enabled=False)}
    for name, policy in policies.items():
        torch.manual_seed(0)
        models[name] = GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, policy),
                                vocab_size=128, max_sequence_length=32, position_embedding_type="rope")
    rows = precision_table_rows(models["fp8"])
    precision = {(r[1], r[2]): r[4] for r in rows}
    assert precision.pop(("embedding", "embedding.word_embeddings")) == "fp32"
    assert precision.pop(("output", "output_layer")) == "fp32"
    if moe:
        assert {p for (_, m), p in precision.items() if m.endswith("router")} == {"fp32"}
        precision = {k: p for k, p in precision.items() if not k[1].endswith("router")}
    assert set(precision.values()) == {"fp8"} and len(precision) >= config.num_layers * 4
    assert "| fp8 | torchao float8 tensorwise" in format_precision_table(rows)
    fp8_modules = [m for m in models["fp8"].modules() if isinstance(m, Fp8LinearMixin)]
    assert len(fp8_modules) == (config.num_layers * (2 + 2 * 4) if moe else config.num_layers * 4)
    fp8_state, bf16_state = models["fp8"].state_dict(), models["bf16"].state_dict()
    assert {k: v.shape for k, v in fp8_state.items() if torch.is_tensor(v)} == \
        {k: v.shape for k, v in bf16_state.items() if torch.is_tensor(v)}
    assert fp8_state.keys() == bf16_state.keys()
    models["fp8"].load_state_dict(bf16_state, strict=True)


# --------------------------------------------------------------------------------------- errors


def _column(config, **kw):
    from megatron_int8.peers.fp8 import Fp8ColumnParallelLinear

    return Fp8ColumnParallelLinear(64, 48, config=config, init_method=torch.nn.init.xavier_normal_, bias=False, **kw)


def test_tensor_parallel_and_unknown_recipe_raise(fake_fp8_device):
    with pytest.raises(ValueError, match="tensor-parallel size 1 only"):
        _column(tiny_config(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="tensor-parallel size 1 only"):
        _column(tiny_config(tensor_model_parallel_size=2, sequence_parallel=True))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size 2"):
        _column(tiny_config(expert_tensor_parallel_size=2), is_expert=True)
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        _column(tiny_config(), fp8_recipe="delayed")
    with pytest.raises(ValueError, match="16-aligned"):
        from megatron_int8.peers.fp8 import Fp8RowParallelLinear
        Fp8RowParallelLinear(60, 48, config=tiny_config(), init_method=torch.nn.init.xavier_normal_, bias=False,
                             input_is_parallel=True, skip_bias_add=False)


def test_missing_torchao_raises_a_clear_import_error(monkeypatch):
    for name in ("torchao", "torchao.float8", "torchao.float8.config", "torchao.float8.float8_linear",
                 "torchao.float8.float8_training_tensor"):
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao...` raises ImportError
    fp8_peer.torchao_float8.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs torchao .*pip install torchao==0\.18\.0"):
            _column(tiny_config())
        assert "pip install torchao" in fp8_peer.fp8_unavailable_reason()
    finally:
        fp8_peer.torchao_float8.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_no_fp8_gpu_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(fp8_peer, "torchao_float8", lambda: None)
    with pytest.raises(RuntimeError, match="compute capability >= 8.9.*CUDA is not available"):
        _column(tiny_config())


# ------------------------------------------------------------- torchao emulation (if installed)


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_emulated_forward_backward_within_fp8_bound(recipe, kind):
    from megatron_int8.peers.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    gen = torch.Generator().manual_seed(1)
    extra = {} if kind == "column" else {"input_is_parallel": True, "skip_bias_add": False}
    cls = Fp8ColumnParallelLinear if kind == "column" else Fp8RowParallelLinear
    layer = cls(128, 96, config=tiny_config(), init_method=torch.nn.init.xavier_normal_, bias=False,
                fp8_recipe=recipe, emulate=True, **extra)
    with torch.no_grad():
        layer.weight.copy_(outlier_tensor(96, 128, generator=gen, scale=8.0) * 0.05)
    x = outlier_tensor(24, 2, 128, generator=gen).requires_grad_(True)  # 48 tokens: no padding
    g = outlier_tensor(24, 2, 96, generator=gen)
    out, _ = layer(x)
    out.backward(g)
    checks = fp8_linear_checks(x.detach().reshape(-1, 128), layer.weight.detach(), g.reshape(-1, 96),
                               out.detach().reshape(-1, 96), x.grad.reshape(-1, 128), layer.weight.grad, recipe)
    assert_fp8_linear_within_bounds(checks, out_rel=4 * 2.0**-24)


@needs_torchao
def test_emulated_gradients_reach_ddp_main_grad_once():
    """gradient_accumulation_fusion=True (as the trainer's config may say): the layer returns weight.grad,
    megatron's DDP hook adds it to main_grad once per micro-batch; nothing is dropped or counted twice.
    Token counts 7 x 3 = 21 (padded to 32 in the wgrad contraction) and 0 (an expert without tokens)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = tiny_config(gradient_accumulation_fusion=True)
    gen = torch.Generator().manual_seed(5)
    # megatron's DDP puts main_grad on the current CUDA device whenever CUDA exists: follow it there
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = _column(config, emulate=True).to(device)
    reference = _column(tiny_config(), emulate=True).to(device)
    reference.load_state_dict(layer.state_dict())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
    ddp.zero_grad_buffer()
    for tokens in (7, 0, 7):
        x, g = (torch.randn(tokens, 3, n, generator=gen).to(device) for n in (64, 48))
        out = ddp(x)[0]
        assert out.shape == (tokens, 3, 48)
        out.backward(g)
        assert layer.weight.grad is None and not layer.weight.grad_added_to_main_grad
        reference(x)[0].backward(g)
    assert reference.weight.grad.abs().sum() > 0
    torch.testing.assert_close(layer.weight.main_grad, reference.weight.grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- benchmarks


def test_bench_e2e_runs_the_fp8_peer_and_tabulates_it(monkeypatch, tmp_path):
    """bench_e2e.py --fp8-peer: a third run per depth with `--fp8-peer tensorwise`, FP8 columns in the table
    and JSON; a model whose FP8 run fails keeps its BF16/INT8 numbers and shows n/a."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    import bench_e2e

    calls = []

    def fake_run(model, layers, int8, opts, env=None, fp8=None):
        calls.append((model, layers, "int8" if int8 else fp8 or "bf16"))
        if fp8 and model == "qwen3_4b":
            raise RuntimeError("trainer failed (no torchao)")
        step = layers * (0.8 if int8 else 0.7 if fp8 else 1.0)
        precision = "int8" if int8 else fp8 or "bf16"
        peak = {"bf16": 14.0, "int8": 13.2, "tensorwise": 12.0}[precision] + layers - 4
        resident = {"bf16": 8.0, "int8": 8.4, "tensorwise": 8.2}[precision] + layers - 4
        return {"step_s": step, "loss": 5.0, "losses": [5.0], "peak_gb": peak, "resident_gb": resident,
                "wall_s": 1.0, "tflops_per_gpu": 1.0}

    monkeypatch.setattr(bench_e2e, "run_trainer", fake_run)
    monkeypatch.setenv("OUT", str(tmp_path))  # the results CSV goes to $OUT, not the repository
    out = tmp_path / "e2e.md"
    bench_e2e.main(["--models", "llama2_7b", "qwen3_4b", "--fp8-peer", "--out", str(out)])
    with open(tmp_path / "e2e_fp8.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["model"] for r in csv_rows] == ["llama2_7b", "qwen3_4b"]
    assert csv_rows[0]["gpu"] and csv_rows[0]["commit"] and "--fp8-peer" not in csv_rows[0]["extra"]

    assert ("llama2_7b", 4, "tensorwise") in calls and ("llama2_7b", 2, "tensorwise") in calls
    table = out.read_text()
    assert "| FP8 tok/s |" in table and "FP8/BF16 (measured)" in table and "torchao float8 tensorwise" in table
    llama = next(line for line in table.splitlines() if line.startswith("| llama2_7b"))
    qwen = next(line for line in table.splitlines() if line.startswith("| qwen3_4b"))
    assert "| 1.429x |" in llama and "| 1.250x |" in llama  # FP8/BF16 = 1/0.7, INT8/BF16 = 1/0.8
    # peak 13.2 / 14.0 GB; above what stays between steps: (13.2 - 8.4) / (14.0 - 8.0)
    assert "| 14.0 / 13.2 / 12.0 | 0.94 | 8.0 / 8.4 / 8.2 | 0.80 |" in llama
    assert qwen.count("n/a") == 6 and "| 1.250x |" in qwen
    header, rule = table.splitlines()[2:4]
    assert header.count("|") == rule.count("|") == llama.count("|") == qwen.count("|")
    records = json.loads(out.with_suffix(".json").read_text())
    assert "fp8_tok_s" in records[0] and "fp8_error" in records[1]
    assert float(csv_rows[0]["int8_tok_s"]) == pytest.approx(records[0]["int8_tok_s"], rel=1e-3)
    assert csv_rows[1]["fp8_tok_s"] == ""  # the failed FP8 run leaves its cell empty
    plain = bench_e2e.format_table(records, bench_e2e.parse_args(["--models", "llama2_7b"]))
    assert "FP8" not in plain and "| speedup (measured) |" in plain


def test_forward_takes_the_keywords_newer_megatron_passes():
    """megatron-core 0.19 passes `gtp_remat_size` to `_forward_impl` (every FP8 layer failed with a TypeError on
    0.19.2): taken at its "off" value, refused by name otherwise, as the INT8 layers do. An empty input (an
    expert without tokens) takes the plain path, so this runs without torchao."""
    from types import SimpleNamespace

    layer = SimpleNamespace(fp8_emulate=True, fp8_recipe="tensorwise", fp8_compile=False)
    x, w = torch.randn(0, 16), torch.randn(8, 16)
    out = fp8_peer.Fp8LinearMixin._forward_impl(layer, x, w, None, False, False, False, gtp_remat_size=1)
    assert out.shape == (0, 8)
    with pytest.raises(NotImplementedError, match="gtp_remat_size=2"):
        fp8_peer.Fp8LinearMixin._forward_impl(layer, x, w, None, False, False, False, gtp_remat_size=2)
