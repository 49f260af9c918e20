"""Whose held fault it is: the owner key a client sends with every apply, renew and revert
(``Streamquake-Owner-Key``). An agent lets only the key a fault was applied with renew or revert
it, short of an operator's explicit force.

A user's key is one random secret in their state directory (``owner-key``, mode 0600), read by
every ``inject``, ``status``, ``revert``, ``run`` and ``recover`` of that user, so the owner flows
on its own: no command needs to remember each fault's key, and a killed run's ``recover`` still
owns what the run applied. Another user (another state directory) needs ``--force``.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from streamquake.journal import state_dir


def user_owner_key() -> str:
    """This user's owner key, made on first use."""
    path = state_dir() / "owner-key"
    with contextlib.suppress(FileNotFoundError):
        if key := path.read_text().strip():
            return key
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_hex(32)
    # Written whole under another name, then linked: a command racing this one reads either
    # no file or the whole key, and the first link wins.
    tmp = path.with_name(f"owner-key.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key)
    try:
        os.link(tmp, path)
    except FileExistsError:
        key = path.read_text().strip()
    finally:
        tmp.unlink()
    return key
