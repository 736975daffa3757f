"""Which parameters fine-tuning trains: the trainable/frozen split of a parameter tree.

Lingo: a *path* is the "/"-joined key path of a leaf in the T5X tree, e.g.
``encoder/layers_1/mlp/router/router_weights/w/kernel``; ``CompressedExperts``
stacks are single leaves. *Candidates* are the float leaves fine-tuning may
train: everything except expert kernels (compressed stacks never; dense T5X
expert kernels only when a pattern asks for them). The trainable part goes to
optax; the frozen part, with every integer array of the compressed experts,
never does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax.numpy as jnp
from flax import traverse_util

from qmoe_jax.codec import CompressedExperts
from qmoe_jax.models.lora import LORA

EXPERT_KERNEL = re.compile(r"/mlp/expert/(wi|wi_0|wi_1|wo)(/kernel)?$")


def flatten(params: dict) -> dict[str, object]:
    """``{path: leaf}`` with ``CompressedExperts`` stacks as leaves."""
    return traverse_util.flatten_dict(params, sep="/")


def unflatten(flat: dict[str, object]) -> dict:
    return traverse_util.unflatten_dict(flat, sep="/")


def _is_float(leaf) -> bool:
    return not isinstance(leaf, CompressedExperts) and jnp.issubdtype(
        jnp.asarray(leaf).dtype, jnp.floating
    )


def select_trainable(params: dict, patterns: Sequence[str] | None) -> list[str]:
    """The paths to train, sorted.

    Args:
      params: the model's parameter tree (adapters included, if any).
      patterns: regular expressions searched in each path (``re.search``); None
        selects every candidate except dense expert kernels. Expert adapters
        (``…/expert/lora/…``) are always trained.

    Raises:
      ValueError: a pattern that matches no trainable parameter (naming it and
        what it would match if anything), or nothing selected at all.
    """
    flat = flatten(params)
    adapters = [path for path in flat if f"/expert/{LORA}/" in path]
    candidates = [path for path, leaf in flat.items() if _is_float(leaf) and path not in adapters]
    if patterns is None:
        chosen = {path for path in candidates if not EXPERT_KERNEL.search(path)}
    else:
        chosen = set()
        for pattern in patterns:
            try:
                regex = re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"--trainable pattern {pattern!r} is not a regular expression: {error}"
                ) from None
            matched = [path for path in candidates if regex.search(path)]
            if not matched:
                frozen = [path for path in flat if regex.search(path) and path not in candidates]
                what = (
                    f"only frozen compressed experts or adapters ({frozen[0]}, ...)"
                    if frozen
                    else "no parameter"
                )
                raise ValueError(
                    f"--trainable pattern {pattern!r} matches {what}; patterns are regular "
                    f"expressions searched in paths such as {candidates[0]!r}"
                )
            chosen.update(matched)
    chosen.update(adapters)
    if not chosen:
        raise ValueError(
            "nothing to train: the model has no trainable parameters under these --trainable "
            "patterns"
        )
    return sorted(chosen)


def split(params: dict, trainable: Sequence[str]) -> tuple[dict, dict]:
    """(trainable, frozen) nested trees; the trainable leaves are float32."""
    flat = flatten(params)
    chosen = set(trainable)
    train = {path: jnp.asarray(leaf, jnp.float32) for path, leaf in flat.items() if path in chosen}
    frozen = {path: leaf for path, leaf in flat.items() if path not in chosen}
    return unflatten(train), unflatten(frozen)


def merge(trainable: dict, frozen: dict) -> dict:
    """The nested parameter tree of both parts."""
    return unflatten({**flatten(frozen), **flatten(trainable)})
