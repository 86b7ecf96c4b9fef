"""Whole-step CUDA graphs for the trainer (`--cuda-graph-impl local`).

A training step's forward and backward over all its micro-batches is captured once, after a few eager
steps, and replayed on every later step: the host then launches one graph instead of thousands of kernels,
which is what an INT8 step at tensor-parallel size 4 and micro-batch 1 waits for (docs/scaling.md).

Same idea as megatron-core's `FullCudaGraphWrapper`, with one difference that makes it work here: the
graph is captured on the stream the whole run uses (`use_side_stream`, set before the model is built), so
every autograd node, DDP's gradient-accumulation hooks included, belongs to the capturing stream. Nodes
created on the legacy default stream would make the autograd engine synchronize it with the capture,
which CUDA forbids.

The step's NCCL traffic is part of the graph: sequence-parallel gathers, pipeline sends and receives
(megatron's device sync after each batched exchange is off: `batch_p2p_sync`), and the data-parallel
gradient reduce-scatter, also when `--overlap-grad-reduce` launches it from backward's hooks on NCCL's
stream (the step waits for it before its end, so the capture joins it).

What a replay cannot do, `args._validate_cuda_graph` rejects up front. The INT8 weight cache is invalidated
right before a capture, so the captured step quantizes its weights itself (see `_capture`).

MoE layers can be captured when every expert's input is padded to its capacity (megatron's
`moe_expert_capacity_factor` with `moe_pad_expert_input_to_capacity`, alltoall dispatcher): the router drops and
pads on the device, the dispatcher sizes everything from shapes, and the grouped experts take their row counts
from shapes too (`megatron.experts.padded_expert_capacity`), so nothing in the step reads a device value on the host.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..ops.linear import invalidate_weight_caches


def use_side_stream() -> None:
    """Make a fresh stream current for the rest of the run (call before building the model)."""
    torch.cuda.set_stream(torch.cuda.Stream())


class GraphedForwardBackward:
    """Wraps megatron's `forward_backward_func`: eager for the first `warmup_steps` calls, then one
    capture (followed by its replay) and replays only. Training and evaluation (`forward_only`) get a
    graph each. Micro-batches are copied into static buffers, the graph's inputs, before every call."""

    def __init__(self, forward_backward, warmup_steps: int):
        self.forward_backward = forward_backward
        self.warmup_steps = warmup_steps
        self.calls = {False: 0, True: 0}
        self.graphs: Dict[bool, torch.cuda.CUDAGraph] = {}
        self.results: Dict[bool, list] = {}
        self.batches: Dict[bool, List[dict]] = {False: [], True: []}
        self.eager_next = False

    def run_next_eagerly(self) -> None:
        """Run the next training call eagerly, not as a replay (a step whose Python must run: INT8 health
        probes). The graphs stay; the replays after it are unchanged."""
        self.eager_next = True

    def recapture(self) -> None:
        """Drop both graphs, training's and evaluation's: the next calls of each warm up eagerly again, then
        capture (after the layers' recipes changed, e.g. an INT8 fallback, whose new kernels must compile and
        tune outside a capture; an evaluation graph kept would go on replaying the old recipes)."""
        for forward_only in (False, True):
            self.graphs.pop(forward_only, None)
            self.results.pop(forward_only, None)
            self.calls[forward_only] = 0

    def __call__(self, **kwargs):
        forward_only = kwargs["forward_only"]
        kwargs["data_iterator"] = self._static_batches(kwargs["data_iterator"], forward_only,
                                                       kwargs["num_microbatches"])
        if self.eager_next and not forward_only:
            self.eager_next = False
            return self.forward_backward(**kwargs)
        calls = self.calls[forward_only]
        self.calls[forward_only] += 1
        if forward_only not in self.graphs:
            if calls < self.warmup_steps:
                return self.forward_backward(**kwargs)
            self._capture(forward_only, kwargs)
        self.graphs[forward_only].replay()
        if not forward_only:  # the training step reduces its losses before the next replay: no copies there
            return self.results[forward_only]
        # evaluation keeps --eval-iters calls' results and averages them: copies, since the next replay writes
        # into the same tensors
        return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in item.items()}
                for item in self.results[forward_only]]

    def _capture(self, forward_only: bool, kwargs: dict) -> None:
        from megatron.core.tensor_parallel.random import get_all_rng_states

        # An entry cached by an eager pass (a validation after the last update) would be captured as a
        # read, and every replay would use those weights: invalidated, the first micro-batch quantizes.
        invalidate_weight_caches()
        torch.cuda.synchronize()
        torch.distributed.barrier()  # every rank captures the same collectives
        graph = torch.cuda.CUDAGraph()
        for state in get_all_rng_states().values():  # megatron's named streams (cudagraph-safe generators)
            graph.register_generator_state(state)
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            self.results[forward_only] = self.forward_backward(**kwargs)
        self.graphs[forward_only] = graph
        torch.cuda.synchronize()
        torch.distributed.barrier()

    def _static_batches(self, data_iterator, forward_only: bool, num_microbatches: int):
        """An iterator over this call's micro-batches, copied into the same CUDA tensors every call."""
        if data_iterator is None:  # a stage that receives activations, not tokens
            return None
        buffers = self.batches[forward_only]
        for i in range(num_microbatches):
            batch = next(data_iterator)
            if i == len(buffers):
                buffers.append({k: v.detach().to("cuda", copy=True) if isinstance(v, torch.Tensor) else v
                                for k, v in batch.items()})
                continue
            static = buffers[i]
            if static.keys() != batch.keys():
                raise ValueError(f"--cuda-graph-impl local: micro-batch fields changed from {sorted(static)} to "
                                 f"{sorted(batch)}")
            for k, v in batch.items():
                if isinstance(v, torch.Tensor):
                    if v.shape != static[k].shape or v.dtype != static[k].dtype:
                        raise ValueError(f"--cuda-graph-impl local: micro-batch field {k!r} changed from "
                                         f"{tuple(static[k].shape)} {static[k].dtype} to {tuple(v.shape)} {v.dtype}")
                    static[k].copy_(v, non_blocking=True)
                elif v is not static[k] and v != static[k]:
                    raise ValueError(f"--cuda-graph-impl local: micro-batch field {k!r} changed")
        return iter(buffers[:num_microbatches])
