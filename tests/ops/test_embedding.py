"""The word embedding's and the output layer's weight gradients go straight into main_grad (megatron_int8.ops.embedding,
layers.fuse_output_layer_wgrad, training.model.fuse_wgrad): against float64 references, tied and untied."""
import os

import pytest
import torch
from mcore_helpers import init_megatron, outlier_tensor, run_distributed, single_process_megatron, tiny_config
from repo_paths import CONFIGS

FP32_EPS = 2.0**-24


@pytest.mark.parametrize("vocab,tokens,distinct", [(50, (3, 100), 40), (7, (1, 1), 1), (9, (4, 16), 1)])
def test_add_rows_into_adds_each_ids_rows_once(vocab, tokens, distinct):
    """main_grad[i] += the sum of the rows of the tokens with id i (many repeats, ids 0 and vocab - 1, a single
    token, all tokens alike); rows of absent ids stay bit for bit. On the CPU the result equals megatron's route,
    F.embedding's dense gradient added once, bit for bit."""
    from megatron_int8.ops.embedding import add_rows_into

    gen = torch.Generator().manual_seed(vocab)
    hidden = 24
    ids = torch.randint(vocab - distinct, vocab, tokens, generator=gen)
    if distinct > 2:
        ids.view(-1)[:3] = 0
    rows = outlier_tensor(*tokens, hidden, generator=gen)
    main_grad = outlier_tensor(vocab, hidden, generator=gen)
    before = main_grad.clone()
    add_rows_into(main_grad, ids, rows.to(torch.bfloat16))  # bf16 rows, as the embedding's gradient arrives

    flat, rows64 = ids.reshape(-1), rows.to(torch.bfloat16).double().reshape(-1, hidden)
    expected = before.double().index_add(0, flat, rows64)
    counts = torch.bincount(flat, minlength=vocab)[:, None].double()
    bound = (counts + 1) * FP32_EPS * before.double().abs().index_add(0, flat, rows64.abs())
    assert ((main_grad.double() - expected).abs() <= bound).all()
    absent = counts[:, 0] == 0
    assert absent.any() and torch.equal(main_grad[absent], before[absent])
    assert not torch.equal(main_grad[~absent], before[~absent])
    dense = torch.ops.aten.embedding_dense_backward(rows.to(torch.bfloat16).float().reshape(-1, hidden), flat, vocab,
                                                    -1, False)
    assert torch.equal(main_grad, before + dense)


def test_add_rows_into_takes_int32_ids_and_no_tokens():
    """int32 ids (F.embedding takes them) give the int64 result; an empty micro-batch adds nothing."""
    from megatron_int8.ops.embedding import add_rows_into

    gen = torch.Generator().manual_seed(6)
    ids, rows = torch.randint(0, 12, (40,), generator=gen), outlier_tensor(40, 8, generator=gen)
    start = outlier_tensor(12, 8, generator=gen)
    wide, narrow = start.clone(), start.clone()
    add_rows_into(wide, ids, rows)
    add_rows_into(narrow, ids.int(), rows)
    assert torch.equal(wide, narrow) and not torch.equal(wide, start)
    add_rows_into(narrow, ids[:0], rows[:0])
    assert torch.equal(wide, narrow)


def _vocab_parallel_worker(rank, world_size, init_file, reduce_scatter):
    # a gloo test: megatron's sequence-parallel mappings allocate on the current CUDA device wherever one is visible
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    from megatron_int8.ops.embedding import fuse_embedding_wgrad

    init_megatron(world_size, rank, init_file, tp=2)
    config = tiny_config(tensor_model_parallel_size=2, sequence_parallel=reduce_scatter)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    ids[0, :4] = torch.tensor([0, 31, 32, 63])  # both partitions' edges
    g = outlier_tensor(*((8 // world_size, 2, 16) if reduce_scatter else (2, 8, 16)), generator=gen)
    g = g + rank  # each rank's own output gradient under sequence parallelism
    modules = [VocabParallelEmbedding(64, 16, init_method=torch.nn.init.normal_, config=config,
                                      reduce_scatter_embeddings=reduce_scatter) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    fused = fuse_embedding_wgrad(modules[1])
    fused.weight.main_grad = torch.zeros_like(fused.weight)
    fused.weight.grad_added_to_main_grad = False
    outputs = [m(ids) for m in modules]
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].shape == g.shape
    for out in outputs:
        out.backward(g)
    assert fused.weight.grad_added_to_main_grad
    reference = modules[0].weight.grad
    assert reference.abs().sum() > 0 and torch.equal(fused.weight.main_grad, reference)


@pytest.mark.slow
@pytest.mark.parametrize("reduce_scatter", [False, True], ids=["all-reduce", "sequence-parallel"])
def test_vocab_parallel_embedding_matches_megatrons_under_tensor_parallelism(reduce_scatter):
    """TP 2 (gloo, CPU): the rows a rank does not own are masked, the output is all-reduced (or, sequence
    parallel, reduce-scattered [s, b, h]) exactly as megatron's layer does, and each rank's main_grad equals
    megatron's weight.grad bit for bit."""
    run_distributed(_vocab_parallel_worker, 2, reduce_scatter)


class _Tap(torch.autograd.Function):
    """Identity that records the gradient passing through it."""

    @staticmethod
    def forward(ctx, x, store):
        ctx.store = store
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.store.append(grad.detach().double().cpu())
        return grad, None


@pytest.fixture
def megatron_world():
    with single_process_megatron():
        yield


@pytest.mark.parametrize("name", ["qwen3_4b", "llama2_7b"])  # tied, untied
def test_embedding_and_output_layer_wgrads_reach_main_grad_exactly_once(name, megatron_world):
    """The trainer's model (fp32 so the reference is exact to fp32 rounding), two micro-batches through megatron's
    DDP: main_grad of the embedding and output weights equals, in float64, the output layer's g^T x plus each
    token's embedding-gradient row added to its id's row, summed over both micro-batches. DDP's hook runs once per
    weight and micro-batch (overlap_grad_reduce counts on it) and leaves no weight.grad; with tied weights
    megatron's zero_out_wgrad mark is gone."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_int8.ops.embedding import MainGradEmbedding
    from megatron_int8.megatron.layers import Int8LinearMixin
    from megatron_int8.megatron.cli import policy_from_args
    from megatron_int8.training.args import parse_args, validate_args
    from megatron_int8.training.model import build_config, build_model, unwrap

    argv = ["--config", os.path.join(CONFIGS, name + ".yaml"), "--num-layers", "1", "--hidden-size", "64",
            "--ffn-hidden-size", "96", "--kv-channels", "16", "--seq-length", "32", "--max-position-embeddings", "64",
            "--tensor-model-parallel-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--global-batch-size", "2", "--micro-batch-size", "1", "--int8-linear", "--int8-backend",
            "reference"]
    args = parse_args(argv)
    args.bf16 = False
    args = validate_args(args, world_size=1)
    args.padded_vocab_size = 256
    ddp = build_model(args, build_config(args, log=lambda message: None), policy_from_args(args), 256)[0]
    model = unwrap([ddp])[0]
    embedding, output = model.embedding.word_embeddings, model.output_layer
    tied = name == "qwen3_4b"
    assert model.share_embeddings_and_output_weights == tied and (output.weight is None) == tied
    assert isinstance(embedding, MainGradEmbedding) and embedding.weight_grad_placeholder != tied
    assert isinstance(output, ColumnParallelLinear) and isinstance(output, Int8LinearMixin) and not output.int8
    assert output.gradient_accumulation_fusion
    weights = {"embedding": embedding.weight} if tied else {"embedding": embedding.weight, "output": output.weight}
    assert not getattr(embedding.weight, "zero_out_wgrad", False)
    with torch.no_grad():  # main_grad starts non-zero, as in a later micro-batch
        for w in weights.values():
            w.main_grad.copy_(outlier_tensor(*w.shape, generator=torch.Generator().manual_seed(1)))
    expected = {k: w.main_grad.double().cpu() for k, w in weights.items()}
    magnitude = {k: v.abs() for k, v in expected.items()}  # |terms| for the fp32 rounding bound
    device = embedding.weight.device
    taps = {"x": [], "embedding_rows": [], "logits": []}
    hooks = [
        output.register_forward_pre_hook(lambda m, inputs: taps["x"].append(inputs[0].detach().double().cpu()) or None),
        output.register_forward_hook(lambda m, inputs, out: (_Tap.apply(out[0], taps["logits"]), out[1])),
        embedding.register_forward_hook(lambda m, inputs, out: _Tap.apply(out, taps["embedding_rows"])),
    ]
    hook_calls = {k: 0 for k in weights}
    for key, w in weights.items():  # a second hook on the accumulator DDP hooks, as megatron registers its own
        accumulator = w.expand_as(w).grad_fn.next_functions[0][0]
        accumulator.register_hook(lambda *unused, key=key: hook_calls.__setitem__(key, hook_calls[key] + 1))
    gen = torch.Generator().manual_seed(2)
    token_batches = [torch.randint(0, 200, (1, 32), generator=gen) for _ in range(2)]
    token_batches[1][0, :8] = token_batches[0][0, 0]  # repeats, also across micro-batches
    for tokens in token_batches:
        tokens = tokens.to(device)
        loss = ddp(tokens, torch.arange(32, device=device)[None], None, labels=tokens.roll(-1, 1))
        loss.float().mean().backward()
        assert all(w.grad is None for w in weights.values())
    assert hook_calls == {k: 2 for k in weights}
    for hook in hooks:
        hook.remove()
    out_key = "embedding" if tied else "output"
    for x, g, rows, tokens in zip(taps["x"], taps["logits"], taps["embedding_rows"], token_batches):
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        expected[out_key] += g2.T @ x2
        magnitude[out_key] += (x2.shape[0] + 2) * (g2.abs().T @ x2.abs())
        # embedding output [b, s, h] -> rows in token order (b, s)
        flat, rows2 = tokens.reshape(-1), rows.reshape(-1, rows.shape[-1])
        expected["embedding"].index_add_(0, flat, rows2)
        counts = torch.bincount(flat, minlength=256)[:, None].double()
        magnitude["embedding"] += (counts + 2) * torch.zeros_like(expected["embedding"]).index_add_(0, flat, rows2.abs())
    for key, w in weights.items():
        bound = 4 * FP32_EPS * (magnitude[key] + expected[key].abs())
        err = (w.main_grad.double().cpu() - expected[key]).abs()
        assert (err <= bound).all(), (key, err.max().item(), bound.max().item())
    # the embedding's own contribution is far above the bound: dropping or doubling it would fail above
    contribution = torch.zeros(256, 64, dtype=torch.float64)
    for rows, tokens in zip(taps["embedding_rows"], token_batches):
        contribution.index_add_(0, tokens.reshape(-1), rows.reshape(-1, rows.shape[-1]))
    assert (contribution.abs() > 1e3 * 4 * FP32_EPS * (magnitude["embedding"] + expected["embedding"].abs())).any()


@pytest.mark.gpu
def test_add_rows_into_on_the_gpu_replays_in_a_cuda_graph_bit_for_bit():
    """Qwen3-4B's vocabulary, 8192 tokens with a few ids repeated hundreds of times (as frequent tokens are): the
    CUDA path (segment sums, then index_add_) is within the float64 bound, deterministic, and a captured graph's replay (the
    trainer's graphed steps) gives the same bits as the eager call."""
    from megatron_int8.ops.embedding import add_rows_into

    gen = torch.Generator().manual_seed(3)
    vocab, hidden, tokens = 151936, 256, 8192
    ids = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    ids.view(-1)[torch.randint(0, tokens, (2000,), generator=gen)] = torch.randint(0, 4, (2000,), generator=gen)
    rows = outlier_tensor(2, tokens // 2, hidden, generator=gen).to(torch.bfloat16)
    before = outlier_tensor(vocab, hidden, generator=gen)
    ids_d, rows_d = ids.cuda(), rows.cuda()
    results = []
    for _ in range(2):
        main_grad = before.cuda()
        add_rows_into(main_grad, ids_d, rows_d)
        results.append(main_grad)
    assert torch.equal(results[0], results[1])
    static = before.cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        add_rows_into(before.cuda(), ids_d, rows_d)  # warm-up off the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            add_rows_into(static, ids_d, rows_d)
    torch.cuda.synchronize()
    static.copy_(before.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, results[0])

    flat, rows64 = ids.reshape(-1), rows.double().reshape(-1, hidden)
    expected = before.double().index_add(0, flat, rows64)
    counts = torch.bincount(flat, minlength=vocab)[:, None].double()
    assert counts.max() > 400
    bound = (counts + 1) * FP32_EPS * before.double().abs().index_add(0, flat, rows64.abs())
    assert ((results[0].cpu().double() - expected).abs() <= bound).all()
