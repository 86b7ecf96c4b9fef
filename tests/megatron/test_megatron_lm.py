"""megatron_int8.megatron_lm: the extra-args provider chain, the layer spec that upstream's --spec names, the `run`
launcher, YAML -> Megatron-LM flags, and (with MEGATRON_LM_GIT=/path/to/a Megatron-LM clone) upstream's own argument
parser and gpt_builder at the tag that matches the installed megatron-core, building an INT8 model with no patch."""
import argparse
import copy
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from free_ports import free_port

from megatron_int8 import megatron_lm
from megatron_int8.training.args import ArgumentError, build_parser, parse_args
from repo_paths import ROOT

MODEL_YAMLS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_add_int8_args_chains_the_previous_provider():
    calls = []

    def modelopt_like(parser):
        calls.append("modelopt")
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = megatron_lm.add_int8_args(modelopt_like)(argparse.ArgumentParser())
    args = parser.parse_args(["--export-te-mcore-model", "--int8-linear", "--int8-granularity", "row",
                              "--int8-attention"])
    assert calls == ["modelopt"] and args.export_te_mcore_model and args.int8_linear and args.int8_attention
    assert args.int8_granularity == "row"
    alone = megatron_lm.add_int8_args(None)(argparse.ArgumentParser()).parse_args([])
    assert alone.int8_linear is False and alone.int8_attention is False


@pytest.fixture(scope="module")
def megatron_world():
    from mcore_helpers import single_process_megatron

    with single_process_megatron():
        yield


def _upstream_like_args(**overrides):
    parser = megatron_lm.add_int8_args(None)(argparse.ArgumentParser())
    args = parser.parse_args(["--int8-linear", "--int8-first-last-layers-bf16", "--int8-num-layers-at-end-in-bf16", "0"])
    args.normalization, args.qk_l2_norm = "RMSNorm", False
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_spec_hook_builds_the_policy_per_layer(megatron_world):
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_int8.megatron.layers import Int8ColumnParallelLinear

    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
                               use_cpu_initialization=True)
    spec = megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(), config, vp_stage=None)
    assert isinstance(spec, TransformerBlockSubmodules) and len(spec.layer_specs) == 3
    qkv = [layer.submodules.self_attention.submodules.linear_qkv for layer in spec.layer_specs]
    assert all(q.module is Int8ColumnParallelLinear for q in qkv)
    assert [q.params["int8"] for q in qkv] == [False, True, True]  # first layer BF16 per the flags
    with pytest.raises(ValueError, match="does not build the layers of --multi-latent-attention"):
        megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(multi_latent_attention=True), config)


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=os.path.basename)
def test_yaml_to_argv_means_the_same_as_the_yaml(path):
    argv = megatron_lm.yaml_to_argv(path)
    assert all(a.startswith("--") or not a.startswith("-") for a in argv)
    assert "--false" not in argv and "True" not in argv
    from_flags, from_yaml = vars(parse_args(argv)), vars(parse_args(["--config", path]))
    # the same values; only the record of where they came from differs (from_config: the YAML's keys)
    assert from_flags.pop("from_config") == {} and from_yaml.pop("from_config")
    assert from_flags == {**from_yaml, "config": None}


def test_yaml_to_argv_values_and_errors(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("swiglu: true\nqk_layernorm: false\ndata_path: [0.3, a, 0.7, b]\nlog_jsonl: x.jsonl\n"
                      "norm-epsilon: 1.0e-6\nkv_channels: null\n")
    assert megatron_lm.yaml_to_argv(str(config)) == ["--swiglu", "--data-path", "0.3", "a", "0.7", "b",
                                                     "--norm-epsilon", "1e-06"]
    config.write_text("hiden_size: 4\n")
    with pytest.raises(ArgumentError, match="did you mean hidden_size"):
        megatron_lm.yaml_to_argv(str(config))
    # `false` where it is not the default: the flag that sets it, for every on/off setting, as the trainer reads it
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):
            key = action.option_strings[0][2:]
            config.write_text(f"{key}: false\n")
            argv = megatron_lm.yaml_to_argv(str(config))
            got, want = getattr(parse_args(argv), action.dest), getattr(parse_args(["--config", str(config)]),
                                                                         action.dest)
            assert got is want, (key, argv, got, want)
    config.write_text("load_optim: false\nint8_weight_cache: false\n")
    assert megatron_lm.yaml_to_argv(str(config)) == ["--no-load-optim", "--int8-no-weight-cache"]


def test_cli_prints_flags_with_environment_flags(capsys):
    assert megatron_lm.main([os.path.join(ROOT, "configs", "tiny.yaml")]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert "--num-layers" in lines and "--swiglu" in lines
    if shutil.which("nvidia-smi") is None:
        assert "--no-gradient-accumulation-fusion" in lines


def _layer_precisions(model):
    """Per transformer layer: (qkv INT8?, MLP kind) in build order."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    return [(layer.self_attention.linear_qkv.int8, type(layer.mlp).__name__) for layer in layers]


def test_int8_layer_spec_picks_each_layers_submodules(megatron_world, monkeypatch):
    """One static spec (what upstream's --spec imports) gives each layer of a GPTModel its own precision and MLP
    kind: layer 1 BF16 by flag, layers 2-3 INT8; MoE where moe_layer_freq says so; the state dict is the BF16
    spec's."""
    from megatron.core.models.gpt import GPTModel

    from mcore_helpers import tiny_config
    from megatron_int8.megatron.policy import Int8Policy
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    flags = ["--int8-linear", "--int8-first-last-layers-bf16", "--int8-num-layers-at-end-in-bf16", "0"]
    monkeypatch.setattr(megatron_lm, "_run_args", megatron_lm._int8_parser().parse_args(flags))
    config = tiny_config(num_layers=3, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                         moe_layer_freq=[0, 1, 1])
    model = GPTModel(config=config, transformer_layer_spec=megatron_lm.int8_layer_spec, vocab_size=64,
                     max_sequence_length=32)
    assert _layer_precisions(model) == [(False, "MLP"), (True, "MoELayer"), (True, "MoELayer")]
    stock = GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, Int8Policy(enabled=False)),
                     vocab_size=64, max_sequence_length=32)
    assert {k: v.shape for k, v in model.state_dict().items() if "_extra_state" not in k} == \
        {k: v.shape for k, v in stock.state_dict().items() if "_extra_state" not in k}


def test_int8_attention_through_the_spec_hook(megatron_world, monkeypatch):
    """--int8-attention reaches the layers that upstream's --spec builds: INT8 attention in the INT8 layers (layer 1
    BF16 by flag keeps BF16 attention); upstream's mask tensor and document masks are refused when the first layer
    is built, naming the flag, as is --int8-attention without --int8-linear."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mcore_helpers import tiny_config

    flags = ["--int8-linear", "--int8-attention", "--int8-first-last-layers-bf16", "--int8-num-layers-at-end-in-bf16",
             "0", "--int8-backend", "reference"]
    monkeypatch.setattr(megatron_lm, "_run_args", megatron_lm._int8_parser().parse_args(flags))
    config = tiny_config(num_layers=3, hidden_size=128, num_attention_heads=2, kv_channels=64)
    model = GPTModel(config=config, transformer_layer_spec=megatron_lm.int8_layer_spec, vocab_size=64,
                     max_sequence_length=32)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert [layer.self_attention.core_attention.int8_attention for layer in layers] == [False, True, True]
    loss = model(torch.randint(0, 64, (1, 32)), torch.arange(32)[None], None, labels=torch.zeros(1, 32).long())
    assert torch.isfinite(loss).all()

    upstream = _upstream_like_args(int8_attention=True, create_attention_mask_in_dataloader=True)
    with pytest.raises(ValueError, match="^--int8-attention takes the causal mask .*--no-create-attention-mask"):
        megatron_lm.get_gpt_int8_spec_from_args(upstream, config)
    upstream.create_attention_mask_in_dataloader, upstream.reset_attention_mask = False, True
    with pytest.raises(ValueError, match="^--int8-attention: --reset-attention-mask"):
        megatron_lm.get_gpt_int8_spec_from_args(upstream, config)
    upstream.reset_attention_mask = False
    spec = megatron_lm.get_gpt_int8_spec_from_args(upstream, config)
    assert [s.submodules.self_attention.submodules.core_attention.keywords["recipe"].int8_attention
            for s in spec.layer_specs[1:]] == [True, True]
    upstream.int8_linear = False
    with pytest.raises(ValueError, match="^--int8-attention runs in the INT8 layers: it needs --int8-linear"):
        megatron_lm.get_gpt_int8_spec_from_args(upstream, config)


def test_upstream_graphs_and_other_low_precision_linears_are_refused(megatron_world):
    """Upstream's CUDA graphs would replay the weights an INT8 linear cached at capture (the cache is decided on the
    host); its FP8 / FP4 / kitchen flags ask for linears the INT8 spec never builds: both refused when the spec is
    built, naming the flag. BF16 linears (no INT8) take upstream's graphs."""
    from mcore_helpers import tiny_config

    config = tiny_config(num_layers=2)
    for name, value, flag in (("cuda_graph_impl", "full_iteration", "--cuda-graph-impl full_iteration"),
                              ("cuda_graph_impl", "local", "--cuda-graph-impl local"),
                              ("fp8", "hybrid", "--fp8-format"), ("fp4", "nvfp4", "--fp4-format"),
                              ("use_kitchen", True, "--use-kitchen"),
                              ("fp16", True, "--fp16 with --int8-check-finite deferred")):
        with pytest.raises(ValueError, match=re.escape(flag)):
            megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(**{name: value}), config)
    megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(cuda_graph_impl="none"), config)
    megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(cuda_graph_impl="local", int8_linear=False), config)
    # megatron-core 0.19's GTP weight sharding leaves each rank a slice of every weight: refused with INT8
    for field, flag in (("gtp_weight_remat_size", "--tensor-parallel-num-weight-shards"),
                        ("expert_gtp_weight_remat_size", "--expert-tensor-parallel-num-weight-shards")):
        sharded = copy.copy(config)
        setattr(sharded, field, 2)
        with pytest.raises(ValueError, match=re.escape(flag)):
            megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(), sharded)
        megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(int8_linear=False), sharded)


def test_deferred_nonfinite_marks_are_read_before_each_upstream_optimizer_step():
    """Upstream's loop never reads the marks that check_finite="deferred" leaves: the hook `run` installs reads
    them before every optimizer step and names the tensor; none is installed without INT8 or with "immediate"."""
    from megatron_int8 import NonFiniteError, int8_linear

    parse = megatron_lm._int8_parser().parse_args
    assert megatron_lm.check_nonfinite_before_each_step(megatron_lm.int8_policy(parse([]))) is None
    assert megatron_lm.check_nonfinite_before_each_step(megatron_lm.int8_policy(
        parse(["--int8-linear", "--int8-check-finite", "immediate"]))) is None
    handle = megatron_lm.check_nonfinite_before_each_step(megatron_lm.int8_policy(parse(["--int8-linear"])))
    try:
        w = torch.nn.Parameter(torch.randn(8, 32))
        optimizer = torch.optim.SGD([w], lr=0.1)
        x = torch.randn(6, 32)
        int8_linear(x, w).sum().backward()
        optimizer.step()  # finite: the step runs
        x[2, 3] = float("inf")
        int8_linear(x, w).sum().backward()
        before = w.detach().clone()
        with pytest.raises(NonFiniteError, match="fprop input"):
            optimizer.step()
        assert torch.equal(w.detach(), before)  # stopped before the update
    finally:
        handle.remove()


def test_run_takes_the_int8_flags_and_names_the_spec(tmp_path, monkeypatch):
    """`run` hands upstream's script its own flags plus --spec, keeps the --int8-* ones, and puts the script's
    folder first on sys.path; bad --int8-* values and a user's own --spec are refused before the script runs."""
    script = tmp_path / "pretrain_gpt.py"
    (tmp_path / "helper_module.py").write_text("VALUE = 7\n")
    script.write_text("import sys, helper_module\nSEEN = (list(sys.argv), helper_module.VALUE)\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(megatron_lm, "_run_args", None)
    seen = {}
    real_run_path = megatron_lm.runpy.run_path
    monkeypatch.setattr(megatron_lm.runpy, "run_path",
                        lambda path, run_name: seen.update(real_run_path(path, run_name=run_name)))
    megatron_lm.run([str(script), "--num-layers", "2", "--int8-linear", "--int8-bf16-modules", "linear_proj",
                     "--lr", "1e-4", "--int8-attention"])
    assert seen["SEEN"] == ([str(script), "--num-layers", "2", "--lr", "1e-4"] + megatron_lm.SPEC_FLAGS, 7)
    assert megatron_lm._run_args.int8_bf16_modules == ["linear_proj"] and megatron_lm._run_args.int8_attention
    megatron_lm.run([str(script), "--num-layers", "2"])  # no --int8-linear: upstream's own spec
    assert seen["SEEN"][0] == [str(script), "--num-layers", "2"]
    with pytest.raises(SystemExit, match="drop --spec"):
        megatron_lm.run([str(script), "--int8-linear", "--spec", "local"])
    with pytest.raises(SystemExit, match="int8-bf16-gemms"):
        megatron_lm.run([str(script), "--int8-linear", "--int8-bf16-gemms", "fprop,bogus"])
    with pytest.raises(SystemExit, match="--int8-attention runs in the INT8 layers: it needs --int8-linear"):
        megatron_lm.run([str(script), "--int8-attention"])
    with pytest.raises(SystemExit, match="not a file"):
        megatron_lm.run([str(tmp_path / "missing.py")])


# Drives upstream's pretrain_gpt.py path up to the model: `run` starts this probe in place of pretrain_gpt.py, so
# the flags go through run's split, upstream's parse_args/validate_args (which know --spec) and gpt_builder.
UPSTREAM_PROBE = r'''
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from megatron_int8.megatron.compat import apply_cpu_compat, model_parallel_seed
apply_cpu_compat()
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
args = parse_args()
validate_args(args, {})
args.padded_vocab_size = 256
global_vars._GLOBAL_ARGS = args
torch.distributed.init_process_group("gloo")
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
model_parallel_seed(1)
import gpt_builders
from megatron_int8.megatron.attention import SDPAttention
from megatron_int8.megatron.layers import Int8LinearMixin
model = gpt_builders.gpt_builder(args, True, True)
int8 = sum(isinstance(m, Int8LinearMixin) and m.int8 for m in model.modules())
attention = sum(isinstance(m, SDPAttention) and m.int8_attention for m in model.modules())
tokens = torch.randint(0, 200, (1, 32))
loss = model(tokens, torch.arange(32)[None], None, labels=tokens)
print("RESULT", args.spec, int8, attention, bool(torch.isfinite(loss.float()).all()))
'''

# MEGATRON_LM_GIT: a Megatron-LM clone or bare repository with the core_v0.* tags
MEGATRON_LM_GIT = os.environ.get("MEGATRON_LM_GIT")


@pytest.mark.skipif(not MEGATRON_LM_GIT, reason="set MEGATRON_LM_GIT to a Megatron-LM clone with its core_v0.* tags")
@pytest.mark.parametrize("attention", [False, True], ids=["bf16-attention", "int8-attention"])
def test_upstream_megatron_lm_builds_int8_model_with_no_patch(tmp_path, attention):
    """scripts/fetch_megatron_lm.sh takes the tag that matches the installed megatron-core (core_v0.16.1 with
    0.16, core_v0.19.0 with 0.19); upstream's own parser, validation and gpt_builder then build a Qwen3-style
    model whose layers 2 of 2 run INT8 (layer 1 BF16 by flag): 4 INT8 linears, a finite loss; with
    --int8-attention (and the settings it needs) layer 2's attention runs INT8 too."""
    dest = tmp_path / "mlm"
    fetched = subprocess.run(["bash", os.path.join(ROOT, "scripts", "fetch_megatron_lm.sh"), MEGATRON_LM_GIT,
                              str(dest)], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHON=sys.executable))
    assert fetched.returncode == 0, fetched.stderr
    (dest / "probe.py").write_text(UPSTREAM_PROBE)
    port = str(free_port())
    flags = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--kv-channels", "64",
             "--seq-length", "32", "--max-position-embeddings", "64", "--tensor-model-parallel-size", "1",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--global-batch-size", "1",
             "--micro-batch-size", "1", "--int8-linear", "--int8-first-last-layers-bf16",
             "--int8-num-layers-at-end-in-bf16", "0"]
    if attention:
        flags += ["--int8-attention", "--attention-dropout", "0", "--no-create-attention-mask-in-dataloader"]
    argv = megatron_lm.yaml_to_argv(os.path.join(ROOT, "configs", "qwen3_4b.yaml")) + megatron_lm.environment_argv()
    pythonpath = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=pythonpath, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=port)
    result = subprocess.run([sys.executable, "-m", "megatron_int8.megatron_lm", "run", str(dest / "probe.py")]
                            + argv + flags, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert f"RESULT ['megatron_int8.megatron_lm', 'int8_layer_spec'] 4 {int(attention)} True" in result.stdout, \
        fetched.stdout + result.stdout[-3000:] + result.stderr[-3000:]
