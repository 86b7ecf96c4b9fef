"""The user's journey after training starts (issue #48), on CPU with tiny models: nothing lost on a mistaken
restart or an interrupt, checkpoint retention, evaluation (--skip-train), generation with a KV cache, export to
Hugging Face transformers (logits compared), and checkpoint loading that runs no code from the checkpoint."""
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from free_ports import launcher
from repo_paths import ROOT
from test_training import SMALL_MODEL, data, losses, train  # noqa: F401  (`data`: fixture)

pytestmark = pytest.mark.slow
ENV = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")


def trainer_argv(data, *flags):
    return [sys.executable, "-m", "megatron_int8.pretrain", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
            "--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"], "--data-cache-path", data["cache"],
            *SMALL_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", *flags]


def run_python(code: str, *argv, timeout=300, nproc=1):
    result = subprocess.run(launcher(nproc) + (["-c", code, *argv] if nproc == 1 else [code, *argv]), cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """Six INT8 iterations with validation and test splits; the checkpoint the later steps use."""
    save = tmp_path_factory.mktemp("trained") / "ckpt"
    out = train(data, "--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "4", "--split",
                "90,5,5", "--eval-interval", "6", "--int8-linear", "--save", str(save))
    return {"save": save, "out": out}


# ------------------------------------------------------------------------------------------- nothing lost


def test_restart_into_a_used_save_is_refused_and_resume_continues_the_log_with_retention(data, tmp_path):
    save = tmp_path / "ckpt"
    common = ["--save", str(save), "--save-interval", "1", "--eval-iters", "0"]
    subprocess.run(trainer_argv(data, "--train-iters", "4", "--most-recent-k", "2", *common), cwd=ROOT, env=ENV,
                   check=True, capture_output=True, timeout=300)
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt",
                                        "train_log.jsonl"]
    log_before = (save / "train_log.jsonl").read_text()
    for mistake in ([], ["--load", str(tmp_path / "typo")], ["--load", str(tmp_path)]):
        result = subprocess.run(trainer_argv(data, "--train-iters", "6", *common, *mistake), cwd=ROOT, env=ENV,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert (f"--load {tmp_path / 'typo'}: no such directory" in result.stderr if "typo" in str(mistake) else
                "already holds checkpoints (latest: iteration 4)" in result.stderr
                and f"To continue that run: --load {save}" in result.stderr), result.stderr
    assert (save / "train_log.jsonl").read_text() == log_before and (save / "iter_0000004").is_dir()
    # Resumed: the log continues, and retention keeps the 2 latest plus multiples of --save-retain-interval.
    out = train(data, "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "7", "--load",
                str(save), "--most-recent-k", "2", "--save-retain-interval", "2", *common)
    assert "loaded checkpoint" in out and "removed iteration(s) 3" in out
    assert sorted(losses(save / "train_log.jsonl")) == list(range(1, 8))
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000004", "iter_0000006", "iter_0000007"]


def _started(log_path, iterations=2, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(log_path) and len(losses(log_path)) >= iterations:
            return
        time.sleep(0.2)
    raise AssertionError("training did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_exit_signal_handler_saves_and_exits_with_one_line(data, tmp_path, sig):
    save = tmp_path / "ckpt"
    process = subprocess.Popen(trainer_argv(data, "--train-iters", "10000", "--eval-iters", "0", "--save", str(save),
                                            "--exit-signal-handler"),
                               cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _started(save / "train_log.jsonl")
        process.send_signal(sig)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err[-3000:]
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and max(losses(save / "train_log.jsonl")) == saved
    assert f"{sig.name} received: stopped after iteration {saved} of 10000, checkpoint saved to {save}; " \
           f"resume with --load {save}" in out
    assert "Traceback" not in err


def test_ctrl_c_without_the_handler_ends_in_one_line(data, tmp_path):
    save = tmp_path / "ckpt"
    process = subprocess.Popen(trainer_argv(data, "--train-iters", "10000", "--eval-iters", "0", "--save", str(save),
                                            "--save-interval", "1"),
                               cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _started(save / "train_log.jsonl", iterations=3)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted after iteration "), err[-3000:]
    assert f"resume with --load {save}" in lines[0] and "--exit-signal-handler" in lines[0]


def test_run_tiny_resumes_when_run_again(data, tmp_path):
    run_dir = tmp_path / "tiny"
    (run_dir / "tokenizer").mkdir(parents=True)
    (run_dir / "data").mkdir()
    (run_dir / "corpus.jsonl").write_text("{}\n")  # present: the script reuses what it finds
    shutil.copy(data["tokenizer"], run_dir / "tokenizer" / "spm.model")
    for ext in (".bin", ".idx"):
        shutil.copy(data["prefix"] + ext, run_dir / "data" / f"stdlib_text_document{ext}")
    small = [*SMALL_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0"]
    for iterations in ("3", "5"):
        result = subprocess.run(["bash", "scripts/run_tiny.sh", *small, "--train-iters", iterations], cwd=ROOT,
                                env=dict(ENV, RUN_DIR=str(run_dir)), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loaded checkpoint" in result.stdout and "(iteration 3," in result.stdout
    assert sorted(losses(run_dir / "train_log.jsonl")) == [1, 2, 3, 4, 5]


def test_run_tiny_both_trains_int8_and_bf16_apart_and_plots_both(data, tmp_path):
    """PRECISION=both: an INT8 run in RUN_DIR, a BF16 run in RUN_DIR/bf16 (never resuming the other's
    checkpoints), and one chart of both curves; an unknown PRECISION is refused before any work."""
    run_dir = tmp_path / "tiny"
    (run_dir / "tokenizer").mkdir(parents=True)
    (run_dir / "data").mkdir()
    (run_dir / "corpus.jsonl").write_text("{}\n")
    shutil.copy(data["tokenizer"], run_dir / "tokenizer" / "spm.model")
    for ext in (".bin", ".idx"):
        shutil.copy(data["prefix"] + ext, run_dir / "data" / f"stdlib_text_document{ext}")
    small = [*SMALL_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
             "--train-iters", "3"]
    bad = subprocess.run(["bash", "scripts/run_tiny.sh"], cwd=ROOT, env=dict(ENV, RUN_DIR=str(run_dir),
                         PRECISION="fp8"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected int8, bf16 or both" in bad.stderr
    result = subprocess.run(["bash", "scripts/run_tiny.sh", *small], cwd=ROOT,
                            env=dict(ENV, RUN_DIR=str(run_dir), PRECISION="both"), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    int8, bf16 = losses(run_dir / "train_log.jsonl"), losses(run_dir / "bf16" / "train_log.jsonl")
    assert sorted(int8) == sorted(bf16) == [1, 2, 3] and int8 != bf16  # two runs, not one resumed
    assert " int8 int8[" in result.stdout and (run_dir / "bf16" / "checkpoints").is_dir()
    assert (run_dir / "loss_both.png").stat().st_size > 0


# ------------------------------------------------------------------------------------- evaluate, generate


def test_skip_train_evaluates_validation_and_test(data, trained):
    out = subprocess.run(trainer_argv(data, "--split", "90,5,5", "--int8-linear", "--skip-train", "--load",
                                      str(trained["save"])),
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    valid = [line for line in out.stdout.splitlines() if line.startswith(" validation loss at iteration 6")]
    test = [line for line in out.stdout.splitlines() if line.startswith(" test loss at iteration 6")]
    assert len(valid) == 1 and len(test) == 1 and "lm loss PPL:" in test[0]
    # the same batches the training run evaluated at its last iteration: the same loss
    trained_loss = losses(trained["save"] / "train_log.jsonl", "valid_lm_loss")[6]
    assert f"lm loss: {trained_loss:.6E}" in valid[0]
    loss = float(test[0].split("lm loss: ")[1].split()[0])
    ppl = float(test[0].split("lm loss PPL: ")[1])
    assert 0 < loss < 10 and abs(ppl - math.exp(loss)) <= 1e-5 * ppl
    assert not (trained["save"] / "iter_0000007").exists()


GENERATE_CHECK = textwrap.dedent('''
    import json, sys
    from megatron_int8.training.cpu import install_cpu_optimizer_support
    install_cpu_optimizer_support()
    import torch
    from megatron_int8.training.inference import _next_token, generate, load_for_inference
    model, args, tokenizer = load_for_inference(sys.argv[1], int8=sys.argv[2] == "int8", log=lambda m: None)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    # megatron's layers fork this stream at construction: on a GPU, building without it fails
    assert "model-parallel-rng" in get_cuda_rng_tracker().get_states()
    prompt = tokenizer.tokenize("def main(args):\\n    ")
    results = {"int8": args.int8_linear}
    for temperature, top_p in ((0.0, 1.0), (1.0, 0.9)):
        cached = generate(model, prompt, 12, temperature=temperature, top_p=top_p, vocab_size=tokenizer.vocab_size,
                          seed=3)
        # the same sampler over a full forward pass of the whole sequence at every step (no cache)
        generator, sequence = torch.Generator().manual_seed(3), list(prompt)
        with torch.no_grad():
            for _ in range(12):
                logits = model(torch.tensor([sequence]), torch.arange(len(sequence)).unsqueeze(0), None,
                               runtime_gather_output=True)[:, -1, :tokenizer.vocab_size]
                sequence.append(int(_next_token(logits, temperature, top_p, generator)))
        results[f"{temperature}"] = [cached, sequence[len(prompt):]]
    print("RESULT " + json.dumps(results))
''')


@pytest.mark.parametrize("linears", ["int8", "bf16"])
def test_generate_with_the_kv_cache_equals_full_recomputation(trained, linears):
    out = run_python(GENERATE_CHECK, str(trained["save"]), linears)
    results = json.loads(out.split("RESULT ")[1])
    assert results["int8"] == (linears == "int8")
    for key in ("0.0", "1.0"):
        cached, full = results[key]
        assert len(cached) == 12 and cached == full, (key, cached, full)
    assert results["0.0"][0] != results["1.0"][0]  # top-p sampling is not greedy


def test_generate_script_prints_the_continuation(trained):
    result = subprocess.run([sys.executable, "scripts/generate.py", "--load", str(trained["save"]), "--prompt",
                             "import os\n", "--max-new-tokens", "8", "--temperature", "0.7", "--top-p", "0.9"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("import os\n") and len(result.stdout) > len("import os\n") + 1
    assert "tokens, iteration 6, INT8 linears, temperature 0.7, top-p 0.9]" in result.stderr


def test_loading_for_inference_tears_its_process_group_down_at_exit(trained):
    """generate.py and export_hf.py end with no process group left (NCCL warned of leaked resources at exit): the
    handler registered first runs last, after load_for_inference's, and sees none."""
    code = textwrap.dedent("""
        import atexit, sys, torch
        atexit.register(lambda: print(f"AT EXIT initialized={torch.distributed.is_initialized()}", flush=True))
        from megatron_int8.training.cpu import install_cpu_optimizer_support
        install_cpu_optimizer_support()
        from megatron_int8.training.inference import load_for_inference
        load_for_inference(sys.argv[1], log=lambda m: None)
        print(f"LOADED initialized={torch.distributed.is_initialized()}", flush=True)
    """)
    out = run_python(code, str(trained["save"]))
    assert "LOADED initialized=True" in out and "AT EXIT initialized=False" in out, out[-2000:]


def test_export_script_of_an_int8_checkpoint_prints_no_precision_note(trained, tmp_path):
    """The export reads the weights without INT8 on purpose; the load's "precision: this run's INT8 off ..., not the
    checkpoint's" line read like a problem."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    result = subprocess.run([sys.executable, "scripts/export_hf.py", "--load", str(trained["save"]), "--output",
                             str(tmp_path / "hf")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exported LlamaForCausalLM" in result.stdout and "precision:" not in result.stdout + result.stderr


def test_a_missing_tokenizer_model_given_is_named_as_the_users(trained, tmp_path):
    """generate.py / export_hf.py --tokenizer-model of a missing file said "the checkpoint's tokenizer ... is not
    here", as if the checkpoint had recorded that path."""
    from megatron_int8.training.checkpoint import CheckpointError
    from megatron_int8.training.inference import inference_arguments

    missing = str(tmp_path / "spm.model")
    with pytest.raises(CheckpointError, match=f"^--tokenizer-model {missing}: no such file$"):
        inference_arguments(str(trained["save"]), tokenizer_model=missing)
    assert os.path.exists(inference_arguments(str(trained["save"])).tokenizer_model)  # the checkpoint's own


# ------------------------------------------------------------------------------------------------ export

EXPORT_CHECK = textwrap.dedent('''
    import json, sys
    from megatron_int8.training.cpu import install_cpu_optimizer_support
    install_cpu_optimizer_support()
    import torch
    from transformers import AutoModelForCausalLM
    from megatron_int8.training.export import export_hf
    from megatron_int8.training.inference import load_for_inference
    load, output = sys.argv[1], sys.argv[2]
    results = {}
    model, args, tokenizer = load_for_inference(load, int8=False, bf16=False, log=lambda m: None)
    torch.manual_seed(0)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 40))
    routers = [layer.mlp.router for layer in model.decoder.layers] if args.num_experts else []
    routed = []  # each MoE layer's router (input, logits), tokens in transformers' (batch, sequence) order

    def capturing(gating):
        def wrapped(x):
            logits = gating(x)
            routed.append(tuple(t.detach().transpose(0, 1).flatten(0, 1).double() for t in (x, logits)))
            return logits
        return wrapped

    for router in routers:
        router.gating = capturing(router.gating)

    def forward():
        routed.clear()
        with torch.no_grad():
            return model(ids, torch.arange(40).expand(2, 40), None, runtime_gather_output=True).double(), list(routed)

    reference, reference_routing = forward()
    exact_router_weights = [router.weight.detach().double().clone() for router in routers]
    with torch.no_grad():  # the weights as the bf16 export stores them; the arithmetic stays fp32
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    rounded, rounded_routing = forward()
    # Near ties: tokens whose top-k experts the bf16 rounding of the weights can change. A router logit l = W x
    # moves by at most |W - W_bf| |x| + |W_bf| |x_bf - x| <= 2^-8 |W| |x| + |W_bf| |x_bf - x| (bf16 keeps 8
    # significant bits; x_bf: the router's input computed with rounded weights), so a chosen expert a and an
    # unchosen c can swap only where l_a - l_c <= bound_a + bound_c.
    near_tie = torch.zeros(ids.numel(), dtype=torch.bool)
    k = args.moe_router_topk
    for (x, logits), (x_bf, _), router, weight in zip(reference_routing, rounded_routing, routers,
                                                      exact_router_weights):
        bound = 2.0 ** -8 * x.abs() @ weight.abs().T + (x_bf - x).abs() @ router.weight.double().abs().T
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(k).indices, True)
        margin = logits.masked_fill(~chosen, float("inf")).amin(1) - logits.masked_fill(chosen, -float("inf")).amax(1)
        near_tie |= margin <= bound.masked_fill(~chosen, 0).amax(1) + bound.masked_fill(chosen, 0).amax(1)
    for dtype in ("float32", "bfloat16"):
        config = export_hf(load, f"{output}/{dtype}", dtype, log=lambda m: None)
        hf = AutoModelForCausalLM.from_pretrained(f"{output}/{dtype}", dtype=torch.float32).eval()
        with torch.no_grad():
            out = hf(ids, **({"output_router_logits": True} if routers else {}))
        logits = out.logits.double()
        rerouted = torch.zeros(ids.numel(), dtype=torch.bool)
        for (_, expected), got in zip(reference_routing, out.router_logits if routers else ()):
            rerouted |= (expected.topk(k).indices.sort(1).values != got.topk(k).indices.sort(1).values).any(1)
        token_error = (logits - reference).abs().amax(-1).flatten()
        compared = ~near_tie if dtype == "bfloat16" else torch.ones_like(near_tie)
        same_weights = rounded if dtype == "bfloat16" else reference
        results[dtype] = {"architecture": config["architectures"][0], "class": type(hf).__name__,
                          "error": token_error[compared].max().item(), "scale": reference.abs().max().item(),
                          "same_weights_error": (logits - same_weights).abs().max().item(),
                          "rerouted": rerouted.nonzero().flatten().tolist(),
                          "near_ties": near_tie.nonzero().flatten().tolist(), "tokens": ids.numel()}
    prompt = ids[:1, :8]
    with torch.no_grad():
        hf_new = hf.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 8:].tolist()
    results["hf_generate"] = hf_new
    print("RESULT " + json.dumps(results))
''')


def _needs_transformers(tokenizer=False):
    for module in ("transformers", "safetensors") + (("google.protobuf",) if tokenizer else ()):
        pytest.importorskip(module)


def _check_export(results, architecture):
    fp32, bf16 = results["float32"], results["bfloat16"]
    assert fp32["architecture"] == fp32["class"] == architecture
    # fp32 weights: the same arithmetic up to summation order, on every token
    assert fp32["error"] <= 1e-4 * fp32["scale"] and not fp32["rerouted"], results
    # bf16 weights: megatron computing with the same rounded weights gives the same logits, on every token
    assert bf16["same_weights_error"] <= 1e-4 * fp32["scale"], results
    # against the exact weights: each weight rounded by up to 2^-8 relative; logits move by a few such steps,
    # where the routing is the same (a near tie that flips sends a token through other experts)
    assert bf16["error"] <= 0.05 * fp32["scale"], results
    assert bf16["error"] > fp32["error"]
    # only near ties change experts, and they are a minority: the bound is ~0.01 against a median margin ~0.07
    # between the k-th and (k+1)-th router logit of the tiny MoE, about a tenth of the tokens per MoE layer
    assert set(bf16["rerouted"]) <= set(bf16["near_ties"]) and len(bf16["near_ties"]) <= bf16["tokens"] // 3, results
    assert len(results["hf_generate"]) == 6


def test_export_llama_loads_in_transformers_with_the_same_logits_and_tokenizer(data, trained, tmp_path):
    _needs_transformers(tokenizer=True)
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run_python(EXPORT_CHECK, str(trained["save"]), str(tmp_path))
    _check_export(json.loads(out.split("RESULT ")[1]), "LlamaForCausalLM")
    assert not list(tmp_path.glob("*.partial"))  # the staging folders moved in whole
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "bfloat16")
    processor = spm.SentencePieceProcessor(model_file=data["tokenizer"])
    text = "def f(x):\n\tif x:\n        return x + 1   # spaces  kept\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == processor.encode(text) == tokenizer(text)["input_ids"]  # no BOS, as the trainer's data
    assert tokenizer.decode(ids) == text
    # text that starts with whitespace or a tab once got other ids than the trainer's ("    return x": a piece of 4
    # spaces, not 5), and "<s>" in text became the BOS id
    from megatron_int8.training.export import PROBE_TEXTS, encoding_differences

    assert encoding_differences(tokenizer, processor) == [] and "    return x\n" in PROBE_TEXTS
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16")
    prompt = tokenizer("import os\n", return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=True, top_p=0.9)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(generated[0]).startswith("import os\n")


@pytest.mark.parametrize("architecture, flags, nproc", [
    ("Qwen3ForCausalLM", ["--qk-layernorm", "--use-rope-scaling", "--pipeline-model-parallel-size", "2"], 2),
    ("MixtralForCausalLM", ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                            "--moe-grouped-gemm"], 2),
])
def test_export_qwen3_and_mixtral_from_parallel_layouts(data, tmp_path, architecture, flags, nproc):
    _needs_transformers()
    save = tmp_path / "ckpt"
    train(data, "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
          "--int8-linear", "--save", str(save), *flags, nproc=nproc)
    out = run_python(EXPORT_CHECK, str(save), str(tmp_path / "hf"))
    _check_export(json.loads(out.split("RESULT ")[1]), architecture)


# ------------------------------------------------------------------------------------------- safe loading


class _Planted:
    """Unpickling it would create a marker file: the proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_checkpoint_files_load_weights_only_and_planted_objects_are_refused(trained, tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_int8.training.checkpoint import latest_checkpoint_dir
    from megatron_int8.training.safe_load import (UnsafeCheckpointError, check_dcp_metadata, load_tensors_file,
                                                  weights_only_loading)

    directory = latest_checkpoint_dir(str(trained["save"]))
    state = load_tensors_file(os.path.join(directory, "rng", "rank_00000.pt"))  # no numpy arrays needed
    assert state["numpy"]["keys"].dtype == torch.int64 and state["numpy"]["keys"].numel() == 624
    # the common state (common.pt in megatron-core 0.16, inside the shards in 0.19) loads weights-only
    with weights_only_loading(directory):
        common = dist_checkpointing.load_common_state_dict(directory)
    assert type(common["args"]).__name__ == "Namespace" and common["args"].num_layers == 2
    assert common["args"].int8_linear is True and common["checkpoint_version"] == 3.0
    check_dcp_metadata(directory)

    marker = tmp_path / "code_ran"
    planted = tmp_path / "rank_00000.pt"
    torch.save({**state, "numpy": _Planted(marker)}, planted)
    with pytest.raises(UnsafeCheckpointError, match="rank_00000.pt holds an object outside the allowlist"):
        load_tensors_file(str(planted), allow_numpy_arrays=True)
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / ".metadata", "wb") as f:
        pickle.dump({"state_dict_metadata": _Planted(marker)}, f)
    with pytest.raises(UnsafeCheckpointError, match="refers to _?io.open, which is not a checkpoint record type"):
        check_dcp_metadata(str(tmp_path / "ckpt"))
    assert not marker.exists()


def test_resume_refuses_a_planted_rng_file(data, trained, tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(trained["save"], save)
    marker = tmp_path / "code_ran"
    rng = save / "iter_0000006" / "rng" / "rank_00000.pt"
    torch.save({"random": _Planted(marker)}, rng)
    result = subprocess.run(trainer_argv(data, "--split", "90,5,5", "--train-iters", "7", "--int8-linear", "--load",
                                         str(save), "--save", str(save)),
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"error: {rng} holds an object outside the allowlist" in result.stderr
    assert not marker.exists() and not (save / "iter_0000007").exists()
