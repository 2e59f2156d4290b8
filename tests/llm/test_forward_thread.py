"""The serving peer's forward thread: results, errors, cancellation, idle exit."""

from __future__ import annotations

import threading

import pytest
import trio

from fedswarm.llm_serving import ForwardThread


def test_runs_calls_in_one_thread_of_its_own_and_returns_their_results() -> None:
    ft = ForwardThread()
    seen: list[str] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread().name)
        return x * 2

    async def main() -> list[int]:
        return [await ft.run(work, i) for i in range(5)]

    assert trio.run(main) == [0, 2, 4, 6, 8]
    assert seen == ["fedswarm-forward"] * 5
    assert threading.main_thread().name not in seen


def test_an_exception_in_the_call_is_raised_in_the_waiting_task() -> None:
    ft = ForwardThread()

    def boom() -> None:
        raise ValueError("bad span")

    async def main() -> int:
        with pytest.raises(ValueError, match="bad span"):
            await ft.run(boom)
        return int(await ft.run(int, "7"))  # the thread goes on serving

    assert trio.run(main) == 7


def test_cancellation_waits_for_the_call_to_finish() -> None:
    """The call's caches stay in use until it returns, so a cancelled
    request must not go on (and release them) while it runs."""
    ft = ForwardThread()
    started, release = threading.Event(), threading.Event()
    log: list[str] = []

    def slow() -> str:
        started.set()
        release.wait(30)
        log.append("call returned")
        return "done"

    async def main() -> None:
        async with trio.open_nursery() as n:
            async def caller() -> None:
                with trio.CancelScope() as scope:
                    n.start_soon(cancel_when_started, scope)
                    log.append("got " + await ft.run(slow))
                    await trio.lowlevel.checkpoint()  # the cancel lands here
                    log.append("not reached")
                log.append("cancelled" if scope.cancelled_caught else "not cancelled")

            async def cancel_when_started(scope: trio.CancelScope) -> None:
                await trio.to_thread.run_sync(started.wait, 30)
                scope.cancel()
                release.set()

            n.start_soon(caller)

    trio.run(main)
    assert log == ["call returned", "got done", "cancelled"]


def test_the_thread_ends_when_idle_and_starts_again_on_the_next_call() -> None:
    ft = ForwardThread(idle_s=0.01)
    threads: list[threading.Thread] = []

    def who() -> threading.Thread:
        return threading.current_thread()

    async def main() -> None:
        threads.append(await ft.run(who))
        threads[0].join(10)  # idle for idle_s: it ends
        assert not threads[0].is_alive()
        threads.append(await ft.run(who))

    trio.run(main)
    assert threads[1] is not threads[0]
    assert threads[1].name == "fedswarm-forward"
