"""A checkpoint of this trainer as a Hugging Face transformers checkpoint (config.json, safetensors, tokenizer).

The model loads at one process whatever layout it was saved at (dist_checkpointing reshards TP/PP/EP), so the
conversion sees whole tensors. Llama-style models (RoPE, RMSNorm, SwiGLU, no biases) map to:

  LlamaForCausalLM    Llama2, Llama3.1 (rope_scaling "llama3": megatron's factors 8, 1, 4, 8192)
  Qwen3ForCausalLM    --qk-layernorm (per-head RMSNorm of queries and keys before RoPE)
  MixtralForCausalLM  --num-experts (softmax over the top-k router logits = Mixtral's renormalized top-k)

Tensors are written under the Hub's key names, which every transformers version reads. megatron's fused
projections split as: linear_qkv rows per query group [its query heads, one key head, one value head];
linear_fc1 rows [gate; up].

A bfloat16 export rounds every weight to 8 significant bits. For a MoE model that moves the router logits a
little (up to 1.5e-3 on the tiny test model, whose router logits reach 0.6), so a token whose k-th and (k+1)-th
router logits are that close (a near tie) can go to other experts than megatron sends it to, and its logits
differ by more than the rounding alone explains; export float32 where the routing must match token for token.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Dict

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportError(ValueError):
    """The checkpoint's model has no Hugging Face counterpart here; the message says what differs."""


def hf_architecture(args) -> str:
    """'llama', 'qwen3' or 'mixtral', or ExportError naming what does not fit."""
    unsupported = {
        f"--position-embedding-type {args.position_embedding_type}": args.position_embedding_type != "rope",
        f"--normalization {args.normalization}": args.normalization != "RMSNorm",
        "no --swiglu": not args.swiglu,
        "biases (no --disable-bias-linear)": args.add_bias_linear,
        f"--rotary-percent {args.rotary_percent}": args.rotary_percent != 1.0,
        "--qk-layernorm with --num-experts (Qwen3-MoE)": args.qk_layernorm and args.num_experts is not None,
        # megatron's sinkhorn router weighs the chosen experts by a softmax over all of them (a sigmoid at top-1),
        # Mixtral by a softmax over the chosen ones
        "--moe-router-load-balancing-type sinkhorn (its expert weights are not Mixtral's)":
            args.num_experts is not None and getattr(args, "moe_router_load_balancing_type", None) == "sinkhorn",
    }
    found = [what for what, applies in unsupported.items() if applies]
    if found:
        raise ExportError("export to Hugging Face covers Llama-, Qwen3- and Mixtral-style models (RoPE, RMSNorm, "
                          f"SwiGLU, no biases); this checkpoint has {', '.join(found)}")
    return "mixtral" if args.num_experts is not None else "qwen3" if args.qk_layernorm else "llama"


def hf_config(args, architecture: str, eos_id, bos_id, dtype: str) -> dict:
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "mixtral": "MixtralForCausalLM"}[architecture]],
        "model_type": architecture,
        "vocab_size": args.padded_vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.moe_ffn_hidden_size if architecture == "mixtral" else args.ffn_hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_query_groups,
        "head_dim": args.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_position_embeddings,
        "rms_norm_eps": args.norm_epsilon,
        "rope_theta": float(args.rotary_base),
        "rope_scaling": None,
        "tie_word_embeddings": not args.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if args.use_rope_scaling:  # megatron's _apply_scaling defaults
        config["rope_scaling"] = {"rope_type": "llama3", "factor": float(args.rope_scaling_factor),
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
    if architecture == "llama":
        config["mlp_bias"] = False
    if architecture == "qwen3":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.num_layers)
    if architecture == "mixtral":
        config.update(num_local_experts=args.num_experts, num_experts_per_tok=args.moe_router_topk,
                      router_aux_loss_coef=args.moe_aux_loss_coeff, sliding_window=None, output_router_logits=False)
    return config


def _split_qkv(weight: torch.Tensor, args):
    groups, head = args.num_query_groups, args.kv_channels
    per_group = args.num_attention_heads // groups
    w = weight.view(groups, per_group + 2, head, -1)
    return (w[:, :per_group].reshape(-1, w.shape[-1]), w[:, per_group].reshape(-1, w.shape[-1]),
            w[:, per_group + 1].reshape(-1, w.shape[-1]))


def hf_state_dict(megatron: Dict[str, torch.Tensor], args, architecture: str) -> Dict[str, torch.Tensor]:
    """megatron GPTModel tensors (one process's, i.e. whole) under the Hub's key names."""
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "model.norm.weight": megatron["decoder.final_layernorm.weight"]}
    if args.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = megatron["output_layer.weight"]
    for i in range(args.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = megatron[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = megatron[src + "pre_mlp_layernorm.weight"]
        q, k, v = _split_qkv(megatron[src + "self_attention.linear_qkv.weight"], args)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v,
                    dst + "self_attn.o_proj.weight": megatron[src + "self_attention.linear_proj.weight"]})
        if architecture == "qwen3":
            out[dst + "self_attn.q_norm.weight"] = megatron[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = megatron[src + "self_attention.k_layernorm.weight"]
        if architecture == "mixtral":
            out[dst + "block_sparse_moe.gate.weight"] = megatron[src + "mlp.router.weight"]
            for e in range(args.num_experts):
                expert = f"{src}mlp.experts.local_experts.{e}."
                gate, up = megatron[expert + "linear_fc1.weight"].chunk(2, dim=0)
                moe = f"{dst}block_sparse_moe.experts.{e}."
                out.update({moe + "w1.weight": gate, moe + "w3.weight": up,
                            moe + "w2.weight": megatron[expert + "linear_fc2.weight"]})
        else:
            gate, up = megatron[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                        dst + "mlp.down_proj.weight": megatron[src + "mlp.linear_fc2.weight"]})
    return out


# Texts whose ids the exported tokenizer must give as SentencePiece does: leading, trailing and repeated whitespace,
# tabs and newlines (user-defined symbols of this trainer's tokenizers), digits, bytes outside the vocabulary,
# special tokens' text
PROBE_TEXTS = ("def f(x):\n\tif x:\n        return x + 1   # spaces  kept\n", "    return x\n", "\tx = 1",
               " leading space", "trailing   ", "  ", " ", "\n", "\n\nx", "x\t\ty ", "a  b   c", "12345 x1y22",
               "é ü 漢字 🙂 \x00\x07", "<s> </s> <unk> text", "")


def encoding_differences(tokenizer, processor) -> list:
    """The PROBE_TEXTS a transformers tokenizer encodes to other ids than a SentencePieceProcessor, or decodes from
    SentencePiece's ids to other text."""
    return [text for text in PROBE_TEXTS
            if tokenizer(text, add_special_tokens=False)["input_ids"] != processor.encode(text)
            or tokenizer.decode(processor.encode(text)) != processor.decode(processor.encode(text))]


def _as_sentencepiece_encodes(converted, model_file: str):
    """transformers' conversion of a SentencePiece BPE model, with SentencePiece's handling of whitespace where the
    model is of the kind preprocess_data.py trains (identity normalization, a dummy prefix, whitespace kept, words
    split before each run of spaces, user-defined symbols such as "\n" and "\t"): the conversion prefixes each span
    between user-defined symbols, and no text that starts with whitespace, with "▁", where SentencePiece prefixes the
    text once. Other models are returned as converted (encoding_differences decides whether they pass)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    if not (trainer.model_type == trainer.BPE and norm.name == "identity" and norm.add_dummy_prefix
            and not norm.remove_extra_whitespaces and trainer.split_by_whitespace
            and not trainer.treat_whitespace_as_suffix and trainer.allow_whitespace_only_pieces):
        return converted
    space = "\u2581"
    spec = json.loads(converted.backend_tokenizer.to_str())
    user = [token["content"] for token in spec["added_tokens"] if not token["special"]]
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["special"]]  # the rest stay pieces
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": " "}, "content": space}, {"type": "Prepend", "prepend": space}]}
    patterns = (["|".join(re.escape(symbol) for symbol in user)] if user else []) + [f"{space}+[^{space}]*"]
    split = [{"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
             for pattern in patterns]
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": split}
    specials = {name: getattr(converted, name) for name in ("unk_token", "bos_token", "eos_token")}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   split_special_tokens=True, **specials)  # "<s>" in text is text to SentencePiece


def _save_tokenizer(args, output: str, write: bool = True):
    """The tokenizer in transformers' format: a SentencePiece model converted to tokenizer.json (transformers'
    Llama converter, rebuilt by _as_sentencepiece_encodes, which needs the protobuf package), a Hugging Face
    tokenizer copied. Returns the (eos, bos) ids; `write` False: only those."""
    from transformers import AutoTokenizer

    from .data import SENTENCEPIECE_TYPES, hf_eod_token

    if args.tokenizer_type in SENTENCEPIECE_TYPES and not write:
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model)
        return processor.eos_id(), processor.bos_id()
    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        with tempfile.TemporaryDirectory() as staging:
            shutil.copy(args.tokenizer_model, os.path.join(staging, "tokenizer.model"))
            with open(os.path.join(staging, "tokenizer_config.json"), "w") as f:
                # the trainer's data has no BOS (preprocess_data.py appends EOD only): neither has the export
                json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                           "legacy": False}, f)
            try:
                tokenizer = AutoTokenizer.from_pretrained(staging)
                tokenizer = _as_sentencepiece_encodes(tokenizer, args.tokenizer_model)
            except ImportError as err:  # transformers' own conversion on loading differs from SentencePiece
                raise ExportError(f"the tokenizer's conversion needs the protobuf package "
                                  f"({str(err).strip().splitlines()[0]}): pip install protobuf, or --no-tokenizer to "
                                  "export the model alone") from None
        import sentencepiece

        differ = encoding_differences(tokenizer, sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model))
        if differ:
            raise ExportError(f"transformers' conversion of {args.tokenizer_model} encodes {len(differ)} of "
                              f"{len(PROBE_TEXTS)} probe texts differently from SentencePiece (e.g. {differ[0]!r}): "
                              "the exported tokenizer would not be the one the model trained with; --no-tokenizer "
                              "exports the model alone (encode with that SentencePiece model)")
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        path = args.tokenizer_model
        directory = os.path.dirname(path) if os.path.isfile(path) else path
        tokenizer = AutoTokenizer.from_pretrained(directory)
        eod = hf_eod_token(directory, getattr(args, "eod_token", None))
        if eod is not None:
            tokenizer.eos_token = eod
    else:
        return None, None  # NullTokenizer: ids only
    if write:
        tokenizer.save_pretrained(output)
    return tokenizer.eos_token_id, tokenizer.bos_token_id


# The files transformers reads from a model folder: an export into a folder (--force) replaces the whole set, so that
# no file of an earlier export is read beside the new ones
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
            "pytorch_model.bin", "pytorch_model.bin.index.json") + TOKENIZER_FILES
STAGING_MARK = ".megatron_int8_export"  # in the staging folder while an export writes it


def _new_staging(output: str) -> str:
    """An empty staging folder `<output>.partial`: an earlier export's (it holds STAGING_MARK) is replaced, anything
    else there is refused rather than deleted."""
    staging = os.path.abspath(output).rstrip(os.sep) + ".partial"
    if os.path.lexists(staging):
        if not os.path.isfile(os.path.join(staging, STAGING_MARK)):
            raise ExportError(f"{staging} exists and is not an interrupted export's staging folder (the export writes "
                              "its files there first): move it, or export to another --output")
        shutil.rmtree(staging)
    os.makedirs(staging)
    open(os.path.join(staging, STAGING_MARK), "w").close()
    return staging


def _move_into(staging: str, output: str, log, tokenizer: bool = True) -> None:
    """The staged export's files into `output`, config.json last; the files of HF_FILES that this export did not
    write are removed from `output` first, as a loader would read them beside the new ones (an earlier export's
    tokenizer.json over a tokenizer.model); the tokenizer's files stay where this export writes none."""
    os.remove(os.path.join(staging, STAGING_MARK))
    os.makedirs(output, exist_ok=True)
    written = set(os.listdir(staging))
    managed = HF_FILES if tokenizer else tuple(name for name in HF_FILES if name not in TOKENIZER_FILES)
    stale = sorted(name for name in managed if name not in written and os.path.isfile(os.path.join(output, name)))
    for name in stale:
        os.remove(os.path.join(output, name))
    if stale:
        log(f"note: removed from {output} the earlier export's {', '.join(stale)}, which this export does not write")
    for name in sorted(written, key=lambda n: n == "config.json"):
        os.replace(os.path.join(staging, name), os.path.join(output, name))
    os.rmdir(staging)


def export_hf(load: str, output: str, dtype: str = "bfloat16", log=print, tokenizer_model=None,
              ckpt_step=None, tokenizer: bool = True) -> dict:
    """Write the checkpoint of iteration `ckpt_step` (default: the latest) under `load` to `output` as a
    transformers checkpoint; returns its config. What the export needs (the packages, an architecture
    transformers has) is checked before the weights are loaded; the files are written into a staging folder
    beside `output` and moved in when all are complete, so an interrupted export leaves no truncated file."""
    from .inference import inference_arguments

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    try:
        import safetensors  # noqa: F401  (the weights' file)
        import transformers  # noqa: F401  (the tokenizer's conversion)
    except ImportError as err:
        raise ExportError(f"the export needs safetensors and transformers ({err}): pip install -e \".[hf]\"") from None
    recorded = inference_arguments(load, int8=False, bf16=False, tokenizer_model=tokenizer_model, ckpt_step=ckpt_step)
    hf_architecture(recorded)  # an ExportError before the load where transformers has no such model
    staging = _new_staging(output)
    try:
        config = _write_export(load, output, staging, dtype, log, tokenizer_model, ckpt_step, tokenizer, recorded)
    except BaseException:  # nothing half-written stays beside the output
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return config


def _write_export(load, output, staging, dtype, log, tokenizer_model, ckpt_step, tokenizer, recorded) -> dict:
    """export_hf's writing, into `staging`, then moved into `output`."""
    from safetensors.torch import save_file

    from .inference import load_for_inference

    # the tokenizer first: a conversion that would encode differently stops the export before the weights load
    eos, bos = _save_tokenizer(recorded, staging, write=tokenizer)
    if getattr(recorded, "moe_expert_capacity_factor", None) is not None:
        log(f"note: trained with --moe-expert-capacity-factor {recorded.moe_expert_capacity_factor}: megatron drops "
            "the token-expert pairs over an expert's capacity (in evaluation too); the exported Mixtral routes every "
            "token, so its logits differ where megatron dropped")
    def load_log(message):  # the weights load without INT8 on purpose: its "not the checkpoint's" note is no news
        if not message.startswith("precision: this run's"):
            log(message)

    model, args, _ = load_for_inference(load, log=load_log, int8=False, bf16=False, tokenizer_model=tokenizer_model,
                                        ckpt_step=ckpt_step)
    architecture = hf_architecture(args)
    megatron = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_state_dict(megatron, args, architecture).items()}
    config = hf_config(args, architecture, eos, bos, dtype)
    save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(staging, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _move_into(staging, output, log, tokenizer)
    log(f"exported {config['architectures'][0]} ({sum(t.numel() for t in tensors.values()) / 1e6:.2f} M parameters, "
        f"{dtype}) from {load} (iteration {args.iteration}) to {output}")
    return config
