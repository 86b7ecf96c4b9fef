"""The trainer on GPUs (skipped on CPU): BF16 with INT8 Triton kernels on one GPU, its `--profile`
report and its CUDA-graph steps (MoE layers padded to capacity too); the FP8 peer
(--fp8-peer, torchao float8) on one GPU; tensor plus sequence parallelism with the distributed optimizer, and
data parallelism with the regular one, resuming to the same losses on two GPUs (NCCL); and an INT8 checkpoint
saved at TP=2 + SP on two GPUs resumed at TP=1 on one."""
import importlib.util
import re

import pytest
import torch
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
APEX_FUSED_WGRAD = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def test_gpu_tiny_pretraining_bf16_int8(data, tmp_path):  # noqa: F811
    out = train(data, "--bf16", "--int8-linear", "--train-iters", "30", "--micro-batch-size", "4",
                "--global-batch-size", "8", "--eval-interval", "15", "--save", str(tmp_path), gpu=True)
    curve = losses(tmp_path / "train_log.jsonl")
    first, last = curve[1], sum(curve[i] for i in range(27, 31)) / 4
    assert last < first - 1.0, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert "device cuda" in out and " int8 int8[" in out and "peak memory (GB)" in out
    assert re.search(r"memory between steps \(GB\): [0-9.]+", out)
    # weights and optimizer states stay between steps; the step's activations come and go
    peak, resident = (losses(tmp_path / "train_log.jsonl", key)[30] for key in ("peak_memory_gb",
                                                                              "memory_between_steps_gb"))
    assert 0 < resident < peak
    if not APEX_FUSED_WGRAD:  # the lent machines: the INT8 wgrads add into main_grad in the GEMM (TMA reduce-add)
        assert "gradient accumulation fusion on for the transformer layers' linears" in out


def test_gpu_profile_reports_the_gpu_busy_share(data, tmp_path):  # noqa: F811
    out = train(data, "--bf16", "--int8-linear", "--train-iters", "4", "--micro-batch-size", "4",
                "--global-batch-size", "8", "--eval-iters", "0", "--profile", "--profile-step-start", "3",
                "--profile-step-end", "5", "--profile-dir", str(tmp_path), gpu=True)
    line = next(l for l in out.splitlines() if l.startswith("profile, rank 0, iterations 3-4: "))
    share = float(line.split("% of the wall time")[0].rsplit("(", 1)[1])
    assert 0 < share <= 100, line
    summary = (tmp_path / "rank0_iters3-4.summary.txt").read_text()
    assert "By GPU time" in summary and "int8_gemm" in summary


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_gpu_cuda_graph_steps_train_like_eager_steps(data, tmp_path, precision):  # noqa: F811
    """--cuda-graph-impl local: 2 eager steps, then each step's forward/backward is one replayed graph. The
    replays must see every update (weights re-quantized inside the graph, not a stale INT8 copy) and the
    validation pass in between: the losses follow the eager run's to within run-to-run kernel noise (a
    graph replaying stale INT8 weights stays near the loss of its capture, about 10% off by the end), and
    the loss keeps going down."""
    common = (["--int8-linear"] if precision == "int8" else [])
    replayed = _graphed_follows_eager(data, tmp_path, common)
    assert sum(replayed[i] for i in range(17, 21)) / 4 < replayed[1] - 0.5  # 6.24 -> 5.39 (eager: the same)


def _graphed_follows_eager(data, tmp_path, flags):
    """20 steps eager and 20 graphed after 2 eager ones, validation every 5: the graphed run's training and
    validation losses within 2% of the eager run's (eager steps equal); returns the graphed training losses."""
    common = ["--bf16", "--train-iters", "20", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--eval-interval", "5", "--eval-iters", "2", *flags]
    eager, graphed = tmp_path / "eager", tmp_path / "graphed"
    train(data, *common, "--save", str(eager), gpu=True)
    out = train(data, *common, "--save", str(graphed), "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2",
                gpu=True)
    assert "CUDA graph: each step's forward and backward captured after 2 eager steps" in out
    reference, replayed = losses(eager / "train_log.jsonl"), losses(graphed / "train_log.jsonl")
    assert sorted(replayed) == list(range(1, 21))
    assert replayed[1] == reference[1] and replayed[2] == reference[2]  # eager in both runs
    for i in range(3, 21):
        assert abs(replayed[i] - reference[i]) <= 0.02 * reference[i], (i, replayed[i], reference[i])
    valid_ref, valid = losses(eager / "train_log.jsonl", "valid_lm_loss"), losses(graphed / "train_log.jsonl",
                                                                                   "valid_lm_loss")
    assert sorted(valid) == [5, 10, 15, 20]
    for i in valid:
        assert abs(valid[i] - valid_ref[i]) <= 0.02 * valid_ref[i], (i, valid[i], valid_ref[i])
    return replayed


def test_gpu_cuda_graph_steps_with_int8_attention_train_like_eager_steps(data, tmp_path):  # noqa: F811
    """--int8-attention in the captured step: its quantization (K smoothing, per-block scales) and its Triton
    kernels, forward and backward, replayed; the replays follow the eager run as the plain INT8 model's do
    (a scale or a statistics buffer frozen at the capture would drift away from it) and the loss keeps going down."""
    replayed = _graphed_follows_eager(data, tmp_path, ["--int8-linear", "--int8-attention", "--kv-channels", "64"])
    assert sum(replayed[i] for i in range(17, 21)) / 4 < replayed[1] - 0.5, replayed


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_gpu_cuda_graph_moe_steps_padded_to_capacity_train_like_eager_steps(data, tmp_path, precision):  # noqa: F811
    """MoE layers in the captured step: 4 grouped experts, top-2, the alltoall dispatcher, every expert's input
    padded to capacity ceil(128 x 2 / 4 x 1.25) = 80 rows per micro-batch, and the load-balancing loss. The router
    drops and pads on the device and the experts take their row counts from shapes, so the replays must follow the
    eager run as the dense model's do (a size read on the host at the capture would freeze its routing into
    every replay), validation included, and the loss keeps going down."""
    flags = ["--num-experts", "4", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
             "--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity",
             "--moe-aux-loss-coeff", "1e-2"]
    replayed = _graphed_follows_eager(data, tmp_path, flags + (["--int8-linear"] if precision == "int8" else []))
    # the training progress is well above the tolerance (2% of a loss near 6)
    assert sum(replayed[i] for i in range(17, 21)) / 4 < replayed[1] - 0.3, replayed


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2"],  # the captured step holds the P2P sends and receives
    ["--use-distributed-optimizer"],  # DP 2: it holds the gradient reduce-scatter
    ["--use-distributed-optimizer", "--overlap-grad-reduce"],  # ... launched from backward's gradient hooks
    # TP 2 + SP with the collectives pipelined with the GEMMs: asynchronous all-gathers and all-to-alls
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"],
], ids=["pp2", "dp2-distopt", "dp2-distopt-overlap", "tp2sp-comm-overlap"])
def test_gpu_cuda_graph_steps_on_two_gpus_train_like_eager_steps(data, tmp_path, layout):  # noqa: F811
    """The captured step also holds the NCCL traffic of the step: pipeline sends/receives between stages
    (PP 2) or the data-parallel gradient reduce-scatter (DP 2; with --overlap-grad-reduce it runs on NCCL's
    stream while the backward goes on, and the captured step joins it before its end). Replays must track
    the eager run as on one GPU (a replay that skipped the exchange would train one stage on garbage, or
    each replica on half the batch)."""
    common = ["--bf16", "--int8-linear", "--train-iters", "12", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--eval-interval", "6", "--eval-iters", "2", *layout]
    eager, graphed = tmp_path / "eager", tmp_path / "graphed"
    train(data, *common, "--save", str(eager), nproc=2, gpu=True)
    out = train(data, *common, "--save", str(graphed), "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2",
                nproc=2, gpu=True)
    assert "CUDA graph: each step's forward and backward captured after 2 eager steps" in out
    reference, replayed = losses(eager / "train_log.jsonl"), losses(graphed / "train_log.jsonl")
    assert sorted(replayed) == list(range(1, 13))
    for i in range(3, 13):
        assert abs(replayed[i] - reference[i]) <= 0.02 * reference[i], (i, replayed[i], reference[i])
    assert reference[1] - reference[12] > 0.2, reference  # the tolerance is finer than the training progress
    valid_ref, valid = losses(eager / "train_log.jsonl", "valid_lm_loss"), losses(graphed / "train_log.jsonl",
                                                                                   "valid_lm_loss")
    assert sorted(valid) == [6, 12]
    for i in valid:
        assert abs(valid[i] - valid_ref[i]) <= 0.02 * valid_ref[i], (i, valid[i], valid_ref[i])


def _fp8_unavailable():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from megatron_int8.peers.fp8 import fp8_unavailable_reason

    return fp8_unavailable_reason()


FP8_UNAVAILABLE = _fp8_unavailable()


@pytest.mark.skipif(FP8_UNAVAILABLE is not None, reason=f"FP8 peer unavailable: {FP8_UNAVAILABLE}")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gpu_tiny_pretraining_fp8_peer(data, tmp_path, compile):  # noqa: F811
    flags = ["--fp8-peer-compile"] if compile else []
    out = train(data, "--bf16", "--fp8-peer", "tensorwise", *flags, "--train-iters", "30", "--micro-batch-size", "4",
                "--global-batch-size", "8", "--eval-interval", "15", "--save", str(tmp_path), gpu=True)
    curve = losses(tmp_path / "train_log.jsonl")
    first, last = curve[1], sum(curve[i] for i in range(27, 31)) / 4
    assert last < first - 1.0, f"loss did not go down: {first:.3f} -> {last:.3f}"
    assert "device cuda" in out and " fp8 torchao float8 tensorwise" in out and " int8 int8[" not in out
    assert "FP8 peer: torchao float8 tensorwise" in out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tp2_sequence_parallel_resume(data, tmp_path):  # noqa: F811
    common = ["--bf16", "--int8-linear", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--use-distributed-optimizer", "--train-iters", "6", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--eval-interval", "3"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(data, *common, "--save", str(whole), nproc=2, gpu=True)
    train(data, *common, "--save", str(split), "--exit-interval", "3", nproc=2, gpu=True)
    out = train(data, *common, "--save", str(split), "--load", str(split), nproc=2, gpu=True)
    assert "loaded checkpoint" in out
    expected, resumed = losses(whole / "train_log.jsonl"), losses(split / "train_log.jsonl")
    assert sorted(resumed) == list(range(1, 7))
    # GPU attention backward kernels may reorder sums: equal up to BF16 noise, not bitwise.
    assert all(abs(resumed[i] - expected[i]) < 2e-2 for i in range(1, 7)), (resumed, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_dp2_saves_without_a_rank_mismatch_and_resumes(data, tmp_path):  # noqa: F811
    """DP 2 with the regular optimizer (torch's fused Adam, whose shared step lives on each rank's GPU): no
    "common state dict differs" warning at a save (megatron-core compared the ranks' steps across devices), and
    the resumed run follows the uninterrupted one."""
    common = ["--bf16", "--int8-linear", "--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "8",
              "--eval-interval", "3"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    out = train(data, *common, "--save", str(whole), "--save-interval", "3", nproc=2, gpu=True, stderr=True)
    out += train(data, *common, "--save", str(split), "--exit-interval", "3", nproc=2, gpu=True, stderr=True)
    assert "saved checkpoint" in out and "common state dict differs" not in out
    resumed_out = train(data, *common, "--save", str(split), "--load", str(split), nproc=2, gpu=True)
    assert "loaded checkpoint" in resumed_out
    expected, resumed = losses(whole / "train_log.jsonl"), losses(split / "train_log.jsonl")
    assert sorted(resumed) == list(range(1, 7))
    assert all(abs(resumed[i] - expected[i]) < 2e-2 for i in range(4, 7)), (resumed, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("optimizer", ["regular", "distributed"])
def test_gpu_tp2_checkpoint_resumes_at_tp1(data, tmp_path, optimizer):  # noqa: F811
    """INT8 at TP=2 + SP (2 GPUs) saves at iteration 3; one GPU at TP=1 loads it (dist_checkpointing
    reshards model and optimizer state) and trains on to 6. Both layouts have DP=1, so the same global
    batch (2 micro-batches of 2) reads the same samples in the same order.

    Reference: the uninterrupted TP=2 run. An uninterrupted TP=1 run is no reference on GPU: megatron
    initializes every TP shard from its own TP-rank RNG stream there, so TP=1 and TP=2 start from
    different weights. Iterations 4-6 then differ from the reference only by how the INT8 noise falls: at
    TP=2 each shard has its own scale (weight shards, row-parallel inputs, output gradients), the
    stochastic-rounding draws differ (RNG states are not restored across world sizes), plus BF16 kernel
    order. Tolerance 2e-2: what the same-layout GPU resume above needs for BF16 kernel order alone; on
    CPU (TP-invariant CPU init, BF16) this test's runs differ by 3e-4 at iterations 4-6, and an
    uninterrupted TP=1 run by < 1e-3; training moves the loss by ~0.17 over iterations 3-6.

    Both optimizers: the distributed one is saved in megatron's fully_reshardable format (model-space Adam
    state), which the TP=1 run reads back (tests/test_checkpoint_reshard.py checks the state itself on CPU)."""
    common = ["--bf16", "--int8-linear", "--train-iters", "6", "--micro-batch-size", "2", "--global-batch-size", "4",
              "--eval-interval", "3"] + (["--use-distributed-optimizer"] if optimizer == "distributed" else [])
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    out = train(data, *common, *tp2, "--save", str(whole), nproc=2, gpu=True)
    assert "world size 2: TP 2, PP 1, DP 1" in out and "device cuda" in out and " int8 int8[" in out
    train(data, *common, *tp2, "--save", str(split), "--exit-interval", "3", nproc=2, gpu=True)
    assert (split / "latest_checkpointed_iteration.txt").read_text() == "3"
    out = train(data, *common, "--save", str(split), "--load", str(split), gpu=True)
    assert "world size 1: TP 1, PP 1, DP 1" in out and "device cuda" in out and " int8 int8[" in out
    assert "loaded checkpoint" in out and "(iteration 3," in out
    if optimizer == "distributed":
        assert "optimizer state: distributed optimizer, fully_reshardable format, Adam steps [3" in out, out[-3000:]
    expected, resumed = losses(whole / "train_log.jsonl"), losses(split / "train_log.jsonl")
    assert sorted(resumed) == list(range(1, 7))
    # all six within 2e-2: 1-3 are the same TP=2 configuration run twice, 4-6 the TP=1 continuation
    assert all(abs(resumed[i] - expected[i]) < 2e-2 for i in range(1, 7)), (resumed, expected)
    assert expected[3] - expected[6] > 4e-2, expected  # the tolerance is finer than the training progress
