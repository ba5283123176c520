"""Tensor subclasses whose all-gather extension hooks are incomplete or mis-declared.

``fully_shard`` must refuse them before anything changes; tests/test_extensions.py checks our
messages, tests/test_error_classes.py what torch's ``fully_shard`` does with the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BadSignature", "PreOnly"]


class PreOnly(torch.Tensor):
    """Half an all-gather extension: a pre hook without its post hook."""

    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        return (self,), None


class BadSignature(torch.Tensor):
    """An all-gather extension whose pre hook takes neither of torch's argument lists
    (``(mesh)`` or ``(mesh, outer_size, outer_stride, module, mp_policy)``); its post hook
    has torch's signature."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any) -> Any:
        return (self,), None

    def fsdp_post_all_gather(
        self, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None
    ) -> Any:
        return outputs[0], ()
