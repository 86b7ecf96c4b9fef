"""--int8-attention in the trainer on CPU (the PyTorch path): a tiny GPT trains with it, its losses finite and close
to the same run's with BF16 attention; its health statistics, the auto fallback of a layer's attention to BF16
and that move kept through a checkpoint; each setting it cannot serve refused at start-up naming the flag; the
upstream Megatron-LM route takes the flag and refuses what it cannot serve."""
import json
import math
import os

import pytest
from repo_paths import CONFIGS
from free_ports import launcher
from test_training import SMALL_MODEL, _run

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "2", "--kv-channels", "64"]
ATTENTION = "layer1.self_attention.core_attention"


def train(*flags, nproc=1):
    return _run(launcher(nproc) + ["-m", "megatron_int8.pretrain", "--config", os.path.join(CONFIGS, "tiny.yaml"),
                                   *SMALL_MODEL, *MOCK, *flags])


def records(path, key):
    with open(path) as f:
        return [r for r in map(json.loads, f) if key in r]


@pytest.mark.slow
def test_tiny_gpt_trains_with_int8_attention_close_to_bf16_attention(tmp_path):
    """Six steps of the same INT8-linear model and data with BF16 and with INT8 attention: every loss finite,
    different, and within 0.1% of the BF16-attention run's (3e-5 apart on 2026-12-02: INT8 attention's output
    error, about 1% of the attention's output, moves the loss of this young model far less); the INT8 run says
    so in its precision summary and logs each attention's health."""
    bf16 = train("--int8-linear", "--train-iters", "6", "--log-jsonl", str(tmp_path / "bf16.jsonl"))
    int8 = train("--int8-linear", "--int8-attention", "--train-iters", "6", "--log-jsonl", str(tmp_path / "int8.jsonl"),
                 "--int8-stats-interval", "2")
    assert "attn:int8" in int8 and "attn:int8" not in bf16
    losses = [[r["lm_loss"] for r in records(tmp_path / f"{run}.jsonl", "lm_loss")] for run in ("bf16", "int8")]
    assert len(losses[0]) == len(losses[1]) == 6 and all(math.isfinite(x) for x in losses[0] + losses[1])
    assert losses[0] != losses[1]  # the attention differs
    for a, b in zip(*losses):
        assert abs(b - a) <= 1e-3 * a, losses
    health = records(tmp_path / "int8.jsonl", "int8_health")
    assert [r["iteration"] for r in health] == [2, 4, 6]
    for layer in (1, 2):
        for stat in ("qk/rel_err", "attention/rel_err"):
            value = health[0]["int8_health"][f"int8_health/layer{layer}.self_attention.core_attention/{stat}"]
            assert 1e-4 < value < 0.1, (layer, stat, value)
    assert "attention rel_err" in int8


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2"]], ids=["tp2-sp", "pp2"])
def test_int8_attention_under_model_parallelism_trains_like_bf16_attention(tmp_path, layout):
    """On 2 gloo ranks (each runs its own heads, or its own layers): four steps with INT8 attention, every loss
    finite and within 0.1% of the same layout's run with BF16 attention (as on one rank)."""
    runs = {}
    for name, extra in (("bf16", []), ("int8", ["--int8-attention"])):
        log = tmp_path / f"{name}.jsonl"
        train("--int8-linear", *extra, *layout, "--train-iters", "4", "--log-jsonl", str(log), nproc=2)
        runs[name] = [r["lm_loss"] for r in records(log, "lm_loss")]
    assert len(runs["int8"]) == 4 and all(math.isfinite(x) for x in runs["int8"]) and runs["int8"] != runs["bf16"]
    for a, b in zip(runs["bf16"], runs["int8"]):
        assert abs(b - a) <= 1e-3 * a, runs


@pytest.mark.slow
def test_auto_fallback_moves_attention_to_bf16_and_a_resume_keeps_it(tmp_path):
    """Every attention "fails" a limit of 1e-9: after 2 checks its layer runs BF16 attention, logged with the
    reason; the linears (default limits) stay; a resumed run restores the move, --int8-reset-fallback drops it."""
    flags = ["--int8-linear", "--int8-attention", "--int8-stats-interval", "1", "--int8-auto-fallback",
             "--int8-fallback-max-attention-rel-err", "1e-9", "--int8-fallback-max-rel-err", "1e6",
             "--int8-fallback-max-underflow", "1", "--int8-fallback-patience", "2"]
    out = train(*flags, "--train-iters", "4", "--save", str(tmp_path / "a"))
    events = [r["int8_fallback"] for r in records(tmp_path / "a" / "train_log.jsonl", "int8_fallback")]
    assert sorted((e["iteration"], e["linear"], e["gemm"], e["change"]) for e in events) == [
        (2, f"layer{n}.self_attention.core_attention", "attention", "INT8 -> BF16 attention") for n in (1, 2)]
    assert f"int8 fallback at iteration 2: {ATTENTION} attention: INT8 -> BF16 attention (rel_err" in out
    resumed = train(*flags[:2], "--train-iters", "5", "--load", str(tmp_path / "a"), "--save", str(tmp_path / "b"))
    assert f"int8 fallback restored from the checkpoint: {ATTENTION} runs BF16 attention (SDPA)" in resumed
    assert "precision: this run's" not in resumed  # the same numerics
    # other scores than the checkpoint's (e.g. a run of the INT8-scores default before 90965e1): trained, and said
    again = train(*flags[:2], "--train-iters", "6", "--load", str(tmp_path / "b"), "--int8-reset-fallback",
                  "--int8-attention-scores", "int8")
    assert "int8 fallback: --int8-reset-fallback: 2 module(s) back to their configured precision" in again
    assert ("precision: this run's int8[row,fprop/dgrad/wgrad,attn:int8/scores:int8], not the checkpoint's "
            "int8[row,fprop/dgrad/wgrad,attn:int8/scores:bf16]") in again


def _validated(*flags, dropout=("--attention-dropout", "0")):
    """Validated arguments of a model with head dim 64 and (unless `dropout` says otherwise) no attention dropout."""
    from megatron_int8.training.args import parse_args, validate_args

    args = parse_args(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "2", "--seq-length",
                       "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
                       "--vocab-size", "128", *dropout, *flags])
    return validate_args(args, 1)


@pytest.mark.parametrize("flags, message", [
    (["--int8-attention"], "--int8-attention runs in the INT8 layers: it needs --int8-linear"),
    (["--int8-linear", "--int8-attention", "--attention-dropout", "0.1"],
     "--int8-attention: attention dropout 0.1: INT8 attention has none; give --attention-dropout 0"),
    (["--int8-linear", "--int8-attention", "--kv-channels", "32"],
     "--int8-attention: head dim 32 (--kv-channels, or --hidden-size / --num-attention-heads): the INT8 attention "
     "kernels take 64 or 128"),
    (["--int8-linear", "--int8-attention", "--num-attention-heads", "4"], "--int8-attention: head dim 32"),
    (["--int8-linear", "--int8-attention", "--reset-attention-mask"],
     "--int8-attention: --reset-attention-mask: document masks are not supported"),
    (["--int8-linear", "--int8-attention-scores", "bf16"],
     "--int8-attention-scores bf16 sets the INT8 attention's scores: it needs --int8-attention"),
    (["--int8-linear", "--int8-stats-interval", "1", "--int8-fallback-max-attention-rel-err", "0"],
     "--int8-fallback-max-attention-rel-err must be positive, got 0.0"),
])
def test_settings_int8_attention_cannot_serve_are_refused_at_start_up(flags, message):
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError) as error:
        _validated(*flags)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_yaml_value_is_named_with_its_file(tmp_path):
    """tiny.yaml-style configs set the attention dropout: the refusal says where it came from."""
    from megatron_int8.training.args import ArgumentError

    config = tmp_path / "c.yaml"
    config.write_text("attention_dropout: 0.1\n")
    with pytest.raises(ArgumentError, match=rf"attention dropout 0.1: .* \(from --config {config}\)$"):
        _validated("--int8-linear", "--int8-attention", "--config", str(config), dropout=())


def test_the_flag_reaches_the_recipe_and_the_model():
    """--int8-attention (head dim 64, no dropout) passes validation and puts int8_attention in the recipe the
    trainer's model is built with; the policy without --int8-linear stays the BF16 baseline."""
    from megatron_int8.megatron.cli import policy_from_args

    default = policy_from_args(_validated("--int8-linear", "--int8-attention")).recipe
    assert default.int8_attention and default.int8_attention_scores == "bf16"
    assert default.numerics.describe().endswith(",attn:int8/scores:bf16]")
    recipe = policy_from_args(_validated("--int8-linear", "--int8-attention", "--int8-attention-scores", "int8")).recipe
    assert recipe.int8_attention and recipe.int8_attention_scores == "int8"
    assert recipe.numerics.describe().endswith(",attn:int8/scores:int8]")
    with pytest.raises(SystemExit):  # argparse names the choices
        _validated("--int8-linear", "--int8-attention", "--int8-attention-scores", "fp8")
    assert not policy_from_args(_validated("--int8-linear")).recipe.int8_attention
    plain = _validated()
    plain.int8_attention = True  # e.g. an INT8 checkpoint's recorded arguments, evaluated in BF16
    assert not policy_from_args(plain).enabled
