"""Test helpers: re-exported from ``fedswarm.testing``, and a bounded poll."""

from __future__ import annotations

from typing import Callable

import trio

from fedswarm.testing import MiniSwarm, ident

__all__ = ["MiniSwarm", "ident", "until"]


async def until(cond: Callable[[], bool], bound: float = 10.0) -> None:
    """Wait (polling every 10 ms) until ``cond()`` holds; ``trio.TooSlowError``
    after ``bound`` seconds. For conditions no event announces, never as a
    guess of how long something takes."""
    with trio.fail_after(bound):
        while not cond():
            await trio.sleep(0.01)
