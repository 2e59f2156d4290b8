"""The client's per-boundary history (``llm_client._Inputs``) against a
plain list of rows: writes past the kept rows or below them, keeps,
truncations, growth and wider dtypes, and what earlier views still show."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.llm_client import _Inputs

WIDTH = 3

ops = st.lists(
    st.one_of(
        # write rows at a position up to the kept length, then keep them or not (a spot check's rejection)
        st.tuples(st.just("write"), st.integers(0, 40), st.integers(1, 20), st.booleans(),
                  st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        st.tuples(st.just("truncate"), st.integers(0, 60)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_the_history_is_what_was_kept(script):
    h = _Inputs()
    model: list[list[float]] = []  # the kept rows
    dtype: torch.dtype | None = None
    held: list[tuple[torch.Tensor, torch.Tensor]] = []  # views handed out, and a copy of what they showed
    value = 0.0
    for op in script:
        if op[0] == "truncate":
            h.truncate(op[1])
            del model[op[1]:]
            # rows past the new length may be written again: views of them are the caller's to copy
            held = [(v, c) for v, c in held if len(v) <= op[1]]
        else:
            _, at, n, keep, dt = op
            at = min(at, len(model))
            x = torch.arange(value, value + n * WIDTH).reshape(n, WIDTH).to(dt)
            value += n * WIDTH
            full = h.write(at, x)
            new_dtype = dt if dtype is None else torch.promote_types(dtype, dt)
            expect = [r for r in model[:at]] + x.to(new_dtype).tolist()
            assert full.dtype == new_dtype and full.tolist() == expect
            if keep:
                h.keep(at + n)
                model = expect
                dtype = new_dtype
        assert len(h) == len(model)
        if model:
            view = h.upto(len(model))
            assert view.tolist() == model and view.dtype == dtype
            assert h.upto(len(model) + 5).tolist() == model  # never past what was kept
            held.append((view, view.clone()))
        for v, copy in held:  # kept rows are never written over in place
            assert torch.equal(v, copy)


def test_a_rejected_write_below_the_kept_rows_leaves_them():
    h = _Inputs()
    h.write(0, torch.ones(4, WIDTH))
    h.keep(4)
    full = h.write(2, torch.zeros(2, WIDTH))  # a resync's outputs, which a spot check then rejects
    assert full[2:].eq(0).all()
    assert h.upto(4).eq(1).all()
    h.write(4, torch.full((1, WIDTH), 2.0))
    h.keep(5)
    assert h.upto(5)[:4].eq(1).all() and h.upto(5)[4].eq(2).all()
