"""Training metrics: model FLOPs, the per-interval log line, the JSONL log and TensorBoard scalars."""
from __future__ import annotations

import gc
import json
import math
import os
import resource
import time
from typing import Optional, Tuple

import torch


def model_flops_per_iteration(args, padded_vocab_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward, 2 FLOPs per MAC).

    Per token and layer: Q/K/V projections (GQA: K and V have num_query_groups heads), the output
    projection, causal attention (QK^T and AV over half the sequence on average), and the MLP (3
    matrices with SwiGLU, else 2; MoE: top-k experts plus the router). Plus the output logits.
    Recompute and pipeline bubbles are not counted (model FLOPs, not hardware FLOPs).
    """
    h, d = args.hidden_size, args.kv_channels
    q_size, kv_size = args.num_attention_heads * d, args.num_query_groups * d
    attention = h * (q_size + 2 * kv_size) + q_size * h + args.seq_length * q_size  # causal: 2 x s/2
    matrices = 3 if args.swiglu else 2
    if args.num_experts:
        mlp = args.moe_router_topk * matrices * h * args.moe_ffn_hidden_size + h * args.num_experts
    else:
        mlp = matrices * h * args.ffn_hidden_size
    macs_per_token = args.num_layers * (attention + mlp) + h * padded_vocab_size
    tokens = args.global_batch_size * args.seq_length
    return 6.0 * tokens * macs_per_token


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def resident_memory_gb() -> Optional[float]:
    """GPU memory allocated between steps (None on CPU): weights, gradients, optimizer states, INT8 weight
    caches and CUDA-graph buffers. Peak less this is what the step itself needs, mostly activations."""
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class GcPauses:
    """Python's cyclic garbage collections in this process (their number and wall time since the last
    `take`), from `gc.callbacks`. A collection pauses the host, and under tensor parallelism one rank's
    pause stalls the others at the next collective, so the log line reports them (see --manual-gc)."""

    def __init__(self):
        self.count, self.seconds, self._start = 0, 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def take(self) -> Tuple[int, float]:
        taken = (self.count, self.seconds)
        self.count, self.seconds = 0, 0.0
        return taken

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class StepPhases:
    """Wall time of one training step's parts, and the CUDA allocator's slow paths in it.

    A step is host-bound when its GPU waits for the host: then the phases that wait for the GPU (the
    non-finite check and the loss reduction hold the step's first host syncs) are near zero. (Process CPU
    time would not tell: CUDA's host syncs spin by default.) `cudaMalloc` calls and allocator retries (a
    retry frees every cached block, with a device synchronize) are counted because they make single steps
    slow once memory fragments.
    """

    _ALLOCATOR_COUNTERS = {"num_device_alloc": "device_mallocs", "num_alloc_retries": "alloc_retries"}

    def __init__(self):
        self.wall_ms = {}
        self._last = time.perf_counter()
        self._allocator_start = self._allocator()

    @classmethod
    def _allocator(cls) -> dict:
        if not torch.cuda.is_available():
            return {}
        stats = torch.cuda.memory_stats()
        return {name: stats.get(key, 0) for key, name in cls._ALLOCATOR_COUNTERS.items()}

    def mark(self, phase: str) -> None:
        """Close `phase`: the wall time since the previous mark (or the start)."""
        now = time.perf_counter()
        self.wall_ms[phase] = round(self.wall_ms.get(phase, 0.0) + (now - self._last) * 1000, 3)
        self._last = now

    def record(self) -> dict:
        """The JSONL fields: phase wall times and allocator counts."""
        fields = {"phase_ms": dict(self.wall_ms)}
        end = self._allocator()
        fields.update({name: end[name] - self._allocator_start[name] for name in end})
        return fields


class TrainingLogger:
    """Writes the log line (rank 0), the JSONL log and TensorBoard scalars.

    The JSONL file gets one line per iteration ({"iteration", "lm_loss", ...}) and per validation
    ({"iteration", "valid_lm_loss"}); each line is flushed, so a crash loses nothing written. When
    a run resumes, the log continues after the checkpoint's iteration (see `_open_jsonl`).
    """

    def __init__(self, args, padded_vocab_size: int, start_iteration: int, is_writer: bool, print_fn=print):
        self.args = args
        self.is_writer = is_writer
        self.print = print_fn
        self.flops_per_iteration = model_flops_per_iteration(args, padded_vocab_size)
        self.world_size = torch.distributed.get_world_size()
        self.interval_start = time.time()
        self.interval_iterations = 0
        self.gc_pauses = GcPauses()
        self.interval_gc = [0, 0.0]  # collections and their seconds since the last log line
        self.jsonl = None
        self.tensorboard = None
        if not is_writer:
            return
        if args.log_jsonl:
            self._open_jsonl(args.log_jsonl, start_iteration)
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.print("note: --tensorboard-dir ignored: the tensorboard package is not installed "
                           "(pip install tensorboard)")
            else:
                self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=10)

    def _open_jsonl(self, path: str, start_iteration: int) -> None:
        """Append to the log. Resuming, the lines of iterations after the checkpoint's (the interrupted run's,
        about to be redone) move to the end of PATH.after-<iteration>, and so does a last line that a kill cut
        short; from scratch, an earlier log moves to the end of PATH.previous."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = [line for line in f if line.strip()]
            cut = None
            if lines and not lines[-1].endswith("\n"):  # a kill mid-write: complete it, or set it aside if cut short
                lines[-1] += "\n"
                try:
                    json.loads(lines[-1])
                except json.JSONDecodeError:
                    cut = len(lines) - 1
            earlier = [start_iteration > 0 and i != cut and json.loads(line).get("iteration", 0) <= start_iteration
                       for i, line in enumerate(lines)]
            kept = [line for line, keep in zip(lines, earlier) if keep]
            if len(kept) < len(lines):
                aside = f"{path}.after-{start_iteration}" if start_iteration > 0 else f"{path}.previous"
                with open(aside, "a", encoding="utf-8") as f:  # a second interruption after the same checkpoint
                    f.writelines(line for line, keep in zip(lines, earlier) if not keep)
                self.print(f"note: {len(lines) - len(kept)} line(s) of {path} after iteration {start_iteration} "
                           f"moved to {aside}")
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)
        self.jsonl = open(path, "a", encoding="utf-8")

    def _write(self, record: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def training_step(self, iteration: int, consumed_samples: int, loss: float, lr: float,
                      grad_norm: Optional[float], skipped: bool, step_seconds: float,
                      phases: Optional[StepPhases] = None, health_summary: str = "", last: bool = False) -> None:
        """One step's JSONL record (and TensorBoard scalars); the console line every --log-interval iterations and
        at the run's `last` iteration (--train-iters, --exit-interval, a signal)."""
        args = self.args
        self.interval_iterations += 1
        if not self.is_writer:
            return
        tokens_per_s = args.global_batch_size * args.seq_length / max(step_seconds, 1e-9)
        resident = resident_memory_gb()
        gc_count, gc_seconds = self.gc_pauses.take()
        self.interval_gc[0] += gc_count
        self.interval_gc[1] += gc_seconds
        self._write({"iteration": iteration, "consumed_samples": consumed_samples, "lm_loss": loss, "lr": lr,
                     "grad_norm": grad_norm, "skipped": skipped, "step_time_s": round(step_seconds, 6),
                     "gc_collections": gc_count, "gc_ms": round(gc_seconds * 1000, 3),
                     "tokens_per_s": round(tokens_per_s, 1), "peak_memory_gb": round(peak_memory_gb(), 4),
                     "memory_between_steps_gb": None if resident is None else round(resident, 4),
                     "int8": bool(args.int8_linear),
                     "fp8_peer": getattr(args, "fp8_peer", None), **(phases.record() if phases else {})})
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("lm loss", loss, iteration)
            self.tensorboard.add_scalar("learning-rate", lr, iteration)
            if grad_norm is not None:
                self.tensorboard.add_scalar("grad-norm", grad_norm, iteration)
            self.tensorboard.add_scalar("tokens-per-second", tokens_per_s, iteration)
        if iteration % args.log_interval and iteration != args.train_iters and not last:
            return
        elapsed = time.time() - self.interval_start
        per_iteration = elapsed / max(self.interval_iterations, 1)
        tflops = self.flops_per_iteration / per_iteration / self.world_size / 1e12
        interval_tokens_per_s = args.global_batch_size * args.seq_length / per_iteration
        norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
        self.print(
            f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {consumed_samples:12d} | "
            f"elapsed time per iteration (ms): {per_iteration * 1000:.1f} | tokens/s: {interval_tokens_per_s:.0f} | "
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.2f} | learning rate: {lr:.6E} | "
            f"global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} | grad norm: {norm} | "
            f"peak memory (GB): {peak_memory_gb():.2f} | "
            + (f"memory between steps (GB): {resident:.2f} | " if resident is not None else "") +
            f"gc: {self.interval_gc[0]} collections, {self.interval_gc[1] * 1000 / max(self.interval_iterations, 1):.1f} ms "
            f"per iteration | "
            f"ETA: {format_duration(per_iteration * (args.train_iters - iteration))}"
            + (" | skipped (non-finite gradients)" if skipped else "")
            + (f" | {health_summary}" if health_summary else ""))
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("throughput-tflops-per-gpu", tflops, iteration)
        self.interval_start = time.time()
        self.interval_iterations = 0
        self.interval_gc = [0, 0.0]

    def int8_health(self, checks) -> None:
        """One JSONL line per statistics check ({"iteration", "int8_health": {name: value}}, names as
        training.health.scalars gives them) and the same TensorBoard scalars."""
        from .health import scalars

        if not self.is_writer:
            return
        for iteration, by_linear in checks:
            values = scalars(by_linear)
            self._write({"iteration": iteration, "int8_health": values})
            if self.tensorboard is not None:
                for name, value in values.items():
                    self.tensorboard.add_scalar(name, value, iteration)

    def int8_fallback(self, event: dict) -> None:
        """A fallback move: logged with its reason, and one JSONL line {"iteration", "int8_fallback": event}."""
        if not self.is_writer:
            return
        self.print(f" int8 fallback at iteration {event['iteration']}: {event['linear']} {event['gemm']}: "
                   f"{event['change']} ({event['reason']})")
        self._write({"iteration": event["iteration"], "int8_fallback": event})

    def validation(self, iteration: int, loss: float) -> None:
        if not self.is_writer:
            return
        self._write({"iteration": iteration, "valid_lm_loss": loss})
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("lm loss validation", loss, iteration)
        line = f" validation loss at iteration {iteration} | lm loss: {loss:.6E} | lm loss PPL: {perplexity(loss):.6E}"
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))

    def pause_interval(self, seconds: float) -> None:
        """Exclude time spent on evaluation or checkpointing from the throughput."""
        self.interval_start += seconds

    def close(self) -> None:
        self.gc_pauses.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) as Megatron-LM's log does."""
    return math.exp(min(loss, 20.0))
