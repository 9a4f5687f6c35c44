"""Every environment variable groupbridge reads, in one place (and GLOO_SOCKET_IFNAME, which
:func:`groupbridge.init_global_group` sets when unset, see there, unless GROUPBRIDGE_SET_GLOO_IFNAME=0).

Launchers (torchrun, Ray, Slurm wrappers) describe a process's place in its world through RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT; some setups use DIST_INIT_METHOD instead. Explicit arguments to the
library always win over these. Values are validated here so that a bad launcher setting is reported with the
variable's name and value, not as a failure deep inside a rendezvous.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = [
    "GLOO_IFNAME",
    "DistEnv",
    "gloo_ifname",
    "read_dist_env",
    "set_gloo_ifname",
    "sets_gloo_ifname",
    "tuning_int",
    "warn_overwrite_env",
]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True, slots=True)
class DistEnv:
    """What the launcher told this process, validated; ``None`` where a variable is unset."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str | None = None


def parse_int(name: str, value: object, *, minimum: int = 0) -> int:
    """Parse an integer setting, raising ``ValueError`` that names it and quotes its value."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not an integer")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        try:
            number = int(text, 10)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return number


def parse_port(name: str, value: object) -> int:
    port = parse_int(name, value, minimum=0)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={value!r} is outside 1-65535")
    return port


def read_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read and validate the launcher's variables.

    Raises:
        ValueError: a variable is not an integer, is negative, is out of range, or is set without the
            variable it only makes sense with (LOCAL_RANK without RANK, RANK without WORLD_SIZE).
    """
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        value = env.get(name)
        return None if value is None or value.strip() == "" else value

    rank = None if (v := get("RANK")) is None else parse_int("RANK", v)
    world_size = None if (v := get("WORLD_SIZE")) is None else parse_int("WORLD_SIZE", v, minimum=1)
    local_rank = None if (v := get("LOCAL_RANK")) is None else parse_int("LOCAL_RANK", v)
    master_port = None if (v := get("MASTER_PORT")) is None else parse_port("MASTER_PORT", v)
    if local_rank is not None and rank is None:
        raise ValueError(f"LOCAL_RANK={local_rank} is set but RANK is not; a launcher sets both")
    if rank is not None and world_size is None:
        raise ValueError(f"RANK={rank} is set but WORLD_SIZE is not; a launcher sets both")
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world_size}")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=get("MASTER_ADDR"),
        master_port=master_port,
        init_method=get("DIST_INIT_METHOD"),
    )


def warn_overwrite_env(name: str, value: str) -> None:
    """Set an environment variable, warning first when it already holds something else."""
    old = os.environ.get(name)
    if old is not None and old != value:
        logger.warning("overwriting environment variable %s=%r with %r", name, old, value)
    os.environ[name] = value


def tuning_int(name: str, default: int, minimum: int = 1) -> int:
    """A ``GROUPBRIDGE_<name>`` tuning knob (for measurements); validated like the launcher's variables."""
    value = os.environ.get(f"GROUPBRIDGE_{name}")
    if value is None or value.strip() == "":
        return default
    return parse_int(f"GROUPBRIDGE_{name}", value, minimum=minimum)


def gloo_ifname() -> str | None:
    """GLOO_SOCKET_IFNAME: the interface gloo binds to, when the user chose one."""
    return os.environ.get(GLOO_IFNAME) or None


SET_GLOO_IFNAME = "GROUPBRIDGE_SET_GLOO_IFNAME"


def sets_gloo_ifname() -> bool:
    """Whether :func:`groupbridge.init_global_group` may set GLOO_SOCKET_IFNAME when it is unset:
    GROUPBRIDGE_SET_GLOO_IFNAME=0 leaves gloo to its own choice (the host name's address), and the process
    environment untouched. ValueError for a value other than 0 or 1."""
    value = os.environ.get(SET_GLOO_IFNAME, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SET_GLOO_IFNAME}={value!r} must be 0 or 1")
    return value != "0"


def set_gloo_ifname(iface: str) -> None:
    """Set GLOO_SOCKET_IFNAME (the caller checked it was unset: an explicit setting always wins)."""
    os.environ[GLOO_IFNAME] = iface
