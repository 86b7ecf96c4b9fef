"""convert_to_int8_training on plain PyTorch and Hugging Face models: what is converted, state dicts,
training against an unconverted copy, DDP and FSDP2 over 2 gloo CPU ranks."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from free_ports import init_gloo
from int8_bounds import heavy_tailed
from megatron_int8 import Int8Linear, Int8Recipe, convert_to_int8_training, int8_linear
from megatron_int8.ops.module import keep_high_precision

transformers = pytest.importorskip("transformers")

# INT8 rounds each operand of a GEMM to half a step, 1/254 of its row's (or column's) max: about 1% of a
# Gaussian row's RMS once both operands and the fp32 output count. A gradient passes through up to 2 layers x
# 4 chained INT8 GEMMs in this model, so its relative (norm) error stays below 6 such steps, 6 * 2/127 ~ 0.095;
# measured 0.008-0.021. The loss (a mean over tokens) moves far less: one step, 1/127.
GRAD_REL_BOUND = 6 * 2 / 127
LOSS_REL_BOUND = 1 / 127


def tiny_llama(tie=False, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def test_converts_the_block_linears_only_and_keeps_state_dict_keys():
    ref = tiny_llama()
    model = convert_to_int8_training(copy.deepcopy(ref))
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("lm_head") is nn.Linear
    assert len(kinds) == 14 and all(k is Int8Linear for k in kinds.values())
    assert type(model.model.embed_tokens) is nn.Embedding
    assert list(model.state_dict()) == list(ref.state_dict())
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name
    tied = convert_to_int8_training(tiny_llama(tie=True))
    assert type(tied.lm_head) is nn.Linear  # tied to the embedding


def test_conversion_keeps_the_parameter_objects():
    model = tiny_llama()
    params = {n: p for n, p in model.named_parameters()}
    convert_to_int8_training(model, Int8Recipe(granularity="tensor", grad_rounding="stochastic"))
    assert all(params[n] is p for n, p in model.named_parameters())
    assert model.model.layers[0].mlp.up_proj.recipe.granularity == "tensor"


def test_conversion_refuses_int8_attention_it_cannot_apply():
    """The recipe's int8_attention concerns the megatron specs' attention; converting linears must not take it
    silently."""
    model = tiny_llama()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="int8_attention=True would be ignored"):
        convert_to_int8_training(model, Int8Recipe(int8_attention=True))
    # the SwiGLU's and the norms' INT8 inputs were taken, shown in the repr and never applied
    with pytest.raises(ValueError, match="recipe.int8_swiglu_input and int8_norm_input=True would be ignored"):
        convert_to_int8_training(model, Int8Recipe(int8_swiglu_input=True, int8_norm_input=True))
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing converted


def test_subclasses_of_linear_the_filter_accepts_are_named_in_a_warning():
    """A model of nn.Linear subclasses converted nothing and said nothing."""

    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(64, 64), ScaledLinear(64, 64), nn.Linear(64, 16))
    with pytest.warns(UserWarning, match=r"left 1 subclass\(es\) of nn.Linear.*1 \(ScaledLinear\)"):
        convert_to_int8_training(model, module_filter_fn=lambda module, fqn: True)
    assert [type(m) for m in model] == [Int8Linear, ScaledLinear, Int8Linear]
    x = torch.randn(3, 64)
    assert torch.equal(model[1](x), 2 * nn.functional.linear(x, model[1].weight, model[1].bias))  # its own forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a filter that declines it: nothing to say
        convert_to_int8_training(model, module_filter_fn=lambda module, fqn: fqn != "1")


def test_converting_again_applies_the_new_recipe_to_the_layers_it_selects():
    """A second call once left the converted layers at the first call's recipe, silently."""
    model = convert_to_int8_training(tiny_llama())
    layers = model.model.layers
    convert_to_int8_training(model, Int8Recipe(granularity="tensor"),
                             module_filter_fn=lambda module, fqn: fqn.endswith("down_proj"))
    assert [layer.mlp.down_proj.recipe.granularity for layer in layers] == ["tensor", "tensor"]
    assert {layer.mlp.up_proj.recipe.granularity for layer in layers} == {"row"}
    assert type(model.lm_head) is nn.Linear


def test_default_filter_rules_and_a_custom_filter():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(96, 32)
            self.router = nn.Linear(32, 8)  # not a multiple of 16
            self.proj = nn.Linear(32, 96)  # vocab-sized, but not the last one
            self.body = nn.Linear(96, 32)
            self.proj_out = nn.Linear(32, 96)  # the last vocab-sized linear: the head

    accept = keep_high_precision(Net())
    net = convert_to_int8_training(Net())
    assert [type(m) is Int8Linear for m in (net.router, net.proj, net.body, net.proj_out)] == [False, True, True, False]
    assert not accept(net.router, "router")
    only_body = convert_to_int8_training(Net(), module_filter_fn=lambda m, fqn: fqn == "body")
    assert [type(m) is Int8Linear for m in (only_body.proj, only_body.body)] == [False, True]
    with pytest.raises(TypeError, match="Int8Recipe"):
        convert_to_int8_training(Net(), recipe="row")


def test_int8_linear_module_equals_the_functional_op():
    lin = Int8Linear(64, 32)
    x = heavy_tailed(5, 64)
    assert torch.equal(lin(x), int8_linear(x, lin.weight, lin.bias))
    assert "int8[row" in repr(lin)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiny_llama_trains_like_the_unconverted_copy():
    ref = tiny_llama()
    model = convert_to_int8_training(copy.deepcopy(ref))
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ref, model)]
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))  # one batch, memorised
    first = None
    for step in range(4):
        losses = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            if step == 0:
                grads = _grads(m) if m is ref else (grads, _grads(m))
            opt.step()
        assert abs(losses[1] - losses[0]) <= LOSS_REL_BOUND * abs(losses[0]), (step, losses)
        first = first or losses
    ref_grads, int8_grads = grads
    for name, g in ref_grads.items():
        err = ((int8_grads[name] - g).norm() / g.norm()).item()
        assert 0 < err <= GRAD_REL_BOUND, (name, err)  # > 0: the INT8 path really ran
    assert losses[0] < first[0] - 0.1 and losses[1] < first[1] - 0.1  # both learn


def _worker(rank, world, store, mode, results):
    init_gloo(rank, world, store)
    try:
        torch.manual_seed(0)
        model = convert_to_int8_training(tiny_llama())
        ids = torch.randint(0, 256, (2 * world, 16), generator=torch.Generator().manual_seed(5))[2 * rank: 2 * rank + 2]
        if mode == "ddp":
            wrapped = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
        results[rank] = {n: g.detach().clone() for n, g in grads.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # multi-process
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_on_two_gloo_ranks(mode, tmp_path):
    """Each rank's gradients equal the mean of the two shards' gradients computed in one process."""
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, str(tmp_path / "store"), mode, results), nprocs=world, join=True)
        results = dict(results)
    single = convert_to_int8_training(tiny_llama())
    ids = torch.randint(0, 256, (2 * world, 16), generator=torch.Generator().manual_seed(5))
    expected = {n: torch.zeros_like(p) for n, p in single.named_parameters()}
    for r in range(world):
        single.zero_grad()
        shard = ids[2 * r: 2 * r + 2]
        single(input_ids=shard, labels=shard).loss.backward()
        for n, p in single.named_parameters():
            expected[n] += p.grad / world
    for r in range(world):
        for n, g in expected.items():
            torch.testing.assert_close(results[r][n], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(),
                                       msg=lambda m: f"rank {r} {n}: {m}")
