"""What a kernel receive stamp costs per read: ``recvmsg`` + SCM_TIMESTAMPNS against ``recv``.

    PYTHONPATH=. .venv/bin/python benchmarks/kernel_timestamps.py [--reads 100000]

On a loopback TCP connection (gevent sockets, as the load generator uses), one OpenAI-shaped
event is written and then read, ``--reads`` times per variant, interleaved in rounds so that
drift on a shared machine hits every variant alike. Only the read is timed:

* ``recv``: the read as it was (no stamping on the socket);
* ``recv, stamped socket``: the same read on a socket with SO_TIMESTAMPNS (the kernel's share);
* ``Arrival.recv``: what the client does now: ``recvmsg`` with room for the stamp, the stamp
  parsed and carried over to perf_counter.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable

import gevent.socket

from streamquake.loadgen.stamps import Arrival, enable_kernel_timestamps

EVENT = (b'id: 7\ndata: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk",'
         b'"created":1700000000,"model":"sim-1","choices":[{"index":0,"delta":{"content":'
         b'"tok7 "},"logprobs":null,"finish_reason":null}]}\n\n')


def _pair(stamped: bool) -> tuple[socket.socket, gevent.socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    reader = gevent.socket.create_connection(listener.getsockname())
    if stamped:
        assert enable_kernel_timestamps(reader)
    writer, _ = listener.accept()
    listener.close()
    writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return writer, reader


def _rounds(read: Callable[[], bytes], writer: socket.socket, n: int) -> float:
    """Seconds spent in ``n`` reads of one event each."""
    spent = 0.0
    for _ in range(n):
        writer.sendall(EVENT)
        t = time.perf_counter()
        data = read()
        spent += time.perf_counter() - t
        assert len(data) == len(EVENT), len(data)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    plain_w, plain_r = _pair(stamped=False)
    st_w, st_r = _pair(stamped=True)
    ar_w, ar_r = _pair(stamped=True)
    arrival = Arrival(ar_r, floor=0.0)
    variants: dict[str, tuple[Callable[[], bytes], socket.socket]] = {
        "recv": (lambda: plain_r.recv(65536), plain_w),
        "recv, stamped socket": (lambda: st_r.recv(65536), st_w),
        "Arrival.recv": (lambda: arrival.recv(ar_r), ar_w),
    }
    per = max(1, args.reads // args.rounds)
    spent: dict[str, list[float]] = {k: [] for k in variants}
    for read, w in variants.values():
        _rounds(read, w, 1000)                            # warm up
    for _ in range(args.rounds):
        for name, (read, w) in variants.items():
            spent[name].append(_rounds(read, w, per) / per)
    assert arrival.kernel, "the kernel gave no receive stamp on this system"
    base = statistics.median(spent["recv"])
    print(f"{per * args.rounds:,} one-event reads per variant on loopback TCP, "
          f"{args.rounds} interleaved rounds; median of the rounds' mean per read")
    for name, values in spent.items():
        m = statistics.median(values)
        print(f"  {name:22s} {m * 1e9:7.0f} ns per read   x{m / base:.2f}")
    for s in (plain_w, plain_r, st_w, st_r, ar_w, ar_r):
        s.close()


if __name__ == "__main__":
    main()
