"""The GPU busy share that `--profile` reports: the union of GPU activity intervals."""
import pytest

from megatron_int8.training.profiling import busy_time_us, device_intervals


@pytest.mark.parametrize("intervals, expected", [
    ([], 0.0),
    ([(0.0, 10.0)], 10.0),
    ([(20.0, 25.0), (0.0, 10.0)], 15.0),  # disjoint, unsorted
    ([(0.0, 10.0), (5.0, 12.0)], 12.0),  # overlapping (two streams)
    ([(0.0, 10.0), (2.0, 3.0), (4.0, 9.0)], 10.0),  # nested
    ([(0.0, 10.0), (10.0, 11.0)], 11.0),  # touching
    ([(0.0, 4.0), (1.0, 2.0), (6.0, 8.0), (7.0, 9.5)], 7.5),
])
def test_busy_time_is_the_union_of_intervals(intervals, expected):
    assert busy_time_us(intervals) == pytest.approx(expected)


def test_device_intervals_keep_gpu_activities_only():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(device, start, end, annotation=False):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation)

    events = [event(DeviceType.CPU, 0, 100), event(DeviceType.CUDA, 5, 8), event(DeviceType.CUDA, 0, 90, True),
              event(DeviceType.CUDA, 20, 30)]
    assert device_intervals(events) == [(5, 8), (20, 30)]


def test_a_failed_report_does_not_stop_training(tmp_path):
    """The profiled window ends, the report cannot be written (its directory is a file): a log line says so
    and no exception reaches the training loop."""
    from megatron_int8.training.profiling import StepProfiler

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    lines = []
    profiler = StepProfiler(start=1, end=2, ranks=[0], directory=str(blocker), rank=0, log=lines.append)
    profiler.before_iteration(1)
    sum(range(1000))
    profiler.after_iteration(1)
    assert len(lines) == 1 and "writing the report into" in lines[0] and "training goes on" in lines[0]


def test_only_the_chosen_ranks_and_window_are_profiled(tmp_path):
    from megatron_int8.training.profiling import StepProfiler

    lines = []
    other_rank = StepProfiler(start=2, end=3, ranks=[0], directory=str(tmp_path), rank=1, log=lines.append)
    profiler = StepProfiler(start=2, end=3, ranks=[0], directory=str(tmp_path), rank=0, log=lines.append)
    for iteration in (1, 2, 3):
        for p in (other_rank, profiler):
            p.before_iteration(iteration)
            p.after_iteration(iteration)
    assert len(lines) == 1 and lines[0].startswith("profile, rank 0, iterations 2-2: ")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["rank0_iters2-2.summary.txt", "rank0_iters2-2.trace.json"]
