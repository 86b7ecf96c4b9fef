"""Bad data, tokenizers and switches (issue #48), in-process and before anything trains: each fails with a
message naming the file and the fix, or is noted; every on/off flag can be undone on the command line."""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml
from repo_paths import ROOT
from test_data import _pretrain_error, _trainer_args, dataset  # noqa: F401  (`dataset`: fixture)

from megatron_int8.training.args import ArgumentError, build_parser, parse_args, validate_args


def _copy_dataset(dataset, tmp_path, name="copy"):
    prefix = str(tmp_path / name)
    for ext in (".bin", ".idx"):
        shutil.copy(dataset["prefix"] + ext, prefix + ext)
    return prefix


def test_truncated_empty_and_mismatched_index_files_are_named(dataset, tmp_path):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = _copy_dataset(dataset, tmp_path)
    whole = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(whole[: len(whole) // 2])
    message = _pretrain_error(_trainer_args(dataset, "--data-path", prefix))
    assert f"{prefix}.idx is truncated" in message and "scripts/preprocess_data.py" in message
    open(prefix + ".idx", "wb").write(b"")
    assert f"{prefix}.idx is empty (0 bytes)" in _pretrain_error(_trainer_args(dataset, "--data-path", prefix))
    open(prefix + ".idx", "wb").write(whole[:12])
    assert f"{prefix}.idx is truncated (12 bytes)" in _pretrain_error(_trainer_args(dataset, "--data-path", prefix))

    # another dataset's index (same vocabulary, other documents) next to this .bin
    other = str(tmp_path / "other")
    builder = IndexedDatasetBuilder(other + ".bin", dtype=DType.optimal_dtype(300))
    rng = np.random.default_rng(0)
    for _ in range(30):
        builder.add_document(rng.integers(0, 300, size=int(rng.integers(50, 400))), [0])
    builder.finalize(other + ".idx")
    shutil.copy(other + ".idx", prefix + ".idx")
    message = _pretrain_error(_trainer_args(dataset, "--data-path", prefix))
    assert f"{prefix}.bin does not match {prefix}.idx" in message and "different preprocessing runs" in message


@pytest.mark.parametrize("extension", [".bin", ".idx"])
def test_data_path_with_an_extension_names_the_prefix(dataset, extension):
    message = _pretrain_error(_trainer_args(dataset, "--data-path", dataset["prefix"] + extension))
    assert f"give the prefix of the .bin/.idx pair, without the extension: --data-path {dataset['prefix']}" in message


def _bare_tokenizer_json(directory, eos=None):
    """A byte-level BPE tokenizer.json with an <|endoftext|> token, and tokenizer_config.json naming it or not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def f(x):\n    return x\n"] * 10, trainer)
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    if eos is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return tokenizer


def test_a_tokenizer_of_the_other_kind_names_the_tokenizer_type(dataset, tmp_path):
    pytest.importorskip("tokenizers")
    _bare_tokenizer_json(tmp_path)
    json_file = str(tmp_path / "tokenizer.json")
    message = _pretrain_error(_trainer_args(dataset, "--tokenizer-model", json_file))  # tiny.yaml: SentencePiece
    assert f"--tokenizer-model {json_file} is a Hugging Face tokenizer (tokenizer.json), not a SentencePiece model: " \
           "pass --tokenizer-type HuggingFaceTokenizer" in message
    message = _pretrain_error(_trainer_args(dataset, "--tokenizer-type", "HuggingFaceTokenizer"))
    assert "is not a Hugging Face tokenizer.json" in message and "--tokenizer-type SentencePieceTokenizer" in message
    result = subprocess.run([sys.executable, "scripts/preprocess_data.py", "--input", str(dataset["root"] / "docs.jsonl"),
                             "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer",
                             "--tokenizer-model", json_file], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "pass --tokenizer-type HuggingFaceTokenizer" in result.stderr
    assert "Traceback" not in result.stderr


def test_hf_tokenizer_without_eos_asks_for_it_and_takes_it_from_config_or_flag(dataset, tmp_path):
    pytest.importorskip("transformers")
    from megatron_int8.training.data import build_tokenizer

    bare, configured = tmp_path / "bare", tmp_path / "configured"
    hf = _bare_tokenizer_json(bare)
    _bare_tokenizer_json(configured, eos="<|endoftext|>")
    eod = hf.token_to_id("<|endoftext|>")

    def args(directory, *extra):
        return validate_args(_trainer_args(dataset, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                           str(directory), *extra), world_size=1)

    with pytest.raises(ArgumentError, match="names no end-of-document \\(EOS\\) token.*pass --eod-token TOKEN"):
        build_tokenizer(args(bare))
    assert build_tokenizer(args(bare, "--eod-token", "<|endoftext|>")).eod == eod
    assert build_tokenizer(args(configured)).eod == eod
    assert build_tokenizer(args(configured, "--eod-token", "<pad>")).eod == hf.token_to_id("<pad>")
    with pytest.raises(ArgumentError, match="end-of-document token '</s>' \\(from --eod-token\\) is not a token of"):
        build_tokenizer(args(bare, "--eod-token", "</s>"))


def _switches():
    """(dest, the flag that sets it away from the default, what that flag sets, the default) of every on/off flag;
    for an automatic setting (default None) every flag of it."""
    parser = build_parser()
    switches = []
    for action in parser._actions:
        if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):
            if action.const != parser.get_default(action.dest):
                switches.append((action.dest, action.option_strings[0], action.const, parser.get_default(action.dest)))
    return switches


def test_every_yaml_switch_can_be_undone_on_the_command_line(tmp_path):
    """A switch set in a YAML file goes back to the built-in default from the command line; an automatic one
    (e.g. --fused-adam) to the opposite setting."""
    switches = _switches()
    assert {flag for _, flag, _, _ in switches} >= {"--sequence-parallel", "--swiglu", "--disable-bias-linear",
                                                    "--int8-linear", "--bf16", "--untie-embeddings-and-output-weights",
                                                    "--fused-adam", "--no-fused-adam"}
    parser = build_parser()
    flags = {}  # (dest, what the flag sets) -> the first flag that sets it
    for action in parser._actions:
        if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):
            flags.setdefault((action.dest, action.const), action.option_strings[0])
    config = tmp_path / "switch.yaml"
    for dest, flag, sets, default in switches:
        config.write_text(yaml.safe_dump({flag[2:]: True}))
        assert getattr(parse_args(["--config", str(config)]), dest) is sets, flag
        back = not sets if default is None else default
        assert (dest, back) in flags, f"{flag} set in a YAML file cannot be undone on the command line"
        assert getattr(parse_args(["--config", str(config), flags[dest, back]]), dest) is back, (flag, back)
    assert flags["sequence_parallel", False] == "--no-sequence-parallel"
    assert flags["add_bias_linear", True] == "--enable-bias-linear"
    assert flags["int8_no_weight_cache", False] == "--int8-weight-cache"
    assert flags["apply_rope_fusion", True] == "--rope-fusion"
    assert flags["fused_adam", False] == "--no-fused-adam"


def test_silent_choices_are_noted(dataset, capsys):
    validate_args(_trainer_args(dataset, "--int8-granularity", "tensor", "--int8-grad-rounding", "stochastic"), 1)
    assert "note: --int8-grad-rounding, --int8-granularity have no effect without --int8-linear" in capsys.readouterr().out
    validate_args(_trainer_args(dataset, "--int8-linear", "--int8-granularity", "tensor"), 1)
    out = capsys.readouterr().out
    assert "warning: --int8-granularity tensor with --int8-grad-rounding nearest" in out
    assert "docs/convergence.md" in out
    for quiet in (["--int8-linear"], ["--int8-linear", "--int8-granularity", "tensor", "--int8-grad-rounding",
                                      "stochastic"], []):
        validate_args(_trainer_args(dataset, *quiet), 1)
        assert capsys.readouterr().out == ""


def test_mock_data_beside_a_data_path_is_noted(dataset, capsys):
    """--mock-data wins over a --data-path (say, from a YAML config): the run says the path is not read."""
    validate_args(_trainer_args(dataset, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"), 1)
    assert f"note: --mock-data trains on random tokens: --data-path {dataset['prefix']} is not read" in (
        capsys.readouterr().out)


def test_query_groups_without_grouped_query_attention_are_noted(dataset, capsys):
    args = validate_args(_trainer_args(dataset, "--no-group-query-attention", "--num-query-groups", "2"), 1)
    assert args.num_query_groups == args.num_attention_heads
    assert ("note: --num-query-groups 2 has no effect without --group-query-attention (every one of the "
            f"{args.num_attention_heads} heads gets its own keys and values)") in capsys.readouterr().out
    args = validate_args(_trainer_args(dataset, "--num-query-groups", "2"), 1)  # tiny.yaml: grouped
    assert args.num_query_groups == 2 and capsys.readouterr().out == ""


@pytest.mark.parametrize("extra, message", [
    (["--skip-train"], "--skip-train evaluates a checkpoint: give --load DIR"),
    (["--skip-train", "--load", "x", "--eval-iters", "0"], "give --eval-iters > 0"),
    (["--save-interval", "4", "--save-retain-interval", "6"], "--save-retain-interval 6 must be a multiple of"),
    (["--most-recent-k", "0"], "--most-recent-k must be >= 1, or -1"),
    (["--save-retain-interval", "0"], "--save-retain-interval must be positive, got 0"),  # once kept the latest only
    (["--ckpt-step", "6"], "--ckpt-step 6 picks a checkpoint of --load: give --load DIR"),
    (["--exit-signal-handler"], "--exit-signal-handler saves a checkpoint before it exits: give --save DIR"),
])
def test_journey_arguments_are_checked(dataset, extra, message):
    with pytest.raises(ArgumentError) as err:
        validate_args(_trainer_args(dataset, *extra), world_size=1)
    assert message in str(err.value)


def test_skip_train_needs_no_schedule(dataset, tmp_path):
    """Nor --train-iters (a config without it), and run_tiny.sh's --exit-signal-handler does not stop it."""
    args = validate_args(_trainer_args(dataset, "--skip-train", "--load", "x", "--lr-warmup-iters", "100",
                                       "--min-lr", "1", "--exit-signal-handler"), world_size=1)
    assert args.no_load_optim and args.save is None and not args.exit_signal_handler
    with open(os.path.join(ROOT, "configs", "tiny.yaml")) as f:
        config = {k: v for k, v in yaml.safe_load(f).items() if k != "train_iters"}
    (tmp_path / "no_iters.yaml").write_text(yaml.safe_dump(config))
    argv = ["--config", str(tmp_path / "no_iters.yaml"), "--data-path", dataset["prefix"], "--tokenizer-model",
            dataset["tokenizer"], "--load", "x"]
    assert validate_args(parse_args(argv + ["--skip-train"]), world_size=1).train_iters == 0
    with pytest.raises(ArgumentError, match="--train-iters"):
        validate_args(parse_args(argv), world_size=1)


def test_exit_interval_without_save_is_noted(dataset, capsys):
    validate_args(_trainer_args(dataset, "--exit-interval", "2"), world_size=1)
    assert ("note: --exit-interval 2 without --save: the run stops at an iteration divisible by it without saving "
            "a checkpoint") in capsys.readouterr().out
    validate_args(_trainer_args(dataset, "--exit-interval", "2", "--save", "s"), world_size=1)
    assert capsys.readouterr().out == ""


def test_export_without_protobuf_stops_naming_the_package(dataset, tmp_path, monkeypatch):
    """The exact tokenizer.json needs protobuf. Without it the export copied tokenizer.model, which transformers
    converts on loading into a tokenizer that encodes leading whitespace and text after newlines otherwise: now it
    stops, naming the package and --no-tokenizer; and --no-tokenizer (write=False) writes nothing, yet gives the
    special ids for config.json."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm

    from megatron_int8.training.export import ExportError, _save_tokenizer

    def no_protobuf(*args, **kwargs):
        raise ImportError("SentencePieceExtractor requires the protobuf library")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_protobuf)
    args = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=dataset["tokenizer"])
    with pytest.raises(ExportError, match="needs the protobuf package .*pip install protobuf, or --no-tokenizer"):
        _save_tokenizer(args, str(tmp_path))
    assert os.listdir(tmp_path) == []
    processor = spm.SentencePieceProcessor(model_file=dataset["tokenizer"])
    assert _save_tokenizer(args, str(tmp_path), write=False) == (processor.eos_id(), processor.bos_id())
    assert os.listdir(tmp_path) == []


def test_a_failed_export_leaves_no_staging_folder(tmp_path, monkeypatch):
    """The staging folder is made before the weights load (a refusal there once left <output>.partial behind)."""
    from megatron_int8.training import export, inference

    recorded = argparse.Namespace(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                  add_bias_linear=False, rotary_percent=1.0, qk_layernorm=False, num_experts=None)
    monkeypatch.setattr(inference, "inference_arguments", lambda *a, **k: recorded)

    def fails(*args, **kwargs):
        raise export.ExportError("the tokenizer differs")

    monkeypatch.setattr(export, "_write_export", fails)
    with pytest.raises(export.ExportError, match="the tokenizer differs"):
        export.export_hf("ckpt", str(tmp_path / "hf"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("save_first", [False, True])
def test_a_second_signal_interrupts_at_once(save_first):
    """The first SIGINT only sets the flag that the loop reads after its iteration; a second one (a step that
    hangs) raises at once. Outside the loop the previous handlers are back."""
    import signal

    from megatron_int8.training.loop import ExitSignals

    before = signal.getsignal(signal.SIGINT)
    with ExitSignals(save_first=save_first) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT
        if not save_first:
            with pytest.raises(KeyboardInterrupt):
                signals.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # the handler runs between bytecodes
    assert signal.getsignal(signal.SIGINT) is before


def test_yaml_false_is_the_opposite_of_the_flag(tmp_path):
    """`key: false` sets the opposite of what the flag sets, also where the built-in default is automatic (None)
    or the flag is a --no-X form; integer flags refuse booleans and fractions instead of truncating them."""
    parser = build_parser()
    config = tmp_path / "switch.yaml"
    checked = 0
    for action in parser._actions:
        if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):
            key = action.option_strings[0][2:]
            for value in (True, False):
                config.write_text(yaml.safe_dump({key: value}))
                got = getattr(parse_args(["--config", str(config)]), action.dest)
                assert got is (action.const if value else not action.const), (key, value, got)
            checked += 1
    assert checked > 40
    for key, dest, want in (("fused_adam", "fused_adam", False), ("cross_entropy_loss_fusion",
                            "cross_entropy_loss_fusion", False), ("no_overlap_grad_reduce", "overlap_grad_reduce",
                            True), ("disable_bias_linear", "add_bias_linear", True)):
        config.write_text(yaml.safe_dump({key: False}))
        assert getattr(parse_args(["--config", str(config)]), dest) is want, key
    for value, message in ((True, "expected a number"), (2048.9, "expected an integer")):
        config.write_text(yaml.safe_dump({"seq_length": value}))
        with pytest.raises(ArgumentError, match=f"config key 'seq_length': {message}"):
            parse_args(["--config", str(config)])
    config.write_text(yaml.safe_dump({"seq_length": 2048.0, "lr": 3}))
    args = parse_args(["--config", str(config)])
    assert args.seq_length == 2048 and args.lr == 3.0


def test_split_shares_for_skip_train_name_a_bad_split():
    """--skip-train compares --split with the checkpoint's before the data are checked: a bad one is one error
    naming it (four weights failed inside megatron's parser, all zeros compared unequal to everything)."""
    from megatron_int8.training.data import split_shares as _shares

    assert _shares("98,2,0") == _shares("49, 1") == [0.98, 0.02, 0.0]
    for bad in ("1,2,3,4", "0,0,0"):
        with pytest.raises(ArgumentError, match=f"--split '{bad}': expected up to three non-negative weights"):
            _shares(bad)


@pytest.mark.parametrize("most_recent_k, retain, kept", [
    (2, None, [9, 10]), (4, None, [7, 8, 9, 10]), (5, None, [6, 7, 8, 9, 10]), (8, None, list(range(3, 11))),
    (12, None, list(range(1, 11))), (-1, 4, [4, 8, 10]), (3, 4, [4, 8, 9, 10]), (1, None, [10]),
])
def test_retention_keeps_the_k_latest_and_the_multiples(tmp_path, most_recent_k, retain, kept):
    """Ten checkpoints saved one by one, retention applied after each save as the trainer does: what survives.
    (With fewer saved than k - 1 before the latest, a negative slice once kept too few: k = 4 and 5 kept [9, 10].)"""
    from megatron_int8.training.checkpoint import apply_retention, checkpoint_dir, saved_iterations

    for iteration in range(1, 11):
        os.makedirs(checkpoint_dir(str(tmp_path), iteration))
        apply_retention(str(tmp_path), iteration, retain, most_recent_k)
    assert saved_iterations(str(tmp_path)) == kept


def test_a_resume_that_reads_other_samples_says_so():
    """Flags that change which samples come next are allowed on a resume (as in Megatron-LM) but noted; the seed
    counts only where it orders the data (no --data-seed)."""
    from megatron_int8.training.checkpoint import data_change

    saved = argparse.Namespace(data_path=["a"], mock_data=False, split="98,2,0", seq_length=64, seed=1, data_seed=None,
                               global_batch_size=4)
    assert data_change(saved, argparse.Namespace(**vars(saved))) is None
    assert data_change(argparse.Namespace(), saved) is None  # a checkpoint from before the arguments were saved
    now = argparse.Namespace(**{**vars(saved), "seed": 2, "split": "90,5,5"})
    assert data_change(saved, now) == ("data: this run's flags, not the checkpoint's (--split 98,2,0 -> 90,5,5; data "
                                       "order seed (--data-seed, else --seed) 1 -> 2): the samples from here on differ "
                                       "from those the checkpoint's run would have read")
    assert data_change(saved, argparse.Namespace(**{**vars(saved), "seed": 2, "data_seed": 1})) is None
    note = data_change(saved, argparse.Namespace(**{**vars(saved), "global_batch_size": 8}))
    assert "--global-batch-size 4 -> 8" in note and "the LR schedule counts iterations" in note


def test_a_deletion_stopped_midway_leaves_no_checkpoint_folder(tmp_path, monkeypatch):
    """Retention renames a checkpoint before deleting it: a kill inside the deletion left a partial iter_* folder that
    counted as a saved checkpoint (and --ckpt-step hints could name it)."""
    from megatron_int8.training import checkpoint as ckpt

    for iteration in (1, 2, 3):
        (tmp_path / f"iter_{iteration:07d}" / "rng").mkdir(parents=True)
        (tmp_path / f"iter_{iteration:07d}" / "common.pt").write_bytes(b"x")

    def killed(path, ignore_errors=False):
        if not os.path.exists(path):
            return
        os.remove(os.path.join(path, "common.pt"))
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.apply_retention(str(tmp_path), 3, None, 1)
    assert ckpt.saved_iterations(str(tmp_path)) == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001.deleting", "iter_0000002", "iter_0000003"]
    # the next save clears it, with a save's temporary folder and a stale copy of a re-saved iteration; a copy whose
    # new folder is missing (a re-save stopped between its renames) is the checkpoint itself and stays
    monkeypatch.undo()
    for name in (".tmp_iter_0000004", "iter_0000003.replaced", "iter_0000005.replaced"):
        (tmp_path / name).mkdir()
    ckpt.remove_leftovers(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000005.replaced"]


def test_export_refuses_sinkhorn_routing():
    """megatron's sinkhorn router weighs the chosen experts by a softmax over all experts (a sigmoid at top-1), Mixtral
    by a softmax over the chosen: exported as Mixtral its logits moved by 8-12% of their scale, silently."""
    from megatron_int8.training.export import ExportError, hf_architecture

    moe = argparse.Namespace(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                             add_bias_linear=False, rotary_percent=1.0, qk_layernorm=False, num_experts=4,
                             moe_router_load_balancing_type="aux_loss")
    assert hf_architecture(moe) == "mixtral"
    moe.moe_router_load_balancing_type = "sinkhorn"
    with pytest.raises(ExportError, match="--moe-router-load-balancing-type sinkhorn"):
        hf_architecture(moe)


def test_export_staging_and_the_files_it_replaces(tmp_path):
    """<output>.partial is the export's own staging folder: an interrupted export's is replaced, another folder of
    that name is refused, not deleted (it once was, silently). Moving in, the files of an earlier export that this
    one does not write go (an old tokenizer.json would be read over a new tokenizer.model), and only those."""
    from megatron_int8.training.export import ExportError, _move_into, _new_staging

    output = tmp_path / "hf"
    foreign = tmp_path / "hf.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not an interrupted export's staging folder"):
        _new_staging(str(output))
    assert (foreign / "notes.txt").read_text() == "mine"
    (foreign / "notes.txt").unlink()
    foreign.rmdir()
    staging = _new_staging(str(output))
    (tmp_path / "hf.partial" / "model.safetensors").write_text("half")
    staging = _new_staging(str(output))  # an interrupted export's: replaced
    assert os.listdir(staging) == [".megatron_int8_export"]
    output.mkdir()
    for name, text in (("tokenizer.json", "old"), ("config.json", "old"), ("README.md", "user")):
        (output / name).write_text(text)
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        (tmp_path / "hf.partial" / name).write_text("new")
    notes = []
    _move_into(staging, str(output), notes.append)
    assert sorted(os.listdir(output)) == ["README.md", "config.json", "model.safetensors", "tokenizer.model"]
    assert (output / "config.json").read_text() == "new" and not (tmp_path / "hf.partial").exists()
    assert notes == [f"note: removed from {output} the earlier export's tokenizer.json, which this export does not "
                     "write"]
