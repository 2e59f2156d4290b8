"""tensor-map as a resumable task: its checkpoints, a run resumed from one,
and the refusal of every state it did not make for this very shard."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.wire import MAX_CHECKPOINT_BYTES as WIRE_MAX
from fedswarm.tasks.registry import (
    MAX_CHECKPOINT_BYTES,
    BadResumeState,
    TaskEstimate,
    is_resumable,
    run_task,
)
from fedswarm.tasks.tensor_map import STATE_VERSION, TensorMapTask, decode_state, encode_state

P = {"seed": 11, "size": 24, "iters": 6}
SHARD = 3


@pytest.fixture(scope="module")
def task() -> TensorMapTask:
    return TensorMapTask()


@pytest.fixture(scope="module")
def saved(task: TensorMapTask) -> tuple[dict, list[tuple[float, bytes]]]:
    """An uninterrupted run's result and every checkpoint it made."""
    calls: list[tuple[float, bytes]] = []
    result = task.run(P, SHARD, device="cpu", checkpoint=lambda done, state: calls.append((done, state)))
    return result, calls


def state(**over: object) -> bytes:
    m: dict[str, object] = {"v": STATE_VERSION, "seed": 11, "size": 24, "iters": 6, "shard": SHARD, "k": 2,
                            "norms": [1.5, 2.5]}
    m.update(over)
    return msgpack.packb({k: v for k, v in m.items() if v is not ...}, use_bin_type=True)


def test_the_task_declares_itself_resumable_and_the_limits_agree(task: TensorMapTask) -> None:
    assert is_resumable(task)
    assert MAX_CHECKPOINT_BYTES == WIRE_MAX  # the registry's copy of the wire's limit


def test_checkpoints_come_after_each_iteration_but_the_last(task: TensorMapTask, saved) -> None:
    result, calls = saved
    assert result == task.run(P, SHARD, device="cpu")  # checkpointing changes nothing
    assert [done for done, _ in calls] == [k / 6 for k in range(1, 6)]
    assert all(0 < done < 1 for done, _ in calls)
    assert all(0 < len(s) <= MAX_CHECKPOINT_BYTES for _, s in calls)
    assert [len(decode_state(s, 11, 24, 6, SHARD)) for _, s in calls] == [1, 2, 3, 4, 5]


def test_a_run_resumed_from_any_checkpoint_returns_the_uninterrupted_result(task: TensorMapTask, saved) -> None:
    result, calls = saved
    for done, s in calls:
        later: list[float] = []
        got = task.run(P, SHARD, device="cpu", resume=s, checkpoint=lambda d, _s: later.append(d))
        assert got == result
        # it goes on checkpointing from where it resumed
        assert later == [k / 6 for k in range(round(done * 6) + 1, 6)]


def test_a_resumed_run_does_only_the_work_left(task: TensorMapTask, saved) -> None:
    """The resumed run does not recompute the iterations the state holds:
    forged norms in the state show up in the checksum."""
    result, _ = saved
    forged = encode_state(11, 24, 6, SHARD, [0.0] * 5)
    got = task.run(P, SHARD, device="cpu", resume=forged)
    assert got["checksum"] < result["checksum"] and got["digest"] != result["digest"]


def test_run_task_calls_either_kind_of_task(task: TensorMapTask, saved) -> None:
    result, calls = saved

    class Plain:
        name = "plain"

        def estimate(self, params: dict) -> TaskEstimate:
            return TaskEstimate(0, 0.0)

        def run(self, params: dict, shard: int, *, device: str) -> dict:
            return {"shard": shard}

    assert run_task(Plain(), {}, 4, device="cpu", resume=b"anything", checkpoint=print) == {"shard": 4}
    assert run_task(task, P, SHARD, device="cpu", resume=calls[2][1]) == result
    assert run_task(task, P, SHARD, device="cpu", resume=b"") == result  # empty: a fresh run
    for truthy in (1, "yes"):
        Plain.resumable = truthy  # type: ignore[attr-defined]
        assert not is_resumable(Plain())


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never used in msgpack
        state() + b"\x00",  # trailing bytes
        msgpack.packb([1, 2, 3]),
        msgpack.packb({b"v": 1}),  # bin keys
        state(v=2),
        state(v=True),
        state(seed=12),
        state(size=32),
        state(iters=7),
        state(shard=SHARD + 1),
        state(k=0, norms=[]),
        state(k=6, norms=[1.0] * 6),
        state(k=-1),
        state(k=2.0),
        state(k=True, norms=[1.0]),
        state(k=3),  # two norms
        state(norms=[1.5]),
        state(norms=[1.5, float("nan")]),
        state(norms=[1.5, float("inf")]),
        state(norms=[1.5, -2.0]),
        state(norms=[1.5, 2]),  # an int
        state(norms=[1.5, True]),
        state(norms=[1.5, None]),
        state(norms=(1.5, b"x")),
        state(norms={"a": 1.0}),
        state(extra=1),
        state(k=...),
        state(norms=...),
        msgpack.packb(msgpack.ExtType(5, b"abc")),
        b"\x00" * (MAX_CHECKPOINT_BYTES + 1),
    ],
)
def test_malformed_or_foreign_states_are_refused(task: TensorMapTask, raw: bytes) -> None:
    with pytest.raises(BadResumeState):
        task.run(P, SHARD, device="cpu", resume=raw)
    assert issubclass(BadResumeState, ValueError)


def test_a_state_of_this_shard_decodes(task: TensorMapTask) -> None:
    assert decode_state(state(), 11, 24, 6, SHARD) == [1.5, 2.5]
    with pytest.raises(BadResumeState):
        decode_state("text", 11, 24, 6, SHARD)  # type: ignore[arg-type]


def test_a_one_iteration_shard_never_checkpoints(task: TensorMapTask) -> None:
    calls: list[float] = []
    task.run({"seed": 1, "size": 8, "iters": 1}, 0, device="cpu", checkpoint=lambda d, s: calls.append(d))
    assert calls == []


plain = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                  st.binary(max_size=8))
values = st.recursive(plain, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=8), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_random_bytes_are_refused_cleanly(raw: bytes) -> None:
    with pytest.raises(BadResumeState):
        decode_state(raw, 11, 24, 6, SHARD)


@settings(max_examples=300, deadline=None)
@given(value=values, over=st.dictionaries(st.sampled_from(["v", "seed", "size", "iters", "shard", "k", "norms",
                                                           "other"]), values, max_size=3))
def test_random_msgpack_values_are_refused_unless_well_formed(value: object, over: dict) -> None:
    for raw in (msgpack.packb(value, use_bin_type=True), state(**over)):
        try:
            norms = decode_state(raw, 11, 24, 6, SHARD)
        except BadResumeState:
            continue
        # whatever passed is a well-formed state of this shard
        assert 1 <= len(norms) < 6
        assert all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in norms)
