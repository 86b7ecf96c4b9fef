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
