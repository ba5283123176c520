"""The documentation: the API reference covers the public API, and every recipe's example runs.

- Every name in ``fully_shard.__all__`` has a ``::: fully_shard.<name>`` entry in
  ``docs/api.md`` (what mkdocstrings renders) and a docstring with an example.
- Every script in ``examples/`` (but the shared ``toy.py`` and ``llama.py``) is linked from a
  docs page and runs to completion on 2 gloo ranks. Each script checks its own claim (no
  reduction before the last micro-batch, bf16 compute with fp32 master weights, identical
  outputs after a DCP round trip, ...) and raises when it does not hold; the test also looks
  for the line that says so.

How the examples are launched. Under ``torchrun`` each one costs three fresh interpreters that
import torch: 12 s of CPU, 12-26 s on the 2 busy cores of CI, 3 minutes for all nine. So each
script runs as ``__main__`` (``runpy``, with its command line in ``sys.argv``) on the warm
2-rank pool of ``harness.py``, where the process group already exists: each script joins it
with ``fully_shard.init_distributed()`` (which keeps an existing group; the test checks the
call, and that no script calls ``init_process_group`` itself), its ``destroy_process_group``
is made a no-op, nothing else is changed. The launcher itself is tested by running
``examples/train.py`` under ``torchrun`` in ``test_multinode.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import fully_shard
from example_runner import run_example
from harness import run_distributed

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
EXAMPLES = REPO / "examples"
TIMEOUT_S = 90  # seconds, per example

# Public names whose docstring has no example yet (src/ is another developer's): strict xfail,
# so the test fails as soon as one gains an example and the mark must go.
NO_EXAMPLE_YET: set[str] = set()

# example -> (extra arguments, a line its output must contain)
EXAMPLES_RUN: dict[str, tuple[list[str], str]] = {
    "train.py": (["--steps", "3"], r"step 2: loss \d"),
    "meta_init.py": ([], r"this rank holds \d+ of \d+ parameter elements"),
    "grad_accum.py": ([], r"step 1 micro-batch 3: [1-9]\d* reduce-scatters"),
    "buckets.py": ([], r"buckets: 3 collectives per step instead of 14; max .* = 0\.0e\+00"),
    "persistent_params.py": ([], r"kept whole: 18 parameters .* 1 all-reduce per step"),
    "mixed_precision.py": ([], r"compute \{torch.bfloat16\}, all-gather torch.bfloat16"),
    "fp32_params.py": ([], r"head computes in \{torch.float32\}, blocks in \{torch.bfloat16\}"),
    "offload.py": ([], r"shards on \{'cpu'\}, optimizer state on \{'cpu'\}"),
    "activation_checkpointing.py": ([], r"step 2: loss \S+, 4 all-gathers in backward"),
    "checkpoint.py": (["--dir", "{tmp}"], r"full state dict \(\d+ tensors\) loads"),
    # a tiny HF Llama when transformers is installed, the toy model's torch.save otherwise
    "pretrained.py": (["--dir", "{tmp}"], r"outputs and one AdamW step match the unsharded model"),
    # aot_eager: inductor needs ~25 s of C++ compilation per process here (tests/test_compile.py)
    "compile.py": (["--backend", "aot_eager"], r"compiled after each step: \[(\d+), \1, \1\]"),
    "compile_whole.py": (
        ["--backend", "aot_eager"],
        r"backward graph: 2 all_gather_into_tensor \(torch.float32\), 3 all_to_all_single",
    ),
    "hf_llama.py": ([], r"step 2: loss \d"),
    "peft_lora.py": ([], r"step 2: loss \d\S*, \d+ of \d+ parameters trainable"),
    "float8.py": ([], r"step 2: loss \d\S*, 1\.00 bytes per gathered element"),
    "low_memory_step.py": ([], r"step 2: loss \d\S*, (\d+) of \1 parameters stepped"),
    "desync.py": ([], r"step 1: rank 0: collectives diverged .* 'layers\.2'"),
    "plan_memory.py": ([], r"step 2: loss \d\S*, planned peak \d+ bytes"),
    "muon.py": ([], r"Muon's matrices 0\.0e\+00, AdamW's parameters 0\.0e\+00; 24 Newton-Schulz"),
    # 2 ranks: TP 2 x DP 1 (tests/test_example_2d.py runs 2 x 2 under torchrun)
    "train_llama_2d.py": (["--steps", "3"], r"max \|2-D - unsharded\| over all parameters"),
    # 2 ranks: 1 x 1 x 2 (tests/test_3d.py runs 2 x 1 x 2 and 1 x 2 x 2 on 4 ranks)
    "train_llama_3d.py": (["--steps", "3"], r"max \|3-D - unsharded\| over all parameters"),
    # 2 ranks: 2 stages x dp 1 (tests/test_pipelining.py runs every schedule on 2 x 2)
    "train_llama_pp.py": (["--steps", "2"], r"max \|pipelined \+ sharded - unsharded\|"),
    # 2 ranks: EP 2 x expert-FSDP 1 (tests/test_per_param_mesh.py runs 2 x 2 on 4 ranks)
    "moe_experts.py": (["--steps", "3"], r"max \|sharded - unsharded\| over all parameters"),
    # tests/test_resume.py kills and restarts it under torchrun
    "train_resumable.py": (
        ["--steps", "4", "--ckpt-every", "2", "--ckpt-dir", "{tmp}", "--out", "{tmp}/final.pt"],
        r"finished 4 steps",
    ),
}
NEEDS = {"hf_llama.py": "transformers", "peft_lora.py": "peft", "float8.py": "torchao"}
SHARED = {"toy.py", "llama.py"}  # modules the scripts import, not scripts


def _api_entries() -> set[str]:
    text = (DOCS / "api.md").read_text()
    return set(re.findall(r"^::: fully_shard\.(\w+)\s*$", text, flags=re.MULTILINE))


def test_api_reference_lists_exactly_the_public_names() -> None:
    public = set(fully_shard.__all__)
    entries = _api_entries()
    assert public - entries == set(), "public names missing from docs/api.md"
    assert entries - public == set(), "docs/api.md documents names that are not public"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(strict=True, reason="docstring has no example yet (src/)"),
        )
        if name in NO_EXAMPLE_YET
        else name
        for name in fully_shard.__all__
    ],
)
def test_public_name_has_a_docstring_with_an_example(name: str) -> None:
    doc = inspect.getdoc(getattr(fully_shard, name)) or ""
    assert doc.strip(), f"fully_shard.{name} has no docstring"
    assert re.search(r"^Example[s]?:\s*$", doc, flags=re.MULTILINE), f"{name}: no 'Example:'"
    assert ">>>" in doc, f"fully_shard.{name}'s example has no >>> line"


def test_every_example_is_run_here_and_linked_from_the_docs() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - SHARED
    assert scripts == set(EXAMPLES_RUN)
    pages = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    unlinked = {s for s in scripts if f"examples/{s}" not in pages}
    assert unlinked == set(), "examples no docs page mentions"


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.MULTILINE | re.DOTALL)
FROM_IMPORT = re.compile(
    r"^\s*from\s+(fully_shard(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", flags=re.MULTILINE
)
CHAIN = re.compile(r"(?<![\w.])fully_shard(?:\.\w+)+")


def _resolve_chain(chain: str) -> bool:
    """``fully_shard.a.b`` as user code reads it after ``import fully_shard`` (or
    ``import fully_shard.a``): attributes, where a missing one may be a submodule to import."""
    obj: object = fully_shard
    prefix = "fully_shard"
    for part in chain.split(".")[1:]:
        prefix = f"{prefix}.{part}"
        if not hasattr(obj, part):
            try:
                importlib.import_module(prefix)
            except ImportError:
                return False
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _names_the_docs_use() -> set[tuple[str, str]]:
    """(page, name) for every ``from fully_shard... import X`` and ``fully_shard.X...`` chain
    in the pages' Python code blocks, and every chain in their inline code."""
    pages = [*DOCS.glob("*.md"), *(DOCS / "recipes").glob("*.md"), REPO / "README.md"]
    used: set[tuple[str, str]] = set()
    for page in pages:
        text = page.read_text()
        blocks = [code for lang, code in FENCE.findall(text) if lang in ("python", "py", "")]
        for code in blocks:
            for module, names in FROM_IMPORT.findall(code):
                for name in re.findall(r"(\w+)(?:\s+as\s+\w+)?", names.strip("()")):
                    used.add((page.name, f"from {module} import {name}"))
        inline = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
        for code in [*blocks, *inline]:
            used.update((page.name, chain) for chain in CHAIN.findall(code))
    return used


def _exists(name: str) -> bool:
    if not name.startswith("from "):
        # `fully_shard.X` is the package's X or, after `from fully_shard import fully_shard`,
        # the function's attribute X (`fully_shard.state(module)`, as torch's has it).
        attrs = name.split(".")[1:]
        return _resolve_chain(name) or (
            len(attrs) == 1 and hasattr(fully_shard.fully_shard, attrs[0])
        )
    _, module, _, attr = name.split()
    try:
        return hasattr(importlib.import_module(module), attr)
    except ImportError:
        return False


def test_every_fully_shard_name_the_docs_use_exists() -> None:
    used = _names_the_docs_use()
    assert len(used) > 50  # the parser still finds the pages' names
    missing = sorted(f"{page}: {name}" for page, name in used if not _exists(name))
    assert missing == [], "names the docs use that the package lacks"


# Where a script may still name the CPU or gloo itself: the user's own choice on the command
# line, or what the script measures. Everything else is init_distributed's to decide.
# (file, the line, stripped) -> why
INHERENTLY_CPU = {
    (
        "bench_collectives.py",
        'init_rank(rank, world, "cpu", "gloo", port, timedelta(minutes=5))  # gloo\'s, by design',
    ): "it measures gloo's collectives against TorchComm's on gloo",
    (
        "bench_compile.py",
        'job = init_rank(rank, cfg.world, "cpu", "gloo", port, timedelta(minutes=30))  # C++',
    ): "it times inductor's CPU code generation (the C++ builds): compile times on CPU",
    (
        "bench_overhead.py",
        'job = init_rank(rank, opts.world, "cpu", "gloo", port, timedelta(minutes=10))  # host',
    ): "it measures the host's Python per group (calls counted on CPU tensors, gloo)",
    (
        "bench_plan.py",
        'mesh = init_rank(rank, world, "cpu", "gloo", port, timedelta(seconds=300)).mesh',
    ): "the planner's numbers are CPU bytes (tracemalloc)",
    (
        "bench_train.py",
        'backend: str = "gloo"  # "nccl" for --device cuda unless --backend gloo',
    ): "the --backend flag's resolved value",
    (
        "bench_train.py",
        'return init_distributed(backend="gloo", timeout=timeout)',
    ): "--device cpu: the user asked for CPU ranks",
    (
        "bench_train.py",
        'if backend != "gloo":  # "auto": the device\'s default backend',
    ): "--device cuda --backend gloo: ranks sharing a GPU, which init_distributed refuses",
    (
        "bench_train.py",
        'device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")',
    ): "the parent's reference run, on the --device asked for",
    ("bench_train.py", 'choices=("auto", "gloo", "nccl"),'): "the --backend flag",
    ("bench_train.py", 'backend = "nccl" if args.device == "cuda" else "gloo"'): "--backend auto",
    (
        "device_check.py",
        'parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")',
    ): "the --backend flag",
    (
        "device_check.py",
        'first = "nccl" if args.device == "cuda" else "gloo"',
    ): "--all: its W=1 run, NCCL on a GPU (gloo when checking on CPU)",
    (
        "device_check.py",
        'runs = [(first, 1), ("gloo", 2), ("gloo", 4)]',
    ): "--all: W=2 and W=4 on gloo sharing one GPU, a column of the verified-where table",
    ("device_check.py", 'backend = "nccl" if args.device == "cuda" else "gloo"'): "--backend auto",
    (
        "device_check.py",
        'device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")',
    ): "the parent's reference run, on the --device asked for",
    (
        "demo.py",
        'backend="gloo" if cfg.device == "cpu" else None, timeout=timedelta(seconds=cfg.timeout_s)',
    ): "--device cpu",
}
HARD_CODED = re.compile(
    r'"gloo"|init_device_mesh\("cpu"|device="cpu"|torch\.device\("cpu"\)|init_process_group\("'
)


def test_no_script_hard_codes_the_cpu_or_gloo() -> None:
    scripts = [
        *EXAMPLES.glob("*.py"),
        *(REPO / "benchmarks").glob("*.py"),
        REPO / "src" / "fully_shard" / "demo.py",
    ]
    found = {
        (path.name, line.strip())
        for path in scripts
        for line in path.read_text().splitlines()
        if HARD_CODED.search(line)
    }
    assert found - INHERENTLY_CPU.keys() == set(), "use init_distributed()'s device and mesh"
    assert INHERENTLY_CPU.keys() - found == set(), "stale entries: drop them"


@pytest.mark.parametrize("script", sorted(EXAMPLES_RUN))
def test_example_runs_on_two_ranks(script: str, tmp_path: Path) -> None:
    module = NEEDS.get(script)
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[hf]')")
    extra, expect = EXAMPLES_RUN[script]
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in extra]
    outputs = run_distributed(run_example, 2, script, argv, timeout=TIMEOUT_S)
    assert re.search(expect, outputs[0]), f"{script}: no line matching {expect!r}:\n{outputs}"
