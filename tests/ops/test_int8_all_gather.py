"""Sequence parallelism over gloo (2 ranks): the INT8 all-gather (tensorwise and row-wise) gives
bit-identical results to gathering BF16 and quantizing the gathered tensor, keeps only the local INT8
shard for backward, and matches the unsharded forward exactly."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from free_ports import init_gloo

from megatron_int8 import Int8Recipe, TPOptions, int8_linear

GRANULARITIES = ("tensor", "row")


def _worker(rank, world, store, result_path):
    init_gloo(rank, world, store)
    try:
        g = torch.Generator().manual_seed(0)
        # column-parallel linear: N is the local shard; 7 x 3 = 21 local tokens (42 gathered: the token axis
        # of the wgrad operands is padded to 48); an outlier channel that only rank 1's tokens carry, so
        # per-channel scales must come from the whole group
        S, B, K, N = 14, 3, 64, 24
        x_full = torch.randn(S, B, K, generator=g) * torch.where(torch.rand(S, B, K, generator=g) < 0.02, 20.0, 1.0)
        x_full[S // 2:, :, 5] *= 300
        w = torch.randn(N, K, generator=g) + rank  # per-rank weight shard
        gy = torch.randn(S, B, N, generator=g)
        x_local = x_full.chunk(world, dim=0)[rank].clone()
        out = {}
        for granularity in GRANULARITIES:
            results = {}
            for gather_int8 in (False, True):
                xl = x_local.clone().requires_grad_()
                wl = w.clone().requires_grad_()
                tp = TPOptions(group=dist.group.WORLD, sequence_parallel=True)
                recipe = Int8Recipe(granularity=granularity, int8_all_gather=gather_int8)
                y = int8_linear(xl, wl, None, recipe, tp=tp)
                saved = [(t.dtype, t.numel()) for t in y.grad_fn.saved_tensors]
                y.backward(gy)
                results[gather_int8] = (y.detach(), xl.grad, wl.grad, saved)
            same = [torch.equal(a, b) for a, b in zip(results[False][:3], results[True][:3])]
            # unsharded: quantizing the full input must give the same forward
            y_ref = int8_linear(x_full, w, None, Int8Recipe(granularity=granularity))
            out[granularity] = {"same": same, "fwd_equal": torch.equal(y_ref, results[True][0]),
                                "saved": results[True][3], "shape": tuple(results[True][0].shape)}
        torch.save(out, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(120)
def test_int8_all_gather_is_bit_identical_to_bf16_gather(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path / "r")), nprocs=world, join=True)
    for rank in range(world):
        results = torch.load(tmp_path / f"r.{rank}")
        for granularity in GRANULARITIES:
            r = results[granularity]
            what = f"rank {rank}, {granularity}-wise"
            assert r["same"] == [True] * 3, f"{what}: output/dgrad/wgrad of the INT8 all-gather differ from BF16's"
            assert r["fwd_equal"], f"{what}: sequence-parallel forward differs from the unsharded one"
            int8_saved = [n for dtype, n in r["saved"] if dtype == torch.int8]
            assert int8_saved == [14 // world * 3 * 64], f"{what}: backward must keep only the local INT8 shard"
            assert r["shape"] == (14, 3, 24)


def _nonfinite_worker(rank, world, store, result_path):
    init_gloo(rank, world, store)
    try:
        raised = {}
        for bad, granularity in [(b, g) for b in (float("nan"), float("inf")) for g in GRANULARITIES]:
            x = torch.randn(4, 2, 32)
            if rank == 1:
                x[1, 0, 3] = bad  # only rank 1's shard holds it
            recipe = Int8Recipe(granularity=granularity, int8_all_gather=True, check_finite="immediate")
            try:
                int8_linear(x, torch.randn(8, 32), None, recipe,
                            tp=TPOptions(group=dist.group.WORLD, sequence_parallel=True))
                raised[(bad, granularity)] = False
            except FloatingPointError:
                raised[(bad, granularity)] = True
        torch.save(raised, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(120)
def test_int8_all_gather_immediate_check_raises_on_every_rank(tmp_path):
    """A NaN or Inf in one rank's shard: with check_finite="immediate" every rank raises (none is left waiting in
    a collective the raising rank never reaches)."""
    world = 2
    mp.spawn(_nonfinite_worker, args=(world, str(tmp_path / "store"), str(tmp_path / "r")), nprocs=world, join=True)
    for rank in range(world):
        raised = torch.load(tmp_path / f"r.{rank}")
        assert len(raised) == 4 and all(raised.values()), (rank, raised)
