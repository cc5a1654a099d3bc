"""CPU thread choice for a shared machine."""

import pytest

from te_core.demo import threads


def test_choose_threads_leaves_out_busy_cpus():
    assert threads.choose_threads(2, 2.0, 2) == 1  # at least one
    assert threads.choose_threads(2, 0.6, 2) == 1
    assert threads.choose_threads(2, 0.4, 2) == 2
    assert threads.choose_threads(8, 3.4, 8) == 5
    assert threads.choose_threads(8, 0.0, 4) == 4  # never above torch's default
    assert threads.choose_threads(4, None, 4) == 4  # load unknown: torch's default
    with pytest.raises(ValueError, match="must be >= 1"):
        threads.choose_threads(0, None, 2)


def test_busy_cpus_is_a_share_of_the_machine(monkeypatch):
    samples = iter([(1000, 4000), (1300, 4400)])  # 300 of 400 jiffies idle over the sample
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    assert threads.busy_cpus(interval=0.0) == pytest.approx(1.0)
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    assert threads.busy_cpus(interval=0.0) is None


def test_pick_honours_a_request_and_describes_the_choice(monkeypatch):
    choice = threads.pick(3)
    assert choice.threads == 3 and choice.requested and not choice.reduced
    assert choice.describe().startswith("3 threads (") and "as requested" in choice.describe()
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        threads.pick(0)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 1.7)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "_torch_default", lambda: 2)
    auto = threads.pick()
    assert auto.threads == 1 and auto.reduced and auto.describe() == "1 thread (2 cpus, 1.7 busy with other work)"


def test_a_request_above_the_cpus_is_called_oversubscribed(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    assert threads.pick(3).oversubscribed
    assert not threads.pick(2).oversubscribed
    monkeypatch.setattr(threads, "busy_cpus", lambda: 0.0)
    monkeypatch.setattr(threads, "_torch_default", lambda: 2)
    assert not threads.pick().oversubscribed  # chosen, never above the CPUs
