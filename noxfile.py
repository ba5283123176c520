"""Developer and CI sessions: ``python3 -m nox -s tests`` (see README.md).

Every session installs with ``-c constraints.txt``, which pins torch to the release CI tests
against (2.13.0) and pins the linters, so that a new ruff or mypy release cannot fail CI on
unchanged code. The pin is a version, not a build: which wheel pip picks is up to its
configuration (on this project's CI machines a local CPU wheel; elsewhere PyPI's CUDA build
unless ``--index-url https://download.pytorch.org/whl/cpu`` comes first). The file is for
these sessions; users install with ``pip install -e .`` and keep their own torch.

``tests_torch_latest`` (not a default session, not run by CI) runs the suite on the newest
torch release instead of the pinned one.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck"]

CONSTRAINTS = ("-c", "constraints.txt")
TORCH_LATEST = "2.14.1"  # the newest torch release the suite has been run on
# Two pytest workers (pytest-xdist), each with its own warm pools of ranks: one worker leaves
# a core idle while its test waits (a W=1 job, a subprocess importing torch, a rank waiting
# out a timeout), and the other fills it. More workers than cores only adds contention: each
# job already runs up to 4 ranks. ``-- -n 0`` runs the tests in one process.
WORKERS = ("-n", "2", "--dist", "worksteal")
LINTED = ("src", "tests", "benchmarks", "examples", "noxfile.py")


def _existing(paths: tuple[str, ...]) -> list[str]:
    """The paths that exist: ruff errors on a missing one, and some land later."""
    return [p for p in paths if Path(p).exists()]


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite; extra arguments go to pytest (``nox -s tests -- -k harness``).

    ``[hf]`` brings ``transformers`` and ``peft`` for the Hugging Face tests (they skip
    without them); ``[test]`` brings ``torchao`` for the float8 test (pinned in
    constraints.txt).
    """
    session.install("-e", ".[test,hf]", *CONSTRAINTS)
    session.run("pytest", *WORKERS, *session.posargs)


@nox.session
def tests_torch_latest(session: nox.Session) -> None:
    """The test suite on the newest torch release; extra arguments go to pytest.

    Not a default session and not in CI: PyPI's Linux wheel of torch is a CUDA build, several
    GB with its libraries (it runs on CPU). Every pin of constraints.txt applies but torch's,
    which a constraints file written into the session's tmp dir replaces, and triton's (the
    torch release brings the one it needs).
    """
    lines = Path("constraints.txt").read_text().splitlines()
    # triton's pin is the soak session's (torchtitan imports it); each torch wants its own
    theirs = ("torch==", "triton==")
    pins = [line for line in lines if not line.replace(" ", "").startswith(theirs)]
    constraints = Path(session.create_tmp()) / "constraints-torch-latest.txt"
    constraints.write_text("\n".join([*pins, f"torch=={TORCH_LATEST}"]) + "\n")
    session.install(f"torch=={TORCH_LATEST}", "-c", str(constraints))
    session.install("-e", ".[test,hf]", "-c", str(constraints))
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", *WORKERS, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting, checked, not applied."""
    session.install("ruff", *CONSTRAINTS)
    paths = _existing(LINTED)
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy in strict mode on the library (configured in pyproject.toml)."""
    # .[plot]: trace.plot_memory imports matplotlib (typed), which mypy must see
    session.install("-e", ".[plot]", "mypy", *CONSTRAINTS)
    session.run("mypy", "src")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/; warnings are errors."""
    # mkdocstrings reads src/ statically: the package and torch need not be installed.
    # (ruff is there because mkdocstrings formats the rendered signatures with it.)
    session.install("mkdocs", "mkdocs-material", "mkdocstrings[python]", "ruff", *CONSTRAINTS)
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """The training benchmark; extra arguments go to it (``nox -s bench -- --steps 50``)."""
    session.install("-e", ".", *CONSTRAINTS)
    session.run("python", "benchmarks/bench_train.py", "--size", "small", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The end-to-end demo; extra arguments go to it (``nox -s demo -- --trace trace/``)."""
    session.install("-e", ".[demo,plot]", *CONSTRAINTS)
    session.run("python", "-m", "fully_shard.demo", *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """Long runs: 1,000 soak steps, 200 random call sequences, 200 examples per property, 60
    drawn models for the planner's prediction against MemTracker (tests: 50, 12, 20, 2), the
    full products of the parametrizations the suite thins (tests/matrix.py), the scripts the
    tests run on the warm pool also launched as a user launches them, and torchtitan's own
    parallelize functions on ours (tests/test_torchtitan.py)."""
    session.install("-e", ".[test]", *CONSTRAINTS)
    # tests/test_torchtitan.py: torchtitan's own parallelize code on ours. Without its
    # dependencies (they would bring another torch, and its data loading and metrics stacks):
    # what its model and parallelize modules import, pinned in constraints.txt.
    session.install("--no-deps", "torchtitan", "spmd_types", "triton", *CONSTRAINTS)
    session.install("tyro", *CONSTRAINTS)
    env = {"FULLY_SHARD_SOAK_STEPS": "1000", "FULLY_SHARD_STATEFUL_EXAMPLES": "200"}
    env["FULLY_SHARD_PROPERTY_EXAMPLES"] = "200"
    env["FULLY_SHARD_PLAN_EXAMPLES"] = "60"
    # the parametrizations the suite thins to all pairs or a subset (tests/matrix.py), in full
    env["FULLY_SHARD_FULL_MATRIX"] = "1"
    # inductor: test_compile.py once more with code generation (C++ on CPU, minutes)
    env["FULLY_SHARD_COMPILE_BACKENDS"] = "aot_eager,inductor"
    # fresh: the benchmarks and the demo in a new interpreter (their ranks spawned), the 2-D and
    # resumable examples under torchrun (its agent restarting the killed ranks)
    env["FULLY_SHARD_LAUNCHERS"] = "pool,fresh"
    tests = ("tests/test_soak.py", "tests/test_stateful.py", "tests/test_properties.py")
    # test_compile.py, test_graph.py and test_regions.py (the whole model in one graph, its
    # blocks as compiled regions) with inductor too
    tests += ("tests/test_compile.py", "tests/test_graph.py", "tests/test_plan.py")
    tests += ("tests/test_bench.py", "tests/test_demo.py", "tests/test_example_2d.py")
    tests += ("tests/test_resume.py", "tests/test_parity.py", "tests/test_pipelining.py")
    tests += ("tests/test_3d.py", "tests/test_multinode.py", "tests/test_dp_mesh_dims.py")
    tests += ("tests/test_reshard_int.py", "tests/test_titan_meshes.py", "tests/test_2d.py")
    tests += ("tests/test_torchtitan.py", "tests/test_regions.py", "tests/test_schedules.py")
    tests += ("tests/test_buckets.py",)
    session.run("pytest", *WORKERS, *tests, *session.posargs, env=env)
