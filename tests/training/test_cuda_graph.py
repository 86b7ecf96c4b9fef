"""GraphedForwardBackward's bookkeeping on CPU (the capture itself needs a GPU: tests/training/test_training_gpu.py):
which calls run eagerly, which capture, which replay, and that `recapture()` (after an INT8 fallback changed the
layers' recipes) drops the evaluation graph as well as the training graph."""
from megatron_int8.training.cuda_graph import GraphedForwardBackward


class FakeGraph:
    def __init__(self, log, forward_only):
        self.log, self.forward_only = log, forward_only

    def replay(self):
        self.log.append(("replay", self.forward_only))


def graphed(monkeypatch, warmup_steps):
    log = []

    def forward_backward(**kwargs):
        log.append(("eager", kwargs["forward_only"]))
        return [kwargs["forward_only"]]

    def capture(self, forward_only, kwargs):
        log.append(("capture", forward_only))
        self.results[forward_only] = [forward_only]
        self.graphs[forward_only] = FakeGraph(log, forward_only)

    monkeypatch.setattr(GraphedForwardBackward, "_capture", capture)
    return GraphedForwardBackward(forward_backward, warmup_steps), log


def call(wrapper, forward_only):
    return wrapper(forward_only=forward_only, data_iterator=None, num_microbatches=1)


def test_recapture_drops_the_training_and_the_evaluation_graph(monkeypatch):
    wrapper, log = graphed(monkeypatch, warmup_steps=1)
    for forward_only in (False, False, True, True):
        assert call(wrapper, forward_only) == [forward_only]
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
