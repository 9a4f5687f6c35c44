"""One trainer session and one worker session, shared by every inference engine groupbridge plugs into.

An engine adapter supplies three small things: on the trainer, an :class:`EngineControl` (how to have
the workers join, begin an update, commit it, leave); on each worker, a :class:`Loader` (how to dry-run a
manifest, load pairs, and leave the model serving) and its end of the update protocol, whose requests are
types (:class:`UpdateWorker`: :class:`Receive`, :class:`Commit`, :class:`Rollback`, :class:`Withhold`,
:class:`Abandon`; :func:`parse_update` reads them off an engine's wire). The bridge, its generations,
versions, the control call beside the send, aborts, the kept buffer, background landing, commit and torn
handling, the probe after a swap and the rollback are here, once.
"""

from __future__ import annotations

from ._config import TrainerConfig
from ._control import Capabilities, EngineControl
from ._fleet import Fleet
from ._info import BridgeInfo, check_seconds
from ._loader import Loader, ReadsBoxes, Swaps
from ._probe import Probe, causal_logprobs
from ._state import Described, SessionState
from ._trainer import TrainerSession
from ._updates import (
    Abandon,
    Commit,
    Receive,
    Rollback,
    Update,
    UpdateWorker,
    Withhold,
    handle,
    parse_update,
    update_fields,
)
from ._worker import WorkerSession

__all__ = [
    "Abandon",
    "BridgeInfo",
    "Capabilities",
    "Commit",
    "Described",
    "EngineControl",
    "Fleet",
    "Loader",
    "Probe",
    "ReadsBoxes",
    "Receive",
    "Rollback",
    "SessionState",
    "Swaps",
    "TrainerConfig",
    "TrainerSession",
    "Update",
    "UpdateWorker",
    "Withhold",
    "WorkerSession",
    "causal_logprobs",
    "check_seconds",
    "handle",
    "parse_update",
    "update_fields",
]
