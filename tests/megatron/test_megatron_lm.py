"""megatron_int8.megatron_lm: the extra-args provider chain, the spec hook, YAML -> Megatron-LM flags,
and (with MEGATRON_LM=/path/to/a core_v0.16.1 checkout) the patch applied and driven end to end."""
import argparse
import glob
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from megatron_int8 import megatron_lm
from megatron_int8.training.args import ArgumentError, parse_args
from repo_paths import ROOT

PATCH = os.path.join(ROOT, "patches", "megatron-lm-core_v0.16.1.patch")
MODEL_YAMLS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_add_int8_args_chains_the_previous_provider():
    calls = []

    def modelopt_like(parser):
        calls.append("modelopt")
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = megatron_lm.add_int8_args(modelopt_like)(argparse.ArgumentParser())
    args = parser.parse_args(["--export-te-mcore-model", "--int8-linear", "--int8-granularity", "row"])
    assert calls == ["modelopt"] and args.export_te_mcore_model and args.int8_linear
    assert args.int8_granularity == "row"
    alone = megatron_lm.add_int8_args(None)(argparse.ArgumentParser()).parse_args([])
    assert alone.int8_linear is False


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
    with pytest.raises(ValueError, match="--int8-linear does not support --multi-latent-attention"):
        megatron_lm.get_gpt_int8_spec_from_args(_upstream_like_args(multi_latent_attention=True), config)


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=os.path.basename)
def test_yaml_to_argv_means_the_same_as_the_yaml(path):
    argv = megatron_lm.yaml_to_argv(path)
    assert all(a.startswith("--") or not a.startswith("-") for a in argv)
    assert "--false" not in argv and "True" not in argv
    assert vars(parse_args(argv)) == {**vars(parse_args(["--config", path])), "config": None}


def test_yaml_to_argv_values_and_errors(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("swiglu: true\nqk_layernorm: false\ndata_path: [0.3, a, 0.7, b]\nlog_jsonl: x.jsonl\n"
                      "norm-epsilon: 1.0e-6\nkv_channels: null\n")
    assert megatron_lm.yaml_to_argv(str(config)) == ["--swiglu", "--data-path", "0.3", "a", "0.7", "b",
                                                     "--norm-epsilon", "1e-06"]
    config.write_text("hiden_size: 4\n")
    with pytest.raises(ArgumentError, match="did you mean hidden_size"):
        megatron_lm.yaml_to_argv(str(config))


def test_cli_prints_flags_with_environment_flags(capsys):
    assert megatron_lm.main([os.path.join(ROOT, "configs", "tiny.yaml")]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert "--num-layers" in lines and "--swiglu" in lines
    if shutil.which("nvidia-smi") is None:
        assert "--no-gradient-accumulation-fusion" in lines


def test_patch_calls_only_existing_hooks():
    with open(PATCH) as f:
        text = f.read()
    assert set(re.findall(r"^\+\+\+ b/(\S+)", text, re.M)) == {"pretrain_gpt.py", "gpt_builders.py"}
    for name in re.findall(r"from megatron_int8\.megatron_lm import (\w+)", text):
        assert callable(getattr(megatron_lm, name))


UPSTREAM_BUILD = r'''
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from megatron_int8.megatron.compat import apply_cpu_compat, model_parallel_seed
apply_cpu_compat()
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from megatron_int8.megatron_lm import add_int8_args, environment_argv, yaml_to_argv
sys.argv = ["pretrain_gpt.py"] + yaml_to_argv(sys.argv[2]) + environment_argv() + sys.argv[3:]
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
args = parse_args(extra_args_provider=add_int8_args(None))
validate_args(args, {})
args.padded_vocab_size = 256
global_vars._GLOBAL_ARGS = args
torch.distributed.init_process_group("gloo")
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
model_parallel_seed(1)
import gpt_builders
from megatron_int8.megatron.layers import Int8LinearMixin
model = gpt_builders.gpt_builder(args, True, True)
int8 = sum(isinstance(m, Int8LinearMixin) and m.int8 for m in model.modules())
tokens = torch.randint(0, 200, (1, 32))
loss = model(tokens, torch.arange(32)[None], None, labels=tokens)
print("RESULT", int8, bool(torch.isfinite(loss.float()).all()))
'''


# MEGATRON_LM: a core_v0.16.1 checkout; unset, the copy that scripts/fetch_megatron_lm.sh made (patched)
THIRD_PARTY_MEGATRON_LM = os.path.join(ROOT, "third_party", "megatron-lm")
MEGATRON_LM = os.environ.get("MEGATRON_LM") or (
    THIRD_PARTY_MEGATRON_LM if os.path.isfile(os.path.join(THIRD_PARTY_MEGATRON_LM, "pretrain_gpt.py")) else None)


@pytest.mark.skipif(not MEGATRON_LM, reason="set MEGATRON_LM to a Megatron-LM core_v0.16.1 checkout, or run "
                    "scripts/fetch_megatron_lm.sh")
def test_patched_megatron_lm_builds_int8_model(tmp_path):
    """Copy the checkout, apply the patch, and let upstream's own argument parser and gpt_builder build
    a Qwen3-style model with INT8 linears (layer 1 kept BF16 by flag). A copy that is already patched
    (third_party/megatron-lm) must be patched with exactly this patch: it is reverted, then re-applied."""
    work = tmp_path / "mlm"
    shutil.copytree(MEGATRON_LM, work, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    already = subprocess.run(["git", "apply", "--reverse", "--check", PATCH], cwd=work, capture_output=True)
    if already.returncode == 0:
        subprocess.run(["git", "apply", "--reverse", PATCH], cwd=work, check=True)
        assert "megatron_int8" not in (work / "pretrain_gpt.py").read_text()
    subprocess.run(["git", "apply", PATCH], cwd=work, check=True)
    (tmp_path / "build.py").write_text(UPSTREAM_BUILD)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    flags = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--kv-channels", "16",
             "--seq-length", "32", "--max-position-embeddings", "64", "--tensor-model-parallel-size", "1",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--global-batch-size", "1",
             "--micro-batch-size", "1", "--int8-linear", "--int8-first-last-layers-bf16",
             "--int8-num-layers-at-end-in-bf16", "0"]
    result = subprocess.run([sys.executable, str(tmp_path / "build.py"), port,
                             os.path.join(ROOT, "configs", "qwen3_4b.yaml")] + flags,
                            cwd=work, env=dict(os.environ, PYTHONPATH=f"{work}{os.pathsep}{ROOT}"),
                            capture_output=True, text=True, timeout=300)
    assert "RESULT 4 True" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
