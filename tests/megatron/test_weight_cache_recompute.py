"""Full activation recomputation (`--recompute-granularity full`) reuses the step's weight quantization: the
recomputed forward reads Q(W) from the weight cache (same weight version, same optimizer-step generation),
so an INT8 block quantizes each weight once per optimizer step however often its forward runs. Without the
cache (`--int8-no-weight-cache`) each micro-batch quantizes each weight three times under recomputation."""
import pytest
import torch
from mcore_helpers import outlier_tensor, single_process_megatron, tiny_config

from megatron_int8 import Int8Recipe
from megatron_int8.reference import ReferenceBackend


def _count_weight_quantizations(monkeypatch):
    """A list that grows by one per backend.quantize call on a weight (the reference backend)."""
    calls = []
    quantize = ReferenceBackend.quantize

    def counting(self, x, **kw):
        if kw.get("weight"):
            calls.append(tuple(x.shape))
        return quantize(self, x, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", counting)
    return calls


@pytest.mark.parametrize("cache_weights", [True, False])
def test_recomputed_forward_does_not_requantize_weights(monkeypatch, cache_weights):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_int8.megatron.layers import Int8LinearMixin
    from megatron_int8.megatron.policy import Int8Policy
    from megatron_int8.megatron.spec import get_gpt_int8_block_spec

    calls = _count_weight_quantizations(monkeypatch)
    with single_process_megatron():
        config = tiny_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        recipe = Int8Recipe(backend="reference", cache_weights=cache_weights)
        block = TransformerBlock(config, spec=get_gpt_int8_block_spec(config, Int8Policy(recipe=recipe)))
        linears = [m for m in block.modules() if isinstance(m, Int8LinearMixin)]
        assert len(linears) == 4 * config.num_layers
        forwards = []
        for m in linears:
            m.register_forward_hook(lambda *_: forwards.append(1))
        optimizer = torch.optim.SGD(block.parameters(), lr=1e-3)

        def micro_batch():
            x = outlier_tensor(8, 2, config.hidden_size).requires_grad_(True)
            block(x, attention_mask=None).float().pow(2).mean().backward()

        for step in range(2):
            for _ in range(2):
                micro_batch()
            optimizer.step()
            optimizer.zero_grad()
            # each linear ran forward twice per micro-batch: once in forward, once recomputed in backward
            assert len(forwards) == (step + 1) * 2 * 2 * len(linears)
            # cached: one quantization per weight and optimizer step (Q(W) and Q(W)^T in one pass); uncached:
            # three per micro-batch: Q(W) in forward, Q(W) again in the recomputed forward, Q(W)^T for dgrad
            per_step = len(linears) if cache_weights else 2 * 3 * len(linears)
            assert len(calls) == (step + 1) * per_step, (cache_weights, step, len(calls))
