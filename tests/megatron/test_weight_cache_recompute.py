"""Full activation recomputation (`--recompute-granularity full`) reuses the step's weight quantization: the
recomputed forward reads Q(W) from the weight cache (same weight version, same optimizer-step generation),
so an INT8 block quantizes each weight once per optimizer step however often its forward runs. Without the
cache (`--int8-no-weight-cache`) each micro-batch quantizes each weight three times under recomputation;
caching Q(W) only (`--int8-no-dgrad-weight-cache`) once, for dgrad's Q(W)^T. All three give the same results."""
import pytest
import torch
from mcore_helpers import outlier_tensor, single_process_megatron, tiny_config

from megatron_int8 import Int8Recipe
from megatron_int8.reference import ReferenceBackend

CACHES = {"both": dict(), "forward only": dict(cache_dgrad_weight=False), "off": dict(cache_weights=False)}


def _count_weight_quantizations(monkeypatch):
    """A list that grows by (rowwise, columnwise) per backend.quantize call on a weight (the reference backend)."""
    calls = []
    quantize = ReferenceBackend.quantize

    def counting(self, x, **kw):
        if kw.get("weight"):
            calls.append((kw["rowwise"], kw["columnwise"]))
        return quantize(self, x, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", counting)
    return calls


def _train_two_steps(cache: str, calls):
    """Two optimizer steps of two micro-batches each on a 2-layer INT8 block with full recomputation; asserts the
    number of weight quantizations per step; returns the final weights."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_int8.megatron.layers import Int8LinearMixin
    from megatron_int8.megatron.policy import Int8Policy
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    with single_process_megatron():
        config = tiny_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        recipe = Int8Recipe(backend="reference", **CACHES[cache])
        torch.manual_seed(0)
        block = TransformerBlock(config, spec=get_gpt_int8_block_spec(config, Int8Policy(recipe=recipe)))
        linears = [m for m in block.modules() if isinstance(m, Int8LinearMixin)]
        assert len(linears) == 4 * config.num_layers
        forwards = []
        for m in linears:
            m.register_forward_hook(lambda *_: forwards.append(1))
        optimizer = torch.optim.SGD(block.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        L = len(linears)
        # per step: forward, recomputed forward and dgrad of 2 micro-batches; the cache serves what it holds
        per_step = {"both": L, "forward only": L + 2 * L, "off": 2 * 3 * L}[cache]
        for step in range(2):
            for _ in range(2):
                x = outlier_tensor(8, 2, config.hidden_size, generator=gen).requires_grad_(True)
                block(x, attention_mask=None).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            # each linear ran forward twice per micro-batch: once in forward, once recomputed in backward
            assert len(forwards) == (step + 1) * 2 * 2 * L
            assert len(calls) == (step + 1) * per_step, (cache, step, calls)
        if cache == "forward only":  # what stays cached between steps is Q(W) alone
            assert all(m.weight._megatron_int8_quantized.col is None for m in linears)
        return [p.detach().clone() for p in block.parameters()]


@pytest.mark.parametrize("cache", list(CACHES))
def test_recomputed_forward_does_not_requantize_weights(monkeypatch, cache):
    calls = _count_weight_quantizations(monkeypatch)
    weights = _train_two_steps(cache, calls)
    if cache != "both":
        monkeypatch.undo()
        for got, want in zip(weights, _train_two_steps("both", _count_weight_quantizations(monkeypatch))):
            assert torch.equal(got, want)
