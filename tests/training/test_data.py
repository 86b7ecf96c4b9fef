"""Data preparation and bad-input handling: preprocess_data.py (SentencePiece with exact whitespace,
EOD, workers), and every early failure of the trainer with its message (in-process, nothing trains)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_int8.training.args import ArgumentError, parse_args, validate_args
from repo_paths import ROOT, SCRIPTS

CODE = "def f(x):\n\tif x:\n        return x + 1   # spaces  kept\n\n\nclass A:\n    pass\n"


def _run(argv):
    result = subprocess.run([sys.executable] + argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return result


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """30 documents: 24 source snippets (JSONL) and a plain-text file, tokenized by a fresh spm model."""
    root = tmp_path_factory.mktemp("data")
    lines = [json.dumps({"text": CODE.replace("x", name) * 20}) for name in
             ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta") * 3]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (root / "notes.txt").write_text("Plain text is one document.\nWith two lines.\n" * 50)
    result = _run(["scripts/preprocess_data.py", "--input", str(root / "docs.jsonl"), str(root / "notes.txt"),
                   "--output-prefix", str(root / "corpus"), "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", str(root / "tok" / "spm.model"), "--train-sentencepiece", "300",
                   "--workers", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "prefix": str(root / "corpus_text_document"), "tokenizer": str(root / "tok" / "spm.model"),
            "stdout": result.stdout}


def test_preprocess_prints_no_megatron_import_notes(dataset, tmp_path):
    """megatron-core's "Transformer Engine and Apex are not installed" notes, which the trainer filters, came out
    of preprocess_data.py too (run here with Python's default warning filters)."""
    (tmp_path / "a.txt").write_text("one document\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    result = subprocess.run([sys.executable, "scripts/preprocess_data.py", "--input", str(tmp_path / "a.txt"),
                             "--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "SentencePieceTokenizer",
                             "--tokenizer-model", dataset["tokenizer"]], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Transformer Engine and Apex" not in result.stderr, result.stderr[-3000:]


def test_preprocess_round_trips_code_and_appends_eod(dataset):
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    processor = spm.SentencePieceProcessor(model_file=dataset["tokenizer"])
    indexed = IndexedDataset(dataset["prefix"])
    assert len(indexed) == 25 and indexed.index.dtype == np.uint16
    first = indexed[0].tolist()
    assert first[-1] == processor.eos_id() and processor.eos_id() not in first[:-1]
    assert processor.decode(first[:-1]) == CODE.replace("x", "alpha") * 20  # newlines, tabs, runs of spaces
    assert processor.decode(indexed[24].tolist()[:-1]) == "Plain text is one document.\nWith two lines.\n" * 50
    assert "done: 25 documents" in dataset["stdout"]


def test_preprocess_errors(tmp_path):
    missing = _run(["scripts/preprocess_data.py", "--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                    str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "m"])
    assert missing.returncode != 0 and "no such file" in missing.stderr
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    wrong_key = _run(["scripts/preprocess_data.py", "--input", str(tmp_path / "bad.jsonl"), "--output-prefix",
                      str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer",
                      "--tokenizer-model", str(tmp_path / "m.model"), "--train-sentencepiece", "300"])
    assert wrong_key.returncode != 0 and "no key 'text'" in wrong_key.stderr
    small = _run(["scripts/preprocess_data.py", "--input", str(tmp_path / "bad.jsonl"), "--output-prefix",
                  str(tmp_path / "x"), "--tokenizer-type", "SentencePieceTokenizer",
                  "--tokenizer-model", str(tmp_path / "m.model"), "--train-sentencepiece", "100"])
    assert small.returncode == 2 and "--train-sentencepiece 100: at least 261" in small.stderr


@pytest.mark.parametrize("name, content, message", [
    ("latin1.jsonl", json.dumps({"text": "x"}).encode() + b"\n" + b'{"text": "caf\xe9"}\n',
     ":2: not UTF-8 (byte 0xe9 at line 1 of it)"),
    ("latin1.txt", "first line\ncafé au lait\n".encode("latin-1"),
     "latin1.txt: not UTF-8 (byte 0xe9 at line 2 of it)"),
    ("list.jsonl", b'["text"]\n', ":1: a JSON list, not an object with the --json-keys 'text'"),
    ("null.jsonl", b'{"text": null}\n', ":1: 'text' holds a NoneType, not a string"),
    ("blank.jsonl", b"\n\n  \n", "no documents in"),
    ("empty.txt", b"", "empty.txt (empty, or whitespace only): leave it out of --input"),
    ("blank.txt", b"\n \t\n", "blank.txt (empty, or whitespace only): leave it out of --input"),
    ("empty_texts.jsonl", b'{"text": ""}\n{"text": " \\n"}\n', "empty_texts.jsonl (empty, or whitespace only)"),
])
def test_preprocess_names_bad_documents(dataset, tmp_path, name, content, message):
    """Once: a UnicodeDecodeError or TypeError traceback naming no file or line; a plain-text file's bad bytes stored
    as replacement characters, silently; an input of empty lines written as a dataset of none; an empty plain-text
    file, or a JSONL file of empty texts, written as a dataset of end-of-document tokens alone (exit 0)."""
    (tmp_path / name).write_bytes(content)
    result = _run(["scripts/preprocess_data.py", "--input", str(tmp_path / name), "--output-prefix",
                   str(tmp_path / "out"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                   dataset["tokenizer"]])
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not list(tmp_path.glob("out_*"))


def test_an_empty_input_beside_others_is_refused_by_name(dataset, tmp_path):
    """An empty file among good ones is most likely a mistake (a wrong path, a failed export): refused, naming it
    alone, before the tokenizer is trained."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n")
    common = ["scripts/preprocess_data.py", "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "spm.model"),
              "--train-sentencepiece", "300"]
    one = _run(common + ["--input", str(dataset["root"] / "docs.jsonl"), str(tmp_path / "empty.txt")])
    assert one.returncode == 1 and one.stderr == (f"error: no documents in {tmp_path / 'empty.txt'} (empty, or "
                                                  "whitespace only): leave it out of --input\n"), one.stderr
    both = _run(common + ["--input", str(tmp_path / "empty.txt"), str(dataset["root"] / "notes.txt"),
                          str(tmp_path / "blank.jsonl")])
    assert both.returncode == 1 and f"no documents in {tmp_path / 'empty.txt'}, {tmp_path / 'blank.jsonl'} (" \
        "empty, or whitespace only): leave them out of --input" in both.stderr, both.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl", "empty.txt"]


@pytest.mark.parametrize("spelling", ["same", "dot", "relative"])
def test_an_input_named_twice_is_refused_before_any_work(dataset, tmp_path, spelling):
    """`--input c.jsonl c.jsonl` (or ./c.jsonl and c.jsonl) tokenized the file twice: its documents twice, and the
    split by document order put copies of training documents into validation."""
    import shutil

    shutil.copy(dataset["root"] / "docs.jsonl", tmp_path / "c.jsonl")
    first = str(tmp_path / "c.jsonl")
    second = {"same": first, "dot": f"{tmp_path}/./c.jsonl", "relative": os.path.relpath(first, ROOT)}[spelling]
    result = _run(["scripts/preprocess_data.py", "--input", first, str(dataset["root"] / "notes.txt"), second,
                   "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", str(tmp_path / "spm.model"), "--train-sentencepiece", "300"])
    named = second if second == first else f"{second} is {first}"
    assert result.returncode == 2 and f"error: --input {named}: a file named twice would write its documents twice, " \
        "and the validation split would hold copies of training documents" in result.stderr, result.stderr
    assert os.listdir(tmp_path) == ["c.jsonl"]  # no tokenizer trained, no dataset


@pytest.mark.parametrize("flags, message", [
    (["--workers", "-3"], "--workers must be at least 1, got -3"),  # printed "-3 worker(s)" and went on
    (["--output-prefix", "OUT/"], "--output-prefix OUT/ names a folder: add the files' name"),  # OUT/_text_document
    (["--json-keys", "text", "code"], "--json-keys text code with plain-text input"),  # an empty code dataset
    (["--eod-token", "</s>"], "--eod-token </s> applies to a Hugging Face tokenizer"),  # silently ignored
])
def test_preprocess_settings_named_before_any_work(dataset, tmp_path, flags, message):
    flags = [f.replace("OUT", str(tmp_path / "out")) for f in flags]
    argv = ["scripts/preprocess_data.py", "--input", str(dataset["root"] / "notes.txt"), "--output-prefix",
            str(tmp_path / "d"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
            dataset["tokenizer"], *flags]
    result = _run(argv)
    assert result.returncode == 2 and message.replace("OUT", str(tmp_path / "out")) in result.stderr, result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["corpus.JSONL", "corpus.ndjson"])
def test_jsonl_is_known_by_its_suffix_in_any_case(dataset, tmp_path, name):
    """corpus.JSONL and .ndjson were tokenized as plain text: one document of JSON syntax."""
    import sentencepiece as spm
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = ["def f(x):\n    return x\n", "class A:\n    pass\n"]
    (tmp_path / name).write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    result = _run(["scripts/preprocess_data.py", "--input", str(tmp_path / name), "--output-prefix",
                   str(tmp_path / "out"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                   dataset["tokenizer"]])
    assert result.returncode == 0, result.stderr
    processor = spm.SentencePieceProcessor(model_file=dataset["tokenizer"])
    indexed = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [processor.decode(indexed[i].tolist()[:-1]) for i in range(len(indexed))] == texts


def test_training_a_tokenizer_does_not_write_over_one_silently(dataset, tmp_path):
    """--train-sentencepiece over an existing --tokenizer-model: the datasets made with the old model would decode
    to other text with the new one (same size, so no vocabulary check notices)."""
    model = tmp_path / "spm.model"
    model.write_bytes(open(dataset["tokenizer"], "rb").read())
    common = ["scripts/preprocess_data.py", "--input", str(dataset["root"] / "docs.jsonl"), "--output-prefix",
              str(tmp_path / "out"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model),
              "--train-sentencepiece", "300"]
    refused = _run(common)
    assert refused.returncode == 2 and "exists and --train-sentencepiece would write over it" in refused.stderr
    assert model.read_bytes() == open(dataset["tokenizer"], "rb").read()
    assert _run(common + ["--force"]).returncode == 0


def test_a_new_tokenizer_is_never_left_beside_the_old_dataset(dataset, tmp_path):
    """--force --train-sentencepiece over a tokenizer and the dataset made with it, interrupted while tokenizing: the
    new tokenizer was written in place at once, so the old dataset stayed beside it and training read its ids through
    the new tokenizer without a word. Now the old dataset is gone before the new tokenizer takes the old one's place."""
    import shutil

    model = tmp_path / "spm.model"
    shutil.copy(dataset["tokenizer"], model)
    for suffix in (".bin", ".idx"):
        shutil.copy(dataset["prefix"] + suffix, tmp_path / f"out_text_document{suffix}")
    other = tmp_path / "other.jsonl"  # another corpus: another tokenizer
    other.write_text("".join(json.dumps({"text": f"total_{i} = measure({i}) * factor_{i % 7}\n"}) + "\n"
                             for i in range(400)))
    interrupted = _run(["-c", f"import sys; sys.path.insert(0, {SCRIPTS!r}); import preprocess_data\n"
                              "def interrupt(self, item):\n    raise KeyboardInterrupt\n"
                              "preprocess_data.Encoder.encode = interrupt\n"
                              "sys.exit(preprocess_data.main(sys.argv[1:]))",
                        "--input", str(other), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                        "SentencePieceTokenizer", "--tokenizer-model", str(model), "--train-sentencepiece", "300",
                        "--force"])
    assert "KeyboardInterrupt" in interrupted.stderr, interrupted.stderr
    assert model.read_bytes() != open(dataset["tokenizer"], "rb").read()  # the new tokenizer, in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.jsonl", "spm.model", "spm.vocab"]  # and no dataset


def test_preprocess_stops_on_bad_input_with_workers_and_keeps_what_exists(dataset, tmp_path):
    """A bad line with worker processes is one error line, not a hang; nothing partial is left; an existing
    dataset is written over only with --force."""
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) for i in range(200)]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines[:100] + ["{not json"] + lines[100:]) + "\n")
    (tmp_path / "good.jsonl").write_text("\n".join(lines) + "\n")
    common = ["scripts/preprocess_data.py", "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", dataset["tokenizer"], "--workers", "2"]
    bad = _run(common + ["--input", str(tmp_path / "bad.jsonl")])
    assert bad.returncode == 1 and f"error: {tmp_path / 'bad.jsonl'}:101: not JSON" in bad.stderr
    assert "Traceback" not in bad.stderr and not list(tmp_path.glob("out_*"))
    assert _run(common + ["--input", str(tmp_path / "good.jsonl")]).returncode == 0
    again = _run(common + ["--input", str(tmp_path / "good.jsonl")])
    assert again.returncode == 2 and "out_text_document.bin exists: pass --force" in again.stderr
    assert _run(common + ["--input", str(tmp_path / "good.jsonl"), "--force"]).returncode == 0


def test_tokenizer_training_prints_while_it_runs(capsys):
    """SentencePiece's trainer is silent at minloglevel 2: a line every interval says the run is alive."""
    import time

    sys.path.insert(0, SCRIPTS)
    from preprocess_data import heartbeat

    with heartbeat("  training", every_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert 3 <= len(lines) <= 7 and all(line.startswith("  training: ") and line.endswith(" s") for line in lines)
    with heartbeat("  quick", every_s=60):
        pass
    assert capsys.readouterr().out == ""  # and it stops with the body


def test_json_keys_named_twice_are_refused(dataset, tmp_path):
    result = _run(["scripts/preprocess_data.py", "--input", str(dataset["root"] / "docs.jsonl"), "--output-prefix",
                   str(tmp_path / "out"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                   dataset["tokenizer"], "--json-keys", "text", "text"])
    assert result.returncode == 2 and "--json-keys text text: a key named twice" in result.stderr


def test_sample_lines_is_seeded_uniform_and_keeps_input_order():
    sys.path.insert(0, SCRIPTS)
    from preprocess_data import sample_lines

    lines = [f"line {i}" for i in range(10_000)]
    sample = sample_lines(iter(lines), 1000)
    assert sample == sample_lines(iter(lines), 1000) and len(set(sample)) == 1000
    picked = [int(line.split()[1]) for line in sample]
    assert picked == sorted(picked)
    # uniform: each tenth of the input holds about a tenth of the sample (binomial sd ~9.5: +-5 sd)
    assert all(abs(sum(p // 1000 == decile for p in picked) - 100) < 48 for decile in range(10))
    assert sample_lines(iter(lines[:50]), 1000) == lines[:50]
    assert sample_lines(iter(lines), 1000, seed=7) != sample


@pytest.mark.slow  # multi-process (three subprocesses)
def test_a_sampled_tokenizer_is_the_same_in_every_process(tmp_path):
    """--train-sentencepiece on a sample of the lines: two processes give the same model and the same tokens
    (SentencePiece's own sampler gave a different model in every process)."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.jsonl"
    assert _run(["scripts/prepare_tiny_corpus.py", "--output", str(corpus), "--max-mb", "0.3"]).returncode == 0
    lines = sum(1 for doc in corpus.read_text().splitlines() for line in json.loads(doc)["text"].split("\n")
                if line.strip())
    assert lines > 3000  # so that a sample of 1500 leaves most lines out
    models = []
    for name in ("a", "b"):
        result = _run(["scripts/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / name),
                       "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                       str(tmp_path / name / "spm.model"), "--train-sentencepiece", "400",
                       "--sentencepiece-sample", "1500"])
        assert result.returncode == 0 and "on 1500 lines" in result.stdout, result.stderr[-3000:]
        processor = spm.SentencePieceProcessor(model_file=str(tmp_path / name / "spm.model"))
        models.append([(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.vocab_size())])
    assert models[0] == models[1]
    assert (tmp_path / "a_text_document.bin").read_bytes() == (tmp_path / "b_text_document.bin").read_bytes()
    bad = _run(["scripts/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "c"),
                "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "c.model"),
                "--train-sentencepiece", "400", "--sentencepiece-sample", "0"])
    assert bad.returncode != 0 and "--sentencepiece-sample must be at least 1" in bad.stderr


def _trainer_args(dataset, *extra):
    return parse_args(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--data-path", dataset["prefix"],
                       "--tokenizer-model", dataset["tokenizer"], "--num-layers", "2", "--train-iters", "4",
                       "--lr-warmup-iters", "1", "--seq-length", "32", "--data-cache-path",
                       str(dataset["root"] / "cache")] + list(extra))


def _pretrain_error(args) -> str:
    """The error of the entry point's sequence: validate_args, then pretrain (which checks data and outputs)."""
    from megatron_int8.training.loop import pretrain

    with pytest.raises(ArgumentError) as err:
        pretrain(validate_args(args, world_size=1))
    return str(err.value)


@pytest.mark.parametrize("extra, message", [
    (["--data-path", "/nonexistent/corpus"], "missing data file(s) /nonexistent/corpus.bin"),
    (["--vocab-size", "1000"], "tokenizer/vocab mismatch: "),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "50"], "contains token id"),
    (["--split", "1,99,0"], "the train split of"),
    (["--split", "99,1,0"], "the validation split of"),
    (["--tokenizer-model", "/nonexistent/spm.model"], "--tokenizer-model /nonexistent/spm.model: no such file"),
    (["--int8-linear", "--int8-bf16-gemms", "fprop,dgrad,wgrad"], "leaves no INT8 GEMM"),
    # once a NaN traceback, a silent 98,2,0 (megatron's parser drops the minus) and a run without evaluation
    (["--split", "0,0,0"], "--split '0,0,0': expected up to three non-negative weights with a positive sum"),
    (["--split", "98,-2,0"], "--split '98,-2,0': expected up to three non-negative weights"),
    (["--split", "100,0,0", "--eval-iters", "2"],
     "--split '100,0,0' gives the validation split no documents while --eval-iters 2 asks for evaluation"),
    # megatron-core asserts a blend's weights are positive when it builds the datasets (after the model)
    (["--data-path", "0", "C", "1", "D"], "--data-path 0 C 1 D: a blend's weights must be positive, got 0, 1"),
    (["--data-path", "-1", "C", "2", "D"], "a blend's weights must be positive, got -1, 2"),
    (["--data-path", "inf", "C", "1", "D"], "--data-path inf C 1 D: a blend's weights must be finite, got inf, 1"),
    (["--data-path", "0.5", "C", "0.5"], "0.5 reads as a weight: a blend is pairs of a weight and a prefix, and "
                                         "--data-path has 3 values"),
    (["--split", "1e3,1"], "--split '1e3,1': expected up to three non-negative weights"),  # megatron: 1,3,1
])
def test_bad_input_fails_early_with_message(dataset, extra, message):
    assert message in _pretrain_error(_trainer_args(dataset, *extra))


def test_a_split_summing_to_zero_is_refused_without_numpy_warnings():
    """The error came after two lines of numpy's RuntimeWarning (a division by the sum 0)."""
    import warnings

    from megatron_int8.training.data import split_shares

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(ArgumentError, match="--split '0,0,0': expected up to three non-negative weights"):
            split_shares("0,0,0")


def test_weighted_blend_checks_the_splits_megatron_will_build(dataset):
    """A weighted blend makes megatron-core build every split with a share, the unused test split too."""
    from megatron_int8.training.data import build_tokenizer, check_data, dataset_sizes

    single = validate_args(_trainer_args(dataset, "--split", "96,3,1"), world_size=1)
    check_data(single, build_tokenizer(single), dataset_sizes(single))  # test split not built: fine
    blend = validate_args(_trainer_args(dataset, "--split", "96,3,1", "--data-path", "0.5", dataset["prefix"],
                                        "0.5", dataset["prefix"]), world_size=1)
    assert dataset_sizes(blend)[2] == blend.global_batch_size
    with pytest.raises(ArgumentError, match="the test split of .* is empty.*or a share of 0"):
        check_data(blend, build_tokenizer(blend), dataset_sizes(blend))


def test_no_validation_share_is_fine_without_evaluation_in_a_weighted_blend(dataset):
    """A weighted blend requests a size for every split, evaluated or not: --eval-iters 0 decides, not that size."""
    from megatron_int8.training.data import build_tokenizer, check_data, dataset_sizes

    args = validate_args(_trainer_args(dataset, "--split", "100,0,0", "--eval-iters", "0", "--data-path", "0.5",
                                       dataset["prefix"], "0.5", dataset["prefix"]), world_size=1)
    assert dataset_sizes(args)[1] == args.global_batch_size
    check_data(args, build_tokenizer(args), dataset_sizes(args))


def test_a_blend_without_weights_checks_every_split_with_a_share(dataset):
    """megatron-core builds each split with a share of an unweighted blend at one epoch, and asserts on one that
    is empty: the empty test split of 96,3,1 once passed the check and failed in megatron after the model was built."""
    from megatron_int8.training.data import build_tokenizer, check_data, dataset_sizes

    blend = validate_args(_trainer_args(dataset, "--split", "96,3,1", "--data-path", dataset["prefix"],
                                        dataset["prefix"]), world_size=1)
    assert dataset_sizes(blend)[2] is None
    with pytest.raises(ArgumentError, match="the test split of .* is empty"):
        check_data(blend, build_tokenizer(blend), dataset_sizes(blend))


def test_a_split_smaller_than_one_step_is_named_not_looped_on():
    """The sampler's loop never yields when a split holds fewer samples than a step reads (an unweighted blend's
    validation split is built at one epoch): the run hung at its first evaluation."""
    from megatron_int8.training.data import PretrainingSampler

    with pytest.raises(ArgumentError, match=r"the validation split holds 4 samples, fewer than one step reads \(8 per "
                                            r"micro-batch x 1 data-parallel ranks\)"):
        PretrainingSampler(4, 0, 8, 0, 1, split="validation")
    with pytest.raises(ArgumentError, match="the train split holds 12 samples"):
        PretrainingSampler(12, 0, 4, 1, 4, split="train")
    assert next(iter(PretrainingSampler(16, 0, 4, 1, 4, split="train"))) == [4, 5, 6, 7]


def test_an_index_cache_older_than_its_data_is_named(dataset, tmp_path):
    """megatron-core keys its sample-index cache by the dataset's path: after preprocess_data.py --force wrote the
    pair again, a run reused the old indices and read other samples (or failed on an index past the new documents)."""
    from megatron_int8.training.data import build_tokenizer, check_data, dataset_sizes

    cache = tmp_path / "cache"
    cache.mkdir()
    description = cache / "0123abcd-GPTDataset-train-description.txt"
    description.write_text(json.dumps({"class": "GPTDataset", "dataset_path": dataset["prefix"]}))
    other = cache / "4567-BlendedDataset-train-description.txt"  # a blend of another dataset: not this one's
    other.write_text(json.dumps({"class": "BlendedDataset", "datasets": [{"dataset_path": "/elsewhere/x"}]}))
    args = validate_args(_trainer_args(dataset, "--data-cache-path", str(cache)), world_size=1)
    tokenizer = build_tokenizer(args)
    check_data(args, tokenizer, dataset_sizes(args))  # built after the data were written: fine
    written = os.path.getmtime(dataset["prefix"] + ".bin")
    for path in (description, other):
        os.utime(path, (written - 60, written - 60))
    with pytest.raises(ArgumentError, match=rf"after the index cache built from them \({cache}/0123abcd-"
                                            r"GPTDataset-train-\*; megatron-core would reuse it"):
        check_data(args, tokenizer, dataset_sizes(args))
    # megatron keys its cache by the path as given: a cache of the same files under another spelling is not reused
    description.write_text(json.dumps({"class": "GPTDataset", "dataset_path": os.path.relpath(dataset["prefix"])}))
    os.utime(description, (written - 60, written - 60))
    check_data(args, tokenizer, dataset_sizes(args))


def test_empty_validation_split_is_fine_without_evaluation(dataset):
    from megatron_int8.training.data import build_tokenizer, check_data, dataset_sizes

    args = validate_args(_trainer_args(dataset, "--split", "99,1,0", "--eval-iters", "0"), world_size=1)
    check_data(args, build_tokenizer(args), dataset_sizes(args))


@pytest.mark.parametrize("extra, world, message", [
    (["--num-attention-heads", "6", "--kv-channels", "16", "--tensor-model-parallel-size", "4"], 4,
     "--tensor-model-parallel-size 4 does not divide --num-attention-heads 6"),
    (["--num-attention-heads", "8", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     "does not divide the 2 query groups"),
    (["--seq-length", "512", "--max-position-embeddings", "256"], 1,
     "--seq-length 512 exceeds --max-position-embeddings 256"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--global-batch-size", "12"], 1, "--global-batch-size 12 is not divisible by --micro-batch-size 8"),
    (["--hidden-size", "250"], 1, "set --kv-channels"),
    (["--num-experts", "4", "--expert-model-parallel-size", "3"], 3, "--expert-model-parallel-size 3 must divide"),
    (["--lr-warmup-iters", "10"], 1, "--lr-warmup-iters 10 must be below --train-iters 4 (the default --lr-decay-iters)"),
    (["--profile", "--profile-step-start", "3", "--profile-step-end", "7"], 1, "need 1 <= start < end <= --train-iters + 1 (5)"),
    (["--profile", "--profile-step-start", "2", "--profile-step-end", "2"], 1, "need 1 <= start < end"),
    (["--profile", "--profile-step-start", "1", "--profile-step-end", "3", "--profile-ranks", "0", "2"], 2,
     "--profile-ranks [2]: not ranks of this 2-process run"),
])
def test_bad_layout_fails_with_message(dataset, extra, world, message):
    args = _trainer_args(dataset, *extra)
    with pytest.raises(ArgumentError) as err:
        validate_args(args, world_size=world)
    assert message in str(err.value)


def test_yaml_typos_and_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("num_layer: 2\nhidden-size: 64\nswigl: true\n")
    with pytest.raises(ArgumentError, match=r"unknown key 'num_layer'; did you mean num_layers.*unknown key 'swigl'"
                                            r"; did you mean swiglu"):
        parse_args(["--config", str(config)])
    config.write_text("swiglu: 1\n")
    with pytest.raises(ArgumentError, match="config key 'swiglu': expected true or false"):
        parse_args(["--config", str(config)])
    config.write_text("position_embedding_type: rotary\n")
    with pytest.raises(ArgumentError, match="is not one of"):
        parse_args(["--config", str(config)])
    config.write_text("num-layers: 3\nhidden_size: 64\ndisable_bias_linear: true\ndata_path: [1, a, 2, b]\n"
                      "lr: 1e-3\n")
    args = parse_args(["--config", str(config), "--num-layers", "5"])
    assert (args.num_layers, args.hidden_size, args.add_bias_linear) == (5, 64, False)
    assert args.data_path == ["1", "a", "2", "b"] and args.lr == 1e-3
    with pytest.raises(ArgumentError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])


def _installed(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(_installed("tokenizers"), reason="the `tokenizers` package is installed")
def test_hf_tokenizer_json_without_tokenizers_package(dataset, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    result = _run(["scripts/preprocess_data.py", "--input", str(dataset["root"] / "docs.jsonl"), "--output-prefix",
                   str(tmp_path / "x"), "--tokenizer-type", "HuggingFaceTokenizer",
                   "--tokenizer-model", str(tmp_path / "tokenizer.json")])
    assert result.returncode != 0 and "needs the `tokenizers` package" in result.stderr


@pytest.mark.skipif(not _installed("tokenizers"), reason="needs the `tokenizers` package")
def test_hf_tokenizer_json_preprocess(dataset, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([CODE] * 10, trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    argv = ["scripts/preprocess_data.py", "--input", str(dataset["root"] / "docs.jsonl"), "--output-prefix",
            str(tmp_path / "hf"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]
    # a bare tokenizer.json names no EOS: the trainer asks for --eod-token, and so does the preprocessing (it
    # guessed one from a list, which the trainer could disagree with)
    bare = _run(argv)
    assert bare.returncode == 1 and "names no end-of-document (EOS) token: pass --eod-token TOKEN" in bare.stderr
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    result = _run(argv)  # where transformers finds the EOS, both find it
    assert result.returncode == 0, result.stderr[-3000:]
    eod = tokenizer.token_to_id("<|endoftext|>")
    documents = IndexedDataset(str(tmp_path / "hf_text_document"))
    assert len(documents) == 24 and documents[0][-1] == eod
    assert tokenizer.decode(documents[0][:-1].tolist()) == CODE.replace("x", "alpha") * 20


@pytest.mark.skipif(_installed("transformers"), reason="the `transformers` package is installed")
def test_trainer_hf_tokenizer_without_transformers(dataset, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    message = _pretrain_error(_trainer_args(dataset, "--tokenizer-type", "HuggingFaceTokenizer",
                                            "--tokenizer-model", str(tmp_path / "tokenizer.json")))
    assert "needs the `transformers` package" in message


def test_data_seed_fixes_the_batches_whatever_the_init_seed(dataset):
    """--data-seed alone decides the sample order: the same batches under another --seed (a noise-floor run),
    different ones under another --data-seed; without it, --seed sets the order as in megatron."""
    from megatron_int8.training.data import build_datasets, build_tokenizer

    def first_samples(*extra):
        args = validate_args(_trainer_args(dataset, "--train-iters", "40", *extra), world_size=1)
        train = build_datasets(args, build_tokenizer(args))[0]
        return np.stack([np.asarray(train[i]["tokens"]) for i in range(24)])

    reference = first_samples("--seed", "1", "--data-seed", "7")
    assert np.array_equal(first_samples("--seed", "2", "--data-seed", "7"), reference)
    assert np.array_equal(first_samples("--seed", "7"), reference)
    assert not np.array_equal(first_samples("--seed", "1", "--data-seed", "8"), reference)
    assert not np.array_equal(first_samples("--seed", "1"), reference)


def test_docstring_corpus_keeps_the_prose_of_the_sources(tmp_path):
    """--text docstrings: each document holds only docstrings of 8 words or more in source order (a method's after
    its class's, a later function's after both), without doctest examples (prompts and outputs); a
    source that does not parse gives nothing; --docs with it is a usage error. loss_parity.sh refuses a run
    folder whose corpus is of the other kind rather than train on it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_tiny_corpus", os.path.join(SCRIPTS, "prepare_tiny_corpus.py"))
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    source = '''"""A module that draws trees with a turtle, one branch at a time, breadth first."""
import os


class Tree:
    """A tree of branches, each drawn by its own clone of the pen."""

    def grow(self, n):
        """Grow the tree by n levels, cloning the pen at every branching point of the tree.

        >>> Tree().grow(2)
        ... # the number of pens
        four pens now draw the tree
        """
        return os.sep * n


class Short:
    """Too short to keep."""


if os.sep:
    def prune(tree):
        """Prune every branch of the tree that has grown past the edge of the canvas."""
'''
    assert corpus.docstring_prose(source).split("\n\n") == [
        "A module that draws trees with a turtle, one branch at a time, breadth first.",
        "A tree of branches, each drawn by its own clone of the pen.",
        "Grow the tree by n levels, cloning the pen at every branching point of the tree.",
        "Prune every branch of the tree that has grown past the edge of the canvas."]
    assert corpus.docstring_prose("def broken(:\n") == ""
    out = tmp_path / "prose.jsonl"
    assert _run(["scripts/prepare_tiny_corpus.py", "--text", "docstrings", "--output", str(out),
                 "--max-mb", "0.2"]).returncode == 0
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(docs) > 5 and all(doc["path"].endswith(".py") for doc in docs)
    lines = [line for doc in docs for line in doc["text"].splitlines()]
    assert not any(line.lstrip().startswith(">>>") for line in lines)
    assert sum(line.startswith(("import ", "def ", "class ")) for line in lines) < 0.01 * len(lines)
    bad = _run(["scripts/prepare_tiny_corpus.py", "--text", "docstrings", "--docs", "--output", str(out)])
    assert bad.returncode != 0 and "leave out --docs" in bad.stderr
    run_dir = tmp_path / "parity"
    run_dir.mkdir()
    (run_dir / "corpus.jsonl").write_text(out.read_text())
    refused = subprocess.run(["bash", os.path.join(SCRIPTS, "loss_parity.sh")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, CORPUS="docstrings", RUN_DIR=str(run_dir)))
    assert refused.returncode == 2 and "not 'docstrings'" in refused.stderr
    (run_dir / "corpus.kind").write_text("docstrings\n")
    (run_dir / "data.settings").write_text("CORPUS_MB=80 VOCAB=8192\n")
    refused = subprocess.run(["bash", os.path.join(SCRIPTS, "loss_parity.sh")], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, CORPUS="docstrings", RUN_DIR=str(run_dir),
                                                             VOCAB="16384"))
    assert refused.returncode == 2 and "holds data built with CORPUS_MB=80 VOCAB=8192, not CORPUS_MB=80 VOCAB=16384" \
        in refused.stderr


def test_corpus_output_is_checked_first_and_no_partial_file_is_left(tmp_path, monkeypatch):
    """--output naming a folder built the whole corpus, then stopped with an IsADirectoryError and left <folder>.tmp;
    an interruption left the .tmp too."""
    import importlib.util

    result = _run(["scripts/prepare_tiny_corpus.py", "--output", str(tmp_path), "--max-mb", "0.05"])
    assert result.returncode == 2 and f"--output {tmp_path} is a folder: give a file name" in result.stderr
    assert not os.path.exists(f"{tmp_path}.tmp")
    monkeypatch.syspath_prepend(SCRIPTS)  # as when the script runs: the scripts' helpers beside it
    spec = importlib.util.spec_from_file_location("prepare_tiny_corpus",
                                                  os.path.join(SCRIPTS, "prepare_tiny_corpus.py"))
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)

    def interrupted(root, max_file_bytes, suffixes):
        yield root, corpus.__file__
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "python_sources", interrupted)
    with pytest.raises(KeyboardInterrupt):
        corpus.main(["--output", str(tmp_path / "corpus.jsonl")])
    assert os.listdir(tmp_path) == []


def test_the_vocabulary_check_reads_spans_over_the_whole_file(tmp_path, monkeypatch):
    """Beyond VOCAB_CHECK_TOKENS the check reads evenly spaced spans: another tokenizer's ids at the end of a large
    file (datasets concatenated) were never read when the check took the file's head alone."""
    from types import SimpleNamespace

    from megatron_int8.training import data

    monkeypatch.setattr(data, "VOCAB_CHECK_TOKENS", 64)
    monkeypatch.setattr(data, "VOCAB_CHECK_SPANS", 4)
    tokens = np.random.default_rng(0).integers(0, 300, 1000).astype(np.uint16)
    tokens[-1] = 999  # in the last span
    tokens.tofile(tmp_path / "d.bin")
    index = SimpleNamespace(index=SimpleNamespace(dtype=np.uint16))
    with pytest.raises(ArgumentError, match="contains token id 999 but the tokenizer has 300 tokens"):
        data._check_token_ids(str(tmp_path / "d"), index, 300)
    tokens[-1] = 5
    tokens.tofile(tmp_path / "d.bin")
    data._check_token_ids(str(tmp_path / "d"), index, 300)


PARITY_TRAINER_STUB = """#!{python}
import json, os, sys
if sys.argv[1:3] == ["-m", "megatron_int8.pretrain"]:  # a run: its command recorded and a log of one step written
    with open(os.environ["COMMANDS"], "a") as f:
        f.write(" ".join(sys.argv[3:]) + "\\n")
    with open(sys.argv[sys.argv.index("--log-jsonl") + 1], "w") as f:
        f.write(json.dumps({{"iteration": 1, "lm_loss": 3.0}}) + "\\n")
elif sys.argv[1:2] == ["-"] or sys.argv[1:2] == ["scripts/plot_loss.py"]:  # the flags' checks, the summary
    os.execv(sys.executable, [sys.executable] + sys.argv[1:])
else:  # the data's steps: recorded, not run
    with open(os.environ["COMMANDS"], "a") as f:
        f.write(" ".join(sys.argv[1:]) + "\\n")
    sys.exit(1)
"""


def _loss_parity(tmp_path, run_dir, **env):
    """scripts/loss_parity.sh with its Python behind a stub that trains nothing (each run's command recorded, its log
    one step) and builds no data: (the result, the commands the runs and the data steps were given)."""
    stub = tmp_path / "python"
    stub.write_text(PARITY_TRAINER_STUB.format(python=sys.executable))
    stub.chmod(0o755)
    commands = tmp_path / "commands"
    result = subprocess.run(["bash", os.path.join(SCRIPTS, "loss_parity.sh")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHON=str(stub), COMMANDS=str(commands),
                                                             RUN_DIR=str(run_dir), **env))
    return result, commands.read_text().splitlines() if commands.exists() else []


@pytest.fixture
def parity_run_dir(dataset, tmp_path):
    """A loss_parity.sh RUN_DIR with the data built (this module's dataset and tokenizer): next come the runs."""
    import shutil

    run_dir = tmp_path / "parity"
    (run_dir / "tokenizer").mkdir(parents=True)
    (run_dir / "data").mkdir()
    shutil.copy(dataset["tokenizer"], run_dir / "tokenizer" / "spm.model")
    for suffix in (".bin", ".idx"):
        shutil.copy(dataset["prefix"] + suffix, run_dir / "data" / f"corpus_text_document{suffix}")
    (run_dir / "corpus.jsonl").write_text(json.dumps({"text": CODE}) + "\n")
    (run_dir / "corpus.kind").write_text("source\n")
    (run_dir / "data.settings").write_text("CORPUS_MB=80 VOCAB=8192\n")
    return run_dir


@pytest.mark.parametrize("env, message", [
    ({"VARIANTS": "bf16 int8_rows"}, "unknown variant 'int8_rows' in VARIANTS"),
    ({"INT8_FLAGS": "--int8-granularity rows"},
     "error: variant int8: argument --int8-granularity: invalid choice: 'rows' (choose from 'tensor', 'row', "),
    ({"PARALLEL": "yes"}, "PARALLEL must be 0 (the variants one after another) or 1 (all at once), got 'yes'"),
], ids=["unknown-variant", "int8-flag-value", "parallel"])
def test_loss_parity_refuses_bad_settings_before_it_builds_data(tmp_path, env, message):
    """Once: an unknown variant was named after the corpus, tokenizer and dataset were built."""
    result, commands = _loss_parity(tmp_path, tmp_path / "parity", **env)
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr
    assert commands == [] and not (tmp_path / "parity").exists()


@pytest.mark.parametrize("flags, message", [
    ("--int8-bf16-gemms fprop,dgrad,wgrad", "--int8-bf16-gemms fprop,dgrad,wgrad leaves no INT8 GEMM"),
    ("--int8-auto-fallback", "--int8-auto-fallback decides from the statistics: it needs --int8-stats-interval N"),
], ids=["recipe", "validation"])
def test_loss_parity_checks_every_run_before_the_first_trains(parity_run_dir, tmp_path, flags, message):
    """A flag the trainer refuses in one variant's command: once found when that run started, after the BF16 run
    trained (2000 iterations)."""
    result, commands = _loss_parity(tmp_path, parity_run_dir, INT8_FLAGS=flags)
    assert result.returncode == 2 and f"error: variant int8: {message}" in result.stderr, result.stderr
    assert commands == []


@pytest.mark.parametrize("parallel, caches", [("0", ["cache", "cache"]), ("1", ["cache_bf16", "cache_int8"])])
def test_loss_parity_parallel_is_0_or_1(parity_run_dir, tmp_path, parallel, caches):
    """PARALLEL=0 once ran the variants at once (any value did): each at once run has its own index cache."""
    result, commands = _loss_parity(tmp_path, parity_run_dir, PARALLEL=parallel)
    assert result.returncode == 0, result.stdout + result.stderr
    used = sorted(command.split("--data-cache-path ")[1].split()[0] for command in commands)
    assert used == [str(parity_run_dir / "data" / cache) for cache in caches]
    assert (parity_run_dir / "summary.md").is_file()


def test_loss_parity_help_prints_its_header_and_does_nothing_else(tmp_path):
    """--help went to the trainer's parser inside the flag check, whose usage went to /dev/null: an IndexError."""
    result = subprocess.run(["bash", os.path.join(SCRIPTS, "loss_parity.sh"), "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=dict(os.environ, RUN_DIR=str(tmp_path / "help_run")))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("INT8 vs BF16 loss parity in one command") and "Variants: bf16;" in result.stdout
    assert "set -euo" not in result.stdout and not (tmp_path / "help_run").exists()
