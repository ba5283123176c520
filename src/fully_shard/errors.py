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
    """An argument of the wrong type, e.g. ``mesh="dp"`` instead of a ``DeviceMesh``.

    Example:
        >>> from fully_shard import FullyShardTypeError, fully_shard
        >>> try:  # doctest: +SKIP
        ...     fully_shard(model, mesh="dp")
        ... except FullyShardTypeError as e:
        ...     print(e)  # says what was passed and how to build a mesh
    """


class FullyShardValueError(FullyShardError, ValueError):
    """An argument of the right type with an unusable value, e.g. ``Shard(3)`` on a 2-D weight.

    Example:
        >>> from fully_shard import FullyShardValueError
        >>> issubclass(FullyShardValueError, ValueError)  # caught by `except ValueError` too
        True
    """


class FullyShardAssertionError(FullyShardValueError, AssertionError):
    """A wrong value where torch's ``fully_shard`` raises ``AssertionError``.

    Both a ``ValueError`` (what it is) and an ``AssertionError`` (what torch raises for the
    same call: ``fully_shard`` applied twice to one module, ``shard_placement_fn`` naming a
    dim the parameter lacks, a mesh info without its shard dim), so ``except`` clauses
    written for either keep working. Raised with ``raise``, so ``python -O`` keeps it.

    Example:
        >>> from fully_shard.errors import FullyShardAssertionError
        >>> issubclass(FullyShardAssertionError, (ValueError, AssertionError))
        True
    """


class FullyShardArgumentTypeError(FullyShardTypeError, ValueError):
    """An argument of the wrong type where torch's ``fully_shard`` raises ``ValueError``.

    Both a ``TypeError`` (what it is) and a ``ValueError`` (what torch raises for the same
    call), so ``except`` clauses written for either keep working: ``reshard_after_forward``
    given a string, ``shard_placement_fn`` returning something other than a placement.

    Example:
        >>> from fully_shard.errors import FullyShardArgumentTypeError
        >>> issubclass(FullyShardArgumentTypeError, (TypeError, ValueError))
        True
    """


class FullyShardNotImplementedError(FullyShardError, NotImplementedError):
    """A valid request that this version does not support yet; the message says what to do.

    Example:
        >>> from fully_shard import FullyShardNotImplementedError, fully_shard
        >>> try:  # doctest: +SKIP  (tp_block holds tensor-parallel DTensor parameters)
        ...     fully_shard(tp_block, mesh=root["dp"], reshard_after_forward=2)
        ... except FullyShardNotImplementedError:
        ...     fully_shard(tp_block, mesh=root["dp"], reshard_after_forward=True)
    """


class FullyShardCopyError(FullyShardNotImplementedError, AssertionError):
    """``copy.deepcopy`` of a sharded module, which is not supported.

    Also an ``AssertionError``, the class torch's ``fully_shard`` raises for the same call, so
    code written against torch's FSDP2 catches it unchanged.

    Example:
        >>> import copy
        >>> from fully_shard import FullyShardCopyError
        >>> try:  # doctest: +SKIP
        ...     twin = copy.deepcopy(model)
        ... except FullyShardCopyError:
        ...     twin = build_model()  # then fully_shard(twin) and twin.load_state_dict(...)
    """


class FullyShardStateError(FullyShardError, RuntimeError):
    """A call that is not legal in the current state, e.g. ``reshard()`` during backward.

    Example:
        >>> from fully_shard import FullyShardStateError
        >>> try:  # doctest: +SKIP
        ...     loss.backward()
        ... except FullyShardStateError:
        ...     model.reset_iter_state()  # then start the iteration again
    """


class FullyShardLaunchError(FullyShardError, RuntimeError):
    """The job cannot start as launched, e.g. fewer GPUs on a node than ranks on it.

    Raised by :func:`~fully_shard.init_distributed` before any process group is created; the
    message says what is missing and how to launch instead.

    Example:
        >>> from fully_shard import FullyShardLaunchError, init_distributed
        >>> try:  # doctest: +SKIP
        ...     job = init_distributed()
        ... except FullyShardLaunchError as e:
        ...     print(e)  # e.g. "8 ranks on this node but only 4 cuda device(s) ..."
    """


class FullyShardDesyncError(FullyShardError, RuntimeError):
    """Ranks were about to issue different collectives (``fully_shard.debug``'s checker).

    Raised on every rank that reaches the check, before anything is sent. The message names
    the call number, this rank's collective and what every other rank issued instead, or that
    it did not arrive within the timeout (with its last call). Call ``reset_iter_state()`` on
    the root to make the model usable again.

    Example:
        >>> from fully_shard import FullyShardDesyncError, debug
        >>> with debug.check_collectives(timeout=30):  # doctest: +SKIP
        ...     try:
        ...         model(x).sum().backward()
        ...     except FullyShardDesyncError as e:
        ...         print(e)  # which module and which call diverged, on every rank
        ...         model.reset_iter_state()
    """


class PlanInfeasibleError(FullyShardValueError):
    """No configuration :func:`fully_shard.plan` may choose fits the memory budget.

    Attributes:
        minimum_bytes: the smallest predicted peak per rank of any allowed configuration.
        plan: that configuration, as a :class:`~fully_shard.plan.Plan` (its table says what
            bound the peak).

    Example:
        >>> from fully_shard import PlanInfeasibleError, plan
        >>> try:  # doctest: +SKIP
        ...     plan(model, budget="1GiB", world_size=8, example_inputs=(tokens,))
        ... except PlanInfeasibleError as e:
        ...     print(e.minimum_bytes, e.plan)
    """

    def __init__(self, message: str, *, minimum_bytes: int, plan: object) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.plan = plan
