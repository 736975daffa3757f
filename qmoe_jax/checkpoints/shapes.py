"""Checking a checkpoint's array shapes against what a model config expects.

Lingo: *expected* maps param paths to shapes (the model engineer derives it
from a config); a *layer prefix* is ``encoder/layers_3``. One error, in one line, counts
the disagreements, shows one of each kind, and names the config mismatch that most likely
explains them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from qmoe_jax.checkpoints.errors import ShapeMismatchError

_LAYER = re.compile(r"^((?:encoder|decoder)/layers_)(\d+)(/|$)")


def _layer_count(paths, stack: str) -> int:
    indices = {int(m.group(2)) for p in paths if (m := _LAYER.match(p)) and p.startswith(stack)}
    return max(indices) + 1 if indices else 0


def _mlp_layers(paths, *, sparse_only: bool) -> set[str]:
    """Layer prefixes with an MLP (``sparse_only``: with an expert stack)."""
    return {
        p.split("/mlp/")[0]
        for p in paths
        if "/mlp/expert/" in p or ("/mlp/" in p and not sparse_only)
    }


def _hints(
    found: Mapping, missing: list[str], extra: list[str], differ: list[str], expected
) -> list[str]:
    hints = []
    for stack in ("encoder", "decoder"):
        have, want = _layer_count(found, stack), _layer_count(expected, stack)
        if have != want:
            hints.append(
                f"the checkpoint has {have} {stack} layers but the config {want}: "
                "pick the config with the checkpoint's depth"
            )
    sparse_found, sparse_wanted = (
        _mlp_layers(found, sparse_only=True),
        _mlp_layers(expected, sparse_only=True),
    )
    dense_in_checkpoint = (sparse_wanted - sparse_found) & _mlp_layers(found, sparse_only=False)
    sparse_in_checkpoint = (sparse_found - sparse_wanted) & _mlp_layers(expected, sparse_only=False)
    for layers, here, there in (
        (dense_in_checkpoint, "dense", "sparse"),
        (sparse_in_checkpoint, "sparse", "dense"),
    ):
        if layers:
            hints.append(
                f"{min(layers)} is {here} in the checkpoint but {there} in the config: "
                "the spacing of sparse (MoE) layers differs"
            )
    expert_counts = {
        (found[p][0], expected[p][0])
        for p in differ
        if "/expert/" in p and found[p][1:] == tuple(expected[p][1:])
    }
    for have, want in sorted(expert_counts):
        hints.append(
            f"the checkpoint has {have} experts per sparse layer but the config {want}: "
            f"pick the config with {have} experts"
        )
    if any(p.endswith(("/wi_0/kernel", "/wi_1/kernel")) for p in missing + extra):
        hints.append("gated GELU (mlp/wi_0 + mlp/wi_1, as in XXL) vs a single mlp/wi differs")
    if "decoder/logits_dense/kernel" in missing:
        hints.append(
            "the config expects untied logits (decoder/logits_dense, as XXL and C) "
            "but the checkpoint ties them to token_embedder"
        )
    if "decoder/logits_dense/kernel" in extra:
        hints.append(
            "the checkpoint has untied logits (decoder/logits_dense) but the config ties them"
        )
    if differ and not expert_counts:
        hints.append(
            "the model sizes differ (d_model, d_ff, heads or vocabulary): "
            "pick the config that matches the checkpoint"
        )
    return hints or ["the checkpoint is of another model than the config describes"]


def check_shapes(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, Sequence[int]],
    *,
    where: str,
    config_name: str | None = None,
    allow_extra: bool = False,
) -> None:
    """Raises ``ShapeMismatchError`` counting the missing, extra and mis-shaped arrays, in one
    line.

    Args:
      found: param path → shape held by the checkpoint.
      expected: param path → shape the config expects.
      where: the checkpoint's location, for the message.
      config_name: the config's name, for the message.
      allow_extra: do not complain about arrays the config does not expect.
    """
    config = f"the config {config_name}" if config_name else "the config"
    missing = sorted(p for p in expected if p not in found)
    extra = [] if allow_extra else sorted(p for p in found if p not in expected)
    differ = sorted(p for p in expected if p in found and tuple(found[p]) != tuple(expected[p]))
    if not (missing or extra or differ):
        return
    parts = []
    if differ:
        p = differ[0]
        parts.append(
            f"{_count(differ, 'array differs', 'arrays differ')}, e.g. {p} has shape "
            f"{tuple(found[p])} in the checkpoint but {config} expects {tuple(expected[p])}"
        )
    if missing:
        p = missing[0]
        parts.append(
            f"{_count(missing, 'array is', 'arrays are')} missing from the checkpoint, e.g. {p} "
            f"({config} expects shape {tuple(expected[p])})"
        )
    if extra:
        p = extra[0]
        parts.append(
            f"{_count(extra, 'array is', 'arrays are')} in the checkpoint but {config} does not "
            f"expect them, e.g. {p} {tuple(found[p])}"
        )
    raise ShapeMismatchError(
        f"the checkpoint {where} does not match {config}: "
        + "; ".join(parts)
        + "; likely cause: "
        + "; ".join(_hints(found, missing, extra, differ, expected))
    )


def _count(paths: list[str], one: str, many: str) -> str:
    return f"1 {one}" if len(paths) == 1 else f"{len(paths)} {many}"


def path_shapes(tree: Mapping) -> dict[str, tuple[int, ...]]:
    """``{"encoder/layers_0/...": shape}`` of a nested parameter tree (arrays or
    ``ShapeDtypeStruct``s)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}/{path}": shape for path, shape in path_shapes(value).items()})
        else:
            flat[key] = tuple(value.shape)
    return flat
