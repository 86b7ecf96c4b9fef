"""The precision-aware optimizer in the trainer, on CPU (gloo): its flags' checks and the memory per
parameter it prints; end to end: megatron's distributed optimizer over 2 data-parallel ranks with INT8
moments and master-weight remainders resumes bit for bit (both of the trainer's checkpoint formats),
reshards to one rank and from TP 2 to TP 1, and its checkpoints load into fp32 states and back;
megatron's mixed-precision (Float16) optimizer with INT8 moments resumes bit for bit."""
import pytest
import torch
from test_checkpoint_reshard import _stopped_at
from test_training import data, losses, train  # noqa: F401  (`data` is the module's fixture)

from megatron_int8.megatron.optimizer import PrecisionAwareAdamW
from megatron_int8.training.checkpoint import checkpoint_dir

RUN = ["--bf16", "--int8-linear", "--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--eval-interval", "100", "--save-interval", "2"]
INT8_STATES = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "int8", "--exp-avg-sq-dtype", "int8"]
DISTRIBUTED = ["--use-distributed-optimizer"]
# A continuation from the same checkpoint with other optimizer states (fp32 <-> int8), DP 2 -> 1 or TP 2 -> 1:
# measured on CPU (2026-11-27, these tests), the losses of iterations 3-4 were within 1.9e-4 of the
# reference run (TP: 7e-5, the INT8 linears' row scales differ per TP shard); iterations 2 -> 4 move the
# loss by 0.048, so the tolerance is finer than training's steps.
CONTINUATION_TOLERANCE = 1e-3


def _checkpoint_tensors(root, iteration):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = root / f"flat_{iteration}.pt"
    dcp_to_torch_save(checkpoint_dir(str(root), iteration), str(target))
    return torch.load(target)


def _assert_bitwise_equal(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_distributed_int8_states_with_remainders_resume_exactly_reshard_and_convert(data, tmp_path):  # noqa: F811
    flags = RUN + DISTRIBUTED + INT8_STATES + ["--store-param-remainders"]
    whole = tmp_path / "whole"
    out = train(data, *flags, "--save", str(whole), nproc=2)
    assert "precision-aware AdamW" in out and "bf16 parameter + int16 remainder" in out
    assert ("master weight (int16 remainder) 1.00 | exp_avg (int8) 0.52 | exp_avg_sq (int8) 0.52" in out), out
    expected = losses(whole / "train_log.jsonl")
    assert expected[2] - expected[4] > 0.03, expected

    resumed = _stopped_at(whole, tmp_path / "resumed", 2)
    out = train(data, *flags, "--save", str(resumed), "--load", str(resumed), nproc=2)
    assert "Adam steps [2.0]" in out
    got = losses(resumed / "train_log.jsonl")
    assert got == {3: expected[3], 4: expected[4]}, (got, expected)
    # model weights, master weights (saved as fp32) and both moments (dequantized) at iteration 4
    _assert_bitwise_equal(_checkpoint_tensors(resumed, 4), _checkpoint_tensors(whole, 4))

    one_rank = _stopped_at(whole, tmp_path / "one_rank", 2)  # DP 2 -> 1, the same global batch
    out = train(data, *flags, "--save", str(one_rank), "--load", str(one_rank))
    assert "DP 1" in out
    got = losses(one_rank / "train_log.jsonl")
    assert all(abs(got[i] - expected[i]) < CONTINUATION_TOLERANCE for i in (3, 4)), (got, expected)

    fp32 = _stopped_at(whole, tmp_path / "fp32", 2)  # int8 states and remainders -> fp32 states (torch's AdamW)
    out = train(data, *RUN, *DISTRIBUTED, "--save", str(fp32), "--load", str(fp32), nproc=2)
    assert "precision-aware" not in out and "Adam steps [2.0]" in out
    got = losses(fp32 / "train_log.jsonl")
    assert all(abs(got[i] - expected[i]) < CONTINUATION_TOLERANCE for i in (3, 4)), (got, expected)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fp32_state_checkpoint_loads_into_int8_states(data, tmp_path):  # noqa: F811
    plain = tmp_path / "plain"
    train(data, *RUN, *DISTRIBUTED, "--save", str(plain), nproc=2)
    expected = losses(plain / "train_log.jsonl")
    int8 = _stopped_at(plain, tmp_path / "int8", 2)
    out = train(data, *RUN, *DISTRIBUTED, *INT8_STATES, "--store-param-remainders", "--save", str(int8),
                "--load", str(int8), nproc=2)
    assert "Adam steps [2.0]" in out
    got = losses(int8 / "train_log.jsonl")
    assert all(abs(got[i] - expected[i]) < CONTINUATION_TOLERANCE for i in (3, 4)), (got, expected)
    # an int8 run writes the fp32 run's checkpoint layout: the same tensors, shapes and dtypes
    saved, reference = _checkpoint_tensors(int8, 4), _checkpoint_tensors(plain, 4)
    assert sorted(saved) == sorted(reference)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in saved), sorted(saved)[:10]
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert (saved[key].shape, saved[key].dtype) == (value.shape, value.dtype), key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mixed_precision_optimizer_with_int8_moments_resumes_exactly(data, tmp_path):  # noqa: F811
    """Without the distributed optimizer: megatron's Float16OptimizerWithFloat16Params keeps fp32 main params,
    the precision-aware AdamW updates them with INT8 moments; its checkpoint stores the moments as fp32."""
    whole = tmp_path / "whole"
    out = train(data, *RUN, *INT8_STATES, "--save", str(whole))
    assert "Float16OptimizerWithFloat16Params" in out and "exp_avg (int8) 1.03" in out, out
    expected = losses(whole / "train_log.jsonl")
    resumed = _stopped_at(whole, tmp_path / "resumed", 2)
    train(data, *RUN, *INT8_STATES, "--save", str(resumed), "--load", str(resumed))
    assert losses(resumed / "train_log.jsonl") == {3: expected[3], 4: expected[4]}
    _assert_bitwise_equal(_checkpoint_tensors(resumed, 4), _checkpoint_tensors(whole, 4))


def _args(flags):
    from megatron_int8.training.args import parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "512"]
    return validate_args(parse_args(base + flags), world_size=2)


@pytest.mark.parametrize("flags,message", [
    (["--exp-avg-dtype", "int8"], "--exp-avg-dtype needs --use-precision-aware-optimizer"),
    (["--store-param-remainders", "--bf16"], "--store-param-remainders needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "int8", "--optimizer", "sgd"],
     "--optimizer sgd is not supported"),
    (["--use-precision-aware-optimizer", "--store-param-remainders", "--use-distributed-optimizer"], "needs --bf16"),
    (["--use-precision-aware-optimizer", "--store-param-remainders", "--bf16"], "needs --use-distributed-optimizer"),
    (["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], "--main-params-dtype fp16 is not supported"),
    (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], "need Transformer Engine"),
])
def test_bad_flags_fail_clearly(flags, message):
    from megatron_int8.training.args import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        _args(flags)


def test_memory_per_parameter_counts_each_state():
    from megatron_int8.training.memory import bytes_per_parameter

    model = torch.nn.Linear(128, 64, bias=False)  # 8192 parameters, no INT8 linear
    args = _args(["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype",
                  "int8", "--exp-avg-sq-dtype", "bf16", "--store-param-remainders"])
    numel, rows = bytes_per_parameter(args, [model])
    assert numel == 8192
    assert dict(rows) == {"bf16 weight": 2.0, "main_grad (fp32)": 4.0, "master weight (int16 remainder)": 1.0,
                          "exp_avg (int8)": (1 + 4 / 128) / 2, "exp_avg_sq (bf16)": 1.0}  # DP 2 shards
    # the formula is what the optimizer allocates: one DP shard of the parameter
    shard = torch.zeros(numel // 2, dtype=torch.bfloat16)
    opt = PrecisionAwareAdamW([shard], exp_avg_dtype="int8", exp_avg_sq_dtype="bf16", master_weights=True,
                              store_param_remainders=True, use_decoupled_grad=True)
    opt.initialize_all_states()
    held = {key: sum(t.numel() * t.element_size() for state in opt.state.values()
                     for t in ((state[key].codes, state[key].scales) if key == "exp_avg" else (state[key],)))
            for key in ("exp_avg", "exp_avg_sq", "master_param")}  # exp_avg is INT8: codes and block scales
    assert held["master_param"] / numel == dict(rows)["master weight (int16 remainder)"]
    assert held["exp_avg"] / numel == dict(rows)["exp_avg (int8)"]
    assert held["exp_avg_sq"] / numel == dict(rows)["exp_avg_sq (bf16)"]
    plain = _args(["--bf16"])
    assert dict(bytes_per_parameter(plain, [model])[1]) == {
        "bf16 weight": 2.0, "main_grad (fp32)": 4.0, "master weight (fp32)": 4.0, "exp_avg (fp32)": 4.0,
        "exp_avg_sq (fp32)": 4.0}


def test_memory_per_parameter_shards_expert_states_over_expert_data_parallel_ranks():
    """Under expert parallelism the distributed optimizer shards expert parameters (allreduce=False) over DP / EP
    ranks, not DP: with DP 2, EP 2 an expert parameter's Adam state is whole on each rank."""
    from megatron_int8.training.memory import bytes_per_parameter, format_bytes_per_parameter

    model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(64, 128, bias=False))
    model[1].weight.allreduce = False  # what megatron sets on an expert weight under expert parallelism
    args = _args(["--bf16", "--use-distributed-optimizer"])
    args.expert_model_parallel_size = 2
    rows = dict(bytes_per_parameter(args, [model])[1])
    # half the parameters sharded over 2 ranks, half over 1: 4 bytes x (1/2 x 1/2 + 1/2 x 1) = 3 per parameter
    assert rows["master weight (fp32)"] == rows["exp_avg (fp32)"] == rows["exp_avg_sq (fp32)"] == 3.0
    assert "sharded over 2 data-parallel ranks (expert parameters over 1)" in format_bytes_per_parameter(args, [model])
    args.expert_model_parallel_size = 1  # EP 1: megatron leaves experts allreduce=True; all over DP
    del model[1].weight.allreduce
    assert dict(bytes_per_parameter(args, [model])[1])["exp_avg (fp32)"] == 2.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dp_reshardable_format_resumes_exactly(data, tmp_path, monkeypatch):  # noqa: F811
    """megatron's dp_reshardable format (each rank's bucket shards, MEGATRON_INT8_DISTOPT_FORMAT): its load
    hands set_scaled_state a per-entry 'padding' flag beside the states."""
    monkeypatch.setenv("MEGATRON_INT8_DISTOPT_FORMAT", "dp_reshardable")
    flags = RUN + DISTRIBUTED + INT8_STATES + ["--store-param-remainders"]
    whole = tmp_path / "whole"
    train(data, *flags, "--save", str(whole), nproc=2)
    expected = losses(whole / "train_log.jsonl")
    resumed = _stopped_at(whole, tmp_path / "resumed", 2)
    out = train(data, *flags, "--save", str(resumed), "--load", str(resumed), nproc=2)
    assert "dp_reshardable format, Adam steps [2.0]" in out
    assert losses(resumed / "train_log.jsonl") == {3: expected[3], 4: expected[4]}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_checkpoint_resumes_at_another_tensor_parallel_size(data, tmp_path):  # noqa: F811
    """TP 2 + SP saves (fully_reshardable: model space), TP 1 resumes with the same global batch."""
    flags = RUN + DISTRIBUTED + INT8_STATES + ["--store-param-remainders"]
    whole = tmp_path / "whole"
    out = train(data, *flags, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(whole),
                nproc=2)
    assert "TP 2, PP 1, DP 1" in out
    expected = losses(whole / "train_log.jsonl")
    tp1 = _stopped_at(whole, tmp_path / "tp1", 2)
    out = train(data, *flags, "--save", str(tp1), "--load", str(tp1))
    assert "TP 1, PP 1, DP 1" in out and "Adam steps [2.0]" in out
    got = losses(tp1 / "train_log.jsonl")
    assert all(abs(got[i] - expected[i]) < CONTINUATION_TOLERANCE for i in (3, 4)), (got, expected)
