"""fully_shard: fully sharded data parallelism (ZeRO-3) for PyTorch, in the FSDP2 style.

Example:
    >>> from fully_shard import fully_shard
    >>> for block in model.layers:  # doctest: +SKIP
    ...     fully_shard(block)
    >>> fully_shard(model)  # doctest: +SKIP
"""

from . import debug, optim, trace
from .api import fully_shard
from .collectives import AllGather, Comm, CommRecord, CountingComm, ReduceScatter, TorchComm
from .errors import (
    FullyShardArgumentTypeError,
    FullyShardAssertionError,
    FullyShardCopyError,
    FullyShardDesyncError,
    FullyShardError,
    FullyShardLaunchError,
    FullyShardNotImplementedError,
    FullyShardStateError,
    FullyShardTypeError,
    FullyShardValueError,
    PlanInfeasibleError,
)
from .launch import Distributed, init_distributed
from .mesh import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from .module import (
    FinalizeBackwardHandle,
    FSDPModule,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from .optim import Muon
from .plan import CheckpointedBlock, Plan, StepCosts, plan
from .policies import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizationPolicy,
)

__version__ = "0.1.0"

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "CheckpointedBlock",
    "Comm",
    "CommRecord",
    "CountingComm",
    "DataParallelMeshDims",
    "Distributed",
    "FSDPMeshInfo",
    "FSDPModule",
    "FinalizeBackwardHandle",
    "FullyShardArgumentTypeError",
    "FullyShardAssertionError",
    "FullyShardCopyError",
    "FullyShardDesyncError",
    "FullyShardError",
    "FullyShardLaunchError",
    "FullyShardNotImplementedError",
    "FullyShardStateError",
    "FullyShardTypeError",
    "FullyShardValueError",
    "HSDPMeshInfo",
    "MixedPrecisionPolicy",
    "Muon",
    "OffloadPolicy",
    "Plan",
    "PlanInfeasibleError",
    "QuantizationPolicy",
    "ReduceScatter",
    "ShardPlacementResult",
    "StepCosts",
    "TorchComm",
    "UnshardHandle",
    "debug",
    "fully_shard",
    "init_distributed",
    "optim",
    "plan",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "trace",
]
