"""Start (or join) this process's torch.distributed world, the same way under torchrun, Ray or plain python.

The backend is derived from the accelerator this process has and the backends this torch build really has
(see :func:`groupbridge.split_backend`), never hard-coded. Launcher settings come from :mod:`groupbridge.env`;
explicit arguments win over them.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _torch_private
from .devices import accelerator, parse_backend, split_backend
from .env import (
    GLOO_IFNAME,
    DistEnv,
    gloo_ifname,
    parse_int,
    read_dist_env,
    set_gloo_ifname,
    sets_gloo_ifname,
)
from .net import Address, Listener, interface_toward, listen
from .store import host_store

logger = logging.getLogger(__name__)

__all__ = ["GlobalGroup", "destroy_global_group", "init_global_group"]


@dataclass(frozen=True, slots=True)
class GlobalGroup:
    """This process's place in its torch.distributed world."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    local_rank: int
    """Rank among the processes of this host; selects the accelerator device."""
    world_size: int
    backend: str
    """The backend string the world runs on, e.g. ``"cpu:gloo"`` or ``"cpu:gloo,cuda:nccl"``."""
    device: str
    """This process's device, e.g. ``"cpu"`` or ``"cuda:1"``."""


def _device_for(kind: str, local_rank: int) -> str:
    return "cpu" if kind == "cpu" else f"{kind}:{local_rank}"


def _comparable(backend_map: dict[str, str], kinds: set[str]) -> dict[str, str]:
    return {d: b for d, b in backend_map.items() if d in kinds}


def _check_live_world(
    requested_backend: str | None, rank: int | None, world_size: int | None, local_rank: int, kind: str
) -> GlobalGroup:
    live_backend = str(dist.get_backend_config())
    live_rank, live_size = dist.get_rank(), dist.get_world_size()
    if world_size is not None and world_size != live_size:
        raise ValueError(
            f"the global group is already initialised with world_size={live_size}; "
            f"this call asked for world_size={world_size}"
        )
    if rank is not None and rank != live_rank:
        raise ValueError(
            f"the global group is already initialised as rank {live_rank}; this call asked for {rank}"
        )
    if requested_backend is not None:
        kinds = {"cpu", kind}
        want = _comparable(parse_backend(requested_backend), kinds)
        have = _comparable(parse_backend(live_backend), kinds)
        if want != have:
            raise ValueError(
                f"the global group is already initialised with backend {live_backend!r}; "
                f"this call asked for {requested_backend!r}"
            )
    return GlobalGroup(live_rank, local_rank, live_size, live_backend, _device_for(kind, local_rank))


def init_global_group(
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=30),
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    *,
    listener: Listener | None = None,
) -> GlobalGroup:
    """Initialise torch.distributed's default group for this process, or check the live one.

    Where the rendezvous comes from, first match wins: ``init_method``; ``listener`` (rank 0 serves the
    store on a socket it bound itself, the others pass its address as ``init_method``); DIST_INIT_METHOD;
    MASTER_ADDR and MASTER_PORT (as torchrun and Ray-launched workers set them); and, with no world
    described at all, a world of one on a loopback port this process binds itself, so a script runs under
    plain ``python`` too.

    With an accelerator, the device is set from ``local_rank`` and passed as ``device_id`` so the device
    backend connects eagerly. In a world of several ranks, gloo is bound to the interface that reaches the
    rendezvous host (GLOO_SOCKET_IFNAME is set when unset, and logged; an explicit setting wins), so
    multi-node jobs work where the host name resolves to a loopback address.

    Calling it again in an initialised process checks the request against the live world and returns the
    same answer; it never re-initialises.

    Args:
        backend: ``None`` (derived: :func:`groupbridge.split_backend`), a backend name or a split string.
        timeout: bound on the rendezvous and on every collective of the world.
        init_method: a torch init URL such as ``tcp://[fd00::1]:29500`` or ``env://``.
        rank, world_size, local_rank: override RANK, WORLD_SIZE, LOCAL_RANK.
        listener: on rank 0, a socket from :func:`groupbridge.listen` to serve the rendezvous on.

    Raises:
        ValueError: a bad rank, world size, port or backend (the message names the variable and value), or
            a request that conflicts with the live world.
    """
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    env = read_dist_env()
    rank, world_size, local_rank = _ranks(env, rank, world_size, local_rank)
    if backend is not None:
        parse_backend(backend)  # validates before anything starts
    kind = accelerator()
    if dist.is_initialized():
        return _check_live_world(backend, rank, world_size, local_rank, kind)
    start = _plan(backend, kind, rank, world_size, local_rank, init_method, listener, env)
    # Everything is checked; from here on things happen.
    if start.world_size > 1:
        _bind_gloo_toward(start.gloo_host)
    kwargs: dict[str, object] = {"backend": start.backend, "timeout": timeout}
    if kind != "cpu":
        getattr(torch, kind).set_device(start.local_rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters and ":" in start.backend:
            kwargs["device_id"] = torch.device(start.device)
    if start.url is not None:
        dist.init_process_group(init_method=start.url, rank=start.rank, world_size=start.world_size, **kwargs)  # type: ignore[arg-type]
    else:
        own = start.listener or listen("127.0.0.1", 0)  # a world of one: on a port of its own
        store = _torch_private.as_default_pg_store(host_store(own, timeout))
        dist.init_process_group(store=store, rank=start.rank, world_size=start.world_size, **kwargs)  # type: ignore[arg-type]
        if start.listener is None:
            logger.info("started a world of one on %s", own.address)
    logger.info(
        "rank %d of %d joined the global group (backend %s)", start.rank, start.world_size, start.backend
    )
    return GlobalGroup(
        start.rank, start.local_rank, start.world_size, str(dist.get_backend_config()), start.device
    )


def _ranks(
    env: DistEnv, rank: int | None, world_size: int | None, local_rank: int | None
) -> tuple[int | None, int | None, int]:
    """Rank, world size and local rank from the arguments, else the launcher's variables; checked."""
    rank = env.rank if rank is None else parse_int("rank", rank)
    world_size = env.world_size if world_size is None else parse_int("world_size", world_size, minimum=1)
    local_rank = env.local_rank if local_rank is None else parse_int("local_rank", local_rank)
    if rank is None and world_size is not None:
        if world_size != 1:
            raise ValueError(f"world_size={world_size} is set but rank is not (set RANK or pass rank=)")
        rank = 0
    if rank is not None and world_size is None:
        raise ValueError(f"rank={rank} is set but world_size is not (set WORLD_SIZE or pass world_size=)")
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"rank={rank} must be < world_size={world_size}")
    return rank, world_size, (0 if rank is None else rank) if local_rank is None else local_rank


@dataclass(frozen=True, slots=True)
class _Start:
    """How this process will start its world, every argument checked (nothing has happened yet)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str
    url: str | None
    """The rendezvous URL, or None to serve the store on ``listener`` (or, for a world of one, a port of
    this process's own)."""
    listener: Listener | None
    gloo_host: str | None
    """The rendezvous host, toward which gloo binds in a world of several."""


def _plan(
    backend: str | None,
    kind: str,
    rank: int | None,
    world_size: int | None,
    local_rank: int,
    init_method: str | None,
    listener: Listener | None,
    env: DistEnv,
) -> _Start:
    """Where the rendezvous comes from (first match wins: see :func:`init_global_group`), checked."""
    if kind != "cpu":
        count = int(getattr(torch, kind).device_count())
        if local_rank >= count:
            raise ValueError(f"LOCAL_RANK={local_rank} but this host has {count} {kind} device(s)")
    if rank is None or world_size is None:
        if any(v is not None for v in (init_method, listener, env.init_method, env.master_addr)):
            raise ValueError(
                "a rendezvous is given (init_method, listener, DIST_INIT_METHOD or MASTER_ADDR) "
                "but rank and world_size are not; set RANK and WORLD_SIZE or pass them"
            )
        rank, world_size = 0, 1
    url: str | None = None
    if init_method is not None:
        url = init_method
    elif listener is not None:
        if rank != 0:
            raise ValueError(f"listener= is for rank 0, which serves the rendezvous; this is rank {rank}")
    elif env.init_method is not None:
        url = env.init_method
    elif env.master_addr is not None or env.master_port is not None:
        if env.master_addr is None or env.master_port is None:
            missing = "MASTER_ADDR" if env.master_addr is None else "MASTER_PORT"
            raise ValueError(f"{missing} is not set; MASTER_ADDR and MASTER_PORT go together")
        url = Address.parse(env.master_addr).with_port(env.master_port).url("tcp")
    elif world_size != 1:
        raise ValueError(
            f"world_size={world_size} needs a rendezvous: set MASTER_ADDR and MASTER_PORT, "
            "pass init_method=, or give rank 0 a listener= and the others its address"
        )
    chosen = backend if backend is not None else split_backend(kind)
    return _Start(
        rank, world_size, local_rank, chosen, _device_for(kind, local_rank), url, listener,
        _rendezvous_host(init_method, listener, env),
    )  # fmt: skip


def _rendezvous_host(init_method: str | None, listener: Listener | None, env: DistEnv) -> str | None:
    from urllib.parse import urlparse

    if init_method is not None:
        return urlparse(init_method).hostname
    if listener is not None:
        return listener.address.host
    if env.init_method is not None:
        return urlparse(env.init_method).hostname
    return env.master_addr


def _bind_gloo_toward(host: str | None) -> None:
    """Bind gloo to the interface that reaches the rendezvous host, unless GLOO_SOCKET_IFNAME says otherwise.

    Left to itself gloo binds to whatever this machine's host name resolves to; where that is a loopback
    address (Debian's default 127.0.1.1 entry does this on many real machines) ranks on other nodes cannot
    connect and the first collective times out. An explicit GLOO_SOCKET_IFNAME always wins, and
    GROUPBRIDGE_SET_GLOO_IFNAME=0 leaves gloo to itself.
    """
    if host is None or gloo_ifname() is not None or not sets_gloo_ifname():
        return
    try:
        iface = interface_toward(Address.parse(host).with_port(9))
    except ValueError:
        return
    if iface is not None:
        logger.info(
            "setting %s=%s: the interface that reaches the rendezvous host %s", GLOO_IFNAME, iface, host
        )
        set_gloo_ifname(iface)


def destroy_global_group() -> None:
    """Tear down torch.distributed's default group; does nothing when there is none."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
