"""Int8Policy semantics, the --int8-* flags, and the precision table formatting."""
import argparse
import types

import pytest

from megatron_int8.megatron.cli import add_int8_arguments, policy_from_args
from megatron_int8.megatron.policy import Int8Policy
from megatron_int8.megatron.precision_table import format_precision_table, summarize_precision_table
from megatron_int8.recipe import Int8Recipe


def _parse(argv, num_layers=8):
    args = add_int8_arguments(argparse.ArgumentParser()).parse_args(argv)
    args.num_layers = num_layers
    return args


def test_defaults_are_off_with_default_recipe():
    policy = policy_from_args(_parse([]))
    assert policy == Int8Policy(enabled=False)
    assert policy.recipe == Int8Recipe()


def test_every_flag_reaches_the_policy():
    policy = policy_from_args(_parse([
        "--int8-linear", "--int8-granularity", "block", "--int8-block-size", "64", "--int8-bf16-gemms", "wgrad, dgrad",
        "--int8-grad-rounding", "stochastic", "--int8-backend", "reference", "--int8-first-last-layers-bf16",
        "--int8-num-layers-at-start-in-bf16", "2", "--int8-num-layers-at-end-in-bf16", "3",
        "--int8-bf16-modules", "linear_proj", "experts", "--int8-check-finite", "immediate", "--int8-no-weight-cache",
        "--int8-all-gather"]))
    assert policy == Int8Policy(
        enabled=True,
        recipe=Int8Recipe(granularity="block", block_size=64, fprop=True, dgrad=False, wgrad=False,
                          grad_rounding="stochastic", backend="reference", check_finite="immediate", cache_weights=False,
                          int8_all_gather=True),
        first_last_layers_bf16=True, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=3,
        bf16_modules=("linear_proj", "experts"))


@pytest.mark.parametrize("argv, message", [
    (["--int8-linear", "--int8-bf16-gemms", "fprop,bprop"], "bprop"),
    (["--int8-linear", "--int8-granularity", "block", "--int8-block-size", "24"], "block_size"),
    (["--int8-linear", "--int8-bf16-gemms", "fprop,dgrad,wgrad"], "no INT8 GEMM"),
    (["--int8-linear", "--int8-first-last-layers-bf16", "--int8-num-layers-at-start-in-bf16", "4",
      "--int8-num-layers-at-end-in-bf16", "4"], "leave no INT8 layer"),
    (["--int8-linear", "--int8-num-layers-at-start-in-bf16", "-1"], "non-negative"),
    (["--int8-linear", "--int8-bf16-modules", "linear_q"], "linear_q"),
])
def test_bad_values_raise_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        policy_from_args(_parse(argv))


def test_bad_choice_is_an_argparse_error():
    with pytest.raises(SystemExit):
        _parse(["--int8-granularity", "channel"])


@pytest.mark.parametrize("first_last, start, end", [(False, 1, 1), (True, 1, 1), (True, 2, 0), (True, 0, 3)])
def test_layer_semantics_match_megatron_first_last_bf16(first_last, start, end):
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    num_layers = 8
    config = types.SimpleNamespace(num_layers=num_layers, first_last_layers_bf16=first_last,
                                   num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    policy = Int8Policy(first_last_layers_bf16=first_last, num_layers_at_start_in_bf16=start,
                        num_layers_at_end_in_bf16=end)
    for layer in range(num_layers):
        assert policy.layer_in_int8(layer, num_layers) == (not is_first_last_bf16_layer(config, layer))
    assert not any(Int8Policy(enabled=False).layer_in_int8(i, num_layers) for i in range(num_layers))


def test_linear_decision_honours_bf16_modules_and_expert_groups():
    policy = Int8Policy(bf16_modules=("linear_fc2", "shared_experts"))
    assert not policy.keeps_in_bf16("linear_qkv")
    assert policy.keeps_in_bf16("linear_fc2")
    assert not policy.keeps_in_bf16("linear_fc1", expert_group="experts")
    assert policy.keeps_in_bf16("linear_fc1", expert_group="shared_experts")


def test_table_is_sorted_and_deduplicated():
    rows = [((2, 0, 9), "output", "output_layer", "96x64", "bf16", "-"),
            ((1, 2, 3), "2", "mlp.linear_fc1", "256x64", "int8", "int8[tensor]"),
            ((0, 0, 1), "embedding", "embedding.word_embeddings", "96x64", "bf16", "-"),
            ((1, 1, 3), "1", "mlp.linear_fc1", "256x64", "bf16", "-")]
    table = format_precision_table(rows + rows[:1], "T")
    lines = table.splitlines()
    assert lines[0] == "T" and lines[1].startswith("| layer | module")
    assert [line.split("|")[1].strip() for line in lines[3:]] == ["embedding", "1", "2", "output"]


def test_summary_counts_linears_and_weight_share_by_precision():
    rows = [((2, 0, 9), "output", "output_layer", "96x64", "bf16", "-"),
            ((1, 2, 3), "2", "mlp.linear_fc1", "256x64", "int8", "int8[row]"),
            ((1, 2, 4), "2", "mlp.linear_fc2", "64x256", "int8", "int8[row]"),
            ((0, 0, 1), "embedding", "embedding.word_embeddings", "96x64", "bf16", "-")]
    summary = summarize_precision_table(rows + rows[:1], "T")  # a repeated row (another rank's) counts once
    assert "\n" not in summary and summary.startswith("T: ")
    # int8: 2 x 16384 of 45056 weight elements; bf16: 2 x 6144
    assert "2 int8 int8[row] (72.7% of weights)" in summary
    assert "2 bf16 (27.3% of weights)" in summary
    assert summary.index("int8") < summary.index("bf16")  # the larger share first
