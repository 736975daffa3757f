"""Where the tests that run stock T5X (t5x, flaxformer) find it, and what they do without it.

Those tests carry the ``t5x`` marker. Where ``import t5x, flaxformer`` fails they
skip, naming how to build a T5X environment (docs/gin.md §9). With
``QMOE_REQUIRE_T5X=1`` (set by ``.ci/run`` in the T5X environment it builds) a
missing T5X or a missing main-job output fails the test instead, so that CI
cannot pass by skipping them.
"""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOW = (
    "build a T5X environment as docs/gin.md §9 says (t5x and flaxformer from GitHub, the PyPI "
    "requirements, then pip install this project into it) and run pytest -m t5x with its python"
)


def required() -> bool:
    return os.environ.get("QMOE_REQUIRE_T5X") == "1"


def missing_reason() -> str | None:
    """Why stock T5X cannot run here, or None when it can."""
    try:
        import flaxformer  # noqa: F401
        import seqio  # noqa: F401
        import t5x  # noqa: F401
    except ImportError as error:
        return f"stock T5X is not installed ({error}); {HOW}"
    return None


def skip_without_t5x() -> None:
    """Skips the calling test module when T5X is missing (fails it under QMOE_REQUIRE_T5X=1)."""
    reason = missing_reason()
    if reason is None:
        return
    if required():
        raise RuntimeError(f"QMOE_REQUIRE_T5X=1 but {reason}")
    pytest.skip(reason, allow_module_level=True)


def source_roots() -> tuple[str, str]:
    """(flaxformer's source root, t5x's source root): the folders that hold their gin files, for
    ``--gin_search_paths``."""
    import flaxformer
    import t5x

    return tuple(
        os.path.dirname(os.path.dirname(os.path.abspath(module.__file__)))
        for module in (flaxformer, t5x)
    )


def main_job_output() -> str:
    """The README main job's compressed checkpoint, runs/compressed/switch-mini-8; skips (or fails
    under QMOE_REQUIRE_T5X=1) when it has not been run."""
    path = os.path.join(REPO, "runs", "compressed", "switch-mini-8")
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        message = f"{path} is missing: run the README's main job (python -m qmoe_jax.compress)"
        if required():
            raise RuntimeError(message)
        pytest.skip(message)
    return path
