"""End-to-end pretraining on CPU through the real entry point (subprocesses, as a user runs it):
loss goes down with INT8 and BF16, an interrupted-and-resumed run equals the uninterrupted one
(distributed optimizer, 2 data-parallel ranks), and an INT8 checkpoint resumes with INT8 off."""
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from free_ports import launcher
from repo_paths import ROOT

pytestmark = pytest.mark.slow
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
               "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
               "--lr-warmup-iters", "2", "--log-interval", "2", "--eval-iters", "2", "--num-workers", "0"]


def _run(argv, timeout=300, gpu=False, stderr=False):
    """The command's stdout (then its stderr too, where `stderr`), after asserting that it succeeded."""
    # CPU tests stay on the CPU (gloo) on GPU machines too; tests/test_training_gpu.py uses the GPUs.
    env = dict(os.environ, PYTHONWARNINGS="ignore", **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""}))
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(argv)}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}"
    return result.stdout + (result.stderr if stderr else "")


def train(data, *flags, nproc=1, gpu=False, stderr=False):
    trainer = ["-m", "megatron_int8.pretrain", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
               "--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"], "--data-cache-path", data["cache"]]
    return _run(launcher(nproc) + trainer + SMALL_MODEL + list(flags), gpu=gpu, stderr=stderr)


def losses(log_path, key="lm_loss"):
    with open(log_path) as f:
        return {r["iteration"]: r[key] for r in map(json.loads, f) if key in r}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small SentencePiece tokenizer and indexed dataset from the standard library's sources."""
    root = tmp_path_factory.mktemp("tiny_data")
    corpus = root / "corpus.jsonl"
    _run([sys.executable, "scripts/prepare_tiny_corpus.py", "--output", str(corpus), "--max-mb", "1.5"])
    _run([sys.executable, "scripts/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(root / "stdlib"),
          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(root / "spm.model"),
          "--train-sentencepiece", "512"])
    return {"prefix": str(root / "stdlib_text_document"), "tokenizer": str(root / "spm.model"),
            "cache": str(root / "cache"), "root": root}


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_tiny_pretraining_loss_decreases(data, tmp_path, precision):
    # BF16 also reads a weighted blend (megatron's BlendedDataset) of the corpus with itself.
    flags = ["--int8-linear"] if precision == "int8" else ["--bf16", "--data-path", "0.6", data["prefix"], "0.4",
                                                           data["prefix"]]
    out = train(data, "--train-iters", "30", "--micro-batch-size", "4", "--global-batch-size", "8",
                "--eval-interval", "15", "--save", str(tmp_path), *flags)
    curve = losses(tmp_path / "train_log.jsonl")
    assert sorted(curve) == list(range(1, 31))
    first, last = curve[1], sum(curve[i] for i in range(27, 31)) / 4
    assert last < first - 1.0, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert len(losses(tmp_path / "train_log.jsonl", "valid_lm_loss")) == 2
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert (tmp_path / "iter_0000030" / "rng" / "rank_00000.pt").exists()
    assert "INT8 precision table" in out and (" int8 int8[" in out) == (precision == "int8")
    assert "lm loss:" in out and "TFLOP/s/GPU" in out and "validation loss at iteration 15" in out
    # on CPU the peak is the process's RSS; what stays between steps is a GPU allocator figure
    assert losses(tmp_path / "train_log.jsonl", "peak_memory_gb")[30] > 0.05
    assert losses(tmp_path / "train_log.jsonl", "memory_between_steps_gb")[30] is None


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_wgrad_fusion_without_apex_equals_unfused(data, tmp_path, precision):
    """Without APEX the trainer fuses the wgrad into main_grad for the layers' linears, INT8 (their GEMM adds
    into it) and BF16 (an addmm into main_grad), and leaves megatron's output layer to DDP. On CPU in fp32
    both routes add the same fp32 product into main_grad, once per micro-batch: the losses must be bitwise
    equal to the unfused run."""
    common = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0"]
    common += ["--int8-linear"] if precision == "int8" else []
    fused, unfused = tmp_path / "fused", tmp_path / "unfused"
    out = train(data, *common, "--save", str(fused))
    assert "gradient accumulation fusion on for the transformer layers' linears" in out
    out = train(data, *common, "--save", str(unfused), "--no-gradient-accumulation-fusion")
    assert "gradient accumulation fusion" not in out
    assert sorted(losses(fused / "train_log.jsonl")) == [1, 2, 3, 4]
    assert losses(fused / "train_log.jsonl") == losses(unfused / "train_log.jsonl")


def test_tp_comm_overlap_trains_exactly_like_unpipelined(data, tmp_path):
    """--tp-comm-overlap (TP 2 + SP) only reorders the communication: the INT8 GEMMs see the same operands,
    and a sum of two partials is the same in either order, so the losses must be bitwise equal."""
    common = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
              "--int8-linear", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    plain, pipelined = tmp_path / "plain", tmp_path / "pipelined"
    train(data, *common, "--save", str(plain), nproc=2)
    out = train(data, *common, "--save", str(pipelined), "--tp-comm-overlap", nproc=2)
    assert "tp-comm-overlap: sequence-parallel all-gathers and reduce-scatters pipelined" in out
    assert sorted(losses(plain / "train_log.jsonl")) == [1, 2, 3, 4]
    assert losses(pipelined / "train_log.jsonl") == losses(plain / "train_log.jsonl")


def test_cross_entropy_loss_fusion_matches_unfused(data, tmp_path):
    """--cross-entropy-loss-fusion (the default on GPUs with --bf16) computes the same losses as megatron's
    unfused cross entropy; both round the logit gradients to bf16 once, and the fp32 sums may run in another
    order. On CPU the default is unfused."""
    common = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0",
              "--int8-linear", "--bf16"]
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    out = train(data, *common, "--save", str(plain))
    assert "cross entropy fused" not in out
    out = train(data, *common, "--save", str(fused), "--cross-entropy-loss-fusion")
    assert "note: cross entropy fused (megatron's native" in out
    want, got = losses(plain / "train_log.jsonl"), losses(fused / "train_log.jsonl")
    assert sorted(got) == [1, 2, 3]
    for i in want:
        assert abs(got[i] - want[i]) <= 1e-5 * want[i], (i, got[i], want[i])


def test_configure_torch_adam_survives_a_checkpoint_of_the_other_kind():
    """Loading an optimizer state restores the saver's param groups: configure_torch_adam sets this run's
    implementation again, both ways, and moves the restored `step` counters (here fp64) to where that
    implementation reads them, as fp32, before the run's first step."""
    import types

    import torch

    from megatron_int8.training.model import configure_torch_adam

    def megatron_like(fused):
        param = torch.nn.Parameter(torch.randn(8))
        adam = torch.optim.AdamW([param], lr=0.1)
        wrapper = types.SimpleNamespace(optimizer=adam)
        assert configure_torch_adam(wrapper, fused=fused) == fused  # a fresh foreach group changes only to fused
        return param, adam, wrapper

    param, adam, wrapper = megatron_like(fused=True)
    param.grad = torch.randn(8)
    adam.step()
    saved_fused = adam.state_dict()
    assert saved_fused["param_groups"][0]["fused"] is True

    _, foreach_adam, foreach_run = megatron_like(fused=False)
    foreach_adam.load_state_dict(saved_fused)
    assert foreach_adam.param_groups[0]["fused"] is True  # what torch restores
    assert configure_torch_adam(foreach_run, fused=False)
    assert foreach_adam.param_groups[0]["fused"] is None and foreach_adam.param_groups[0]["foreach"] is None
    assert not configure_torch_adam(foreach_run, fused=False)  # idempotent

    param2, fused_adam, fused_run = megatron_like(fused=True)
    foreach_state = torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))], lr=0.1).state_dict()
    fused_adam.load_state_dict(foreach_state)
    fused_adam.state[param2].update(step=torch.tensor(3.0, dtype=torch.float64), exp_avg=torch.zeros(8),
                                    exp_avg_sq=torch.zeros(8))  # as checkpoint.py restores them
    assert fused_adam.param_groups[0]["fused"] is None
    assert configure_torch_adam(fused_run, fused=True)
    assert fused_adam.param_groups[0]["fused"] is True and fused_adam.param_groups[0]["foreach"] is False
    assert fused_adam.state[param2]["step"].dtype == torch.float32
    param2.grad = torch.randn(8)
    fused_adam.step()
    assert fused_adam.state[param2]["step"].dtype == torch.float32 and float(fused_adam.state[param2]["step"]) == 4


def test_fused_adam_trains_like_foreach_and_resumes_a_foreach_checkpoint(data, tmp_path):
    """--fused-adam (torch's fused AdamW where megatron falls back to torch's): the same losses as the
    foreach default within fp32 rounding (on CPU they agree bitwise), and it resumes a foreach run's distributed-optimizer checkpoint
    (2 DP ranks; restored per-parameter steps) on the same trajectory."""
    common = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0",
              "--use-distributed-optimizer", "--int8-linear"]
    foreach, fused, resumed = tmp_path / "foreach", tmp_path / "fused", tmp_path / "resumed"
    out = train(data, *common, "--save", str(foreach), nproc=2)
    assert "--fused-adam" not in out
    out = train(data, *common, "--save", str(fused), "--fused-adam", nproc=2)
    assert "optimizer: torch's fused Adam kernels (--no-fused-adam for foreach)" in out
    train(data, *common, "--save", str(resumed), "--exit-interval", "2", nproc=2)
    out = train(data, *common, "--save", str(resumed), "--load", str(resumed), "--fused-adam", nproc=2)
    # loading restores the saved (foreach) param groups; the run must switch them back to fused
    assert "loaded checkpoint" in out
    assert "the loaded Adam param groups set back to this run's implementation (fused)" in out
    reference = losses(foreach / "train_log.jsonl")
    assert sorted(reference) == [1, 2, 3, 4]
    for run in (fused, resumed):
        got = losses(run / "train_log.jsonl")
        assert sorted(got) == [1, 2, 3, 4]
        for i in reference:
            assert abs(got[i] - reference[i]) <= 1e-5 * reference[i], (run.name, i, got[i], reference[i])


def test_profile_writes_a_trace_and_leaves_training_unchanged(data, tmp_path):
    """--profile records iterations 2-3 on rank 0 of a 2-process run: a trace and a summary appear, the log
    names the window (on CPU there is no GPU activity to report), and the losses equal an unprofiled run's."""
    common = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0",
              "--int8-linear"]
    plain, profiled, traces = tmp_path / "plain", tmp_path / "profiled", tmp_path / "traces"
    train(data, *common, "--save", str(plain), nproc=2)
    out = train(data, *common, "--save", str(profiled), "--profile", "--profile-step-start", "2",
                "--profile-step-end", "4", "--profile-dir", str(traces), nproc=2)
    assert "profile, rank 0, iterations 2-3: " in out and "no GPU activity recorded" in out
    assert "profile, rank 1" not in out
    summary = (traces / "rank0_iters2-3.summary.txt").read_text()
    assert "By own host (CPU) time" in summary and "_Int8LinearFunction" in summary
    assert (traces / "rank0_iters2-3.trace.json").stat().st_size > 0
    assert sorted(os.listdir(traces)) == ["rank0_iters2-3.summary.txt", "rank0_iters2-3.trace.json"]
    assert losses(profiled / "train_log.jsonl") == losses(plain / "train_log.jsonl")


def test_gc_pauses_count_collections():
    from megatron_int8.training.metrics import GcPauses

    pauses = GcPauses()
    try:
        pauses.take()
        gc.collect()
        gc.collect()
        count, seconds = pauses.take()
        assert count >= 2 and seconds > 0  # automatic collections may add to the two
        gc.disable()
        try:
            assert pauses.take() == (0, 0.0)
        finally:
            gc.enable()
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks


@pytest.mark.parametrize("flags, message", [
    (["--manual-gc-interval", "2"], "--manual-gc-interval needs --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0, got -1"),
])
def test_manual_gc_arguments_are_checked(flags, message):
    _expect_argument_error(flags, message)


@pytest.mark.parametrize("flags, message", [
    (["--cross-entropy-loss-fusion"], "--cross-entropy-loss-fusion needs --bf16"),
    (["--fused-adam", "--optimizer", "sgd"], "--fused-adam needs --optimizer adam"),
    (["--tp-comm-overlap"], "--tp-comm-overlap needs --sequence-parallel"),
])
def test_fusion_and_overlap_arguments_are_checked(flags, message):
    _expect_argument_error(flags, message)


@pytest.mark.parametrize("flags, message", [
    (["--cuda-graph-warmup-steps", "0"], "--cuda-graph-warmup-steps must be >= 1"),
    (["--num-experts", "4"], "MoE layers"),
    (["--int8-linear", "--int8-grad-rounding", "stochastic"], "stochastic draws its seeds on the host"),
    (["--int8-linear", "--int8-check-finite", "immediate"], "immediate synchronizes with the host"),
])
def test_cuda_graph_arguments_reject_what_a_replayed_step_cannot_do(flags, message):
    _expect_argument_error(["--cuda-graph-impl", "local", *flags], message)


def test_graphed_runs_turn_off_the_device_sync_after_pipeline_exchanges():
    """megatron synchronizes the device after each batched P2P exchange unless told otherwise; a captured
    pipeline step cannot contain that sync (tests/test_training_gpu.py runs PP 2 graphed on GPUs)."""
    from megatron_int8.training.args import parse_args, transformer_config_from_args

    flags = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--pipeline-model-parallel-size", "2"]
    eager = transformer_config_from_args(parse_args(flags), use_cpu_initialization=True)
    graphed = transformer_config_from_args(parse_args(flags + ["--cuda-graph-impl", "local"]),
                                           use_cpu_initialization=True)
    assert eager.batch_p2p_comm and eager.batch_p2p_sync
    assert graphed.batch_p2p_comm and not graphed.batch_p2p_sync


def test_no_overlap_grad_reduce_turns_off_the_yaml_setting():
    from megatron_int8.training.args import parse_args

    config = os.path.join(ROOT, "configs", "llama2_13b.yaml")
    assert parse_args(["--config", config]).overlap_grad_reduce is True
    assert parse_args(["--config", config, "--no-overlap-grad-reduce"]).overlap_grad_reduce is False


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_graph_needs_a_gpu():
    _expect_argument_error(["--cuda-graph-impl", "local"], "it needs a CUDA GPU")


def test_fused_defaults_follow_the_device(monkeypatch):
    """No flag: fused AdamW with CUDA and Adam, foreach on CPU or with SGD; the flags override either way, and
    --fused-adam with SGD is an error rather than ignored. The fused cross entropy likewise: on with CUDA and
    --bf16 only."""
    import torch

    from megatron_int8.training.args import parse_args, validate_args

    def resolved(*flags):
        args = parse_args(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--mock-data", "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "512", *flags])
        return validate_args(args, world_size=1)

    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert resolved().fused_adam is cuda
        assert resolved("--optimizer", "sgd").fused_adam is False
        assert resolved("--no-fused-adam").fused_adam is False
        assert resolved("--fused-adam").fused_adam is True
        assert resolved("--bf16").cross_entropy_loss_fusion is cuda
        assert resolved().cross_entropy_loss_fusion is False  # tiny.yaml trains in fp32
        assert resolved("--bf16", "--no-cross-entropy-loss-fusion").cross_entropy_loss_fusion is False
    _expect_argument_error(["--fused-adam", "--optimizer", "sgd"], "--fused-adam needs --optimizer adam")


def _expect_argument_error(flags, message):
    from megatron_int8.training.args import ArgumentError, parse_args, validate_args

    args = parse_args(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--mock-data", "--tokenizer-type",
                       "NullTokenizer", *flags])
    with pytest.raises(ArgumentError, match=message):
        validate_args(args, world_size=1)


def test_manual_gc_collects_only_when_asked_and_leaves_training_unchanged(data, tmp_path):
    """--manual-gc --manual-gc-interval 2: the collector runs at the start (counted with iteration 1) and
    after iterations 2 and 4, never on its own, and the losses equal a run with automatic collection."""
    common = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "0",
              "--int8-linear"]
    auto, manual = tmp_path / "auto", tmp_path / "manual"
    train(data, *common, "--save", str(auto))
    out = train(data, *common, "--save", str(manual), "--manual-gc", "--manual-gc-interval", "2")
    assert "gc: " in out and "collections" in out
    collections = losses(manual / "train_log.jsonl", "gc_collections")
    assert collections[1] >= 1 and collections[2] >= 1 and collections[3] == 0 and collections[4] >= 1
    assert losses(manual / "train_log.jsonl") == losses(auto / "train_log.jsonl")
    phases = losses(manual / "train_log.jsonl", "phase_ms")
    assert [i for i in sorted(phases) if "manual_gc" in phases[i]] == [2, 4]
    for i, step_s in losses(manual / "train_log.jsonl", "step_time_s").items():
        # the phases partition the step: together they are its time, less the logger's own bookkeeping
        assert set(phases[i]) >= {"forward_backward", "nonfinite_check", "optimizer", "loss_reduce", "final_sync"}
        assert 0.5 * step_s * 1000 <= sum(phases[i].values()) <= step_s * 1000 + 1.0


def test_step_phases_accumulate_per_phase():
    from megatron_int8.training.metrics import StepPhases

    phases = StepPhases()
    time.sleep(0.05)
    phases.mark("first")
    time.sleep(0.03)
    phases.mark("second")
    time.sleep(0.01)
    phases.mark("first")  # a phase marked twice adds up
    record = phases.record()
    assert set(record["phase_ms"]) == {"first", "second"}
    assert 60 <= record["phase_ms"]["first"] < 1000 and 30 <= record["phase_ms"]["second"] < 1000


def test_resume_matches_uninterrupted_and_switches_precision(data, tmp_path):
    common = ["--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "3",
              "--use-distributed-optimizer", "--int8-linear"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(data, *common, "--save", str(whole), nproc=2)
    train(data, *common, "--save", str(split), "--exit-interval", "3", nproc=2)
    assert (split / "latest_checkpointed_iteration.txt").read_text() == "3"
    shutil.copytree(split, tmp_path / "for_bf16")
    (split / ".tmp_iter_0000005").mkdir()  # debris of a save killed midway: ignored, then cleaned up
    (split / ".tmp_iter_0000005" / "common.pt").write_bytes(b"partial")
    out = train(data, *common, "--save", str(split), "--load", str(split), nproc=2)
    assert "loaded checkpoint" in out and not (split / ".tmp_iter_0000005").exists()
    # Bitwise on CPU: model, Adam state (with per-parameter steps), LR schedule, RNG and data position.
    assert losses(split / "train_log.jsonl") == losses(whole / "train_log.jsonl")
    assert losses(split / "train_log.jsonl", "valid_lm_loss") == losses(whole / "train_log.jsonl", "valid_lm_loss")

    # The INT8 checkpoint resumes in BF16 (same state dict), on one rank (distributed optimizer
    # state re-sharded over DP): training continues from the same place, at nearly the same loss.
    bf16_dir = tmp_path / "for_bf16"
    common.remove("--int8-linear")
    out = train(data, *common, "--save", str(bf16_dir), "--load", str(bf16_dir))
    resumed, reference = losses(bf16_dir / "train_log.jsonl"), losses(whole / "train_log.jsonl")
    assert sorted(resumed) == list(range(1, 7)) and " int8 int8[" not in out
    assert all(abs(resumed[i] - reference[i]) < 0.05 for i in (4, 5, 6)), (resumed, reference)


def test_pipeline_checkpoint_resumes_under_tensor_and_sequence_parallelism(data, tmp_path):
    """PP=2 (pipeline schedule, loss from the last stage) saves; TP=2 with sequence parallelism loads
    it (dist_checkpointing reshards model and optimizer) and continues like the PP=2 run."""
    common = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "2",
              "--int8-linear"]
    reference, split = tmp_path / "reference", tmp_path / "split"
    train(data, *common, "--pipeline-model-parallel-size", "2", "--save", str(reference), nproc=2)
    train(data, *common, "--pipeline-model-parallel-size", "2", "--save", str(split), "--exit-interval", "2", nproc=2)
    out = train(data, *common, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(split),
                "--load", str(split), nproc=2)
    assert "TP 2, PP 1" in out and "loaded checkpoint" in out
    expected, resumed = losses(reference / "train_log.jsonl"), losses(split / "train_log.jsonl")
    assert [resumed[i] for i in (1, 2)] == [expected[i] for i in (1, 2)]
    assert all(abs(resumed[i] - expected[i]) < 1e-3 for i in (3, 4)), (resumed, expected)


DIES_DURING_SECOND_SAVE = r'''
import os, sys
from megatron_int8.training.cpu import install_cpu_optimizer_support
install_cpu_optimizer_support()
from megatron.core import dist_checkpointing
from megatron_int8.pretrain import main

original_save, saves = dist_checkpointing.save, []


def save_then_die(*args, **kwargs):
    saves.append(original_save(*args, **kwargs))
    if len(saves) == 2:
        os._exit(9)  # killed after writing the shards, before the checkpoint is renamed into place


if __name__ == "__main__":  # dist_checkpointing's spawn Manager re-imports this script
    dist_checkpointing.save = save_then_die
    sys.exit(main())
'''


def test_save_killed_midway_keeps_the_last_checkpoint(data, tmp_path):
    (tmp_path / "dies.py").write_text(DIES_DURING_SECOND_SAVE)
    save = tmp_path / "ckpt"
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--data-path", data["prefix"],
            "--tokenizer-model", data["tokenizer"], "--data-cache-path", data["cache"], *SMALL_MODEL,
            "--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "8", "--eval-interval", "100",
            "--save-interval", "2", "--save", str(save), "--int8-linear"]
    # Its own process group (setsid): the dying trainer leaves megatron's checkpoint-writer Manager process behind,
    # which is then ended with that process group.
    with open(tmp_path / "killed.log", "w") as log:
        killed = subprocess.Popen([sys.executable, str(tmp_path / "dies.py")] + argv, cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env=dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=""))
        try:
            returncode = killed.wait(timeout=300)
        finally:
            try:
                os.killpg(killed.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode == 9, (tmp_path / "killed.log").read_text()[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (save / "iter_0000002").is_dir() and not (save / "iter_0000004").exists()
    assert (save / ".tmp_iter_0000004").is_dir()
    out = train(data, *argv[8:], "--load", str(save))
    assert "loaded checkpoint" in out and "(iteration 2," in out
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert not (save / ".tmp_iter_0000004").exists()
    assert sorted(losses(save / "train_log.jsonl")) == list(range(1, 7))


def test_train_step_stops_before_the_update_on_a_nonfinite_int8_input():
    """The deferred Inf/NaN check runs between backward and the optimizer: the update never happens."""
    from types import SimpleNamespace

    import torch

    from megatron_int8 import NonFiniteError, quantize
    from megatron_int8.training.loop import train_step

    class Optimizer:
        def zero_grad(self):
            pass

        def step(self):
            raise AssertionError("the optimizer ran on a step with a non-finite INT8 input")

    def forward_backward(**_kwargs):
        x = torch.randn(4, 8)
        x[1, 2] = float("nan")
        quantize(x, "row", name="fc1 input")  # as an INT8 linear of the model would
        return []

    args = SimpleNamespace(num_micro_batches=1, seq_length=8, micro_batch_size=1, cuda_graph_impl="none")
    with pytest.raises(NonFiniteError, match="fc1 input"):
        train_step(forward_backward, None, [], Optimizer(), None, args)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_step_gradient_check_finds_nonfinite_values_in_any_buffer(monkeypatch, bad):
    """DDP's in-step NaN check is off (it syncs twice per bucket); this check replaces it once per step."""
    from types import SimpleNamespace

    import torch

    from megatron_int8.training import loop

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: None)  # one rank
    grads = [torch.randn(1000) * 1e30, torch.randn(10), torch.randn(500)]  # large but finite
    if bad is not None:
        grads[2][123] = bad  # in an expert-parallel buffer
    chunk = SimpleNamespace(buffers=[SimpleNamespace(grad_data=grads[0]), SimpleNamespace(grad_data=grads[1])],
                            expert_parallel_buffers=[SimpleNamespace(grad_data=grads[2])])
    if bad is None:
        loop._raise_if_grads_nonfinite([chunk])
    else:
        with pytest.raises(FloatingPointError, match="Inf or NaN in the gradients"):
            loop._raise_if_grads_nonfinite([chunk])


def test_eager_step_checks_gradients_before_the_update(monkeypatch):
    """An eager step (no CUDA graph) runs the once-per-step gradient check before the optimizer: a NaN in a
    gradient buffer stops it without an update."""
    from types import SimpleNamespace

    import torch

    from megatron_int8.training import loop

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: None)  # one rank
    grads = torch.randn(64)
    chunk = SimpleNamespace(buffers=[SimpleNamespace(grad_data=grads)], expert_parallel_buffers=[],
                            zero_grad_buffer=lambda: None)
    stepped = []
    optimizer = SimpleNamespace(zero_grad=lambda: None, step=lambda: stepped.append(1) or (True, 1.0, None))

    def forward_backward(**kw):
        grads[5] = float("nan")  # the backward produced a NaN
        return []

    args = SimpleNamespace(num_micro_batches=1, seq_length=8, micro_batch_size=1, cuda_graph_impl="none")
    with pytest.raises(FloatingPointError, match="Inf or NaN in the gradients"):
        loop.train_step(forward_backward, None, [chunk], optimizer, None, args)
    assert not stepped


@pytest.mark.parametrize("sizes,experts,kept", [((1, 1), 8, False), ((2, 1), 8, True), ((1, 2), 8, True),
                                                ((1, 2), None, False)])
def test_grad_reduce_overlap_off_without_data_parallelism(monkeypatch, sizes, experts, kept):
    """overlap_grad_reduce is dropped (with a note) only where neither the data-parallel nor the expert
    data-parallel group communicates gradients (the latter only counts with experts); never turned on."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_int8.training.model import settle_grad_reduce_overlap

    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda **kw: sizes[0])
    monkeypatch.setattr(parallel_state, "get_expert_data_parallel_world_size", lambda **kw: sizes[1])
    args, notes = SimpleNamespace(overlap_grad_reduce=True, num_experts=experts), []
    settle_grad_reduce_overlap(args, notes.append)
    assert args.overlap_grad_reduce is kept and bool(notes) is not kept
    args.overlap_grad_reduce = False
    settle_grad_reduce_overlap(args, notes.append)
    assert args.overlap_grad_reduce is False
