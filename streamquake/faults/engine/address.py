"""Where an engine fault acts when its scenario gives no ``url``: the target's address, as
``inject --target HOST:PORT`` or the run's target gives it (over http)."""

from __future__ import annotations

from streamquake.faults.contract import InjectorError, RunContext


def target_base(ctx: RunContext, label: str, type_name: str, wants: str, example: str) -> str:
    """``http://HOST:PORT`` of the target, or an error naming the fault and both ways to say it
    (``wants``: what it lacks, e.g. "no engine to flush")."""
    if not ctx.target_host or not ctx.target_port:
        raise InjectorError(f"fault '{label}' ({type_name}) has {wants}: give its `url` (e.g. "
                            f"{example}), or the target's address (`streamquake inject ... "
                            "--target HOST:PORT`)")
    host = f"[{ctx.target_host}]" if ":" in ctx.target_host else ctx.target_host
    return f"http://{host}:{ctx.target_port}"
