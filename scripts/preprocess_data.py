#!/usr/bin/env python3
"""Tokenize text into a Megatron indexed dataset (PREFIX_<key>_document.bin/.idx), appending EOD.

Input: JSONL files (.jsonl, .json or .ndjson, in any case: one document per line, text under --json-keys) or
plain-text files (any other name: one document per file), each named once. A file without a document that holds
more than whitespace (an empty file, a JSONL file of empty texts) is refused, even beside other files: it is most
likely the wrong file, and its documents would be written as end-of-document tokens alone. Tokenizers: a
SentencePiece model (Llama-2 style) or a Hugging Face `tokenizer.json` (Llama-3.1, Qwen3; needs the `tokenizers`
package). With --train-sentencepiece V, a SentencePiece BPE model of V tokens is first trained on the input and
written to --tokenizer-model; it keeps whitespace and newlines exactly (identity normalization, byte fallback), so
code stays code.

    python3 scripts/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok/spm.model [--train-sentencepiece 4096] --workers 4
"""
import argparse
import contextlib
import json
import multiprocessing
import os
import random
import sys
import threading
import time

import numpy as np

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # of a lower-cased name: corpus.JSONL is JSONL too
MIN_SENTENCEPIECE_VOCAB = 256 + 3 + 2  # byte fallback's 256, <unk> <s> </s>, "\n" "\t"; the corpus's characters more


class InputError(Exception):
    """Bad input, reported in one line. (An Exception, not SystemExit: raised inside a worker pool's task
    thread, SystemExit would end that thread silently and leave the pool waiting.)"""


def _utf8(data: bytes, where: str) -> str:
    """`data` decoded as UTF-8, or InputError naming `where` (never a replacement character in the dataset)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise InputError(f"{where}: not UTF-8 (byte {data[err.start]:#04x} at line {line} of it): convert it first, "
                         "e.g. iconv -f latin1 -t utf-8") from None


def read_documents(paths, json_keys):
    """(key, text) for every document of every input file: a JSONL line is an object whose --json-keys are strings,
    a plain-text file one document; every file UTF-8."""
    for path in paths:
        if path.lower().endswith(JSONL_SUFFIXES):
            with open(path, "rb") as f:
                for line_number, raw in enumerate(f, 1):
                    where = f"{path}:{line_number}"
                    line = _utf8(raw, where)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise InputError(f"{where}: not JSON: {err}") from None
                    if not isinstance(record, dict):
                        raise InputError(f"{where}: a JSON {type(record).__name__}, not an object with the "
                                         f"--json-keys {', '.join(map(repr, json_keys))}")
                    for key in json_keys:
                        if key not in record:
                            raise InputError(f"{where}: no key {key!r} (--json-keys)")
                        if not isinstance(record[key], str):
                            raise InputError(f"{where}: {key!r} holds a {type(record[key]).__name__}, not a string")
                        yield key, record[key]
        else:
            with open(path, "rb") as f:
                yield json_keys[0], _utf8(f.read(), path)


def files_without_documents(paths, json_keys) -> list:
    """The files of `paths` none of whose documents holds more than whitespace; each is read only up to its first
    such document."""
    return [path for path in paths if not any(text.strip() for _, text in read_documents([path], json_keys))]


def sample_lines(lines, count: int, seed: int = 1234) -> list:
    """A uniform sample of `count` lines (all of them if fewer), in input order: a reservoir sample drawn with
    Python's seeded generator. SentencePiece's own sampler (input_sentence_size) cannot be reproduced: from 0.2.3
    on it draws from abseil's generator, which salts every seed with per-process entropy, so the same corpus gave
    a different tokenizer in every process."""
    rng, sample = random.Random(seed), []
    for i, line in enumerate(lines):
        if i < count:
            sample.append((i, line))
        else:
            j = rng.randrange(i + 1)
            if j < count:
                sample[j] = (i, line)
    sample.sort(key=lambda item: item[0])
    return [line for _, line in sample]


def train_sentencepiece(paths, json_keys, model_path: str, vocab_size: int, sample: int = 2_000_000,
                        invalidates=()) -> None:
    """BPE over a sample of the input's lines (sample_lines: the same corpus gives the same tokenizer);
    whitespace-preserving so that decode(encode(code)) == code. Characters outside the 99.99% coverage become
    UTF-8 byte tokens (byte fallback): still lossless. The model is trained beside `model_path` and moved there
    once the files of `invalidates` (token ids of the model it replaces) are deleted: wherever the run stops, no
    new tokenizer is left beside old token ids."""
    import sentencepiece as spm

    def lines():
        for _, text in read_documents(paths, json_keys):
            for line in text.split("\n"):
                if line.strip():
                    yield line

    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    prefix = model_path[: -len(".model")] if model_path.endswith(".model") else model_path
    started = time.time()
    print(f"training a SentencePiece BPE tokenizer ({vocab_size} tokens) on {', '.join(paths)} ...", flush=True)
    chosen = sample_lines(lines(), sample)
    print(f"  on {len(chosen)} lines (a seeded sample of at most {sample})", flush=True)
    staged = prefix + ".partial"
    try:
        with heartbeat(f"  training the tokenizer on {len(chosen)} lines"):
            _train_bpe(spm, chosen, staged, vocab_size)
    except RuntimeError as err:  # e.g. a vocabulary smaller than the corpus's characters need
        raise InputError(f"--train-sentencepiece {vocab_size}: {str(err).strip().splitlines()[-1]}") from None
    for path in invalidates:
        if os.path.exists(path):
            os.remove(path)
    os.replace(staged + ".vocab", prefix + ".vocab")
    os.replace(staged + ".model", model_path)
    print(f"wrote {model_path} in {time.time() - started:.1f} s", flush=True)


@contextlib.contextmanager
def heartbeat(what: str, every_s: float = 30.0):
    """A line every `every_s` seconds while the body runs (SentencePiece's trainer prints nothing at minloglevel 2,
    and trains for minutes on a large corpus)."""
    done, started = threading.Event(), time.time()

    def beat():
        while not done.wait(every_s):
            print(f"{what}: {time.time() - started:.0f} s", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _train_bpe(spm, chosen, prefix, vocab_size):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(chosen), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_by_whitespace=True,
        allow_whitespace_only_pieces=True, byte_fallback=True, split_digits=True, character_coverage=0.9999,
        user_defined_symbols=["\n", "\t"], input_sentence_size=0, shuffle_input_sentence=False,
        max_sentence_length=16384, num_threads=os.cpu_count() or 1, minloglevel=2)


class Encoder:
    """Loaded once per worker process (tokenizers do not pickle)."""

    def __init__(self, tokenizer_type, tokenizer_model, eod_token):
        self.tokenizer_type, self.tokenizer_model, self.eod_token = tokenizer_type, tokenizer_model, eod_token

    def load(self):
        if self.tokenizer_type == "HuggingFaceTokenizer":
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise SystemExit("error: a Hugging Face tokenizer.json needs the `tokenizers` package "
                                 "(pip install tokenizers)")
            path = self.tokenizer_model
            if os.path.isdir(path):
                path = os.path.join(path, "tokenizer.json")
            tokenizer = Tokenizer.from_file(path)
            self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
            from megatron_int8.training.data import hf_eod_token

            name = hf_eod_token(os.path.dirname(path), self.eod_token)  # the trainer's rule
            if name is None:
                raise InputError(f"{path}: the tokenizer names no end-of-document (EOS) token: pass --eod-token TOKEN "
                                 "(e.g. '<|endoftext|>'), or add \"eos_token\" to its tokenizer_config.json")
            if tokenizer.token_to_id(name) is None:
                raise InputError(f"end-of-document token {name!r} is not a token of {path}")
            self.eod_name, self.eod = name, tokenizer.token_to_id(name)
            self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
        else:
            import sentencepiece as spm

            processor = spm.SentencePieceProcessor(model_file=self.tokenizer_model)
            self.vocab_size, self.eod = processor.vocab_size(), processor.eos_id()
            self.eod_name = processor.id_to_piece(self.eod)
            self._encode = processor.encode
        return self

    def encode(self, item):
        key, text = item
        ids = self._encode(text)
        ids.append(self.eod)
        return key, np.asarray(ids, dtype=np.int64), len(text.encode("utf-8"))


_worker_encoder = None


def _init_worker(encoder):
    global _worker_encoder
    _worker_encoder = encoder.load()


def _encode_in_worker(item):
    return _worker_encoder.encode(item)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL files (.jsonl, .json, .ndjson) or plain-text files (any other name), each "
                             "once and each with a document of more than whitespace")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL fields to tokenize")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx")
    parser.add_argument("--tokenizer-type", required=True,
                        choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                 "HuggingFaceTokenizer"])
    parser.add_argument("--tokenizer-model", required=True, help="SentencePiece .model, or tokenizer.json (or its dir)")
    parser.add_argument("--train-sentencepiece", type=int, metavar="VOCAB", default=None,
                        help="first train a SentencePiece model of VOCAB tokens on the input (to --tokenizer-model)")
    parser.add_argument("--sentencepiece-sample", type=int, metavar="LINES", default=2_000_000,
                        help="--train-sentencepiece trains on a seeded sample of this many of the input's non-empty "
                             "lines (default: %(default)s)")
    parser.add_argument("--eod-token", default=None, help="Hugging Face EOD token (default: the eos_token of "
                        "tokenizer_config.json, else of special_tokens_map.json, as the trainer takes it)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    parser.add_argument("--log-interval-s", type=float, default=2.0, help="seconds between progress lines")
    parser.add_argument("--force", action="store_true",
                        help="write over an existing PREFIX_<key>_document.bin/.idx, and with --train-sentencepiece "
                             "an existing --tokenizer-model (delete the index caches built from the data too: "
                             "megatron-core names them by path, not content; the trainer refuses stale ones)")
    args = parser.parse_args(argv)
    from megatron_int8.training.known_warnings import filter_known_warnings

    filter_known_warnings()  # megatron-core's import-time notes, as the trainer filters them
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    plain = [path for path in args.input if not path.lower().endswith(JSONL_SUFFIXES)]
    if plain and len(args.json_keys) > 1:  # a plain-text file's one document goes to the first key alone
        parser.error(f"--json-keys {' '.join(args.json_keys)} with plain-text input ({plain[0]}): its text would go "
                     f"to {args.json_keys[0]} alone and the other datasets would miss it; give one key, or JSONL")
    if args.eod_token is not None and args.tokenizer_type != "HuggingFaceTokenizer":
        parser.error(f"--eod-token {args.eod_token} applies to a Hugging Face tokenizer; a SentencePiece model's "
                     "end of document is its own EOS")
    if not os.path.basename(args.output_prefix):  # data/ would write data/_text_document.bin
        parser.error(f"--output-prefix {args.output_prefix} names a folder: add the files' name, e.g. "
                     f"{os.path.join(args.output_prefix, 'corpus')}")
    if len(set(args.json_keys)) != len(args.json_keys):
        parser.error(f"--json-keys {' '.join(args.json_keys)}: a key named twice would write its documents twice")
    first_named = {}  # real path -> its first spelling: ./c.jsonl and c.jsonl are one file
    for path in args.input:
        real = os.path.realpath(path)
        if real in first_named:
            first = first_named[real]
            parser.error(f"--input {path}{'' if path == first else f' is {first}'}: a file named twice would write "
                         "its documents twice, and the validation split would hold copies of training documents")
        first_named[real] = path
    try:
        return _run(parser, args)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _run(parser, args) -> int:
    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input {path}: no such file")
    # the .bin is renamed into place last: an .idx without it is an interrupted build, written over freely
    existing = [f"{args.output_prefix}_{key}_document.bin" for key in args.json_keys]
    existing = [path for path in existing if os.path.exists(path)]
    if existing and not args.force:
        parser.error(f"{existing[0]} exists: pass --force to write over it (and delete the index caches built from "
                     "it, e.g. --data-cache-path: megatron-core finds them by path and would reuse them), or choose "
                     "another --output-prefix")
    if args.train_sentencepiece is not None:
        if os.path.exists(args.tokenizer_model) and not args.force:
            parser.error(f"--tokenizer-model {args.tokenizer_model} exists and --train-sentencepiece would write over "
                         "it (the datasets made with it would then decode to other text): pass --force to, or "
                         "name another --tokenizer-model")
        if args.train_sentencepiece < MIN_SENTENCEPIECE_VOCAB:
            parser.error(f"--train-sentencepiece {args.train_sentencepiece}: at least {MIN_SENTENCEPIECE_VOCAB} "
                         "(byte fallback alone takes 256 entries), more for a corpus of many characters")
        if args.tokenizer_type == "HuggingFaceTokenizer":
            parser.error("--train-sentencepiece makes a SentencePiece model: use a SentencePiece --tokenizer-type")
        if args.sentencepiece_sample < 1:
            parser.error(f"--sentencepiece-sample must be at least 1, got {args.sentencepiece_sample}")
    elif not os.path.exists(args.tokenizer_model):
        parser.error(f"--tokenizer-model {args.tokenizer_model}: no such file (or pass --train-sentencepiece VOCAB)")
    empty = files_without_documents(args.input, args.json_keys)
    if empty:
        raise InputError(f"no documents in {', '.join(empty)} (empty, or whitespace only): leave "
                         f"{'it' if len(empty) == 1 else 'them'} out of --input")
    if args.train_sentencepiece is not None:
        # the datasets of the prefix hold the replaced tokenizer's ids (the .bin first: it marks a complete build)
        stale = [f"{args.output_prefix}_{key}_document{suffix}" for key in args.json_keys
                 for suffix in (".bin", ".idx")]
        train_sentencepiece(args.input, args.json_keys, args.tokenizer_model, args.train_sentencepiece,
                            args.sentencepiece_sample, invalidates=stale)

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_int8.training.args import ArgumentError
    from megatron_int8.training.data import check_tokenizer_file

    try:
        check_tokenizer_file(args.tokenizer_type, args.tokenizer_model)
    except ArgumentError as err:
        parser.error(str(err))
    encoder = Encoder(args.tokenizer_type, args.tokenizer_model, args.eod_token)
    local = Encoder(args.tokenizer_type, args.tokenizer_model, args.eod_token).load()
    dtype = DType.optimal_dtype(local.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    outputs = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(path + ".bin.tmp", dtype=dtype) for key, path in outputs.items()}
    print(f"tokenizing with {args.tokenizer_type} ({local.vocab_size} tokens, EOD {local.eod_name!r}={local.eod}), "
          f"{args.workers} worker(s)", flush=True)

    started = last = time.time()
    docs = tokens = nbytes = 0
    documents = read_documents(args.input, args.json_keys)
    if args.workers > 1:
        pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(encoder,))
        encoded = pool.imap(_encode_in_worker, documents, chunksize=16)
    else:
        pool, encoded = None, map(local.encode, documents)
    try:
        for key, ids, size in encoded:
            builders[key].add_document(ids, [len(ids)])
            docs, tokens, nbytes = docs + 1, tokens + len(ids), nbytes + size
            if time.time() - last >= args.log_interval_s:
                last = time.time()
                print(f"  {docs} documents, {tokens} tokens, {nbytes / 2**20:.1f} MB "
                      f"({nbytes / 2**20 / (last - started):.2f} MB/s)", flush=True)
    except BaseException:  # bad input or Ctrl-C: no worker left running, no partial file left behind
        if pool is not None:
            pool.terminate()
        for path in outputs.values():
            if os.path.exists(path + ".bin.tmp"):
                os.remove(path + ".bin.tmp")
        raise
    if pool is not None:
        pool.close()
        pool.join()
    for key, builder in builders.items():
        builder.finalize(outputs[key] + ".idx")
        os.replace(outputs[key] + ".bin.tmp", outputs[key] + ".bin")  # .bin appears only when complete
        print(f"wrote {outputs[key]}.bin/.idx", flush=True)
    print(f"done: {docs} documents, {tokens} tokens ({tokens / max(nbytes, 1):.3f} tokens/byte) in "
          f"{time.time() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
