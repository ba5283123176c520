"""``FSDPModule``: the methods a sharded module gains, and ``register_fsdp_forward_method``.

``fully_shard`` swaps a module's class to ``FSDP<Class>``, a subclass of both
:class:`FSDPModule` and the original class, so ``isinstance`` checks keep working and the
control methods below appear on the module itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ._compat import calls_only_these_hooks
from .bucket import cap_bytes
from .collectives import Comm, is_comm_protocol
from .errors import (
    FullyShardCopyError,
    FullyShardNotImplementedError,
    FullyShardStateError,
    FullyShardTypeError,
    FullyShardValueError,
)
from .graph import graph_call, takes_graph_path
from .group import ParamGroup
from .hooks import FSDPState


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the full parameters usable.

    Example:
        >>> handle = block.unshard(async_op=True)  # doctest: +SKIP
        >>> ...  # other work overlaps with the all-gather
        >>> handle.wait()  # doctest: +SKIP
    """

    def __init__(self, *groups: ParamGroup) -> None:
        self._groups: tuple[ParamGroup, ...] | None = groups

    def wait(self) -> None:
        """Block until the all-gathers are done and the unsharded parameters are registered."""
        if self._groups is not None:
            for group in self._groups:
                group.wait_for_unshard()
            self._groups = None


class FinalizeBackwardHandle:
    """Returned by ``finalize_backward(async_op=True)``: ``wait()`` finishes the reductions.

    Until ``wait()`` returns, the last group's gradient reduction may still be in flight and
    the sharded ``.grad`` of its parameters incomplete: wait before the optimizer step. The
    next forward of the root waits for it if nobody did.

    Example:
        >>> handle = model.finalize_backward(async_op=True)  # doctest: +SKIP
        >>> ...  # other work (another pipeline stage's compute) overlaps the reduction
        >>> handle.wait()  # doctest: +SKIP
        >>> optim.step()  # doctest: +SKIP
    """

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        """Block until the reductions are done, the groups resharded and the step ended."""
        if self._finish is not None:
            self._finish()
            self._finish = None


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise FullyShardTypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _replace_config(group: ParamGroup, **changes: Any) -> None:
    """Give ``group`` its config with ``changes``: the object it had before with the same
    values if there is one, else a new one.

    Why: equal options are then one object, and the graph path guards on that identity, one
    guard per group (``fully_shard.graph._plan_for``): an option flipped back and forth
    (``set_requires_gradient_sync`` per micro-batch) finds the graph traced for each value
    again instead of recompiling at every flip. Each group keeps the configs it has had
    (``ParamGroup.configs_seen``, strongly: dynamo drops a graph whose guarded object dies).
    """
    old = group.config
    new = dataclasses.replace(old, **changes)
    seen = group.configs_seen
    try:
        seen.setdefault(old, old)
        group.config = seen.setdefault(new, new)
    except (TypeError, RuntimeError):  # a user's object without a hash, or one whose == is
        # not a bool (tensors inside): no interning, compiled graphs recompile at each change
        group.config = new


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Where the two runtimes part. Inside a frame dynamo traces from the root down
        # (torch.compile(model)), the graph path (graph.py): the whole step in one graph.
        # Everywhere else the eager hooks, called here while they are the module's only hooks
        # and through nn.Module.__call__ otherwise; a block compiled on its own still runs them
        # outside its compiled code. A frame of ours also makes
        # torch.compile(model) trace the root's hooks in the same frame as its forward
        # (dynamo would otherwise start inside torch.nn, each hook a frame of its own).
        state = self._fsdp_state
        if torch.compiler.is_compiling():
            if takes_graph_path(state):
                return graph_call(self, state, args, kwargs)
            return super().__call__(*args, **kwargs)
        ids = state.hook_ids.get(id(self))
        if ids is not None and calls_only_these_hooks(self, *ids):
            # Our two hooks around forward, called as nn.Module.__call__ would, minus its
            # slow path's cost (calls_only_these_hooks says when nothing else would run).
            args, kwargs = state.pre_forward(self, args, kwargs)
            return state.post_forward(self, args, kwargs, self.forward(*args, **kwargs))
        return super().__call__(*args, **kwargs)

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
            for group in module._fsdp_state.groups:
                _replace_config(group, **changes)

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
        for group in state.groups:
            group.unshard(async_op=async_op)
        handle = UnshardHandle(*state.groups)
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
        for group in state.groups:
            group.reshard()

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
        # As in torch: for HSDP this turns the all-reduce on or off together with it.
        self._update_config(recurse, requires_gradient_sync=flag, requires_all_reduce=flag)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce gradients over the replicate dim (True) or only reduce-scatter them.

        With False, each backward still reduce-scatters within the shard group but keeps the
        result, summed over backward passes, in the group (one ``(total,)`` buffer per group
        in the reduce dtype); the sharded ``.grad`` is not touched. The next backward with
        True adds that sum in and all-reduces once: gradient accumulation that pays the
        (slow, cross-node) all-reduce once per step. No effect on a 1-D mesh.
        ``set_requires_gradient_sync`` sets this flag too.

        Example:
            >>> for i, (x, y) in enumerate(micro_batches):  # doctest: +SKIP
            ...     model.set_requires_all_reduce(i == len(micro_batches) - 1)
            ...     loss_fn(model(x), y).backward()
        """
        flag = _check_bool("requires_all_reduce", requires_all_reduce)
        _check_bool("recurse", recurse)
        self._check_not_in_backward(f"set_requires_all_reduce({flag})")
        self._update_config(recurse, requires_all_reduce=flag)

    def _check_one_group(self, call: str) -> None:
        groups = self._fsdp_state.groups
        if len(groups) > 1:
            # One hook or comm for groups on different meshes would be ambiguous (torch
            # refuses it too).
            labels = ", ".join(repr(g.label) for g in groups)
            raise FullyShardValueError(
                f"{call} is not supported on a module whose parameters are sharded over "
                f"{len(groups)} meshes (groups {labels}, from shard_placement_fn returning "
                "ShardPlacementResult): it would be ambiguous across the meshes; shard those "
                "parameters in a separate fully_shard call to set it per mesh"
            )

    def _check_not_in_backward(self, call: str) -> None:
        root = self._fsdp_state.root
        if root is not None and root.in_backward:
            raise FullyShardStateError(
                f"{call} was called during backward, after some groups had already reduced; "
                "call it before the forward (or between backward passes)"
            )

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free parameters after forward (True) or keep them until after backward (False).

        False saves one all-gather per group in backward at the cost of holding the group's
        unsharded parameters from forward to backward. Takes a bool, like torch's: it
        replaces an int given to ``fully_shard`` (True then reshards to the whole world).

        Example:
            >>> model.set_reshard_after_forward(False)  # doctest: +SKIP
        """
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise FullyShardValueError(
                f"set_reshard_after_forward takes a bool (as torch's does), got "
                f"{reshard_after_forward}; to reshard to groups of n ranks after forward pass "
                "reshard_after_forward=n to fully_shard"
            )
        flag = _check_bool("reshard_after_forward", reshard_after_forward)
        recurse = _check_bool("recurse", recurse)
        self._update_config(recurse, reshard_after_forward=flag, post_forward=None)

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

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether the caller finishes backward once per step with :meth:`finalize_backward`
        (torch 2.15), instead of the end of every backward.

        With True, the end of a backward finishes nothing: a group whose backward did not
        end in it (the root, whose inputs need no gradient; a layer whose backward a later
        backward call continues) stays gathered, its gradients accumulating on the unsharded
        parameters (in the reduce dtype), and reductions stay in flight. Groups whose
        module's backward did end still reduce then (if gradient sync is on) or keep their
        gradients (if off), as always. Then call :meth:`finalize_backward` after the step's
        last backward. For several backward calls per step (pipeline stages, a loss
        backpropagated in parts, CUDA-graph gradient accumulation). Set for the whole model
        (the root's tree), whichever sharded module it is called on; not during a backward.
        torch 2.15's pipelining turns it on for every sharded stage before each forward.

        Example:
            >>> model.set_manual_backward_finalization(True)  # doctest: +SKIP
            >>> for x in micro_batches:  # doctest: +SKIP
            ...     model(x).sum().backward()
            >>> model.finalize_backward()  # doctest: +SKIP
            >>> optim.step()  # doctest: +SKIP
        """
        flag = _check_bool("set_manual_backward_finalization(enabled)", enabled)
        self._check_not_in_backward(f"set_manual_backward_finalization({flag})")
        root = self._fsdp_state.root
        if root is not None:
            root.manual_finalization = flag  # one flag for the whole tree
            return
        for module in self._fsdp_modules(recurse=True):  # the root, once found, reads its own
            module._fsdp_state.manual_finalization_preset = flag

    def finalize_backward(self, *, async_op: bool = False) -> FinalizeBackwardHandle | None:
        """Finish the step's backward, under :meth:`set_manual_backward_finalization` (torch 2.15).

        For every group that ran a forward since its gradients were last reduced: reduce
        them (if gradient sync is on now; else keep them for a later call), reshard (if
        resharding after backward), then wait for the reductions and start the next step, as
        the end of a backward does without manual finalization. A group that already reduced
        in a backward is not reduced again. With ``async_op=True`` the wait is left to the
        returned handle's ``wait()`` (the next forward waits if nobody did). Raises if manual
        finalization is off, or during a forward or backward. Eager only (the graph path
        refuses manual finalization when it compiles).

        Example:
            >>> model.set_requires_gradient_sync(True)  # doctest: +SKIP
            >>> handle = model.finalize_backward(async_op=True)  # doctest: +SKIP
            >>> handle.wait()  # doctest: +SKIP
        """
        flag = _check_bool("finalize_backward(async_op=...)", async_op)
        finish = self._fsdp_state.finalize_backward(async_op=flag)
        return None if finish is None else FinalizeBackwardHandle(finish)

    def set_keep_unsharded_storage(self, enabled: bool) -> None:
        """Keep the unsharded parameters' storage (and so their addresses) across reshards
        (torch 2.15), for this module and every sharded module below it.

        A reshard still shows the sharded DTensors to the module, but the gathered bytes stay
        allocated and the next all-gather writes into the same addresses: a CUDA graph that
        captured a step (or an inference engine holding the weights, as torchtitan's RL
        weight sync) keeps reading valid memory. Costs the unsharded bytes of every such
        group for as long as it is on (the memory of an unsharded model); False frees them at
        the next reshard. Eager only (the graph path refuses it when it compiles).

        Example:
            >>> model.set_keep_unsharded_storage(True)  # doctest: +SKIP
        """
        flag = _check_bool("set_keep_unsharded_storage(enabled)", enabled)
        self._update_config(True, keep_unsharded_storage=flag)

    def set_compile_region(self, enabled: bool, *, recurse: bool = True) -> None:
        """Whether ``torch.compile`` of the whole model traces this module (and, with
        ``recurse``, every sharded module below it) as a nested compile region (default on).

        On the graph path (``torch.compile(model, fullgraph=True)`` of the sharded model) each
        sharded block called from the root's forward is a region holding its all-gather, its
        forward and its reduce-scatter, traced and compiled once per block structure and
        called again for every block of that structure: the first step's compilation stays
        nearly flat in the depth. ``False`` traces the module inline, each block anew, as
        before regions (the step compiles longer; the compiled step is the same computation).
        Changing it recompiles once. No effect eagerly or on the per-block compile orders.

        Example:
            >>> model.set_compile_region(False)  # doctest: +SKIP
            >>> compiled = torch.compile(model, fullgraph=True)  # blocks inline  # doctest: +SKIP
        """
        flag = _check_bool("set_compile_region(enabled)", enabled)
        self._update_config(_check_bool("recurse", recurse), compile_region=flag)

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

    def set_bucket_cap_mb(self, bucket_cap_mb: float | None) -> None:
        """Merge the collectives of consecutive groups into buckets of at most this many MiB
        (DDP's ``bucket_cap_mb``), for this module's tree; ``None`` or 0 turns it off.

        One all-gather then serves a run of groups in forward order (and one in backward
        order for the groups that gather again there), and one reduce-scatter a run of
        groups' gradients in backward order, issued when the run's last group is done. The
        cap bounds a bucket's flat buffer (the all-gather output, or the reduce-scatter
        input). Groups keep their own options; one whose options differ (dtypes, mesh,
        offload, a custom collective, int8, ``reshard_after_forward=n``) closes a bucket.
        The price is memory: a bucket's gathered parameters are alive together, and its
        groups' full-size gradients wait for its reduce-scatter. Pays where groups are many
        and small (collective launch latency dominates); the default keeps torch's one
        all-gather and one reduce-scatter per group. Takes effect at the next forward of
        the root; the first iteration (which records the order) runs unbucketed. The
        compiled graph path (``torch.compile(model)``) honours it too: one all-gather and one
        reduce-scatter per bucket in the graph; a new cap recompiles once.

        Example:
            >>> model.set_bucket_cap_mb(25)  # doctest: +SKIP
            >>> model.set_bucket_cap_mb(None)  # off again  # doctest: +SKIP
        """
        if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
        ):
            raise FullyShardTypeError(
                f"set_bucket_cap_mb takes a size in MiB (an int or float) or None, got "
                f"{bucket_cap_mb!r} ({type(bucket_cap_mb).__name__})"
            )
        if bucket_cap_mb is not None and not (math.isfinite(bucket_cap_mb) and bucket_cap_mb >= 0):
            raise FullyShardValueError(
                f"set_bucket_cap_mb takes a finite size in MiB >= 0, got {bucket_cap_mb!r}; "
                "0 or None turns buckets off"
            )
        cap = cap_bytes(bucket_cap_mb)
        for module in self._fsdp_modules(recurse=True):
            module._fsdp_state.bucket_cap = cap
        root = self._fsdp_state.root
        if root is not None:
            root.buckets_dirty = True  # planned again at the root's next forward

    # -- reductions ---------------------------------------------------------------------------

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Call ``hook(reduce_output)`` on this group's reduced gradients, every backward.

        ``reduce_output`` is the group's flat ``(total,)`` gradient buffer in the reduce
        dtype: this rank's reduce-scattered chunk of every packed parameter (padded), after
        the HSDP all-reduce if there is one, and before the last division when the division
        is not part of the collectives (fp16, ``set_force_sum_reduction_for_comms``). Edit
        it in place, e.g. a custom all-reduce over your own replicate group with 1-D FSDP.
        Not called in a backward that keeps an HSDP partial sum
        (``set_requires_all_reduce(False)``).

        ``stream`` (CUDA, 1-D meshes only, as in torch): accepted and checked; the hook runs
        on the current stream, which is where all our collectives run, so its ordering with
        the reduction is the same.

        Example:
            >>> def all_reduce_over_replicas(t):  # doctest: +SKIP
            ...     dist.all_reduce(t, op=dist.ReduceOp.AVG, group=replica_group)
            >>> model.set_all_reduce_hook(all_reduce_over_replicas)  # doctest: +SKIP
        """
        if not callable(hook):
            raise FullyShardTypeError(
                f"set_all_reduce_hook needs a callable hook(reduce_output) -> None, got "
                f"{type(hook).__name__}"
            )
        self._check_one_group("set_all_reduce_hook")
        given: object = stream  # checked as given: a caller may pass anything
        if given is not None:
            if not (
                isinstance(given, torch.Stream) or callable(getattr(given, "wait_stream", None))
            ):
                raise FullyShardTypeError(
                    f"set_all_reduce_hook(stream=...) must be a torch.Stream (e.g. "
                    f"torch.cuda.Stream()) or None, got {type(stream).__name__}"
                )
            if any(g.info.replicate_group is not None for g in self._fsdp_state.groups):
                raise FullyShardValueError(
                    "set_all_reduce_hook: stream cannot be set when using native HSDP (a 2-D "
                    "mesh): the hook runs after the HSDP all-reduce; pass stream=None"
                )
        self._update_config(False, all_reduce_hook=hook)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this group's summed gradients by ``factor`` instead of the data-parallel size.

        ``factor=1`` gives the plain sum over ranks; the default is the mean (shard size x
        replicate size). With fp32/bf16 the division is part of the reduce-scatter (NCCL's
        ``PREMUL_SUM``; ``AVG`` when ``factor`` is the shard size; on gloo, which has
        neither, a sum followed by one division of this rank's chunk); fp16 splits it before
        and after the sum. This module's group only, as in torch.

        Example:
            >>> model.set_gradient_divide_factor(1.0)  # sum over ranks  # doctest: +SKIP
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise FullyShardTypeError(
                f"set_gradient_divide_factor needs a number, got {factor!r} "
                f"({type(factor).__name__})"
            )
        if not math.isfinite(factor) or factor <= 0:
            raise FullyShardValueError(
                f"set_gradient_divide_factor({factor}) must be a finite number > 0 (1.0 sums the "
                "gradients, the data-parallel size averages them)"
            )
        self._update_config(False, gradient_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in torch): use :meth:`set_gradient_divide_factor`.

        Example:
            >>> model.set_gradient_divide_factor(2.0)  # doctest: +SKIP
        """
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Let the collectives only ever sum; divisions run as separate steps around them.

        NCCL's zero-copy collectives need ``SUM``. The default fp32/bf16 path averages inside
        the collective instead; with this on, the sum is divided once afterwards (fp16:
        partly before). The numbers then match torch's FSDP2 with the same setting bit for
        bit. A custom all-reduce hook must follow the same rule itself. This group only.

        Example:
            >>> model.set_force_sum_reduction_for_comms(True)  # doctest: +SKIP
        """
        flag = _check_bool("set_force_sum_reduction_for_comms(enable)", enable)
        self._update_config(False, force_sum_reduction_for_comms=flag)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for a trainable parameter that got no gradient in a backward.

        Needed when ranks use different parameters (conditional control flow: mixture of
        experts, multi-modal branches): by default, as in torch, a group packs only the
        parameters that have a gradient, so two ranks would send reduce-scatters of
        different layouts and hang or mix up gradients. With True every rank packs every
        trainable parameter of the group (zeros where it got none), and each parameter's
        gradient is the average over all ranks, zeros included (like DDP's
        ``find_unused_parameters``); a parameter no rank used then gets a zero gradient
        instead of ``None``.

        Example:
            >>> model.set_reduce_scatter_unused_params(True)  # doctest: +SKIP
        """
        flag = _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        _check_bool("recurse", recurse)
        self._update_config(recurse, reduce_scatter_unused_params=flag)

    # -- communication resources (CUDA/NCCL tuning; validated and recorded on CPU) ----------

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter input buffers may be in flight (torch: a CUDA overlap dial).

        torch's FSDP2 keeps one by default; more lets the next group's gradient copy-in skip
        waiting for the previous reduce-scatter at the cost of memory. We have no separate
        streams: at most one group's reduce-scatter is in flight (the next group's
        post-backward finishes it), whatever the value. Validated and recorded; numbers
        never depend on it.

        Example:
            >>> model.set_reduce_scatter_max_input_buffers(2)  # doctest: +SKIP
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise FullyShardTypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise FullyShardValueError(
                f"max_input_buffers must be a positive int (1 is the default), got "
                f"{max_input_buffers}"
            )
        _check_bool("recurse", recurse)
        modules = list(self._fsdp_modules(recurse))
        if max_input_buffers > 1:
            for module in modules:
                if module._fsdp_state.config.symm_mem_backend is not None:
                    raise FullyShardValueError(
                        f"set_reduce_scatter_max_input_buffers({max_input_buffers}) with "
                        "symmetric memory (set_symm_mem_for_comm): the symmetric pool reuses "
                        "one buffer; keep max_input_buffers=1"
                    )
        for module in modules:
            for group in module._fsdp_state.groups:
                _replace_config(group, reduce_scatter_max_input_buffers=max_input_buffers)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run gradient reduce-scatters on their own process group (True) or the shard group.

        On NCCL a second communicator lets a reduce-scatter progress while an all-gather runs.
        One group is created per distinct set of shard ranks (``dist.new_group(ranks,
        use_local_synchronization=True)``, so it is collective over those ranks: call it on
        every rank), reused by later calls; ``False`` goes back to the shard group. On gloo
        it works the same way; the numbers do not change.

        Example:
            >>> model.set_separate_reduce_scatter_group(True)  # doctest: +SKIP
        """
        flag = _check_bool("set_separate_reduce_scatter_group(enable)", enable)
        _check_bool("recurse", recurse)
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for module in self._fsdp_modules(recurse):
            for group in module._fsdp_state.groups:
                rs_group = None
                if flag:
                    ranks = tuple(dist.get_process_group_ranks(group.info.shard_group))
                    if ranks not in created:
                        existing = group.config.reduce_scatter_group
                        created[ranks] = existing or dist.new_group(
                            list(ranks), use_local_synchronization=True
                        )
                    rs_group = created[ranks]
                _replace_config(group, reduce_scatter_group=rs_group)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Take the communication buffers from the process group's own allocator.

        NCCL can then use zero-copy transfers (SHARP over NVLink/InfiniBand). A backend
        without an allocator (gloo) gives ordinary ``torch.empty`` buffers: accepted, no
        change. Not combinable with ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
        (those say how to allocate). This group only.

        Example:
            >>> model.set_allocate_memory_from_process_group_for_comm(True)  # doctest: +SKIP
        """
        flag = _check_bool("set_allocate_memory_from_process_group_for_comm(enable)", enable)
        self._check_no_custom_comm("set_allocate_memory_from_process_group_for_comm")
        self._update_config(False, allocate_from_process_group=flag)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Symmetric-memory buffers for NCCL's optimised all-gathers (NCCL process groups only).

        Raises on any other backend (gloo on CPU): symmetric memory is an NCCL feature. On
        NCCL the choice is validated and recorded; our buffers still come from the regular
        allocator (numbers are identical: it is a transport optimisation we do not
        implement yet). This group only.

        Example:
            >>> model.set_symm_mem_for_comm("NCCL")  # doctest: +SKIP  (NCCL only)
        """
        if backend != "NCCL":
            raise FullyShardValueError(
                f"set_symm_mem_for_comm(backend={backend!r}): only 'NCCL' is supported"
            )
        self._check_no_custom_comm("set_symm_mem_for_comm")
        state = self._fsdp_state
        for group in state.groups:
            pg_backend = str(dist.get_backend(group.info.shard_group)).lower()
            if pg_backend != "nccl":
                raise FullyShardNotImplementedError(
                    f"set_symm_mem_for_comm needs an NCCL process group; this module's shard "
                    f"group runs on {pg_backend!r}. Symmetric memory is a CUDA/NCCL transport "
                    "feature: leave it off on CPU (gloo)"
                )
        if state.config.reduce_scatter_max_input_buffers > 1:
            raise FullyShardValueError(
                "set_symm_mem_for_comm with set_reduce_scatter_max_input_buffers(>1): the "
                "symmetric pool reuses one buffer; set max_input_buffers back to 1 first"
            )
        self._update_config(False, symm_mem_backend=backend)

    def _check_no_custom_comm(self, call: str) -> None:
        config = self._fsdp_state.config
        for name, comm in (
            ("set_custom_all_gather", config.all_gather_comm),
            ("set_custom_reduce_scatter", config.reduce_scatter_comm),
        ):
            if comm is not None:
                raise FullyShardValueError(
                    f"{call} cannot be combined with {name} ({type(comm).__name__}), which "
                    "already decides how buffers are allocated"
                )

    def set_custom_all_gather(self, comm: AllGatherLike) -> None:
        """Issue this group's all-gathers through ``comm`` (an :class:`~fully_shard.AllGather`).

        ``comm.allocate((W * total,), dtype=..., device=...)`` makes the all-gather output
        (this rank's input is its own slice of it) and ``comm(output_tensor=...,
        input_tensor=..., group=..., async_op=...)`` issues it. torch's own ``AllGather``
        subclasses work too. The call still goes through the group's observers, so
        ``fully_shard.trace`` and ``torch.profiler`` labels see it. This group only.

        Example:
            >>> model.set_custom_all_gather(MyAllGather())  # doctest: +SKIP
        """
        _check_comm("set_custom_all_gather", comm, "AllGather")
        self._check_one_group("set_custom_all_gather")
        self._update_config(False, all_gather_comm=comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatterLike) -> None:
        """Issue this group's gradient reduce-scatters through ``comm`` (a ``ReduceScatter``).

        ``comm.allocate`` makes the ``(W * total,)`` input and ``(total,)`` output buffers;
        ``comm(output_tensor=..., input_tensor=..., group=..., op=...)`` is called
        synchronously with the op torch's FSDP2 would pass (``AVG`` for fp32/bf16 by default;
        ``PREMUL_SUM`` for a custom divide factor, which gloo cannot run: combine with
        ``set_force_sum_reduction_for_comms(True)`` there). Divisions outside the op are done
        around the call. This group only.

        Example:
            >>> model.set_custom_reduce_scatter(MyReduceScatter())  # doctest: +SKIP
        """
        _check_comm("set_custom_reduce_scatter", comm, "ReduceScatter")
        self._check_one_group("set_custom_reduce_scatter")
        self._update_config(False, reduce_scatter_comm=comm)

    # -- backward and optimizer ---------------------------------------------------------------

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this group's parameters (default True).

        False saves one all-gather per backward for a group whose parameters no gradient
        computation reads, e.g. an embedding (its weight gradient needs only the indices).
        Gradients are still reduce-scattered. The gathers of activation-checkpoint
        recomputation are skipped too (as in torch), so do not combine it with checkpointing
        the group. If backward does read the parameters (a ``Linear``'s weight for the
        input gradient), autograd finds the freed storage and raises a ``RuntimeError``
        (with ``reshard_after_forward=False`` the parameters are still gathered and it
        works). This group only.

        Example:
            >>> model.tok_embeddings.set_unshard_in_backward(False)  # doctest: +SKIP
        """
        flag = _check_bool("unshard_in_backward", unshard_in_backward)
        self._update_config(False, unshard_in_backward=flag)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The event recorded after the optimizer step, for the next all-gathers to wait on.

        torch's FSDP2 all-gathers on side streams, which normally wait for the whole current
        stream; with an event they wait only for the optimizer step. Our collectives run on
        the current stream: here the current stream waits for ``event`` now (a stream wait,
        not a host wait), so the next all-gathers are ordered after the step even if it ran
        on another stream. A CPU event needs nothing: CPU work is done when it returns.
        Call it with a new event each iteration, as in torch.

        Example:
            >>> optim.step()  # doctest: +SKIP
            >>> event = torch.cuda.current_stream().record_event()  # doctest: +SKIP
            >>> model.set_post_optim_event(event)  # doctest: +SKIP
        """
        given: object = event  # checked as given: a caller may pass anything
        cpu_event = getattr(torch.cpu, "Event", None)
        is_event = isinstance(given, torch.Event) or (
            cpu_event is not None and isinstance(event, cpu_event)
        )
        if not is_event and not (
            callable(getattr(given, "wait", None)) and callable(getattr(given, "record", None))
        ):
            raise FullyShardTypeError(
                f"set_post_optim_event needs a torch.Event (e.g. "
                f"torch.cuda.current_stream().record_event()), got {type(event).__name__}"
            )
        device = getattr(event, "device", None)
        on_cpu = (cpu_event is not None and isinstance(event, cpu_event)) or (
            isinstance(device, torch.device) and device.type == "cpu"
        )
        if not on_cpu:
            event.wait()

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
            for group in module._fsdp_state.groups:
                group.comm = comm

    # -- the private names of torch's FSDPModule (our class may have it as a base) -------------

    def _get_fsdp_state(self) -> Any:
        # torch's tools that instrument FSDP internals (FSDPMemTracker) call this on a module
        # they recognise; answering ours would fail deep inside them.
        raise FullyShardNotImplementedError(
            f"{type(self).__name__} is sharded by fully_shard, not by torch's FSDP2: it has "
            "no torch FSDPState for torch's FSDPMemTracker (or other tools built on torch's "
            "FSDP internals) to instrument. Measure memory with "
            "torch.distributed._tools.mem_tracker.MemTracker or fully_shard.trace instead"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        # torch's private switch for async all-gathers in its hooks: ours are issued from the
        # current stream already, so there is nothing to switch (validated, recorded nowhere).
        _check_bool("_set_unshard_async_op(async_op)", async_op)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # to_empty(), to(), cuda() replace the sharded tensors: pick the new ones up.
        if any(g.state.name != "SHARDED" for g in self._fsdp_state.groups):
            raise FullyShardStateError(
                f"{type(self).__name__}: to()/to_empty()/cuda() while the parameters are "
                "gathered; call reshard() first"
            )
        for group in self._fsdp_state.groups:
            # Post-forward pieces (reshard_after_forward=n) go: _apply must convert the sharded
            # DTensors, never the pieces the module shows between forward and backward.
            group.reshard()
        out: nn.Module = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for group in self._fsdp_state.groups:
            group.sync_with_module()
        return out


AllGatherLike = Any
"""An :class:`~fully_shard.AllGather`, ours or torch's (checked by duck typing)."""
ReduceScatterLike = Any
"""A :class:`~fully_shard.ReduceScatter`, ours or torch's (checked by duck typing)."""


def _check_comm(call: str, comm: object, kind: str) -> None:
    if not is_comm_protocol(comm):
        raise FullyShardTypeError(
            f"{call} needs a fully_shard.{kind} (or torch's): an object with "
            f"allocate(size, *, dtype, device) and __call__; {type(comm).__name__} has "
            f"{'no allocate' if not callable(getattr(comm, 'allocate', None)) else 'no __call__'}"
        )


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots share one communication context (torch: CUDA streams, e.g. for PP).

    In torch's FSDP2 each root owns all-gather / reduce-scatter streams; sharing them
    between pipeline stages avoids memory fragmentation between streams. Our collectives
    run on the current stream, which every root already shares, so after checking that
    every item is a module ``fully_shard`` was applied to there is nothing to change.

    Example:
        >>> from fully_shard import share_comm_ctx
        >>> share_comm_ctx([stage0, stage1])  # doctest: +SKIP
    """
    if not isinstance(modules, (list, tuple)):
        raise FullyShardTypeError(
            f"share_comm_ctx expects a list of FSDPModules, got {type(modules).__name__}"
        )
    for i, module in enumerate(modules):
        if not isinstance(module, FSDPModule):
            raise FullyShardValueError(
                f"share_comm_ctx expects a list of FSDPModules but item {i} is a "
                f"{type(module).__name__}; pass modules fully_shard was applied to"
            )


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
