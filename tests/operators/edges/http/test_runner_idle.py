"""The HTTP runner's uvicorn server sleeps while idle: its main loop wakes once a second
(for the ``Date`` header) instead of ten times, and at once when told to exit."""

from __future__ import annotations

import anyio
import uvicorn

from operators.edges.http.runner import _Server


async def app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError("no request in this test")


def idle_server() -> tuple[_Server, list[int]]:
    server = _Server(uvicorn.Config(app, log_level="warning"), lambda host, port: None)
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    return server, ticks


async def test_an_idle_main_loop_ticks_once_a_second_and_keeps_the_date_header() -> None:
    server, ticks = idle_server()
    server.config.load()  # (what startup does: the headers on_tick refreshes)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.main_loop)
        await anyio.sleep(1.5)  # (a span of idle time to count wake-ups in: no event to await)
        server.should_exit = True
    # uvicorn's own loop would have ticked 15 or 16 times; every tick refreshes the Date
    assert 2 <= len(ticks) <= 3, ticks
    assert all(counter % 10 == 0 for counter in ticks)
    assert any(name == b"date" for name, _ in server.server_state.default_headers)


async def test_should_exit_wakes_the_main_loop_at_once() -> None:
    server, ticks = idle_server()
    server.config.load()
    with anyio.fail_after(0.9):  # (well under the one-second tick)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.main_loop)
            await anyio.wait_all_tasks_blocked()
            server.should_exit = True
    assert ticks == [0, 10]  # the first tick, and the one that saw the flag
    server.should_exit = False  # and it can be cleared, as uvicorn does not but might
    assert not server.should_exit
