"""MoE expert capacity in the trainer (--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity): each
setting megatron cannot run refused at start-up in one line; --cuda-graph-impl local takes MoE layers padded to a
fixed capacity and dispatched by alltoall, and names the fix otherwise; the flags reach megatron's TransformerConfig;
a tiny MoE GPT trains with them on CPU, padding to a capacity that holds every token trains like dropless routing,
and a capacity that drops tokens does not."""
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from repo_paths import CONFIGS
from test_training import SMALL_MODEL, _run

MOE = ["--num-experts", "4", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"]
PADDED = ["--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity"]
UNPADDED_MOE_IN_A_GRAPH = (
    "--cuda-graph-impl local: MoE layers (--num-experts) route a different number of tokens to each expert every "
    "step; give every expert a fixed capacity with --moe-expert-capacity-factor F --moe-pad-expert-input-to-capacity "
    "(tokens beyond F x an even share are dropped, the rest padded)")


def _validated(*flags):
    from megatron_int8.training.args import parse_args, validate_args

    args = parse_args(["--config", os.path.join(CONFIGS, "tiny.yaml"), "--mock-data", "--tokenizer-type",
                       "NullTokenizer", "--vocab-size", "512", *flags])
    return validate_args(args, world_size=1)


def _refusal(*flags) -> str:
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError) as error:
        _validated(*flags)
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("flags, message", [
    (["--moe-expert-capacity-factor", "1.25"],
     "--moe-expert-capacity-factor: it applies to MoE layers only: give --num-experts N"),
    (["--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity: it applies to MoE layers only: give --num-experts N"),
    (PADDED, "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity: they apply to MoE layers only"),
    (MOE + ["--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity pads every expert's input to its capacity: it needs "
     "--moe-expert-capacity-factor F"),
    (MOE + ["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor 0.0: must be a positive number"),
    (MOE + ["--moe-expert-capacity-factor", "-1"], "--moe-expert-capacity-factor -1.0: must be a positive number"),
    (MOE + ["--moe-expert-capacity-factor", "nan"], "--moe-expert-capacity-factor nan: must be a positive number"),
    (MOE + PADDED + ["--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-expert-capacity-factor needs --moe-router-load-balancing-type aux_loss, seq_aux_loss or none, not "
     "sinkhorn"),
], ids=["factor-without-moe", "padding-without-moe", "both-without-moe", "padding-without-factor", "factor-0",
        "factor-negative", "factor-nan", "sinkhorn"])
def test_capacity_settings_megatron_cannot_run_are_refused_at_start_up(flags, message):
    assert _refusal(*flags).startswith(message)


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "4"], UNPADDED_MOE_IN_A_GRAPH),
    (MOE, UNPADDED_MOE_IN_A_GRAPH),
    (MOE + ["--moe-expert-capacity-factor", "1.25"], UNPADDED_MOE_IN_A_GRAPH),  # drops, but sizes vary below capacity
    (["--num-experts", "4", "--moe-grouped-gemm"] + PADDED,  # the default dispatcher
     "--cuda-graph-impl local: --moe-token-dispatcher-type allgather copies its token counts to the host every step; "
     "use alltoall"),
], ids=["dropless", "dropless-alltoall", "unpadded", "padded-allgather"])
def test_cuda_graphs_refuse_moe_layers_of_varying_shapes_naming_the_fix(flags, message):
    assert _refusal("--cuda-graph-impl", "local", *flags) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_graphs_take_padded_alltoall_moe_layers():
    """The MoE rule passes: what stops this run is the next reason, the CPU."""
    assert _refusal("--cuda-graph-impl", "local", *MOE, *PADDED) == "--cuda-graph-impl local: it needs a CUDA GPU"


def test_moe_graph_problem():
    from megatron_int8.training.validation import _moe_graph_problem

    def problem(experts=8, factor=1.25, pad=True, dispatcher="alltoall"):
        return _moe_graph_problem(SimpleNamespace(num_experts=experts, moe_expert_capacity_factor=factor,
                                                  moe_pad_expert_input_to_capacity=pad,
                                                  moe_token_dispatcher_type=dispatcher))

    assert problem() is None
    assert problem(experts=None, factor=None, pad=False, dispatcher="allgather") is None  # dense
    for unpadded in (dict(factor=None, pad=False), dict(pad=False), dict(factor=None)):
        assert problem(**unpadded).startswith("MoE layers (--num-experts) route a different number of tokens")
    assert problem(dispatcher="allgather").startswith("--moe-token-dispatcher-type allgather copies its token counts")
    # padding comes first: dropless allgather names the capacity, the fix it needs either way
    assert problem(factor=None, pad=False, dispatcher="allgather").startswith("MoE layers")


def test_capacity_flags_reach_the_transformer_config():
    """1.25 and True reach megatron's TransformerConfig (which both megatron-core versions accept); without the flags,
    and from a checkpoint's recorded arguments that predate them, the layer is dropless."""
    from megatron_int8.training.args import transformer_config_from_args

    config = transformer_config_from_args(_validated(*MOE, *PADDED), use_cpu_initialization=True)
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity) == (1.25, True)
    assert config.moe_token_dispatcher_type == "alltoall" and config.num_moe_experts == 4
    config = transformer_config_from_args(_validated(*MOE, "--moe-expert-capacity-factor", "2"),
                                          use_cpu_initialization=True)
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity) == (2.0, False)
    older = _validated(*MOE)
    del older.moe_expert_capacity_factor, older.moe_pad_expert_input_to_capacity
    config = transformer_config_from_args(older, use_cpu_initialization=True)
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity) == (None, False)


MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1"]


def _losses(tmp_path, name, *flags):
    """The lm losses of 6 steps of a 2-layer MoE GPT (4 experts, top-2; 128 tokens per micro-batch)."""
    log = tmp_path / f"{name}.jsonl"
    _run([sys.executable, "-m", "megatron_int8.pretrain", "--config", os.path.join(CONFIGS, "tiny.yaml"),
          *SMALL_MODEL, *MOCK, *MOE, "--train-iters", "6", "--log-jsonl", str(log), *flags])
    with open(log) as f:
        losses = [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), (name, losses)
    return losses


@pytest.mark.slow
def test_tiny_moe_gpt_trains_with_int8_experts_padded_to_capacity(tmp_path):
    """INT8 grouped experts at capacity ceil(128 x 2 / 4 x 1.25) = 80 rows per expert, laid out at 128: finite
    losses that go down."""
    losses = _losses(tmp_path, "int8", *PADDED, "--int8-linear")
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow
def test_a_capacity_of_every_token_trains_like_dropless_and_a_smaller_one_drops(tmp_path):
    """fp32 experts. At factor 2 the capacity, ceil(128 x 2 / 4 x 2) = 128 rows per expert, holds every token: each
    expert's routed tokens keep their probabilities and the others join at probability 0, so the losses are
    dropless routing's up to fp32 summation order. At factor 0.5 (32 rows per expert, half the 256 token-expert
    pairs dropped) they are not: the flags reach the layers."""
    dropless = _losses(tmp_path, "dropless")
    padded = _losses(tmp_path, "every-token", "--moe-expert-capacity-factor", "2", "--moe-pad-expert-input-to-capacity")
    for a, b in zip(dropless, padded):
        assert abs(a - b) <= 1e-5 * a, (dropless, padded)
    dropping = _losses(tmp_path, "dropping", "--moe-expert-capacity-factor", "0.5",
                       "--moe-pad-expert-input-to-capacity")
    assert max(abs(a - b) for a, b in zip(dropless, dropping)) > 1e-3, (dropless, dropping)


@pytest.mark.slow
def test_generate_and_export_of_a_capacity_model_say_what_differs(tmp_path):
    """A MoE trained with a capacity factor: megatron drops the pairs over an expert's capacity of one forward pass,
    the prompt's pass as any; KV-cached generation's one-token passes drop none, the exported Mixtral never drops.
    Both say so (their tokens or logits differ from megatron's full passes there)."""
    from repo_paths import SCRIPTS

    save = tmp_path / "ckpt"
    _run([sys.executable, "-m", "megatron_int8.pretrain", "--config", os.path.join(CONFIGS, "tiny.yaml"),
          *SMALL_MODEL, *MOCK, *MOE, "--moe-expert-capacity-factor", "0.5", "--train-iters", "2", "--lr-warmup-iters",
          "0", "--save", str(save)])
    out = _run([sys.executable, os.path.join(SCRIPTS, "generate.py"), "--load", str(save), "--prompt", "1 2 3",
                "--max-new-tokens", "2"], stderr=True)
    assert "note: trained with --moe-expert-capacity-factor 0.5: an expert's capacity counts the tokens of one" in out
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    out = _run([sys.executable, os.path.join(SCRIPTS, "export_hf.py"), "--load", str(save), "--output",
                str(tmp_path / "hf")], stderr=True)
    assert "note: trained with --moe-expert-capacity-factor 0.5: megatron drops" in out
    assert (tmp_path / "hf" / "config.json").is_file()
