"""``with`` for the library's handles: a handle with ``close()`` closes on leaving the block."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["Closing"]

C = TypeVar("C", bound="Closing")


class Closing:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
