"""Moving KV cells from a prefill worker to a decode worker: the transfer store, its TCP
server and the pull, and the signed handles that say where the cells are.

No model here: the cells are synthetic (``test_llama_kv_cells.state``); the engines' use of
all this is tested with SmolLM2 in ``test_llama_disagg.py``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import anyio
import pytest

pytest.importorskip("numpy", reason="the llama engine's extra")

from operators.engines.llama._kv_cells import KvCells
from operators.engines.llama._kv_handle import expired, handle_problem, issue
from operators.engines.llama._transfer import (
    TransferError,
    TransferServer,
    TransferStore,
    pull,
    release,
)
from operators.testing import make_request
from tests.operators.engines.llama.test_llama_kv_cells import state

SECRET = b"deployment secret"


@pytest.fixture
def server() -> Iterator[TransferServer]:
    server = TransferServer(TransferStore(1 << 20, ttl=30.0), SECRET)
    yield server
    server.close()


def cells(count: int = 12) -> KvCells:
    return KvCells.from_state(state(0, count))


async def test_a_pull_gets_the_cells_from_a_position_once(server: TransferServer) -> None:
    original = cells()
    transfer_id, expires = server.store.put(original)
    assert expires > time.time()
    got = await pull(
        server.address, transfer_id, 5, secret=SECRET, layout=original.layout, within=5
    )
    assert (got.start, got.count) == (5, 7)
    assert got.payload() == original.slice(5, 12).payload()
    assert len(server.store) == 0  # released once pulled
    assert server.served == 1
    assert server.sent_bytes == got.nbytes
    with pytest.raises(TransferError, match="unknown or expired"):
        await pull(server.address, transfer_id, 5, secret=SECRET, layout=original.layout, within=5)


async def test_a_client_without_the_secret_gets_nothing_and_takes_nothing(
    server: TransferServer,
) -> None:
    original = cells()
    transfer_id, _ = server.store.put(original)
    with pytest.raises(TransferError, match="not authenticated"):
        await pull(server.address, transfer_id, 0, secret=b"?", layout=original.layout, within=5)
    assert not await release(server.address, transfer_id, secret=b"guess", within=5)
    assert len(server.store) == 1  # still there for the decode worker that has the secret
    layout = original.layout
    got = await pull(server.address, transfer_id, 0, secret=SECRET, layout=layout, within=5)
    assert got.payload() == original.payload()


async def test_cells_are_released_when_asked_expired_or_crowded_out() -> None:
    store = TransferStore(3 * cells().nbytes, ttl=30.0)
    server = TransferServer(store, SECRET)
    try:
        first, _ = store.put(cells())
        assert await release(server.address, first, secret=SECRET, within=5)
        assert len(store) == 0
        assert not await release(server.address, first, secret=SECRET, within=5)
        kept = [store.put(cells())[0] for _ in range(4)]  # one over the capacity
        assert len(store) == 3
        assert store.take(kept[0]) is None  # the oldest went first
        assert store.used_bytes == 3 * cells().nbytes
        store.ttl = 0.0
        late, _ = store.put(cells())
        with pytest.raises(TransferError, match="unknown or expired"):
            await pull(server.address, late, 0, secret=SECRET, layout=cells().layout, within=5)
        assert len(store) == 2  # the late one expired at once; two of the others remain
        assert store.dropped == 4  # released, crowded out (twice), expired
    finally:
        server.close()


async def test_a_pull_is_bounded_in_time_and_fails_fast_when_nobody_listens() -> None:
    layout = cells().layout
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"within 0\.3s"):
            await pull(address, "x", 0, secret=SECRET, layout=layout, within=0.3)
        assert time.monotonic() - started < 3
    finally:
        silent.close()
    with pytest.raises(TransferError):  # the port is closed now: refused at once
        await pull(address, "x", 0, secret=SECRET, layout=layout, within=5)
    with pytest.raises(TransferError, match="host:port"):
        await pull("nowhere", "x", 0, secret=SECRET, layout=layout, within=5)
    assert not await release(address, "x", secret=SECRET, within=1)


async def test_cells_of_another_layout_are_refused(server: TransferServer) -> None:
    transfer_id, _ = server.store.put(cells())
    other = KvCells.from_state(state(0, 2, v_trans=False)).layout
    with pytest.raises(TransferError, match="layout"):
        await pull(server.address, transfer_id, 0, secret=SECRET, layout=other, within=5)


async def test_a_broken_request_line_is_answered_by_closing(server: TransferServer) -> None:
    host, port = server.address.split(":")
    async with await anyio.connect_tcp(host, int(port)) as stream:
        await stream.send(b"not json\n")
        with pytest.raises(anyio.EndOfStream):
            await stream.receive()


# -- handles ------------------------------------------------------------------------------------


def handle(**changes: object) -> dict[str, object]:
    issued = issue(
        SECRET,
        worker_id="prefill-0",
        request_id="r1",
        token_ids=[1, 2, 3],
        first_token=7,
        address="127.0.0.1:1",
        transfer_id="abc",
        expires=time.time() + 30,
        layout="f00d",
        rng={"bit_generator": "PCG64", "state": "1f", "inc": "3", "has_uint32": 0, "uinteger": 0},
    )
    return {**issued, **changes}


def test_a_handle_issued_for_the_request_is_accepted() -> None:
    verified, problem = handle_problem(SECRET, "r1", make_request(prefill_result=handle()))
    assert problem is None
    assert verified is not None
    assert (verified.first_token, verified.transfer_id, verified.layout) == (7, "abc", "f00d")
    assert verified.rng is not None
    assert not expired(verified)
    stale, _ = handle_problem(
        SECRET, "r1", make_request(prefill_result=handle(expires=1.0, signature=None))
    )
    assert stale is None  # the signature covers the expiry too


@pytest.mark.parametrize(
    ("prefill_result", "request_id", "token_ids", "message"),
    [
        (handle(first_token=8), "r1", [1, 2, 3], "bad signature"),
        (handle(address="10.0.0.1:1"), "r1", [1, 2, 3], "bad signature"),
        ({**handle(), "signature": "0" * 64}, "r1", [1, 2, 3], "bad signature"),
        (handle(), "r2", [1, 2, 3], "issued for request 'r1'"),
        (handle(), "r1", [1, 2, 4], "another prompt"),
        (handle(), "r1", [1, 2], "3 prompt tokens"),
        ({"kind": "mocker.kv/1"}, "r1", [1, 2, 3], "not a llama transfer handle"),
        ("not even a dict", "r1", [1, 2, 3], "not a llama transfer handle"),
    ],
)
def test_a_handle_that_fails_verification_is_refused(
    prefill_result: object, request_id: str, token_ids: list[int], message: str
) -> None:
    verified, problem = handle_problem(
        SECRET,
        request_id,
        make_request(token_ids, prefill_result=prefill_result),  # type: ignore[arg-type]
    )
    assert verified is None
    assert problem is not None
    assert message in problem


def test_a_handle_signed_with_another_secret_is_refused() -> None:
    verified, problem = handle_problem(
        b"another deployment", "r1", make_request(prefill_result=handle())
    )
    assert verified is None
    assert problem is not None
    assert "another transfer_secret" in problem
