"""``python -m streamquake.embedded``: serve the simulated LLM until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from streamquake.embedded.app import start_server
from streamquake.embedded.config import Protocol, TargetConfig
from streamquake.errors import EXIT_SCENARIO, ScenarioError, StreamquakeError

CONFIG_SHAPE = ("the target configuration is a mapping of a scenario's target.embedded "
                "settings (ttft, itl, output_tokens, ...)")


def load_config_file(path: Path) -> TargetConfig:
    """A ``--config`` file, with the scenario loader's limits and ``file:line:col`` errors;
    raises ScenarioError."""
    from streamquake.located_yaml import load_model

    return load_model(path, TargetConfig, "target configuration", CONFIG_SHAPE)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m streamquake.embedded", description=__doc__)
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
            cfg = load_config_file(args.config)
        else:
            cfg = TargetConfig()
    except ScenarioError as exc:
        for line in exc.problems:
            print(f"Error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_SCENARIO) from None
    except ValidationError as exc:
        # --config-json comes from the runner, which validated it: this is a bug, said plainly.
        print(f"Error: invalid --config-json: {exc.error_count()} problem(s), the first: "
              f"{exc.errors()[0]['msg']}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_SCENARIO) from None
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
