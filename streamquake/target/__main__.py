"""``python -m streamquake.target``: serve the simulated LLM until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import get_args

from pydantic import ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from streamquake.errors import StreamquakeError
from streamquake.target.config import Protocol, TargetConfig
from streamquake.target.server import start_server


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m streamquake.target", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config-json", help="TargetConfig as JSON")
    src.add_argument("--config", type=Path,
                     help="YAML or JSON file holding the target settings (a scenario's "
                          "target.embedded mapping)")
    p.add_argument(
        "--protocol",
        action="extend",
        nargs="+",
        choices=get_args(Protocol),
        help="serve only these protocols (repeatable); default: those in the config",
    )
    return p.parse_args(argv)


def _load_config(args: argparse.Namespace) -> TargetConfig:
    try:
        if args.config_json is not None:
            cfg = TargetConfig.model_validate_json(args.config_json)
        elif args.config is not None:
            cfg = TargetConfig.model_validate(YAML(typ="safe").load(args.config.read_text()) or {})
        else:
            cfg = TargetConfig()
    except (OSError, ValidationError, YAMLError) as exc:
        raise SystemExit(f"Error: invalid target configuration: {exc}") from None
    if args.protocol:
        cfg = cfg.model_copy(update={"protocols": list(dict.fromkeys(args.protocol))})
    return cfg


async def _serve(cfg: TargetConfig, host: str, port: int) -> None:
    runner, url = await start_server(cfg, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"LISTENING {url}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cfg = _load_config(args)
    try:
        asyncio.run(_serve(cfg, args.host, args.port))
    except StreamquakeError as exc:
        print(f"Error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
