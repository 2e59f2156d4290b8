import pytest

from fedswarm.tasks import registry as reg
from fedswarm.tasks.registry import TaskEstimate, TaskRegistry, UnknownTask


class EchoTask:
    name = "echo"

    def estimate(self, params):
        return TaskEstimate(mem_bytes=0, ref_seconds=0.0)

    def run(self, params, shard, *, device):
        return {"shard": shard}


class FakeEP:
    def __init__(self, name, obj):
        self.name, self._obj = name, obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_builtins_and_unknown():
    r = TaskRegistry(plugins=False)
    assert r.names() == ["llm-batch", "tensor-map"]
    assert r.get("tensor-map").name == "tensor-map"
    with pytest.raises(UnknownTask, match="unknown task kind"):
        r.get("nope")
    with pytest.raises(ValueError):  # UnknownTask is a ValueError
        r.get(123)


def test_register_and_duplicates():
    r = TaskRegistry(plugins=False)
    r.register(EchoTask())
    assert r.get("echo").run({}, 3, device="cpu") == {"shard": 3}
    with pytest.raises(ValueError, match="already registered"):
        r.register(EchoTask())
    with pytest.raises(ValueError, match="already registered"):
        t = EchoTask()
        t.name = "tensor-map"
        r.register(t)
    bad = EchoTask()
    bad.name = "Bad Name"
    with pytest.raises(TypeError):
        r.register(bad)


def test_entry_point_plugins(monkeypatch):
    eps = [
        FakeEP("echo", EchoTask),  # a class: instantiated
        FakeEP("tensor-map", EchoTask()),  # may not replace a built-in (and name mismatch)
        FakeEP("broken", ImportError("boom")),  # skipped, logged
    ]
    monkeypatch.setattr(reg, "entry_points", lambda group: eps if group == reg.ENTRY_POINT_GROUP else [])
    r = TaskRegistry()
    assert r.get("echo").run({}, 1, device="cpu") == {"shard": 1}
    assert r.names() == ["echo", "llm-batch", "tensor-map"]
    assert r.get("tensor-map").__class__.__name__ == "TensorMapTask"


def test_estimate_validates():
    with pytest.raises(ValueError):
        TaskEstimate(mem_bytes=-1, ref_seconds=1.0)
    with pytest.raises(ValueError):
        TaskEstimate(mem_bytes=1, ref_seconds=float("nan"))
