"""What makes two sharded blocks the same block for the compiler: their structure, as a value.

The graph path (``fully_shard.graph``) compiles each sharded block's call as a nested compile
region, traced once and called again for every block of the same structure. torch decides
reuse from a key we give it, in place of its guards (which match our objects by identity and
refuse a region with side effects), so the key must hold everything the traced region depends
on besides its tensor inputs: what :func:`block_structure` reads off the module tree, with the
gather's plan and the inputs' metadata that the graph path adds.

What goes in, per module of the block (the block first, then its submodules in order):

- the class, the ``training`` flag and every plain attribute (numbers, strings, dtypes, enums,
  tuples of them), by value: a sliding-window layer's window, a checkpointed block's flag;
- where each parameter and buffer sits, and for those not gathered by the block's group
  (buffers, ignored parameters) their shape, dtype and ``requires_grad``;
- forward hooks, and any other object attribute, by identity, except functions, classes and
  ``functools.partial`` of them, which compare by what they are (an activation function or a
  ``checkpoint_wrapper``'s partial is the same object in every block). Two blocks whose
  attributes are distinct objects get regions of their own: never shared wrongly, at the
  price of a compile.

Example:
    >>> from torch import nn
    >>> a, b = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> block_structure(a) == block_structure(b)
    True
    >>> block_structure(a) == block_structure(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))
    False
"""

from __future__ import annotations

import enum
import functools
import types
from typing import Any

import torch
from torch import nn

# nn.Module's own bookkeeping in its __dict__: the containers are read apart (parameters,
# buffers, submodules, hooks); the others (state-dict and load hooks, the names of
# non-persistent buffers) do not change what forward computes.
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_fsdp_state",  # the gather is keyed by its plan (fully_shard.graph)
    }
)
# torch.distributed._composable's per-module registry (interop.py registers ours there, so
# that torch's tools recognise a sharded module): one object per module, never read by forward.
_COMPOSABLE_PREFIX = "__composable_api_state_key"
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def value_key(value: Any, depth: int = 0) -> Any:
    """A hashable stand-in for ``value``: equal for values a traced forward cannot tell apart.

    Plain values by value, containers item by item, functions and classes as themselves,
    ``functools.partial`` by its function and arguments, tensors by shape, dtype and
    ``requires_grad``, anything else by identity (``id``): equal only to itself.
    """
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if depth < 4:
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(value_key(v, depth + 1) for v in value))
        if isinstance(value, dict):
            return (dict, tuple((value_key(k), value_key(v, depth + 1)) for k, v in value.items()))
        if isinstance(value, functools.partial):
            return (
                functools.partial,
                value_key(value.func, depth + 1),
                value_key(value.args, depth + 1),
                value_key(value.keywords, depth + 1),
            )
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return value  # module-level functions and classes: one object for every block
    return ("object", id(value))


def block_structure(block: nn.Module) -> tuple[Any, ...]:
    """The structure of ``block``'s module tree as a hashable value (see the module docstring).

    Parameters and buffers appear by place, shape, dtype (and ``requires_grad``). The block's
    own forward hooks are left out: they are ``fully_shard``'s, one pair per block, and the
    graph path puts a block in a region only when it has no others.
    """
    out: list[Any] = []
    for path, module in block.named_modules(remove_duplicate=False):
        attrs = tuple(
            (name, value_key(value))
            for name, value in vars(module).items()
            if name not in _MODULE_INTERNALS and not name.startswith(_COMPOSABLE_PREFIX)
        )
        params = tuple(
            (name, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad))
            for name, p in module._parameters.items()
        )
        buffers = tuple(
            (name, None if b is None else (tuple(b.shape), b.dtype))
            for name, b in module._buffers.items()
        )
        hooks = tuple(
            value_key(hook)
            for hooks in (module._forward_pre_hooks, module._forward_hooks)
            for hook in hooks.values()
            if module is not block
        )
        out.append((path, type(module), attrs, params, buffers, hooks))
    return tuple(out)
