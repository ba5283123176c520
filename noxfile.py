"""Developer and CI sessions: ``python3 -m nox -s tests`` (see README.md).

Every session installs with ``-c constraints.txt``, which pins torch to the CPU build this
project is tested against (so no session can pull a multi-gigabyte CUDA wheel) and pins the
linters, so that a new ruff or mypy release cannot fail CI on unchanged code.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck"]

CONSTRAINTS = ("-c", "constraints.txt")
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
    session.run("pytest", *session.posargs)


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
    drawn models for the planner's prediction against MemTracker (tests: 100, 12, 20, 2), and
    the scripts the tests run on the warm pool also launched as a user launches them."""
    session.install("-e", ".[test]", *CONSTRAINTS)
    env = {"FULLY_SHARD_SOAK_STEPS": "1000", "FULLY_SHARD_STATEFUL_EXAMPLES": "200"}
    env["FULLY_SHARD_PROPERTY_EXAMPLES"] = "200"
    env["FULLY_SHARD_PLAN_EXAMPLES"] = "60"
    # inductor: test_compile.py once more with code generation (C++ on CPU, minutes)
    env["FULLY_SHARD_COMPILE_BACKENDS"] = "aot_eager,inductor"
    # fresh: the benchmarks and the demo in a new interpreter (their ranks spawned), the 2-D and
    # resumable examples under torchrun (its agent restarting the killed ranks)
    env["FULLY_SHARD_LAUNCHERS"] = "pool,fresh"
    tests = ("tests/test_soak.py", "tests/test_stateful.py", "tests/test_properties.py")
    # test_compile.py and test_graph.py (the whole model in one graph) with inductor too
    tests += ("tests/test_compile.py", "tests/test_graph.py", "tests/test_plan.py")
    tests += ("tests/test_bench.py", "tests/test_demo.py", "tests/test_example_2d.py")
    tests += ("tests/test_resume.py",)
    session.run("pytest", *tests, *session.posargs, env=env)
