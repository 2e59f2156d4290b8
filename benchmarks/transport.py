"""Loopback benchmark: Libp2pTransport vs raw trio TCP with the same framing.

    .venv/bin/python benchmarks/transport.py [--calls 2000] [--bulk-mb 256]

The parent spawns a *server* process and then a *client* process (both fresh
interpreters) for each stack, and prints one table:

* rtt p50/p99: request/response round trip with a 1 kB payload, ``--calls``
  sequential calls after 100 warm-up calls (libp2p: ``Transport.request`` on a
  pooled stream; raw: one TCP connection, 4-byte big-endian length frames);
* bulk MB/s: ``--bulk-mb`` MiB sent as 1 MiB frames (libp2p: ``send`` on the
  reused direct stream; raw: frames on one TCP connection), timed at the
  client from the first frame until the server confirmed it received every
  byte (a sync request / sync frame after the last frame);
* connect: time from ``Popen`` of the client process (interpreter start and
  imports included) until it is connected to the server, and from opening the
  transport (``open_libp2p_transport`` with the server as bootstrap, or
  ``trio.open_tcp_stream``) until connected.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

HDR = struct.Struct(">I")
FRAME = 1 << 20
PAYLOAD = 1024


# --------------------------------------------------------------------------- raw
class _Reader:
    def __init__(self, stream) -> None:  # noqa: ANN001
        self.s = stream
        self.buf = bytearray()

    async def frame(self) -> bytes | None:
        while len(self.buf) < 4:
            chunk = await self.s.receive_some(1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        (n,) = HDR.unpack_from(self.buf)
        while len(self.buf) < 4 + n:
            chunk = await self.s.receive_some(1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        data = bytes(self.buf[4:4 + n])
        del self.buf[:4 + n]
        return data


async def _raw_server() -> None:
    import trio

    async def conn(stream) -> None:  # noqa: ANN001
        r = _Reader(stream)
        mode = await r.frame()
        while True:
            f = await r.frame()
            if f is None:
                return
            if mode == b"E":
                await stream.send_all(HDR.pack(len(f)) + f)
            elif not f:  # bulk: empty frame = sync marker, all frames before it read
                await stream.send_all(HDR.pack(0))

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    print(json.dumps({"addr": f"127.0.0.1:{port}"}), flush=True)
    await trio.serve_listeners(conn, listeners)


async def _raw_client(addr: str, spawned: float, calls: int, bulk_mb: int) -> dict:
    import trio

    host, port = addr.split(":")
    t_open = time.perf_counter()
    echo = await trio.open_tcp_stream(host, int(port))
    connect_open = time.perf_counter() - t_open
    connect_spawn = time.time() - spawned
    await echo.send_all(HDR.pack(1) + b"E")
    r = _Reader(echo)
    payload = os.urandom(PAYLOAD)
    lat = []
    for i in range(100 + calls):
        t = time.perf_counter()
        await echo.send_all(HDR.pack(len(payload)) + payload)
        assert await r.frame() == payload
        if i >= 100:
            lat.append(time.perf_counter() - t)
    bulk = await trio.open_tcp_stream(host, int(port))
    await bulk.send_all(HDR.pack(1) + b"B")
    rb = _Reader(bulk)
    frame = os.urandom(FRAME)
    t = time.perf_counter()
    for _ in range(bulk_mb):
        await bulk.send_all(HDR.pack(len(frame)) + frame)
    await bulk.send_all(HDR.pack(0))
    assert await rb.frame() == b""
    bulk_s = time.perf_counter() - t
    await echo.aclose()
    await bulk.aclose()
    return _result(lat, bulk_mb, bulk_s, connect_spawn, connect_open)


# ------------------------------------------------------------------------- libp2p
async def _p2p_server() -> None:
    import trio

    from fedswarm.core.identity import Identity
    from fedswarm.net.libp2p import open_libp2p_transport

    received = 0
    changed = trio.Event()

    async def echo(sender: str, data: bytes) -> bytes:
        return data

    async def sync(sender: str, data: bytes) -> bytes:
        want = int(data)
        while received < want:
            await changed.wait()
        return b"ok"

    async with open_libp2p_transport(Identity.generate()) as t:
        t.set_request_handler("/fedswarm/bench/echo/1", echo)
        t.set_request_handler("/fedswarm/bench/sync/1", sync)
        print(json.dumps({"addr": t.listen_addrs()[0]}), flush=True)
        while True:
            msg = await t.receive()
            received += len(msg.data)
            changed.set()
            changed = trio.Event()


async def _p2p_client(addr: str, spawned: float, calls: int, bulk_mb: int) -> dict:
    import trio

    from fedswarm.core.identity import Identity
    from fedswarm.net.libp2p import open_libp2p_transport

    server = addr.rsplit("/p2p/", 1)[1]
    t_open = time.perf_counter()
    async with open_libp2p_transport(Identity.generate(), bootstrap=[addr]) as t:
        assert server in t.connected_peers()
        connect_open = time.perf_counter() - t_open
        connect_spawn = time.time() - spawned
        payload = os.urandom(PAYLOAD)
        lat = []
        for i in range(100 + calls):
            s = time.perf_counter()
            resp = await t.request(server, "/fedswarm/bench/echo/1", payload, timeout=10)
            if i >= 100:
                lat.append(time.perf_counter() - s)
            assert resp == payload
        frame = os.urandom(FRAME)
        s = time.perf_counter()
        for _ in range(bulk_mb):
            await t.send(server, frame)
        await t.request(server, "/fedswarm/bench/sync/1", str(bulk_mb * FRAME).encode(), timeout=120)
        bulk_s = time.perf_counter() - s
        st = t.statistics()
        assert st.request_streams_opened <= 2 and st.direct_streams_opened == 1, st
    return _result(lat, bulk_mb, bulk_s, connect_spawn, connect_open)


# -------------------------------------------------------------------------- driver
def _result(lat: list[float], bulk_mb: int, bulk_s: float, c_spawn: float, c_open: float) -> dict:
    lat.sort()
    return {
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "bulk_mb_s": bulk_mb * FRAME / bulk_s / 1e6,
        "connect_spawn_ms": c_spawn * 1e3,
        "connect_open_ms": c_open * 1e3,
    }


def _run_pair(stack: str, calls: int, bulk_mb: int) -> dict:
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    server = subprocess.Popen(
        [sys.executable, __file__, "--role", "server", "--stack", stack],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )
    try:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"{stack} server did not start")
        addr = json.loads(line)["addr"]
        spawned = time.time()
        out = subprocess.run(
            [sys.executable, __file__, "--role", "client", "--stack", stack, "--addr", addr,
             "--spawned", repr(spawned), "--calls", str(calls), "--bulk-mb", str(bulk_mb)],
            capture_output=True, env=env, text=True, timeout=110,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{stack} client failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--bulk-mb", type=int, default=256)
    ap.add_argument("--role", choices=["driver", "server", "client"], default="driver")
    ap.add_argument("--stack", choices=["libp2p", "raw"], default="libp2p")
    ap.add_argument("--addr", default="")
    ap.add_argument("--spawned", type=float, default=0.0)
    args = ap.parse_args()

    if args.role != "driver":
        import logging

        import trio

        logging.disable(logging.WARNING)
        if args.role == "server":
            trio.run(_p2p_server if args.stack == "libp2p" else _raw_server)
        else:
            fn = _p2p_client if args.stack == "libp2p" else _raw_client
            print(json.dumps(trio.run(fn, args.addr, args.spawned, args.calls, args.bulk_mb)))
        return

    t0 = time.perf_counter()
    res = {s: _run_pair(s, args.calls, args.bulk_mb) for s in ("raw", "libp2p")}
    rows = [
        ("rtt p50 (ms), 1 kB", "p50_ms"),
        ("rtt p99 (ms), 1 kB", "p99_ms"),
        (f"bulk MB/s, {args.bulk_mb} x 1 MiB", "bulk_mb_s"),
        ("connect from spawn (ms)", "connect_spawn_ms"),
        ("connect from open (ms)", "connect_open_ms"),
    ]
    print(f"calls={args.calls} bulk={args.bulk_mb} MiB, loopback, 2 processes per stack")
    print(f"{'measure':<32}{'raw tcp':>12}{'libp2p':>12}{'libp2p/raw':>12}")
    for label, key in rows:
        r, p = res["raw"][key], res["libp2p"][key]
        print(f"{label:<32}{r:>12.3f}{p:>12.3f}{p / r if r else float('nan'):>12.2f}")
    print(f"(total {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
