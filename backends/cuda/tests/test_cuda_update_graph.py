"""The update-graph cache's decisions, with capture and replay faked (runs on the CPU; the real
capture and replay are checked on the GPU in test_cuda_graphs.py)."""
import pytest
import torch
from te_backend_cuda import update_graph


class _FakeGraph:
    def __init__(self, launch):
        self.launch, self.replays = launch, 0

    def replay(self):
        self.replays += 1
        self.launch()


def _setup(monkeypatch, capturing=False):
    captured = []

    def capture(launch):
        captured.append(_FakeGraph(launch))
        return captured[-1]

    monkeypatch.setattr(update_graph, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    update_graph.clear()
    return captured


def test_first_call_launches_second_captures_then_replays(monkeypatch):
    captured = _setup(monkeypatch)
    launches = []
    for _ in range(4):
        update_graph.run(("k",), lambda: "plan", lambda: launches.append(1))
    assert len(launches) == 4  # exactly one update per call, whichever way it ran
    assert len(captured) == 1 and captured[0].replays == 3  # captured on call 2, replayed on 2, 3, 4
    assert update_graph._GRAPHS[("k",)] == (captured[0], "plan")  # the plan is kept with its graph
    update_graph.clear()


def test_inside_a_capture_it_only_launches(monkeypatch):
    captured = _setup(monkeypatch, capturing=True)
    launches = []
    for _ in range(3):
        update_graph.run(("k",), lambda: "plan", lambda: launches.append(1))
    assert len(launches) == 3 and not captured and ("k",) not in update_graph._GRAPHS


def test_cache_is_bounded(monkeypatch):
    _setup(monkeypatch)
    for i in range(update_graph.MAX_GRAPHS + 5):
        update_graph.run(("k", i), lambda: "plan", lambda: None)
    assert len(update_graph._GRAPHS) <= update_graph.MAX_GRAPHS
    update_graph.clear()


def test_a_failed_capture_falls_back_to_direct_launches(monkeypatch):
    _setup(monkeypatch)

    def failing_capture(launch):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(update_graph, "_capture", failing_capture)
    launches = []
    update_graph.run(("k",), lambda: "plan", lambda: launches.append(1))
    with pytest.warns(RuntimeWarning, match="could not be captured.*launches directly"):
        update_graph.run(("k",), lambda: "plan", lambda: launches.append(1))
    update_graph.run(("k",), lambda: "plan", lambda: launches.append(1))  # no second attempt, no warning
    assert len(launches) == 3 and update_graph._GRAPHS[("k",)][0] == update_graph.DIRECT
    update_graph.clear()


def test_the_plan_is_made_before_the_capture(monkeypatch):
    # te_triton's plan cache is bounded: a plan dropped between the first launch and the capture
    # would be rebuilt inside the capture, whose host-to-device copy of its table a capture refuses
    _setup(monkeypatch)
    events = []

    def capture(launch):
        events.append("capture")
        return _FakeGraph(launch)

    monkeypatch.setattr(update_graph, "_capture", capture)

    def plan():
        events.append("plan")
        return "plan"

    update_graph.run(("k",), plan, lambda: None)
    events.clear()
    update_graph.run(("k",), plan, lambda: None)
    assert events[:2] == ["plan", "capture"]
    update_graph.clear()
