"""What torch's own code expects of an FSDP2 module, answered by ours.

Libraries recognise an FSDP2 module by ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
and then call its public methods. Ours passes that check whenever torch's FSDP package is
loaded (:func:`fully_shard._compat.torch_fsdp_module_class`; every method stays ours). What
each of them then does with ours:

- **torch's pipelining** (``torch.distributed.pipelining``, every schedule of torch 2.13):
  before each microbatch's backward the stage calls ``set_is_last_backward(False)``,
  ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``, so our
  groups keep their unsharded gradients locally; the schedule's REDUCE_GRAD action then turns
  them back on and asks torch's state for every group's ``post_backward()`` and the root's
  ``_root_post_backward_final_callback()``. :class:`TorchStateView` answers those two names:
  each group reduce-scatters its accumulated gradient once per step, and the root waits for
  the reductions. The runtime schedules' UNSHARD / RESHARD actions call our ``unshard`` /
  ``reshard``.
- **Accelerate** (``fsdp2_prepare_model``) keeps a model that already is an FSDP2 module as it
  is: shard with ours, then hand the model to ``Accelerator.prepare``.
- **torch's FSDPMemTracker** instruments torch's private FSDP state, which ours has not:
  ``_get_fsdp_state()`` raises :class:`~fully_shard.FullyShardNotImplementedError` saying so
  (torch's ``MemTracker`` and ``fully_shard.trace`` measure ours).

Example:
    >>> view = TorchStateView(model._fsdp_state)  # doctest: +SKIP
    >>> [len(s._fsdp_param_groups) for s in view._state_ctx.all_states]  # doctest: +SKIP
    [1, 1, 1]
"""

from __future__ import annotations

from .hooks import FSDPState


class _GroupView:
    """One state's groups as torch's pipelining sees an ``FSDPParamGroup``."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def post_backward(self) -> None:
        """Reduce the gradients accumulated since the last reduction (REDUCE_GRAD)."""
        self._state.reduce_on_request()


class _StateView:
    def __init__(self, state: FSDPState) -> None:
        # All of a state's groups reduce together: one entry stands for them all.
        self._fsdp_param_groups = [_GroupView(state)]


class _ContextView:
    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def all_states(self) -> list[_StateView]:
        """Every state under the root, read when asked (lazy init finds them)."""
        ctx = self._state.ensure_initialized()
        return [_StateView(s) for s in ctx.states]


class TorchStateView:
    """The two names torch's pipelining reads off ``fully_shard.state(stage_module)``.

    Example:
        >>> TorchStateView(model._fsdp_state)._root_post_backward_final_callback()  # doctest: +SKIP
    """

    def __init__(self, state: FSDPState) -> None:
        self._state = state
        self._state_ctx = _ContextView(state)

    def _root_post_backward_final_callback(self) -> None:
        """Wait for every reduction the groups issued and start the next iteration."""
        self._state.finish_on_request()
