"""Int8Recipe(shape_policy="auto") with a fake timer (CPU): the faster path per shape, measured once."""
import time

import pytest
import torch
import torch.nn.functional as F

from int8_bounds import heavy_tailed
from megatron_int8 import Int8Linear, Int8Recipe, int8_linear
from megatron_int8.ops import shape_policy

AUTO = Int8Recipe(shape_policy="auto")


class FakeTimer:
    """High precision 'faster' for out_features in `hp_wins`; runs each timed step once (so the timing code
    really executes) and records what it was asked to time."""

    def __init__(self, hp_wins):
        self.hp_wins, self.calls, self.shape = hp_wins, [], None

    def __call__(self, fn, path):
        fn()
        self.calls.append((self.shape, path))
        return {"int8": 1.0, "hp": 0.5 if self.shape in self.hp_wins else 2.0}[path]


@pytest.fixture
def timer(monkeypatch):
    fake = FakeTimer(hp_wins={48})
    measure = shape_policy._measure

    def measuring(recipe, input, weight, *args):
        fake.shape = weight.shape[0]
        return measure(recipe, input, weight, *args)

    monkeypatch.setattr(shape_policy, "_measure", measuring)
    monkeypatch.setattr(shape_policy, "_env_policy", [])
    shape_policy.set_timer(fake)
    yield fake
    shape_policy.set_timer(None)


def test_auto_runs_the_faster_path_per_shape_and_caches_it(timer):
    x = heavy_tailed(6, 64)
    w_slow, w_fast = heavy_tailed(48, 64), heavy_tailed(32, 64)  # INT8 "slower" at 48 outputs, faster at 32
    for _ in range(3):
        assert torch.equal(int8_linear(x, w_slow, None, AUTO), F.linear(x, w_slow))
        assert torch.equal(int8_linear(x, w_fast, None, AUTO), int8_linear(x, w_fast))  # the INT8 result
        assert not torch.equal(int8_linear(x, w_fast, None, AUTO), F.linear(x, w_fast))
    assert timer.calls == [(48, "int8"), (48, "hp"), (32, "int8"), (32, "hp")]  # once per shape
    int8_linear(heavy_tailed(7, 64), w_slow, None, AUTO)  # another token count is another shape
    assert len(timer.calls) == 6
    table = shape_policy.format_decisions()
    assert "| 6 | 64 -> 48 | float32 |" in table and table.count("| int8 |") == 1
    assert shape_policy.describe_weight(48, 64) == "float32 at 6 tokens, float32 at 7 tokens"


def test_gradients_follow_the_decision(timer):
    x, w, gy = heavy_tailed(6, 64), heavy_tailed(48, 64), heavy_tailed(6, 48)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    int8_linear(xl, wl, None, AUTO).backward(gy)
    assert torch.equal(xl.grad, gy @ w) and torch.equal(wl.grad, gy.t() @ x)


def test_default_policy_and_env_override_never_time(timer, monkeypatch):
    x, w = heavy_tailed(6, 64), heavy_tailed(48, 64)
    assert torch.equal(int8_linear(x, w), int8_linear(x, w, None, Int8Recipe()))
    monkeypatch.setattr(shape_policy, "_env_policy", [])
    monkeypatch.setenv("MEGATRON_INT8_SHAPE_POLICY", "int8")
    assert not torch.equal(int8_linear(x, w, None, AUTO), F.linear(x, w))
    assert timer.calls == []
    monkeypatch.setattr(shape_policy, "_env_policy", [])
    monkeypatch.setenv("MEGATRON_INT8_SHAPE_POLICY", "auto")  # turns it on for a default recipe
    lin = Int8Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    assert torch.equal(lin(x), F.linear(x, w))
    assert lin.precision == "int8/auto (float32 at 6 tokens)" and "precision=int8/auto" in repr(lin)
    assert len(timer.calls) == 2


def test_first_call_under_no_grad_still_times_forward_and_backward(timer):
    x, w = heavy_tailed(6, 64), heavy_tailed(48, 64)
    with torch.no_grad():
        assert torch.equal(int8_linear(x, w, None, AUTO), F.linear(x, w))
    with torch.inference_mode():
        assert torch.equal(int8_linear(x, w, None, AUTO), F.linear(x, w))
    assert timer.calls == [(48, "int8"), (48, "hp")]


def test_compiled_graph_takes_the_eager_decisions(timer):
    """fullgraph compile: a shape decided eagerly runs as decided; an undecided one runs INT8 untimed."""
    w = heavy_tailed(48, 64)
    fn = torch.compile(lambda x: int8_linear(x, w, None, AUTO), fullgraph=True, backend="aot_eager")
    x = heavy_tailed(6, 64)
    int8_linear(x, w, None, AUTO)  # eager: measured, high precision "faster"
    assert torch.equal(fn(x), F.linear(x, w))
    torch._dynamo.reset()
    x9 = heavy_tailed(9, 64)
    assert torch.equal(fn(x9), int8_linear(x9, w))
    assert len(timer.calls) == 2  # only the eager call timed
    torch._dynamo.reset()


def test_no_timing_without_a_device_timer():
    """The CUDA-event timer cannot time on CPU: INT8 runs and nothing is cached."""
    shape_policy.set_timer(None)
    x, w = heavy_tailed(6, 64), heavy_tailed(48, 64)
    if not torch.cuda.is_available():
        assert torch.equal(int8_linear(x, w, None, AUTO), int8_linear(x, w))
        assert shape_policy.decisions() == []


def test_bad_policy_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="shape_policy"):
        Int8Recipe(shape_policy="fast")
    monkeypatch.setattr(shape_policy, "_env_policy", [])
    monkeypatch.setenv("MEGATRON_INT8_SHAPE_POLICY", "fastest")
    with pytest.raises(ValueError, match="MEGATRON_INT8_SHAPE_POLICY"):
        int8_linear(heavy_tailed(2, 16), heavy_tailed(16, 16))


@pytest.mark.gpu
def test_cuda_timer_decides_once_per_shape(monkeypatch):
    monkeypatch.setattr(shape_policy, "_env_policy", [])
    shape_policy.set_timer(None)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
    y = int8_linear(x, w, None, AUTO)
    made = shape_policy.decisions()
    assert len(made) == 1 and made[0].int8_ms > 0 and made[0].hp_ms > 0
    expected = int8_linear(x, w) if made[0].int8 else F.linear(x, w)
    assert torch.equal(y, expected) and torch.equal(int8_linear(x, w, None, AUTO), expected)
    assert len(shape_policy.decisions()) == 1
    print(shape_policy.format_decisions())


class FakeEvent:
    """A CUDA event stand-in: `woke` says whether the GPU had reached it when the host asked."""
    woke, elapsed_ms = False, 0.0

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def query(self):
        return FakeEvent.woke

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return FakeEvent.elapsed_ms


@pytest.mark.parametrize("woke", [False, True])
def test_launch_free_timer_times_queued_work_or_falls_back(monkeypatch, woke):
    """The GPU sleeps while the host queues the timed calls: their mean is the GPU time alone. If the GPU woke
    before the host was done, the launches were timed too, and the synchronous timer's figure is returned."""
    slept, calls = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "woke", woke)
    monkeypatch.setattr(FakeEvent, "elapsed_ms", 2.5)
    monkeypatch.setattr(shape_policy, "cuda_event_timer", lambda fn, path, warmup, reps: ("synchronous", reps))

    def fn():
        time.sleep(0.002)
        calls.append(1)

    got = shape_policy.launch_free_timer(fn, "int8", warmup=2, reps=5)
    assert len(calls) == 2 + 1 + 5  # warm-up, the host-time probe, the timed calls
    # the sleep covers twice the 5 calls at >= 2 ms each, at the clock bound
    assert len(slept) == 1 and slept[0] >= 2 * 5 * 0.002 * shape_policy._SLEEP_CYCLES_PER_S
    assert got == (("synchronous", 5) if woke else pytest.approx(2.5 / 5))


@pytest.mark.gpu
def test_launch_free_timer_drops_the_launches_only():
    """A launch-bound call (200 tiny kernels) costs far less GPU time than host-and-GPU time; a GEMM-bound
    one costs the same either way (within 15%: single timings)."""
    tiny = torch.ones(16, device="cuda")

    def launches():
        for _ in range(200):
            tiny.add_(1)

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: a @ a  # noqa: E731
    assert shape_policy.launch_free_timer(launches, "hp") < 0.5 * shape_policy.cuda_event_timer(launches, "hp")
    free, synchronous = shape_policy.launch_free_timer(gemm, "hp"), shape_policy.cuda_event_timer(gemm, "hp")
    assert free == pytest.approx(synchronous, rel=0.15)


def _disagreeing_ranks_worker(rank, world, store, result_path):
    """Rank 0's timer finds INT8 faster, rank 1's high precision (timing noise): the group must take one path."""
    import torch.distributed as dist
    from free_ports import init_gloo

    from megatron_int8 import TPOptions

    init_gloo(rank, world, store)
    try:
        favour = "int8" if rank == 0 else "hp"
        shape_policy.set_timer(lambda fn, path: 1.0 if path == favour else 2.0)
        recipe = Int8Recipe(granularity="tensor", int8_all_gather=True, shape_policy="auto")
        tp = TPOptions(group=dist.group.WORLD, sequence_parallel=True)
        x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        w = torch.randn(16, 32, generator=torch.Generator().manual_seed(7), requires_grad=True)
        int8_linear(x, w, None, recipe, tp=tp).sum().backward()  # a disagreement hangs here (different collectives)
        made = shape_policy.decisions()
        torch.save([(d.precision, d.int8_ms, d.hp_ms) for d in made], f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(120)
def test_tensor_parallel_ranks_agree_on_the_decision(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_disagreeing_ranks_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "r")), nprocs=2, join=True)
    made = [torch.load(tmp_path / f"r.{rank}") for rank in range(2)]
    assert made[0] == made[1], made
    assert len(made[0]) == 1 and made[0][0][1:] == (2.0, 2.0), made  # each time the group's slowest
