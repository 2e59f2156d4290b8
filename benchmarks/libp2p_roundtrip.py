#!/usr/bin/env python3
"""What one request/response costs on each stack py-libp2p 0.8.1 offers, side
by side in one run (loopback, a fresh server and client process per stack).

    .venv/bin/python benchmarks/libp2p_roundtrip.py [--calls 2000] [--payload 2400] [--rounds 3] [--stacks a,b,..]

Stacks (every libp2p one authenticates and encrypts; 4-byte length frames):

* ``raw``: trio TCP, one connection (no security, no muxer): the floor.
* ``fedswarm``: ``Libp2pTransport.request`` as the LLM protocol uses it
  (TCP + Noise + yamux, fedswarm's yamux tuning, a pooled stream per
  (peer, protocol), per-request deadline and counters).
* ``fedswarm-lane``: ``Libp2pTransport.request`` on a protocol that direct
  lanes carry (``fedswarm.net.lane``: the LLM's protocols by default): after a
  hello over libp2p, the requests travel on one TCP connection sealed with
  ChaCha20-Poly1305; the timed calls all go that way.
* ``fedswarm-libcredit``: the same with py-libp2p's own yamux credit release
  (``Libp2pConfig(yamux_credit_bytes=None)``: a window update after nearly
  every read) instead of fedswarm's (credit once 64 KiB were read).
* ``yamux``: the same host stack, one long-lived stream used directly
  (``host.new_stream`` once): what fedswarm's request path adds above it.
* ``yamux-newstream``: a new stream per request (yamux SYN + multistream-select
  of the protocol every time): what pooling saves.
* ``mplex``: TCP + Noise + mplex (``/mplex/6.7.0``), one long-lived stream.
* ``quic``: QUIC v1 (aioquic; TLS 1.3 and QUIC's own streams), one long-lived
  stream.

Per stack: round trip p50 / p99 over ``--calls`` sequential calls (after 100
warm-up calls) with a ``--payload``-byte message each way (default 2400: one
SmolLM2 hidden state, 576 float32, with its msgpack envelope), and the CPU
time per round trip of the client and of the server process (``getrusage``
over the timed calls; both processes' CPU, kernel time included, is what a
hop costs a 2-core machine). The stacks take turns for ``--rounds`` rounds
and the medians are printed, with the range of the p50s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

from transport import _Reader  # benchmarks/transport.py: the same 4-byte frames on raw TCP

HDR = struct.Struct(">I")
PROTO = "/fedswarm/bench/rt/1"
STACKS = ("raw", "fedswarm", "fedswarm-lane", "fedswarm-libcredit", "yamux", "yamux-newstream", "mplex", "quic")
CPU = b"?cpu"  # asks the server for its CPU seconds so far


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _answer(data: bytes) -> bytes:
    return repr(_cpu()).encode() if data == CPU else data


# ------------------------------------------------------------------------- raw
async def _raw_server() -> None:
    import trio

    async def conn(stream) -> None:  # noqa: ANN001
        r = _Reader(stream)
        while (f := await r.frame()) is not None:
            out = _answer(f)
            await stream.send_all(HDR.pack(len(out)) + out)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(json.dumps({"addr": f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"}), flush=True)
    await trio.serve_listeners(conn, listeners)


async def _raw_client(addr: str, calls: int, payload: bytes) -> dict:
    import trio

    host, port = addr.split(":")
    s = await trio.open_tcp_stream(host, int(port))
    r = _Reader(s)

    async def call(data: bytes) -> bytes:
        await s.send_all(HDR.pack(len(data)) + data)
        out = await r.frame()
        assert out is not None
        return out

    res = await _timed(call, calls, payload)
    await s.aclose()
    return res


# ------------------------------------------------------------------------ libp2p
def _host(stack: str):  # noqa: ANN202
    from libp2p import new_host
    from libp2p.network.config import ConnectionConfig
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE
    from libp2p.security.noise.transport import Transport as Noise
    from libp2p.crypto.x25519 import create_new_key_pair as x25519
    from libp2p.custom_types import TProtocol

    from fedswarm.core.identity import Identity
    from fedswarm.net.libp2p import Libp2pConfig, _keypair_from_identity, _tune_yamux

    kp = _keypair_from_identity(Identity.generate())
    if stack == "quic":
        from libp2p.transport.quic.config import QUICTransportConfig

        return new_host(key_pair=kp, enable_quic=True, enable_tcp=False,
                        quic_transport_opt=QUICTransportConfig(max_connections_per_peer=1)), \
            "/ip4/127.0.0.1/udp/0/quic-v1"
    if stack == "mplex":
        from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex

        muxer = {TProtocol(MPLEX_PROTOCOL_ID): Mplex}
    else:
        from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX
        from libp2p.stream_muxer.yamux.yamux import Yamux

        _tune_yamux(Libp2pConfig())  # fedswarm's settings (window updates batched, 256 KiB frames)
        muxer = {TProtocol(YAMUX): Yamux}
    return new_host(key_pair=kp, sec_opt={TProtocol(NOISE): Noise(kp, noise_privkey=x25519().private_key)},
                    muxer_opt=muxer, connection_config=ConnectionConfig(max_connections_per_peer=1)), \
        "/ip4/127.0.0.1/tcp/0"


def _config(stack: str):  # noqa: ANN202
    from fedswarm.net.lane import LaneConfig
    from fedswarm.net.libp2p import Libp2pConfig

    if stack == "fedswarm-libcredit":
        return Libp2pConfig(yamux_credit_bytes=None)
    if stack == "fedswarm-lane":
        return Libp2pConfig(lane_config=LaneConfig(protocols=(PROTO,)))
    return Libp2pConfig()


async def _p2p_server(stack: str) -> None:
    import multiaddr
    import trio
    from libp2p.custom_types import TProtocol

    from fedswarm.core.identity import Identity
    from fedswarm.net.libp2p import _FramedStream, open_libp2p_transport

    if stack.startswith("fedswarm"):
        async def echo(sender: str, data: bytes) -> bytes:
            return _answer(data)

        async with open_libp2p_transport(Identity.generate(), config=_config(stack)) as t:
            t.set_request_handler(PROTO, echo)
            print(json.dumps({"addr": t.listen_addrs()[0]}), flush=True)
            await trio.sleep_forever()
    host, listen = _host(stack)

    async def serve(stream) -> None:  # noqa: ANN001
        fs = _FramedStream(stream)
        while (f := await fs.read_frame(1 << 24)) is not None:
            await fs.write_frame(_answer(f))

    async with host.run([multiaddr.Multiaddr(listen)]):
        host.set_stream_handler(TProtocol(PROTO), serve)
        addr = f"{host.get_addrs()[0]}"
        addr = addr if "/p2p/" in addr else f"{addr}/p2p/{host.get_id().to_base58()}"
        print(json.dumps({"addr": addr}), flush=True)
        await trio.sleep_forever()


async def _p2p_client(stack: str, addr: str, calls: int, payload: bytes) -> dict:
    import multiaddr
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from fedswarm.core.identity import Identity
    from fedswarm.net.libp2p import _FramedStream, open_libp2p_transport

    server = addr.rsplit("/p2p/", 1)[1]
    if stack.startswith("fedswarm"):
        async with open_libp2p_transport(Identity.generate(), bootstrap=[addr], config=_config(stack)) as t:
            async def call(data: bytes) -> bytes:
                return await t.request(server, PROTO, data, timeout=10)

            if stack == "fedswarm-lane":
                await call(payload)  # over libp2p; the lane opens beside it
                import trio

                with trio.fail_after(10):
                    while not t.lanes_live():
                        await trio.sleep(0.01)
            before = t.statistics().lane_requests_out
            res = await _timed(call, calls, payload)
            lane_calls = t.statistics().lane_requests_out - before
            assert lane_calls == (calls + 102 if stack == "fedswarm-lane" else 0), lane_calls
            assert t.statistics().request_streams_opened == 1
            return res
    host, listen = _host(stack)
    async with host.run([multiaddr.Multiaddr(listen)]):
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        await host.connect(info)
        if stack == "yamux-newstream":
            async def call(data: bytes) -> bytes:
                fs = _FramedStream(await host.new_stream(info.peer_id, [TProtocol(PROTO)]))
                await fs.write_frame(data)
                out = await fs.read_frame(1 << 24)
                await fs.stream.close()
                assert out is not None
                return out
        else:
            fs = _FramedStream(await host.new_stream(info.peer_id, [TProtocol(PROTO)]))

            async def call(data: bytes) -> bytes:
                await fs.write_frame(data)
                out = await fs.read_frame(1 << 24)
                assert out is not None
                return out

        return await _timed(call, calls, payload)


async def _timed(call, calls: int, payload: bytes) -> dict:  # noqa: ANN001
    for _ in range(100):
        assert await call(payload) == payload
    s0, c0 = float(await call(CPU)), _cpu()
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        await call(payload)
        lat.append(time.perf_counter() - t)
    c1, s1 = _cpu(), float(await call(CPU))
    lat.sort()
    return {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
            "client_cpu_us": (c1 - c0) / calls * 1e6, "server_cpu_us": (s1 - s0) / calls * 1e6}


# -------------------------------------------------------------------------- driver
def _me(*args: str, **kw) -> subprocess.Popen:  # noqa: ANN003
    """This script again in a fresh interpreter (with this checkout's src)."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, text=True, **kw)


def _run_pair(stack: str, calls: int, payload: int) -> dict:
    with _me("--role", "server", "--stack", stack, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as server:
        try:
            line = server.stdout.readline() if server.stdout else ""
            if not line:
                raise RuntimeError(f"{stack} server did not start")
            client = _me("--role", "client", "--stack", stack, "--addr", json.loads(line)["addr"], "--calls",
                         str(calls), "--payload", str(payload), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = client.communicate(timeout=300)
            if client.returncode != 0:
                raise RuntimeError(f"{stack} client failed:\n{err[-3000:]}")
            return json.loads(out.strip().splitlines()[-1])
        finally:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--payload", type=int, default=2400)
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--rounds", type=int, default=3, help="runs of every stack, taking turns")
    ap.add_argument("--role", choices=["driver", "server", "client"], default="driver")
    ap.add_argument("--stack", choices=STACKS, default="fedswarm")
    ap.add_argument("--addr", default="")
    a = ap.parse_args()
    if a.role != "driver":
        import logging

        import trio

        logging.disable(logging.WARNING)
        if a.role == "server":
            trio.run(_raw_server) if a.stack == "raw" else trio.run(_p2p_server, a.stack)
        else:
            payload = os.urandom(a.payload)
            res = (trio.run(_raw_client, a.addr, a.calls, payload) if a.stack == "raw"
                   else trio.run(_p2p_client, a.stack, a.addr, a.calls, payload))
            print(json.dumps(res))
        return
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    stacks = a.stacks.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in stacks}
    errors: dict[str, str] = {}
    for _ in range(a.rounds):  # the stacks take turns, so a load spike hits one round of each, not one stack
        for s in stacks:
            if s in errors:
                continue
            try:
                runs[s].append(_run_pair(s, a.calls, a.payload))
            except Exception as exc:  # a stack that does not work here is a result too
                errors[s] = str(exc).strip().splitlines()[-1][:120]
    print(f"{a.calls} sequential round trips of {a.payload} B each way, loopback, a server and a client process "
          f"per stack; median of {a.rounds} rounds (the stacks take turns), [lowest, highest] of the p50s")
    print(f"{'stack':<19}{'p50 ms':>8}{'[range]':>15}{'p99 ms':>8}{'client CPU us':>15}{'server CPU us':>15}"
          f"{'CPU us both':>13}")
    for s in stacks:
        if s in errors:
            print(f"{s:<19}  failed: {errors[s]}")
            continue
        med = {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]}
        both = statistics.median(r["client_cpu_us"] + r["server_cpu_us"] for r in runs[s])
        lo, hi = min(r["p50_ms"] for r in runs[s]), max(r["p50_ms"] for r in runs[s])
        print(f"{s:<19}{med['p50_ms']:>8.3f}{f'[{lo:.3f}, {hi:.3f}]':>15}{med['p99_ms']:>8.3f}"
              f"{med['client_cpu_us']:>15.0f}{med['server_cpu_us']:>15.0f}{both:>13.0f}")
    print(f"(ran {time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPUs; 1-min load average {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end)")


if __name__ == "__main__":
    main()
