"""`--profile`: torch.profiler over a few training iterations on chosen ranks.

Besides the trace, it reports the number that separates a host-bound step from a GPU-bound one: the
share of the profiled iterations' wall time during which the GPU ran anything (the union of its kernel,
copy and memset intervals). A step whose GPU is busy 95% of the time gains from faster kernels; one whose
GPU idles waits on Python and launch overhead, which faster kernels do not shorten.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from torch.autograd import DeviceType


def busy_time_us(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (overlapping kernels on several streams count once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def device_intervals(events) -> List[Tuple[float, float]]:
    """(start, end) in us of every GPU activity (kernels, copies, memsets) among profiler events;
    GPU-side user annotations span other activities and are left out."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


class StepProfiler:
    """Profiles the training iterations numbered `start` .. `end - 1` (as the log numbers them) on the
    ranks in `ranks`; writes a chrome trace and a summary into `directory` and logs the GPU busy share."""

    def __init__(self, start: int, end: int, ranks: List[int], directory: str, rank: int,
                 log: Callable[[str], None]):
        self.start, self.end, self.directory, self.rank = start, end, directory, rank
        self.enabled = rank in ranks
        self.log = log
        self._prof: Optional[torch.profiler.profile] = None
        self._t0 = 0.0

    @classmethod
    def from_args(cls, args, rank: int, log: Callable[[str], None]) -> Optional["StepProfiler"]:
        if not args.profile:
            return None
        return cls(args.profile_step_start, args.profile_step_end, args.profile_ranks, args.profile_dir, rank, log)

    def before_iteration(self, iteration: int) -> None:
        """Called before the iteration numbered `iteration` runs."""
        if not self.enabled or iteration != self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.start()
        self._t0 = time.perf_counter()

    def after_iteration(self, iteration: int) -> None:
        """Called once the iteration numbered `iteration` finished (the loop has synchronized the GPU)."""
        if self._prof is None or iteration != self.end - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.stop()
        try:
            self._report(prof, wall_ms)
        except (OSError, RuntimeError) as err:  # a full disk must not end the training run
            self.log(f"profile, rank {self.rank}: writing the report into {self.directory} failed ({err}); "
                     "training goes on")

    def _report(self, prof, wall_ms: float) -> None:
        iters = self.end - self.start
        os.makedirs(self.directory, exist_ok=True)
        stem = os.path.join(self.directory, f"rank{self.rank}_iters{self.start}-{self.end - 1}")
        prof.export_chrome_trace(stem + ".trace.json")
        events = prof.events()
        intervals = device_intervals(events)
        if intervals:
            busy_ms = busy_time_us(intervals) / 1e3
            gpu = (f"GPU busy {busy_ms / iters:.1f} ms per iteration ({100 * busy_ms / wall_ms:.1f}% of the wall "
                   f"time; {len(intervals) / iters:.0f} GPU activities per iteration)")
        else:
            gpu = "no GPU activity recorded"
        headline = (f"profile, rank {self.rank}, iterations {self.start}-{self.end - 1}: "
                    f"{wall_ms / iters:.1f} ms per iteration, {gpu}; trace and summary: {stem}.*")
        averages = events.key_averages()
        with open(stem + ".summary.txt", "w", encoding="utf-8") as f:
            f.write(headline + "\n\nBy own host (CPU) time:\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
            if intervals:
                f.write("\nBy GPU time:\n" + averages.table(sort_by="self_device_time_total", row_limit=30) + "\n")
        self.log(headline)
