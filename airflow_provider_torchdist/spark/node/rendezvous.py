"""torchrun's static rendezvous, with its store listening only on the address the nodes use.

torch's own rendezvous backends create their ``TCPStore`` server with a host name that only clients
use: the server listens on every interface (``::``/``0.0.0.0``), whatever the endpoint says. That
store has no authentication, so any host that can reach its port during the run can read and write
the keys the agents and ranks coordinate with. ``TCPStore`` takes a socket that is already bound
(``master_listen_fd``, public and documented), and torch's rendezvous registry takes handlers from
outside torch, so this backend is torch's ``static`` one (``static_tcp_rendezvous.py``) with that
one difference, composed from public API only:

- **several nodes** (distributed mode): node 0 serves the store on task 0's address and port, the
  address the other nodes connect to; the store lives for the whole run, as with ``static``.
- **one node** (local mode, or one barrier task): the store listens on that node's address (127.0.0.1
  in local mode) at a fresh port, and a new store is made for every round. A restarted worker group
  then never reads the keys of the group before it (gloo's addresses among them), which is what
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gave the ``c10d`` backend this replaces in local mode.

Node 0 holds its store past its own exit barrier until the other nodes have left theirs
(:meth:`BoundStoreRendezvous.shutdown`): torch's barrier lets the last node to arrive release node
0 while a node that arrived earlier may not yet have sent its wait; with the store gone, that node
logged "Error waiting on exit barrier" and a C++ stack trace at the end of a successful run.

In both cases the ranks use this store (``use_agent_store``: ``init_process_group`` connects to it
as a client), so no rank opens a store server of its own. Where the address cannot be bound (a host
name that resolves to loopback here, or an address that is not this machine's, as behind NAT), the
store falls back to torch's default, every interface, with a warning: see docs/security.md.
"""

from __future__ import annotations

import datetime
import errno
import logging
import socket
from typing import cast

from torch.distributed import DistError, PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from airflow_provider_torchdist.spark.node.network import is_loopback_name, listen_on

#: The ``rdzv_backend`` name this module registers with torchrun's rendezvous registry.
BACKEND = "torchdist-static"

logger = logging.getLogger(__name__)

#: The key torchrun's exit barrier sets once every node has arrived: the run succeeded on every
#: node. torch's private names for it (the agent's ``_TERMINAL_STATE_SYNC_ID`` and
#: ``store_util._LAST_MEMBER_CHECKIN``) are spelled out here; should torch rename the key, node 0
#: would no longer hold its store, and tests/unit/spark/node/test_exit_barrier.py fails.
EXIT_BARRIER_PASSED = "torchelastic/agent/terminal_state/last_member"
#: Each other node adds 1 here once it is out of the exit barrier; the last sets ``NODES_LEFT_ALL``.
NODES_LEFT = "torchdist/exit/nodes_left"
NODES_LEFT_ALL = "torchdist/exit/all_left"
#: How long node 0 holds its store for nodes that have passed the exit barrier but not yet said so:
#: a node that never does was killed, and the run is over for it anyway.
EXIT_HOLD_TIMEOUT_S = 30.0


def store_listener(host: str, port: int, *, world_size: int) -> socket.socket | None:
    """A socket listening on ``host`` only, for ``TCPStore(master_listen_fd=)``; ``port`` 0: any.

    None when ``host`` cannot be bound, and the store must listen on every interface as torch's own
    backends do.
    """
    if world_size > 1 and is_loopback_name(host):
        logger.warning(
            "the rendezvous store listens on every interface: %r resolves to loopback on this "
            "machine, so the address the other nodes reach it at is unknown here",
            host,
        )
        return None
    try:
        return listen_on(host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise OSError(
                exc.errno, f"cannot listen for the rendezvous store on {host}:{port}: {exc}"
            ) from exc
        logger.warning(
            "the rendezvous store listens on every interface: %r is not an address of this machine (%s)",
            host,
            exc,
        )
        return None


class BoundStoreRendezvous(RendezvousHandler):
    """torch's ``StaticTCPRendezvous``, with the store bound to ``master_addr`` on node 0."""

    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, run_id: str, timeout: int
    ) -> None:
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.timeout = datetime.timedelta(seconds=timeout)
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def _new_store(self, port: int) -> TCPStore:
        fd = None
        if self.rank == 0:
            listener = store_listener(self.master_addr, port, world_size=self.world_size)
            if listener is not None:
                port = listener.getsockname()[1]  # TCPStore checks that the two agree
                # TCPStore owns the descriptor from the call on and closes it, even when it fails.
                fd = listener.detach()
        return TCPStore(
            self.master_addr, port, self.world_size, self.rank == 0, self.timeout, master_listen_fd=fd
        )

    def next_rendezvous(self) -> RendezvousInfo:
        if self.world_size == 1:
            # Nobody else needs this store's address: a fresh one per round, at a new port (the
            # agent still holds the last one while this runs).
            self._store = None
            self._store = self._new_store(0)
        elif self._store is None:
            self._store = self._new_store(self.master_port)
        store: Store = PrefixStore(self.run_id, self._store)
        # The ranks connect to the same server; it listens only where the nodes reach it.
        bootstrap = RendezvousStoreInfo(self.master_addr, self._store.port)
        return RendezvousInfo(store, self.rank, self.world_size, bootstrap)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        """Called by ``elastic_launch`` once the agent is done (after its exit barrier when the run
        succeeded). Node 0's store dies with this handler, so node 0 first waits for the other
        nodes to leave the barrier, and each other node says it has left."""
        if self.world_size == 1 or self._store is None:
            return True
        store = PrefixStore(self.run_id, self._store)
        if self.rank != 0:
            try:
                if store.add(NODES_LEFT, 1) == self.world_size - 1:
                    store.set(NODES_LEFT_ALL, "1")
            except DistError:
                pass  # node 0 stopped holding the store (it gave up waiting): nothing left to tell
            return True
        # Only after a successful run: when a node failed, the others are not in the barrier, and
        # holding the store would only delay the failure's report.
        if store.check([EXIT_BARRIER_PASSED]):
            logger.debug(
                "node 0 holds the rendezvous store until %d node(s) leave the exit barrier",
                self.world_size - 1,
            )
            try:
                store.wait([NODES_LEFT_ALL], datetime.timedelta(seconds=EXIT_HOLD_TIMEOUT_S))
            except DistError as exc:
                logger.warning(
                    "node 0 stops serving the rendezvous store: not every node left torchrun's exit "
                    "barrier within %.0f s (%s). Their ranks had finished.",
                    EXIT_HOLD_TIMEOUT_S,
                    type(exc).__name__,
                )
        return True


def create_handler(params: RendezvousParameters) -> BoundStoreRendezvous:
    """Build the handler from ``rdzv_endpoint`` (node 0's address; port 0 for one node) and
    ``rdzv_configs`` ``rank`` (this node's) and ``timeout`` (seconds), as ``static`` takes them."""
    master_addr, master_port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    if master_port < 0:
        raise ValueError(f"the rendezvous endpoint {params.endpoint!r} has no port")
    return BoundStoreRendezvous(
        master_addr,
        master_port,
        rank=cast(int, params.config["rank"]),
        world_size=params.max_nodes,
        run_id=params.run_id,
        timeout=int(params.config["timeout"]),
    )


#: How often torchrun's agent polls its ranks in a run with this rendezvous (torchrun's default:
#: 0.1 s). :meth:`BoundStoreRendezvous.num_nodes_waiting` answers locally, so a 20 ms poll costs nothing
#: and the agent sees its ranks end sooner; an elastic run's asks the driver's store, and keeps 0.1 s.
MONITOR_INTERVAL_S = 0.02


def register() -> str:
    """Make ``BACKEND`` known to torchrun (idempotent); returns its name, for ``LaunchConfig``."""
    rendezvous_handler_registry.register(BACKEND, create_handler)
    return BACKEND
