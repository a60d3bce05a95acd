"""`init_local_ray`'s one retry: Ray gives a new node's raylet a fixed 30 s to register (not configurable), which a
loaded machine can pass; that failure, and only that one, starts the node once more. Pure logic: `ray.init` and
`ray.shutdown` are replaced here (the real start is every Ray test's fixture)."""

from __future__ import annotations

import pytest

from deploy import controller

TIMEOUT = Exception(f"{controller.RAY_NODE_START_TIMEOUT}. This could happen because some of the raylet failed")


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[str] = []

    def init(self, **kwargs: object) -> None:
        self.calls.append("init")
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_a_node_start_timeout_is_retried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay([TIMEOUT])
    monkeypatch.setattr(controller, "ray", fake)
    controller.init_local_ray()
    assert fake.calls == ["init", "shutdown", "init"]


def test_a_second_timeout_or_another_error_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay([TIMEOUT, TIMEOUT])
    monkeypatch.setattr(controller, "ray", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        controller.init_local_ray()
    assert fake.calls == ["init", "shutdown", "init"]
    other = FakeRay([ValueError("bad resources")])
    monkeypatch.setattr(controller, "ray", other)
    with pytest.raises(ValueError, match="bad resources"):
        controller.init_local_ray()
    assert other.calls == ["init"]
