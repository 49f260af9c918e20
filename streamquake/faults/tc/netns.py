"""Network namespaces: the embedded target in its own netns behind a veth pair, and netlink access.

``network: {mode: namespace}`` puts the embedded target in a namespace of its own, so that a tc
fault on the path to it touches nothing else on the machine::

    load generator (our netns)                       target netns  sq-<id>
      sqh<id>  10.213.N.1/30  <====== veth ======>  sqt<id>  10.213.N.2/30   target listens here

The /30 is picked in 10.213.0.0/16 clear of every address and route already present where the
host end lives. The topology is written to the journal (type ``netns``) *before* anything is
created, and is removed by ``destroy()`` (context manager exit, exceptions, Ctrl-C) or, after a
SIGKILL, by ``NamespaceTopology.recover(state)``.
"""

from __future__ import annotations

import ipaddress
import os
import random
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2 import netns as pr_netns
from pyroute2.netlink.exceptions import NetlinkError

from streamquake.deadline import run_with_deadline
from streamquake.errors import InjectorError, RevertError
from streamquake.faults.contract import NetworkView
from streamquake.journal import Journal, JournalEntry
from streamquake.jsontypes import JsonDict
from streamquake.killpoints import killpoint

TOPOLOGY_JOURNAL_TYPE = "netns"
NETNS_DIR = Path(pr_netns.NETNS_RUN_DIR)
_SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")
_CAP_NET_ADMIN = 12
_ENOENT, _ENODEV, _ESRCH = 2, 19, 3



def has_cap_net_admin() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    return False


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


@contextmanager
def entered(netns: str | None) -> Iterator[None]:
    """Run the calling thread inside ``netns`` for the block; sockets made there stay there.

    setns(2) on a network namespace moves only the calling thread, and no fork is needed.
    """
    if netns is None:
        yield
        return
    if not netns_exists(netns):
        raise FileNotFoundError(f"network namespace {netns!r} does not exist")
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        pr_netns.setns(netns, flags=0)
        try:
            yield
        finally:
            pr_netns.setns(own, flags=0)
    finally:
        os.close(own)


@contextmanager
def iproute(netns: str | None) -> Iterator[IPRoute]:
    """An rtnetlink socket in ``netns`` (None: our own). Never creates a namespace."""
    with entered(netns):
        ipr = IPRoute()
    # pyroute2 0.9.7's sync IPRoute never sets this, and its nlm_request() reads it.
    ipr.asyncore.status.setdefault("nlm_generator", False)
    try:
        yield ipr
    finally:
        ipr.close()


def is_gone(exc: BaseException) -> bool:
    """True for 'no such device/namespace/object' errors: the thing to remove is already gone."""
    if isinstance(exc, FileNotFoundError):
        return True
    return isinstance(exc, NetlinkError) and exc.code in (_ENOENT, _ENODEV, _ESRCH)


def _used_networks(ipr: IPRoute) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    used = []
    for msg in ipr.get_addr(family=2):
        used.append(ipaddress.ip_network(
            f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}", strict=False))
    for msg in ipr.get_routes(family=2, table=254) + ipr.get_routes(family=2, table=255):
        dst = msg.get_attr("RTA_DST")
        if dst:
            used.append(ipaddress.ip_network(f"{dst}/{msg['dst_len']}", strict=False))
    return used


def _pick_subnet(ipr: IPRoute) -> ipaddress.IPv4Network:
    used = _used_networks(ipr)
    candidates = list(_SUBNET_POOL.subnets(new_prefix=30))
    start = random.randrange(len(candidates))
    for net in candidates[start:] + candidates[:start]:
        # The default route 0/0 overlaps everything and says nothing about a clash.
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise InjectorError(
        f"no free /30 left in {_SUBNET_POOL} for a target namespace: remove stale sq-* "
        "namespaces (`streamquake recover`) or free part of that range"
    )


class NamespaceTopology:
    """The embedded target's own network namespace, reached through a veth pair.

    ``host_netns`` is where the host end (and the load generator) lives: None for our own
    namespace. Use as a context manager, or call ``create()`` / ``destroy()``.
    """

    create_timeout_s = 15.0
    destroy_timeout_s = 10.0

    def __init__(self, *, host_netns: str | None = None, journal: Journal | None = None) -> None:
        token = uuid.uuid4().hex[:8]
        self.netns = f"sq-{token}"
        self.host_netns = host_netns
        self.host_ifname = f"sqh{token}"
        self.target_ifname = f"sqt{token}"
        self.subnet: ipaddress.IPv4Network | None = None
        self._journal = journal if journal is not None else Journal()
        self._entry: JournalEntry | None = None
        self.create_ms: float | None = None
        self.destroy_ms: float | None = None

    @classmethod
    def for_run(cls, network: NetworkView, journal: Journal | None = None) -> NamespaceTopology:
        """The topology a run with ``network`` needs (enter it to create it)."""
        if network.mode != "namespace":
            raise ValueError("a namespace topology is only for network mode 'namespace'")
        return cls(journal=journal)

    @property
    def name(self) -> str:
        return self.netns

    # Addresses: .1 is the host end, .2 the target's.
    @property
    def host_addr(self) -> str:
        assert self.subnet is not None, "create() the topology first"
        return str(self.subnet.network_address + 1)

    @property
    def target_addr(self) -> str:
        assert self.subnet is not None, "create() the topology first"
        return str(self.subnet.network_address + 2)

    def cmd_prefix(self) -> list[str]:
        """Prefix for a command line that must run inside the target's namespace."""
        return ["ip", "netns", "exec", self.netns]

    def state(self) -> JsonDict:
        return {
            "netns": self.netns,
            "host_netns": self.host_netns,
            "host_ifname": self.host_ifname,
            "target_ifname": self.target_ifname,
            "subnet": str(self.subnet) if self.subnet else None,
        }

    def describe(self) -> JsonDict:
        return {**self.state(), "create_ms": self.create_ms, "destroy_ms": self.destroy_ms}

    def __enter__(self) -> NamespaceTopology:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> NamespaceTopology:
        started = time.perf_counter()
        try:
            run_with_deadline(self._create, self.create_timeout_s, f"creating {self.netns}")
        except BaseException as exc:
            self.destroy()
            if isinstance(exc, NetlinkError | OSError | TimeoutError):
                raise InjectorError(
                    f"could not create the target's network namespace {self.netns}: {exc}. "
                    "Namespace mode needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and veth support"
                ) from exc
            raise
        self.create_ms = (time.perf_counter() - started) * 1000
        return self

    def _create(self) -> None:
        with iproute(self.host_netns) as ipr:
            self.subnet = _pick_subnet(ipr)
            # Journal first: a kill from here on leaves enough behind for recover().
            self._entry = self._journal.add(TOPOLOGY_JOURNAL_TYPE, self.netns, self.state())
            killpoint("netns.journalled")
            pr_netns.create(self.netns)
            ipr.link("add", ifname=self.host_ifname, kind="veth",
                     peer={"ifname": self.target_ifname})
            host_idx = ipr.link_lookup(ifname=self.host_ifname)[0]
            peer_idx = ipr.link_lookup(ifname=self.target_ifname)[0]
            ipr.link("set", index=peer_idx, net_ns_fd=self.netns)
            ipr.addr("add", index=host_idx, address=self.host_addr, prefixlen=30)
            ipr.link("set", index=host_idx, state="up")
        with iproute(self.netns) as nsr:
            nsr.link("set", index=nsr.link_lookup(ifname="lo")[0], state="up")
            idx = nsr.link_lookup(ifname=self.target_ifname)[0]
            nsr.addr("add", index=idx, address=self.target_addr, prefixlen=30)
            nsr.link("set", index=idx, state="up")
        killpoint("netns.created")

    def destroy(self) -> JsonDict:
        """Remove the namespace and the veth pair. Idempotent; raises RevertError if it cannot."""
        started = time.perf_counter()
        sentence = _destroy(self.netns, self.host_netns, self.host_ifname, self.destroy_timeout_s)
        self.destroy_ms = (time.perf_counter() - started) * 1000
        if self._entry is not None:
            self._entry.done()
            self._entry = None
        return {"removed": sentence, "destroy_ms": self.destroy_ms}

    @classmethod
    def recover(cls, state: Mapping[str, object]) -> str:
        """Undo a topology from its journal state alone (after the creating process was killed).

        Raises ValueError for a state that names no namespace and host-side veth.
        """
        netns, host_netns, host_ifname = (state.get("netns"), state.get("host_netns"),
                                          state.get("host_ifname"))
        if not (isinstance(netns, str) and isinstance(host_ifname, str)
                and (host_netns is None or isinstance(host_netns, str))):
            raise ValueError(f"journal topology state: {dict(state)!r} names no namespace and "
                             "veth (netns, host_netns, host_ifname)")
        return _destroy(netns, host_netns, host_ifname, cls.destroy_timeout_s)


def _destroy(name: str, host_netns: str | None, host_ifname: str, timeout_s: float) -> str:
    def work() -> str:
        removed = []
        try:
            with iproute(host_netns) as ipr:
                idx = ipr.link_lookup(ifname=host_ifname)
                if idx:
                    # Deleting one end of a veth pair deletes its peer in the namespace too.
                    ipr.link("del", index=idx[0])
                    removed.append(f"veth {host_ifname}")
        except Exception as exc:
            if not is_gone(exc):
                raise
        if netns_exists(name):
            pr_netns.remove(name)
            removed.append(f"namespace {name}")
        return ("removed " + " and ".join(removed)) if removed else f"{name} was already gone"

    try:
        return run_with_deadline(work, timeout_s, f"removing {name}")
    except (NetlinkError, OSError, TimeoutError) as exc:
        raise RevertError(
            f"could not remove network namespace {name}: {exc}. Remove it by hand with "
            f"`ip netns del {name}; ip link del {host_ifname}`"
        ) from exc
