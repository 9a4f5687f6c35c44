"""One trainer session and one worker session, shared by every inference engine groupbridge plugs into.

An engine adapter supplies two small things: on the trainer, an :class:`EngineControl` (how to have the
workers join, begin an update, commit it, leave); on each worker, a :class:`Loader` (how to dry-run a
manifest, load pairs, and leave the model serving). The bridge, its generations, versions, the control call
beside the send, aborts, the kept buffer, background landing, commit and torn handling are here, once.
"""

from __future__ import annotations

from ._info import BridgeInfo, check_seconds
from ._state import Described, SessionState
from ._trainer import EngineControl, TrainerConfig, TrainerSession
from ._worker import Loader, WorkerSession

__all__ = [
    "BridgeInfo",
    "Described",
    "EngineControl",
    "Loader",
    "SessionState",
    "TrainerConfig",
    "TrainerSession",
    "WorkerSession",
    "check_seconds",
]
