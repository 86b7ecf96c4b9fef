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


def _save_tokenizer(args, output: str, log):
    """The tokenizer in transformers' format: a SentencePiece model converted to tokenizer.json (transformers'
    Llama converter, which needs the protobuf package; without it the model is copied as tokenizer.model,
    which transformers converts when it loads it, where protobuf is installed), a Hugging Face tokenizer
    copied. Returns the (eos, bos) ids."""
    from transformers import AutoTokenizer

    from .data import SENTENCEPIECE_TYPES, hf_eod_token

    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        with tempfile.TemporaryDirectory() as staging:
            shutil.copy(args.tokenizer_model, os.path.join(staging, "tokenizer.model"))
            with open(os.path.join(staging, "tokenizer_config.json"), "w") as f:
                # the trainer's data has no BOS (preprocess_data.py appends EOD only): neither has the export
                json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                           "legacy": False}, f)
            try:
                tokenizer = AutoTokenizer.from_pretrained(staging)
            except ImportError as err:
                import sentencepiece

                processor = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model)
                for name in ("tokenizer.model", "tokenizer_config.json"):
                    shutil.copy(os.path.join(staging, name), os.path.join(output, name))
                log(f"note: tokenizer.json not written ({str(err).strip().splitlines()[0]}); tokenizer.model copied, "
                    "which transformers converts on loading where protobuf is installed")
                return processor.eos_id(), processor.bos_id()
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        path = args.tokenizer_model
        directory = os.path.dirname(path) if os.path.isfile(path) else path
        tokenizer = AutoTokenizer.from_pretrained(directory)
        eod = hf_eod_token(directory, getattr(args, "eod_token", None))
        if eod is not None:
            tokenizer.eos_token = eod
    else:
        return None, None  # NullTokenizer: ids only
    tokenizer.save_pretrained(output)
    return tokenizer.eos_token_id, tokenizer.bos_token_id


def export_hf(load: str, output: str, dtype: str = "bfloat16", log=print, tokenizer_model=None,
              ckpt_step=None) -> dict:
    """Write the checkpoint of iteration `ckpt_step` (default: the latest) under `load` to `output` as a
    transformers checkpoint; returns its config. What the export needs (the packages, an architecture
    transformers has) is checked before the weights are loaded; the files are written into a staging folder
    beside `output` and moved in when all are complete, so an interrupted export leaves no truncated file."""
    from .inference import inference_arguments, load_for_inference

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    try:
        from safetensors.torch import save_file
        import transformers  # noqa: F401  (the tokenizer's conversion)
    except ImportError as err:
        raise ExportError(f"the export needs safetensors and transformers ({err}): pip install -e \".[hf]\"") from None
    recorded = inference_arguments(load, int8=False, bf16=False, tokenizer_model=tokenizer_model, ckpt_step=ckpt_step)
    hf_architecture(recorded)  # an ExportError before the load where transformers has no such model
    model, args, _ = load_for_inference(load, log=log, int8=False, bf16=False, tokenizer_model=tokenizer_model,
                                        ckpt_step=ckpt_step)
    architecture = hf_architecture(args)
    megatron = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf_state_dict(megatron, args, architecture).items()}
    staging = os.path.abspath(output).rstrip(os.sep) + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    eos, bos = _save_tokenizer(args, staging, log)
    config = hf_config(args, architecture, eos, bos, dtype)
    save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(staging, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.makedirs(output, exist_ok=True)
    for name in sorted(os.listdir(staging), key=lambda n: n == "config.json"):  # config.json last
        os.replace(os.path.join(staging, name), os.path.join(output, name))
    os.rmdir(staging)
    log(f"exported {config['architectures'][0]} ({sum(t.numel() for t in tensors.values()) / 1e6:.2f} M parameters, "
        f"{dtype}) from {load} (iteration {args.iteration}) to {output}")
    return config
