"""The exceptions ``fully_shard`` raises.

Every error the library raises on purpose derives from :class:`FullyShardError`, and also from
the builtin that fits (``TypeError`` for a wrong type, ``ValueError`` for a wrong value, ...),
so callers can catch either.

Example:
    >>> from fully_shard import FullyShardError, FullyShardValueError
    >>> try:
    ...     raise FullyShardValueError("bad")
    ... except FullyShardError as e:
    ...     print(type(e).__name__, e)
    FullyShardValueError bad
"""

from __future__ import annotations


class FullyShardError(Exception):
    """Base class of every error raised by ``fully_shard``.

    Example:
        >>> from fully_shard import FullyShardError, FullyShardTypeError
        >>> issubclass(FullyShardTypeError, FullyShardError)
        True
    """


class FullyShardTypeError(FullyShardError, TypeError):
    """An argument of the wrong type, e.g. ``mesh="dp"`` instead of a ``DeviceMesh``."""


class FullyShardValueError(FullyShardError, ValueError):
    """An argument of the right type with an unusable value, e.g. ``Shard(3)`` on a 2-D weight."""


class FullyShardNotImplementedError(FullyShardError, NotImplementedError):
    """A valid request that this version does not support yet; the message says what to do."""


class FullyShardStateError(FullyShardError, RuntimeError):
    """A call that is not legal in the current state, e.g. ``reshard()`` during backward."""
