"""Ray integration: actor groups as torch worlds, and bridges between actor groups.

Ray places the actors; groupbridge gives each its RANK, WORLD_SIZE, LOCAL_RANK (from its placement: its
index among the group's actors on the same node) and a master address whose socket the rank-0 actor bound
itself before anyone heard of the port, then calls :func:`groupbridge.init_global_group` in every actor. A
bridge is made the same way: the listener is created on the sending actor, its real address travels through
Ray, the others join. No free-port probing anywhere.

Actors subclass :class:`WorldMember`; install with ``pip install 'groupbridge[ray]'``.

    world = gb_ray.start_world(Trainer, 2)                       # a torch world of 2 actors
    workers = gb_ray.start_world(Worker, 2)
    gb_ray.bridge(world.actors[0], workers.actors, name="weights")
    # inside the actors: self.bridges["weights"] is a StatelessGroup
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .env import warn_overwrite_env
from .global_group import GlobalGroup, destroy_global_group, init_global_group
from .net import Listener, listen
from .stateless import StatelessGroup

__all__ = ["ActorWorld", "WorldMember", "bridge", "start_world"]


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("groupbridge.ray needs Ray: pip install 'groupbridge[ray]'") from e
    return ray


def _default_host() -> str:
    return str(_ray().util.get_node_ip_address())


class WorldMember:
    """Base class for actors that join a torch world and bridges; the methods are called by the driver."""

    def __init__(self) -> None:
        self.global_group: GlobalGroup | None = None
        self.bridges: dict[str, StatelessGroup] = {}
        self._gb_listeners: dict[str, Listener] = {}

    def _gb_state(self) -> None:
        if not hasattr(self, "bridges"):  # a subclass that forgot super().__init__()
            WorldMember.__init__(self)

    def gb_node_id(self) -> str:
        return str(_ray().get_runtime_context().get_node_id())

    def gb_listen(self, key: str, host: str | None) -> str:
        """Bind a listener now (port 0) and return its address; it serves ``key`` (the world or a bridge)."""
        self._gb_state()
        lis = listen(host or _default_host(), 0)
        self._gb_listeners[key] = lis
        return str(lis.address)

    def gb_init_world(
        self, rank: int, world_size: int, local_rank: int, address: str, timeout_s: float
    ) -> dict[str, Any]:
        """Set the launcher variables and start the world (rank 0 serves on the listener it bound)."""
        self._gb_state()
        from .net import Address

        addr = Address.parse(address)
        launcher = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank,
                    "MASTER_ADDR": addr.host, "MASTER_PORT": addr.port}  # fmt: skip
        for name, value in launcher.items():  # what torchrun would set, for code in the actor that reads it
            warn_overwrite_env(name, str(value))
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            g = init_global_group(timeout=timeout, listener=self._gb_listeners.pop("world"))
        else:
            g = init_global_group(timeout=timeout)
        self.global_group = g
        return {"rank": g.rank, "local_rank": g.local_rank, "world_size": g.world_size, "backend": g.backend,
                "device": g.device}  # fmt: skip

    def gb_join_bridge(self, name: str, address: str | None, rank: int, world_size: int, token: str | None,
                       timeout_s: float) -> int:  # fmt: skip
        self._gb_state()
        timeout = timedelta(seconds=timeout_s)
        if rank == 0:
            lis = self._gb_listeners.pop(f"bridge:{name}")
            grp = StatelessGroup.create(None, rank=0, world_size=world_size, listener=lis, name=name,
                                        token=token, timeout=timeout)  # fmt: skip
        else:
            grp = StatelessGroup.create(address, rank=rank, world_size=world_size, name=name, token=token,
                                        timeout=timeout)  # fmt: skip
        self.bridges[name] = grp
        return rank

    def gb_shutdown(self) -> None:
        for grp in self.bridges.values():
            grp.close()
        self.bridges.clear()
        destroy_global_group()


@dataclass
class ActorWorld:
    actors: list[Any]
    address: str
    groups: list[dict[str, Any]]


def start_world(
    actor_cls: type,
    n: int,
    *,
    args: Sequence[Any] = (),
    num_cpus: float = 1,
    num_gpus: float = 0,
    host: str | None = None,
    timeout: timedelta = timedelta(minutes=5),
) -> ActorWorld:
    """Start ``n`` actors of ``actor_cls`` (a :class:`WorldMember`) as one torch world.

    ``host`` is the address rank 0 binds (default: its node's IP as Ray sees it).
    """
    if not issubclass(actor_cls, WorldMember):
        raise TypeError(f"{actor_cls.__name__} must subclass groupbridge.ray.WorldMember")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    ray = _ray()
    remote = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(actor_cls)
    actors = [remote.remote(*args) for _ in range(n)]
    nodes = ray.get([a.gb_node_id.remote() for a in actors], timeout=timeout.total_seconds())
    local = [sum(1 for j in range(r) if nodes[j] == nodes[r]) for r in range(n)]
    address = ray.get(actors[0].gb_listen.remote("world", host), timeout=timeout.total_seconds())
    secs = timeout.total_seconds()
    groups = ray.get([a.gb_init_world.remote(r, n, local[r], address, secs) for r, a in enumerate(actors)],
                     timeout=secs + 30)  # fmt: skip
    return ActorWorld(actors, address, groups)


def bridge(
    sender: Any,
    receivers: Sequence[Any],
    *,
    name: str = "bridge",
    host: str | None = None,
    token: str | None = None,
    timeout: timedelta = timedelta(minutes=5),
) -> str:
    """Join ``sender`` (rank 0) and ``receivers`` (ranks 1..) in a StatelessGroup named ``name``.

    The listener is bound on the sender's actor; its address travels through Ray. Returns that address.
    """
    ray = _ray()
    secs = timeout.total_seconds()
    address = ray.get(sender.gb_listen.remote(f"bridge:{name}", host), timeout=secs)
    n = len(receivers) + 1
    calls = [sender.gb_join_bridge.remote(name, None, 0, n, token, secs)]
    calls += [a.gb_join_bridge.remote(name, address, i + 1, n, token, secs) for i, a in enumerate(receivers)]
    ray.get(calls, timeout=secs + 30)
    return str(address)
