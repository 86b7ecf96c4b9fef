"""Tokenizer, datasets and resumable data iterators, built on megatron-core's dataset stack.

Everything that can be checked cheaply is checked before megatron-core builds its index caches:
missing .bin/.idx files, token ids beyond the tokenizer's vocabulary, and splits that would get no
tokens (megatron-core's GPTDataset then loops forever computing its epoch count).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .errors import ArgumentError

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
SPLIT_NAMES = ("train", "validation", "test")
VOCAB_CHECK_TOKENS = 1 << 24  # token ids read per data file for the vocabulary check, in VOCAB_CHECK_SPANS spans
VOCAB_CHECK_SPANS = 8  # spread over the file: a concatenation of datasets shows another tokenizer's part too
INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron-core's .idx: header, version <Q, dtype code <B, 2 counts <Q
INDEX_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron's DType codes -> bytes per token


def _tokenizer_kind(path: str) -> Tuple[str, str]:
    """What a --tokenizer-model path holds: ("hf", tokenizer.json path), ("spm", .model path),
    ("jsonl", path) for a JSON-lines file (a corpus, not a tokenizer), or ("unknown", why)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return "hf", os.path.join(path, "tokenizer.json")
        models = sorted(name for name in os.listdir(path) if name.endswith(".model"))
        if models:
            return "spm", os.path.join(path, models[0])
        return "unknown", "a directory with neither a tokenizer.json nor a SentencePiece .model"
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if not head.lstrip().startswith(b"{"):
        return "spm", path  # SentencePiece models are binary protobufs: the SentencePiece loader judges them
    if path.endswith(".jsonl") or b"}\n{" in head.replace(b"\r", b""):
        return "jsonl", path
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        return "unknown", f"a file starting with '{{' that is not valid JSON ({err})"
    if isinstance(content, dict) and "model" in content:
        return "hf", path
    return "unknown", "a JSON file without the \"model\" of a Hugging Face tokenizer.json"


def check_tokenizer_file(kind: str, path: str) -> str:
    """The file a --tokenizer-type reads from `path` (a directory gives its tokenizer file); a path of the other
    family, a directory or a corpus fails here, naming the flags that would read it."""
    found, where = _tokenizer_kind(path)
    if found == "jsonl":
        raise ArgumentError(f"--tokenizer-model {path} is a JSON-lines file (a corpus?), not a tokenizer: give the "
                            "SentencePiece .model (or tokenizer.json) that scripts/preprocess_data.py used or made")
    if found == "unknown":
        raise ArgumentError(f"--tokenizer-model {path}: {where}; give a SentencePiece .model, or a Hugging Face "
                            "tokenizer.json or its directory")
    if kind in SENTENCEPIECE_TYPES and found == "hf":
        held = "" if where == path else f", holding {where}"
        raise ArgumentError(f"--tokenizer-model {path} is a Hugging Face tokenizer (tokenizer.json{held}), not a "
                            "SentencePiece model: pass --tokenizer-type HuggingFaceTokenizer")
    if kind in SENTENCEPIECE_TYPES and where != path:
        raise ArgumentError(f"--tokenizer-model {path} is a directory; give the SentencePiece model in it: "
                            f"--tokenizer-model {where}")
    if kind == "HuggingFaceTokenizer" and found == "spm":
        raise ArgumentError(f"--tokenizer-model {path} is not a Hugging Face tokenizer.json (or a directory holding "
                            f"one); for the SentencePiece model {where} pass --tokenizer-type SentencePieceTokenizer "
                            f"--tokenizer-model {where}")
    return where


def hf_eod_token(directory: str, eod_token: Optional[str]) -> Optional[str]:
    """The end-of-document token of a Hugging Face tokenizer directory: --eod-token, else the eos_token of its
    tokenizer_config.json, else of its special_tokens_map.json (where transformers looks too; a string, or a
    dict with "content"); None if none names one. The trainer, scripts/preprocess_data.py and the export agree
    through it."""
    if eod_token:
        return eod_token
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if eos:
                return eos.get("content") if isinstance(eos, dict) else eos
    return None


def build_tokenizer(args):
    """A MegatronTokenizer for --tokenizer-type; checks --vocab-size against it when both are given."""
    from megatron.core.tokenizers import MegatronTokenizer

    from ..megatron.compat import null_tokenizer_metadata

    kind = args.tokenizer_type
    if kind == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path=null_tokenizer_metadata(),
                                                 vocab_size=args.vocab_size)
    check_tokenizer_file(kind, args.tokenizer_model)
    if kind in SENTENCEPIECE_TYPES:
        try:
            tokenizer = MegatronTokenizer.from_pretrained(
                tokenizer_path=args.tokenizer_model, metadata_path={"library": "sentencepiece", "model_type": "gpt"})
        except RuntimeError as err:
            raise ArgumentError(f"--tokenizer-model {args.tokenizer_model}: not a SentencePiece model ({err})") from None
    elif kind == "HuggingFaceTokenizer":
        try:
            import transformers  # noqa: F401  (megatron's HuggingFaceTokenizer wraps AutoTokenizer)
        except ImportError:
            raise ArgumentError("--tokenizer-type HuggingFaceTokenizer needs the `transformers` package "
                                "(pip install transformers)") from None
        path = args.tokenizer_model
        directory = os.path.dirname(path) if os.path.isfile(path) else path
        tokenizer = MegatronTokenizer.from_pretrained(
            tokenizer_path=directory, metadata_path={"library": "huggingface", "model_type": "gpt"}, use_fast=True)
        _settle_hf_eod(tokenizer, directory, getattr(args, "eod_token", None))
    else:
        raise ArgumentError(f"unsupported --tokenizer-type {kind}")
    if args.vocab_size is not None and tokenizer.vocab_size != args.vocab_size:
        raise ArgumentError(f"tokenizer/vocab mismatch: {args.tokenizer_model} has {tokenizer.vocab_size} tokens "
                            f"but --vocab-size is {args.vocab_size}; fix --vocab-size or use the matching tokenizer")
    return tokenizer


def _settle_hf_eod(tokenizer, directory: str, eod_token: Optional[str]) -> None:
    """megatron's GPTDataset appends the tokenizer's EOS id: a tokenizer.json alone names none (megatron then
    fails deep inside with a TypeError). Take it from --eod-token or tokenizer_config.json, or say so."""
    wrapper = tokenizer._tokenizer  # megatron's HuggingFaceTokenizer, around transformers' AutoTokenizer
    hf = wrapper.tokenizer
    name = hf_eod_token(directory, eod_token) or hf.eos_token
    if name is None:
        raise ArgumentError(f"{directory}: the tokenizer names no end-of-document (EOS) token, which the trainer puts "
                            "between documents: pass --eod-token TOKEN (e.g. '<|endoftext|>'), or add \"eos_token\" "
                            "to its tokenizer_config.json")
    if name not in hf.get_vocab():
        source = "--eod-token" if eod_token else f"{directory}/tokenizer_config.json"
        raise ArgumentError(f"end-of-document token {name!r} (from {source}) is not a token of {directory}")
    wrapper.eos_token = hf.eos_token = name


def _check_indexed_files(prefix: str) -> None:
    """The .idx must be whole and describe this .bin: a truncated, empty or other dataset's index fails
    here, naming the files, instead of in megatron-core (a struct error, or silently wrong tokens)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    remake = "recreate both files with scripts/preprocess_data.py"
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(len(INDEX_HEADER) + 8 + 1 + 8 + 8)
    if len(head) < len(INDEX_HEADER) + 25 or not head.startswith(INDEX_HEADER):
        what = "empty" if size == 0 else "truncated" if INDEX_HEADER.startswith(head[:9]) else "not a megatron index"
        raise ArgumentError(f"{idx} is {what} ({size} bytes): {remake}")
    offset = len(INDEX_HEADER)
    _version, code, sequences, documents = struct.unpack_from("<QBQQ", head, offset)
    if code not in INDEX_DTYPE_SIZES:
        raise ArgumentError(f"{idx}: unknown token dtype code {code}: {remake}")
    expected = len(head) + sequences * (4 + 8) + documents * 8
    if size != expected:
        raise ArgumentError(f"{idx} is {'truncated' if size < expected else 'longer than its header says'}: its "
                            f"header lists {sequences} sequences, which take {expected} bytes, and the file has "
                            f"{size}: {remake}")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=len(head), shape=(sequences,))
    tokens = int(np.sum(lengths, dtype=np.int64))
    token_bytes = tokens * INDEX_DTYPE_SIZES[code]
    if os.path.getsize(bin_) != token_bytes:
        raise ArgumentError(f"{bin_} does not match {idx}: the index describes {tokens} tokens ({token_bytes} bytes) "
                            f"and the .bin has {os.path.getsize(bin_)} bytes; the two files come from different "
                            f"preprocessing runs (or one was cut short): {remake}")


def data_prefixes(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """(prefixes, weights or None) from --data-path, as megatron-core's get_blend_from_list reads it; a blend's
    weights must be positive (megatron-core asserts so when it builds the blend)."""
    from megatron.core.datasets.utils import get_blend_from_list

    try:
        prefixes, weights = get_blend_from_list(list(data_path))
    except (ValueError, AssertionError) as err:
        raise ArgumentError(f"--data-path {' '.join(data_path)}: {err}") from None
    if weights is not None and not all(w > 0 for w in weights):
        raise ArgumentError(f"--data-path {' '.join(data_path)}: a blend's weights must be positive, got "
                            f"{', '.join(f'{w:g}' for w in weights)}: leave out the prefixes not to train on")
    if weights is not None and not all(math.isfinite(w) for w in weights):  # megatron-core asserted on it later
        raise ArgumentError(f"--data-path {' '.join(data_path)}: a blend's weights must be finite, got "
                            f"{', '.join(f'{w:g}' for w in weights)}: each prefix's share is its weight over their sum")
    return list(prefixes), (list(weights) if weights is not None else None)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def split_shares(split: str) -> list:
    """'98,2,0' and '98, 2' and '49,1,0' alike: megatron's normalized train/validation/test proportions, rounded
    so that equal proportions compare equal; ArgumentError for what megatron would misread (a sign or an exponent,
    which its parser drops) or fail on (more than three weights, a sum of 0)."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    plain = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)(\s*[,/]\s*(\d+\.?\d*|\.\d+))*\s*", split)
    try:  # megatron's parser reads the digits of anything else (1e3 as 1, 3; -2 as 2)
        with np.errstate(divide="ignore", invalid="ignore"):  # a sum of 0: NaN shares, refused below
            shares = parse_and_normalize_split(split) if plain else []
    except (ValueError, AssertionError):
        shares = []
    if len(shares) != 3 or not all(math.isfinite(v) for v in shares):
        raise ArgumentError(f"--split {split!r}: expected up to three non-negative weights with a positive sum "
                            "(train, validation, test), in digits and a point, e.g. '98,2,0'")
    return [round(v, 9) for v in shares]


def check_data(args, tokenizer, sizes: Sequence[Optional[int]]) -> None:
    """Fail early on missing files, out-of-vocabulary token ids and splits left without tokens."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, weights = data_prefixes(args.data_path)
    for prefix in prefixes:
        if prefix.endswith((".bin", ".idx")):
            raise ArgumentError(f"--data-path {prefix}: give the prefix of the .bin/.idx pair, without the "
                                f"extension: --data-path {prefix[:-4]}")
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            weight = (f"; {prefix} reads as a weight: a blend is pairs of a weight and a prefix, and --data-path has "
                      f"{len(args.data_path)} values" if _is_number(prefix) else "")
            raise ArgumentError(f"missing data file(s) {', '.join(missing)} (from --data-path); "
                                f"create them with scripts/preprocess_data.py{weight}")
        _check_indexed_files(prefix)
    shares = split_shares(args.split)
    if args.eval_iters > 0 and shares[1] == 0 and not getattr(args, "skip_train", False):
        raise ArgumentError(f"--split {args.split!r} gives the validation split no documents while --eval-iters "
                            f"{args.eval_iters} asks for evaluation: give it a share (e.g. '98,2,0'), or "
                            "--eval-iters 0")
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))
    # megatron-core builds every split with a share of a blend without weights (each at one epoch), and fails on
    # one that is empty in any of its datasets: those are checked whether or not this run reads them
    every_split = weights is None and len(prefixes) > 1
    for index, prefix in enumerate(prefixes):
        dataset = IndexedDataset(prefix, mmap=True)
        lengths = dataset.sequence_lengths
        for split, bookends in enumerate(split_matrix):
            if bookends is None or not (sizes[split] or every_split):
                continue
            begin, end = (int(round(b * float(len(lengths)))) for b in bookends)
            if int(np.sum(lengths[begin:end], dtype=np.int64)) == 0:
                raise ArgumentError(
                    f"the {SPLIT_NAMES[split]} split of {prefix} is empty: --split {args.split!r} gives it "
                    f"documents [{begin}, {end}) of {len(lengths)} (megatron-core would loop forever on it). "
                    "Use more documents, or a --split that gives this split at least one document or a share of 0"
                    + (" (or --eval-iters 0)" if split == 1 and weights is None else ""))
        _check_token_ids(prefix, dataset, tokenizer.vocab_size)
        _check_index_caches(prefix, args.data_cache_path)


def _dataset_paths(description) -> Iterator[str]:
    """The "dataset_path" values of a megatron-core cache description (a GPTDataset's, or a blend's nested ones)."""
    if isinstance(description, dict):
        if isinstance(description.get("dataset_path"), str):
            yield description["dataset_path"]
        for value in description.values():
            yield from _dataset_paths(value)
    elif isinstance(description, list):
        for value in description:
            yield from _dataset_paths(value)


def _check_index_caches(prefix: str, cache_path: Optional[str]) -> None:
    """megatron-core keys its cached sample indices by the dataset's path, not its contents: a cache built before
    the .bin/.idx pair was written again (preprocess_data.py --force) would be reused and read other samples, or
    indices past the new documents. Such cache files are named, to be deleted."""
    cache = cache_path or os.path.join(prefix, "cache", "GPTDataset_indices")  # megatron-core's default
    if not os.path.isdir(cache):
        return
    written = max(os.path.getmtime(prefix + ext) for ext in (".bin", ".idx"))
    stale = []
    for name in sorted(os.listdir(cache)):
        if not name.endswith("-description.txt"):
            continue
        path = os.path.join(cache, name)
        try:
            with open(path, encoding="utf-8") as f:
                paths = set(_dataset_paths(json.load(f)))
        except (OSError, ValueError):
            continue  # not megatron's; it would not be read as one either
        if prefix in paths and os.path.getmtime(path) < written:  # megatron's key holds the path as given
            stale.append(os.path.join(cache, name[:-len("description.txt")] + "*"))
    if stale:
        raise ArgumentError(f"{prefix}.bin/.idx were written (or copied without their times) after the index cache "
                            f"built from them ({', '.join(stale)}; megatron-core would reuse it and read other "
                            "samples): delete those files, or give another --data-cache-path")


def _check_token_ids(prefix: str, dataset, vocab_size: int) -> None:
    """Token ids must index the embedding: a larger id means data made with another tokenizer. Files beyond
    VOCAB_CHECK_TOKENS are read in VOCAB_CHECK_SPANS evenly spaced spans of that many tokens in all."""
    tokens = np.memmap(prefix + ".bin", dtype=dataset.index.dtype, mode="r")
    if tokens.size <= VOCAB_CHECK_TOKENS:
        spans = [tokens]
    else:
        length = VOCAB_CHECK_TOKENS // VOCAB_CHECK_SPANS
        starts = np.linspace(0, tokens.size - length, VOCAB_CHECK_SPANS).astype(np.int64)
        spans = [tokens[start:start + length] for start in starts]
    largest = max((int(span.max()) for span in spans if span.size), default=-1)
    if largest >= vocab_size:
        raise ArgumentError(f"tokenizer/vocab mismatch: {prefix}.bin contains token id {largest} but the "
                            f"tokenizer has {vocab_size} tokens; preprocess the data with this tokenizer")


def dataset_sizes(args) -> List[Optional[int]]:
    """Samples per split; None (build nothing extra) for the test split, which training never uses
    (--skip-train evaluates it, and builds no train split), and for validation without --eval-iters.
    Every evaluation scores the same first --eval-iters batches, and the validation split is requested at that
    size in training and with --skip-train alike: megatron-core's shuffle depends on the size requested (its
    epoch count), so that the two see the same batches. megatron-core needs a size for every split of a
    weighted blend: those unused splits then get one global batch."""
    evaluated = args.eval_iters * args.global_batch_size if args.eval_iters > 0 else None
    if getattr(args, "skip_train", False):
        sizes = [None, evaluated, evaluated]
    else:
        sizes = [args.train_iters * args.global_batch_size, evaluated, None]
    if not args.mock_data and data_prefixes(args.data_path)[1] is not None:
        sizes = [args.global_batch_size if size is None else size for size in sizes]
    return sizes


def build_datasets(args, tokenizer):
    """(train, valid, test) megatron-core datasets: GPTDataset/BlendedDataset over --data-path, or mock data.

    Call `check_data` first (before the model is built) for real data.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    sizes = dataset_sizes(args)
    config = GPTDatasetConfig(
        random_seed=args.data_seed,
        sequence_length=args.seq_length,
        blend=data_prefixes(args.data_path) if not args.mock_data else None,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask,
        mid_level_dataset_surplus=0.005,
    )
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    # Every rank builds (memory-mapped, cached on disk by the first rank): TP ranks then read the same
    # micro-batches without a broadcast.
    return tuple(BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build())


class PretrainingSampler:
    """Micro-batch indices for one data-parallel rank, starting after `consumed_samples`.

    Each global step takes the next micro x DP samples in order and gives this rank its slice, so a
    run resumed at `consumed_samples` with the same --train-iters sees exactly the samples the uninterrupted
    run would have. (A resume with another --train-iters requests another train-split size, and where that
    changes how many times megatron's GPTDataset repeats the corpus, its shuffle changes: docs/training.md.)
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, split: str = "train"):
        if total_samples < micro_batch_size * data_parallel_size:  # the loop below would never yield
            raise ArgumentError(f"the {split} split holds {total_samples} samples, fewer than one step reads "
                                f"({micro_batch_size} per micro-batch x {data_parallel_size} data-parallel ranks): "
                                "give it more documents (--split, or more data), or a smaller --micro-batch-size")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank_slice = slice(data_parallel_rank * micro_batch_size, (data_parallel_rank + 1) * micro_batch_size)
        self.step = micro_batch_size * data_parallel_size

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed_samples
        while True:  # cycle: validation re-reads its split; train is sized for --train-iters
            for first in range(start, self.total_samples - self.step + 1, self.step):
                yield list(range(first, first + self.step))[self.rank_slice]
            start = 0


def rank_sampler(dataset, consumed_samples: int, args, split: str) -> PretrainingSampler:
    """This data-parallel rank's PretrainingSampler over `dataset` (ArgumentError where the split is too small)."""
    from megatron.core import parallel_state

    return PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples % max(len(dataset), 1),
        micro_batch_size=args.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        split=split,
    )


def build_data_iterator(dataset, consumed_samples: int, args, split: str = "train") -> Optional[Iterator]:
    """An endless iterator of micro-batches (dicts of CPU tensors) for this data-parallel rank; ArgumentError where
    the `split`'s dataset holds fewer samples than one step reads."""
    if dataset is None:
        return None
    sampler = rank_sampler(dataset, consumed_samples, args, split)
    # Its own generator: creating the iterator must not draw from the global RNG, which a resumed run
    # restores before building iterators (stochastic rounding and dropout consume that RNG).
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.num_workers, pin_memory=torch.cuda.is_available(),
        persistent_workers=args.num_workers > 0, generator=torch.Generator().manual_seed(args.data_seed))
    return iter(loader)
