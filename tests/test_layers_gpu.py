"""GPU checks of the megatron-core integration (skipped without CUDA): INT8 layers with the
default (Triton) backend in bf16 against float64 within scale-derived bounds, a tiny INT8 GPT
training on GPU, and the layer benchmark on tiny shapes."""
import os
import subprocess
import sys

import pytest
import torch
from mcore_helpers import nearest_recipe, outlier_tensor, qgemm_bound, single_process_megatron, tiny_config

pytestmark = pytest.mark.gpu
BF16_HALF_ULP = 2.0**-9  # relative rounding of a bf16 result


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with single_process_megatron():
        yield


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_int8_column_layer_on_gpu_within_bound(granularity):
    from megatron_int8.layers import Int8ColumnParallelLinear

    gen = torch.Generator().manual_seed(0)
    config = tiny_config(params_dtype=torch.bfloat16, bf16=True)
    layer = Int8ColumnParallelLinear(256, 384, config=config, init_method=torch.nn.init.xavier_normal_, bias=False,
                                     recipe=nearest_recipe(granularity=granularity)).cuda()
    with torch.no_grad():
        layer.weight.copy_(outlier_tensor(384, 256, generator=gen, scale=8.0) * 0.05)
    x = outlier_tensor(64, 4, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_(True)
    g = outlier_tensor(64, 4, 384, generator=gen).to("cuda", torch.bfloat16)
    out, _ = layer(x)
    out.backward(g)
    x2, g2 = x.detach().double().reshape(-1, 256), g.double().reshape(-1, 384)
    w = layer.weight.detach().double()
    checks = [(out.detach().double().reshape(-1, 384), x2 @ w.T, qgemm_bound(x2, w, granularity=granularity)),
              (x.grad.double().reshape(-1, 256), g2 @ w, qgemm_bound(g2, w.T.contiguous(), granularity=granularity)),
              (layer.weight.grad.double(), g2.T @ x2,
               qgemm_bound(g2.T.contiguous(), x2.T.contiguous(), granularity=granularity))]
    for got, exact, bound in checks:
        assert ((got - exact).abs() <= bound + BF16_HALF_ULP * (exact.abs() + bound)).all()


def test_tiny_int8_gpt_trains_on_gpu():
    from megatron.core.models.gpt import GPTModel

    from megatron_int8.policy import Int8Policy
    from megatron_int8.spec import get_gpt_int8_block_spec

    torch.manual_seed(0)
    config = tiny_config(num_query_groups=2, params_dtype=torch.bfloat16, bf16=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_int8_block_spec(config, Int8Policy()),
                     vocab_size=128, max_sequence_length=64, position_embedding_type="rope").cuda().bfloat16()
    tokens = torch.randint(0, 128, (4, 65), device="cuda")
    positions = torch.arange(64, device="cuda").expand(4, -1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_bench_layer_tiny_on_gpu(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    result = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_layer.py"), "--tiny"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| INT8 |" in (tmp_path / "bench_layer.md").read_text()
