"""SSE events/s one core of the embedded target serves, against a bare aiohttp baseline.

    .venv/bin/python benchmarks/target_events.py [--seconds 4] [--concurrency 64] [--tokens 256]

The server under test (ours, then the baseline) runs pinned to core 0 with TTFT and ITL 0; the
load comes from a separate client process pinned to core 1. The baseline is a minimal aiohttp
handler that writes the same number of the same pre-encoded event bytes, one write per event,
so the ratio is what our parsing, planning, scheduling and encoding cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web  # noqa: E402

from streamquake import procs  # noqa: E402
from streamquake.embedded.config import TargetConfig  # noqa: E402
from streamquake.embedded.formats import FORMATS, TOKEN_JSON, Completion  # noqa: E402
from streamquake.embedded.process import start_target  # noqa: E402

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
         "stream_options": {"include_usage": True}},
    ),
    "sse": ("/v1/stream", {"prompt": "hi"}),
}


def pre_encoded(protocol: str, tokens: int) -> list[bytes]:
    """The event bytes our target sends for one response, one entry per event."""
    path, body = CASES[protocol]
    fmt = FORMATS[protocol]
    enc = fmt.encoder(fmt.parse(body, None), True)
    events = [enc.token(TOKEN_JSON[i % len(TOKEN_JSON)]) for i in range(tokens)]
    closing = enc.closing(Completion(tokens, False))
    events += [e + b"\n\n" for e in closing.split(b"\n\n") if e]
    return [e for e in events if e]


# --- the baseline server ------------------------------------------------------------------------


def serve_baseline(protocol: str, tokens: int) -> None:
    events = pre_encoded(protocol, tokens)

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post(CASES[protocol][0], handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"LISTENING http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# --- the client --------------------------------------------------------------------------------


async def _client(url: str, body: bytes, concurrency: int, seconds: float) -> dict[str, Any]:
    counts = {"events": 0, "streams": 0}
    stop_at = time.monotonic() + seconds

    async def worker(session: ClientSession) -> None:
        while time.monotonic() < stop_at:
            async with session.post(url, data=body) as resp:
                tail = b""
                async for chunk in resp.content.iter_any():
                    counts["events"] += (tail + chunk).count(b"\n\n")
                    tail = chunk[-1:]
            counts["streams"] += 1

    connector = TCPConnector(limit=concurrency)
    async with ClientSession(connector=connector, timeout=ClientTimeout(total=60)) as session:
        started = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        counts["seconds"] = time.monotonic() - started  # type: ignore[assignment]
    return counts


def run_client(url: str, body: str, concurrency: int, seconds: float) -> None:
    print(json.dumps(asyncio.run(_client(url, body.encode(), concurrency, seconds))), flush=True)


def measure(url: str, protocol: str, args: argparse.Namespace) -> dict[str, Any]:
    path, body = CASES[protocol]
    cmd = ["taskset", "-c", "1", sys.executable, __file__,
           "--client", url + path, "--body", json.dumps(body),
           "--concurrency", str(args.concurrency), "--seconds", str(args.seconds)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True, timeout=60, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["rate"] = result["events"] / result["seconds"]
    return result


def run_baseline(protocol: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = ["taskset", "-c", "0", sys.executable, __file__,
           "--baseline-server", protocol, "--tokens", str(args.tokens)]
    proc = procs.spawn(cmd, cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        url = procs.read_listening_line(proc, 15, "the baseline server")
        return measure(url, protocol, args)
    finally:
        procs.stop(proc)
        assert proc.stdout is not None
        proc.stdout.close()


def run_ours(protocol: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = TargetConfig.model_validate({
        "ttft": 0, "itl": 0, "output_tokens": {"min": args.tokens, "max": args.tokens},
        "capacity": 100_000, "protocols": [protocol],
    })
    with start_target(cfg, cmd_prefix=["taskset", "-c", "0"]) as target:
        return measure(target.url, protocol, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--protocol", action="append", choices=sorted(CASES))
    p.add_argument("--baseline-server", choices=sorted(CASES), help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--body", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.baseline_server:
        serve_baseline(args.baseline_server, args.tokens)
        return
    if args.client:
        run_client(args.client, args.body, args.concurrency, args.seconds)
        return
    print(f"server pinned to core 0, client to core 1; {args.concurrency} concurrent streams, "
          f"{args.tokens} tokens each, TTFT=ITL=0, {args.seconds:.0f} s per row")
    print(f"{'protocol':<10}{'ours ev/s':>12}{'baseline ev/s':>16}{'ratio':>8}"
          f"{'ours streams/s':>16}")
    for protocol in args.protocol or sorted(CASES):
        ours = run_ours(protocol, args)
        base = run_baseline(protocol, args)
        print(f"{protocol:<10}{ours['rate']:>12,.0f}{base['rate']:>16,.0f}"
              f"{ours['rate'] / base['rate']:>8.2f}{ours['streams'] / ours['seconds']:>16,.1f}",
              flush=True)


if __name__ == "__main__":
    main()
