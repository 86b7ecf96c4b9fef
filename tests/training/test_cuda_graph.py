"""GraphedForwardBackward's bookkeeping on CPU (the capture itself needs a GPU: tests/training/test_training_gpu.py):
which calls run eagerly, which capture, which replay, and that `recapture()` (after an INT8 fallback changed the
layers' recipes) drops the evaluation graph as well as the training graph."""
import torch

from megatron_int8.training.cuda_graph import GraphedForwardBackward


class FakeGraph:
    """A replay writes the next batch's loss into the captured output tensor, as a CUDA graph's replay does."""

    def __init__(self, log, forward_only, results):
        self.log, self.forward_only, self.results = log, forward_only, results

    def replay(self):
        self.log.append(("replay", self.forward_only))
        self.results[0]["lm loss"].add_(1.0)


def graphed(monkeypatch, warmup_steps):
    log = []

    def forward_backward(**kwargs):
        log.append(("eager", kwargs["forward_only"]))
        return [{"lm loss": torch.tensor(-1.0)}]

    def capture(self, forward_only, kwargs):
        log.append(("capture", forward_only))
        self.results[forward_only] = [{"lm loss": torch.tensor(0.0)}]
        self.graphs[forward_only] = FakeGraph(log, forward_only, self.results[forward_only])

    monkeypatch.setattr(GraphedForwardBackward, "_capture", capture)
    return GraphedForwardBackward(forward_backward, warmup_steps), log


def call(wrapper, forward_only):
    return wrapper(forward_only=forward_only, data_iterator=None, num_microbatches=1)


def test_recapture_drops_the_training_and_the_evaluation_graph(monkeypatch):
    wrapper, log = graphed(monkeypatch, warmup_steps=1)
    for forward_only in (False, False, True, True):
        assert [list(item) for item in call(wrapper, forward_only)] == [["lm loss"]]
    assert log == [("eager", False), ("capture", False), ("replay", False),
                   ("eager", True), ("capture", True), ("replay", True)]
    log.clear()
    wrapper.recapture()  # the recipes changed: neither graph may replay the old kernels
    for forward_only in (True, False, True, False):
        call(wrapper, forward_only)
    assert log == [("eager", True), ("eager", False), ("capture", True), ("replay", True),
                   ("capture", False), ("replay", False)]


def test_an_eager_step_between_replays_keeps_the_graphs(monkeypatch):
    wrapper, log = graphed(monkeypatch, warmup_steps=0)
    call(wrapper, False)
    wrapper.run_next_eagerly()  # a health-probe step
    call(wrapper, False)
    call(wrapper, False)
    assert log == [("capture", False), ("replay", False), ("eager", False), ("replay", False)]


def test_each_replay_returns_its_own_results(monkeypatch):
    """Evaluation keeps --eval-iters calls' results and averages them: each replay's must be its own, not the
    captured tensors that the next replay writes over (the average was then the last batch's loss)."""
    wrapper, _ = graphed(monkeypatch, warmup_steps=1)
    kept = [call(wrapper, True)[0]["lm loss"] for _ in range(5)]
    assert [float(v) for v in kept] == [-1.0, 1.0, 2.0, 3.0, 4.0]
