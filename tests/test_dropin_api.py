"""The drop-in surface: every public FSDP2 name, method and parameter of torch's, in ours.

Read off the installed torch (2.13 in CI), never hard-coded: the names of
``torch.distributed.fsdp.__all__`` that belong to FSDP2, the call protocols ``AllGather`` and
``ReduceScatter``, every public method ``FSDPModule`` adds to ``nn.Module`` with its parameter
names, kinds and defaults, ``fully_shard``'s parameters and defaults, and the policies' fields
and defaults. Each test fails with the list of everything we lack.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_api  # AllGather / ReduceScatter live here

import fully_shard as ours

# torch.distributed.fsdp also exports FSDP1 (FullyShardedDataParallel and its configs), which is
# not part of the FSDP2 drop-in surface: the FSDP2 names are those of its _fully_shard package.
PROTOCOLS = ("AllGather", "ReduceScatter")


def _fsdp2_names() -> list[str]:
    fsdp2 = set(torch_fsdp._fully_shard.__all__)
    return sorted(n for n in torch_fsdp.__all__ if n in fsdp2)


def _signature(fn: Any) -> list[tuple[str, str, Any]]:
    """(name, kind, default) of every parameter but ``self``."""
    return [
        (p.name, p.kind.name, p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


def _missing_params(theirs: Any, mine: Any, where: str) -> list[str]:
    got = {name: (kind, default) for name, kind, default in _signature(mine)}
    missing = []
    for name, kind, default in _signature(theirs):
        if name not in got:
            missing.append(f"{where}: parameter {name!r}")
            continue
        my_kind, my_default = got[name]
        if my_kind != kind:
            missing.append(f"{where}: parameter {name!r} is {my_kind}, torch's is {kind}")
        if not _same_default(default, my_default):
            missing.append(f"{where}: {name}={my_default!r}, torch's default is {default!r}")
    return missing


# Policy fields of a newer torch than the one installed, which ours has already (and their
# defaults): torch 2.15's MixedPrecisionPolicy.param_dtype_override_fn.
NEWER_TORCH_FIELDS = {"param_dtype_override_fn": None}


def _same_default(theirs: Any, mine: Any) -> bool:
    if theirs is inspect.Parameter.empty or mine is inspect.Parameter.empty:
        return theirs is mine
    if dataclasses.is_dataclass(theirs) and dataclasses.is_dataclass(mine):
        # A policy object as a default (MixedPrecisionPolicy()): compare its fields; ours may
        # add a newer torch's, with that torch's default.
        their_fields, my_fields = _fields(type(theirs)), _fields(type(mine))
        extra = {k: v for k, v in my_fields.items() if k not in their_fields}
        return their_fields.items() <= my_fields.items() and extra.items() <= (
            NEWER_TORCH_FIELDS.items()
        )
    return bool(theirs == mine)


def _fields(cls: type) -> dict[str, Any]:
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else "<factory>"
        for f in dataclasses.fields(cls)
    }


def test_every_public_fsdp2_name_is_exported() -> None:
    wanted = [*_fsdp2_names(), *PROTOCOLS]
    missing = [n for n in wanted if n not in ours.__all__ or not hasattr(ours, n)]
    assert not missing, f"fully_shard lacks torch's FSDP2 names: {missing}"
    assert "DataParallelMeshDims" in wanted and "share_comm_ctx" in wanted  # read off torch


def _torch_fsdp_module_methods() -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(torch_fsdp.FSDPModule)
        if not name.startswith("_") and callable(member) and not hasattr(nn.Module, name)
    )


def test_every_fsdp_module_method_exists_with_torchs_parameters() -> None:
    methods = _torch_fsdp_module_methods()
    assert len(methods) >= 20, methods  # torch 2.13 has 23
    missing = []
    for name in methods:
        mine = getattr(ours.FSDPModule, name, None)
        if mine is None:
            missing.append(f"FSDPModule.{name}")
            continue
        missing += _missing_params(getattr(torch_fsdp.FSDPModule, name), mine, name)
    assert not missing, "FSDPModule differs from torch's:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["fully_shard", "register_fsdp_forward_method", "share_comm_ctx"])
def test_functions_take_torchs_parameters(name: str) -> None:
    mine = getattr(ours, name, None)
    assert mine is not None, f"fully_shard.{name} is missing"
    missing = _missing_params(getattr(torch_fsdp, name), mine, name)
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(
    "name", ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]
)
def test_policies_have_torchs_fields_and_defaults(name: str) -> None:
    mine = getattr(ours, name, None)
    assert mine is not None, f"fully_shard.{name} is missing"
    theirs = _fields(getattr(torch_fsdp, name))
    got = _fields(mine)
    missing = {k: v for k, v in theirs.items() if got.get(k, "<missing>") != v}
    assert not missing, f"{name}: fields that differ from torch's (torch's values): {missing}"


def test_unshard_handle_and_comm_protocols_have_torchs_methods() -> None:
    assert callable(getattr(ours.UnshardHandle, "wait", None))
    missing = []
    for proto in PROTOCOLS:
        mine = getattr(ours, proto, None)
        if mine is None:
            missing.append(proto)
            continue
        for method in ("allocate", "__call__"):
            theirs = getattr(getattr(_fsdp_api, proto), method)
            if getattr(mine, method, None) is None:
                missing.append(f"{proto}.{method}")
            else:
                missing += _missing_params(theirs, getattr(mine, method), f"{proto}.{method}")
    assert not missing, "\n".join(missing)
