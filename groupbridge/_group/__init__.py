"""The parts of a :class:`~groupbridge.stateless.StatelessGroup`, one job each; the group is their facade.

- :mod:`.state`: what the parts share (who this member is, its store connection, whether the group broke
  or closed) and the group's rank-prefixed log;
- :mod:`.health`: the liveness watcher's wiring, this member's published status, and the errors that say
  why the group broke;
- :mod:`.objects`: object operations over the control channel, their sequence numbers and the collection
  of their keys;
- :mod:`.tensors`: tensor operations over gloo or the device's own backend, and their bounded waits;
- :mod:`.threads`: the process-wide registry of background threads that interpreter exit waits for.
"""
