"""The one contract between a sans-IO core and whatever drives it.

``PeerCore`` and ``ClientCore`` (and any core to come) satisfy ``Core``; the
trio ``Agent``, netsim and ``testing.MiniSwarm`` drive any ``Core`` the same
way (``core.events`` has the loop)::

    effects = core.start(now)
    loop:
        perform(effects)
        wait until an input arrives or now >= core.next_deadline()
        effects = core.handle(now, input)   # or core.poll(now) on a deadline

Everything a driver tells a core is an ``Input`` handed to ``handle``;
everything a core asks for is an ``Effect`` it returns. A driver needs
nothing else of a core but ``id``, the pubsub ``topics`` to subscribe to, and
``idle`` (nothing in flight that stopping now would lose: what a graceful
leave waits for).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .events import Effect, Input

__all__ = ["Core"]


@runtime_checkable
class Core(Protocol):
    """What every sans-IO core offers its driver. See the module docstring."""

    #: this participant's peer id
    id: str

    @property
    def topics(self) -> tuple[str, ...]:
        """The pubsub topics whose messages this core wants (``MessageReceived``)."""
        ...

    @property
    def idle(self) -> bool:
        """Nothing in flight that stopping now would lose."""
        ...

    def start(self, now: float) -> list[Effect]:
        """Begin at ``now`` (once, before anything else)."""
        ...

    def handle(self, now: float, inp: Input) -> list[Effect]:
        """Take one input at ``now``; what to do about it."""
        ...

    def poll(self, now: float) -> list[Effect]:
        """Do whatever is due at ``now`` (early or late calls are fine)."""
        ...

    def next_deadline(self) -> float:
        """When ``poll`` should next be called (``inf``: only on input)."""
        ...
