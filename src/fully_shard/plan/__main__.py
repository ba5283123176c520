"""``python -m fully_shard.plan``: plan a Hugging Face causal LM from its config file.

    python -m fully_shard.plan --config config.json --world-size 64 --budget 80GiB \\
        --batch 1 --seq 4096 --mixed-precision bf16

Builds the model on the meta device with ``transformers`` (no weights are read or allocated),
plans one training step of ``--batch`` sequences of ``--seq`` tokens per rank with the
model's own loss (``labels=``), and prints the plan's table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..policies import MixedPrecisionPolicy
from . import plan

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, plan, print; return the exit status (1: infeasible).

    Example:
        >>> main(["--config", "config.json", "--world-size", "8", "--budget", "40GiB",
        ...       "--batch", "1", "--seq", "2048"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="python -m fully_shard.plan", description=__doc__)
    parser.add_argument("--config", required=True, help="a Hugging Face config.json")
    parser.add_argument("--world-size", type=int, required=True, help="shard ranks")
    parser.add_argument("--budget", required=True, help="memory per rank, e.g. 80GiB")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--mixed-precision", choices=sorted(_DTYPES), default=None)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "sgd_momentum"])
    parser.add_argument(
        "--allow", default="reshard,checkpoint,offload", help="options the planner may change"
    )
    parser.add_argument(
        "--param-persistence-threshold",
        type=int,
        default=None,
        help="keep parameters of fewer elements whole on every rank (fully_shard's option)",
    )
    ns = parser.parse_args(argv)
    try:
        # Imported by name: an optional dependency (the `hf` extra), not needed to type-check.
        transformers: Any = importlib.import_module("transformers")
    except ImportError:
        parser.error(
            "the command line builds the model with transformers: pip install transformers"
        )

    with open(ns.config) as f:
        raw = json.load(f)
    model_type = raw.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    mp = None
    if ns.mixed_precision is not None:
        mp = MixedPrecisionPolicy(
            param_dtype=_DTYPES[ns.mixed_precision], reduce_dtype=torch.float32
        )
    tokens = torch.zeros(ns.batch, ns.seq, dtype=torch.long, device="meta")
    from ..errors import PlanInfeasibleError

    try:
        result = plan(
            model,
            budget=ns.budget,
            world_size=ns.world_size,
            example_inputs={"input_ids": tokens, "labels": tokens, "use_cache": False},
            mp_policy=mp,
            optimizer=ns.optimizer,
            allow=tuple(a for a in ns.allow.split(",") if a),
            param_persistence_threshold=ns.param_persistence_threshold,
        )
    except PlanInfeasibleError as e:
        print(e, file=sys.stderr)
        print(e.plan, file=sys.stderr)
        return 1
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
