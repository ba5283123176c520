"""``FSDPModule``: the methods a sharded module gains, and ``register_fsdp_forward_method``.

``fully_shard`` swaps a module's class to ``FSDP<Class>``, a subclass of both
:class:`FSDPModule` and the original class, so ``isinstance`` checks keep working and the
control methods below appear on the module itself.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .collectives import Comm
from .errors import (
    FullyShardCopyError,
    FullyShardNotImplementedError,
    FullyShardStateError,
    FullyShardTypeError,
    FullyShardValueError,
)
from .group import ParamGroup
from .hooks import FSDPState


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the full parameters usable.

    Example:
        >>> handle = block.unshard(async_op=True)  # doctest: +SKIP
        >>> ...  # other work overlaps with the all-gather
        >>> handle.wait()  # doctest: +SKIP
    """

    def __init__(self, group: ParamGroup) -> None:
        self._group: ParamGroup | None = group

    def wait(self) -> None:
        """Block until the all-gather is done and the unsharded parameters are registered."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise FullyShardTypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


class FSDPModule(nn.Module):
    """Mixin of every module ``fully_shard`` was applied to.

    Example:
        >>> model = fully_shard(model)  # doctest: +SKIP
        >>> isinstance(model, FSDPModule)  # doctest: +SKIP
        True
        >>> model.set_requires_gradient_sync(False)  # doctest: +SKIP  (gradient accumulation)
    """

    _fsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of type(self), e.g. Sequential slicing: they get a
        # plain instance of the user's class, not an FSDP one with no state behind it.
        original: type[nn.Module] | None = cls.__dict__.get("_fsdp_original_class")
        if original is None:
            return super().__new__(cls)
        module = original.__new__(original, *args, **kwargs)
        original.__init__(module, *args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict[int, Any]) -> FSDPModule:
        # A copy would share the group's hooks, buffers and process groups with the original
        # (or silently alias its shards); torch's fully_shard refuses it too.
        raise FullyShardCopyError(
            f"copy.deepcopy of a sharded module ({type(self).__name__}) is not supported: its "
            "parameters are shards tied to this module's communication group. Deep-copy the "
            "model before fully_shard, or build a new model, fully_shard it the same way and "
            "load_state_dict(model.state_dict()) into it"
        )

    def _fsdp_modules(self, recurse: bool) -> Iterator[FSDPModule]:
        if not recurse:
            yield self
            return
        for module in self.modules():
            if isinstance(module, FSDPModule):
                yield module

    def _update_config(self, recurse: bool, **changes: Any) -> None:
        for module in self._fsdp_modules(recurse):
            group = module._fsdp_state.group
            group.config = dataclasses.replace(group.config, **changes)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now, ahead of its forward.

        With ``async_op=True`` the all-gather runs in the background and the returned handle's
        ``wait()`` finishes it (the module's forward also waits for it). The parameters stay
        gathered until the next reshard (after forward if ``reshard_after_forward``).

        Example:
            >>> model.unshard()  # doctest: +SKIP
            >>> full = model.weight  # a plain tensor of the full shape  # doctest: +SKIP
            >>> model.reshard()  # doctest: +SKIP
        """
        _check_bool("unshard(async_op=...)", async_op)
        state = self._fsdp_state
        state.ensure_initialized()
        state.group.unshard(async_op=async_op)
        handle = UnshardHandle(state.group)
        if not async_op:
            handle.wait()
            return None
        return handle

    def reshard(self) -> None:
        """Free this module's unsharded parameters and show the sharded DTensors again.

        Example:
            >>> model.reshard()  # doctest: +SKIP
        """
        state = self._fsdp_state
        if state.root is not None and state.root.in_backward:
            raise FullyShardStateError(
                "reshard() was called during backward, while the parameters are gathered for "
                "gradient computation; call it after backward has finished"
            )
        state.group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Turn gradient reduction on or off (off: gradient accumulation without communication).

        With sync off, backward keeps unsharded gradients locally — a full-size gradient per
        parameter, so memory grows by the unsharded model size — and the next backward with
        sync on reduce-scatters the accumulated sum once.

        Example:
            >>> model.set_requires_gradient_sync(False)  # doctest: +SKIP
            >>> model(x1).sum().backward()  # no communication  # doctest: +SKIP
            >>> model.set_requires_gradient_sync(True)  # doctest: +SKIP
            >>> model(x2).sum().backward()  # reduces x1's and x2's gradients  # doctest: +SKIP
        """
        flag = _check_bool("requires_gradient_sync", requires_gradient_sync)
        root = self._fsdp_state.root
        if root is not None and root.in_backward:
            # Groups already reduced and groups still to come would disagree: half the model
            # would get averaged gradients, half local ones.
            raise FullyShardStateError(
                f"set_requires_gradient_sync({flag}) was called during backward, after some "
                "groups had already decided whether to reduce; call it before the forward "
                "(or between backward passes)"
            )
        self._update_config(recurse, requires_gradient_sync=flag)

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Free parameters after forward (True) or keep them until after backward (False).

        False saves one all-gather per group in backward at the cost of holding the group's
        unsharded parameters from forward to backward.

        Example:
            >>> model.set_reshard_after_forward(False)  # doctest: +SKIP
        """
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise FullyShardNotImplementedError(
                "set_reshard_after_forward takes a bool; resharding to a smaller world size "
                "after forward (an int) is not supported yet"
            )
        flag = _check_bool("reshard_after_forward", reshard_after_forward)
        self._update_config(recurse, reshard_after_forward=flag)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free parameters after backward (True, default) or keep them gathered (False).

        False skips the next forward's all-gather — useful between micro-batches of gradient
        accumulation — but the gathered copies go stale once the optimizer steps: set it back
        to True before the last micro-batch.

        Example:
            >>> model.set_reshard_after_backward(False)  # doctest: +SKIP
        """
        flag = _check_bool("reshard_after_backward", reshard_after_backward)
        self._update_config(recurse, reshard_after_backward=flag)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the coming backward is the last before the optimizer step.

        If False, the root does not wait for the final reduce-scatter at the end of backward;
        it is finished by the next backward. Set True before the backward whose gradients the
        optimizer reads. The flag belongs to the whole model: calling this on any sharded
        module sets it for every group under the same root (as torch's FSDP2 does); before
        the first forward, the root's own call decides.

        Example:
            >>> model.set_is_last_backward(False)  # doctest: +SKIP
        """
        flag = _check_bool("is_last_backward", is_last_backward)
        state = self._fsdp_state
        if state.root is not None:
            state.root.is_last_backward = flag  # one flag for the whole tree, as in torch
        else:
            state.is_last_backward_preset = flag

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` (asynchronously) as soon as this module's forward starts.

        Replaces the implicit choice (the group whose forward came next in the first
        iteration). An empty list turns forward prefetching off for this module. Every rank
        must set the same lists.

        Example:
            >>> for i, block in enumerate(model.layers[:-1]):  # doctest: +SKIP
            ...     block.set_modules_to_forward_prefetch([model.layers[i + 1]])
        """
        self._fsdp_state.forward_prefetch = self._prefetch_states(
            "set_modules_to_forward_prefetch", modules
        )

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` (asynchronously) as soon as this module's backward starts.

        Replaces the implicit choice (the group whose forward finished just before this
        one's). An empty list turns backward prefetching off for this module.

        Example:
            >>> for i, block in enumerate(model.layers[1:], start=1):  # doctest: +SKIP
            ...     block.set_modules_to_backward_prefetch([model.layers[i - 1]])
        """
        self._fsdp_state.backward_prefetch = self._prefetch_states(
            "set_modules_to_backward_prefetch", modules
        )

    def _prefetch_states(self, call: str, modules: object) -> list[FSDPState]:
        if not isinstance(modules, (list, tuple)):
            raise FullyShardTypeError(
                f"{call} expects a list of FSDPModules, got {type(modules).__name__}"
            )
        states = []
        for i, m in enumerate(modules):
            if not isinstance(m, FSDPModule):
                raise FullyShardTypeError(
                    f"{call}: item {i} is a {type(m).__name__}, not a module fully_shard was "
                    "applied to; pass modules returned by fully_shard"
                )
            if m._fsdp_state is self._fsdp_state:
                raise FullyShardValueError(f"{call}: a module cannot prefetch its own group")
            states.append(m._fsdp_state)
        return states

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward: reshard all, drop partial grads.

        Call it on the root. Gradients kept by earlier backward passes with sync off remain.

        Example:
            >>> try:  # doctest: +SKIP
            ...     loss = model(x).sum(); loss.backward()
            ... except RuntimeError:
            ...     model.reset_iter_state()
        """
        self._fsdp_state.reset()

    def set_comm(self, comm: Comm, *, recurse: bool = True) -> None:
        """Route this module's collectives through ``comm`` (e.g. a ``CountingComm``).

        Example:
            >>> from fully_shard import CountingComm
            >>> counter = CountingComm()
            >>> model.set_comm(counter)  # doctest: +SKIP
            >>> counter.bytes_by_op()  # after a step  # doctest: +SKIP
            {'all_gather': 1024, 'reduce_scatter': 2048}
        """
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            if not callable(getattr(comm, name, None)):
                raise FullyShardTypeError(
                    f"set_comm needs an object with all_gather, reduce_scatter and all_reduce "
                    f"methods (see fully_shard.Comm); {type(comm).__name__} has no {name}"
                )
        for module in self._fsdp_modules(recurse):
            module._fsdp_state.group.comm = comm

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # to_empty(), to(), cuda() replace the sharded tensors: pick the new ones up.
        if self._fsdp_state.group.state.name != "SHARDED":
            raise FullyShardStateError(
                f"{type(self).__name__}: to()/to_empty()/cuda() while the parameters are "
                "gathered; call reshard() first"
            )
        out: nn.Module = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for p in self._fsdp_state.group.params:
            p.sync_with_module()
        return out


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Gather ``module``'s parameters around ``module.<method_name>`` as around ``forward``.

    For methods other than ``forward`` that use the parameters, e.g. ``generate``.

    Example:
        >>> fully_shard(model)  # doctest: +SKIP
        >>> register_fsdp_forward_method(model, "generate")  # doctest: +SKIP
        >>> tokens = model.generate(prompt)  # doctest: +SKIP
    """
    if not isinstance(module, FSDPModule):
        raise FullyShardTypeError(
            f"register_fsdp_forward_method needs a module fully_shard was applied to, got "
            f"{type(module).__name__}; call fully_shard(module) first"
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise FullyShardValueError(
            f"{type(module).__name__} has no method {method_name!r} to register"
        )
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(module, args, kwargs)
        out = method(*args, **kwargs)
        return state.post_forward(module, args, kwargs, out)

    setattr(module, method_name, wrapped)
