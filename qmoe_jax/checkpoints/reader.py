"""Opening a T5X checkpoint of either format, detected from what the location holds.

Detection follows t5x (t5x/checkpoint_utils.py, ``detect_checkpoint_type``): an Orbax
``_METADATA`` file wins; otherwise a ``checkpoint`` msgpack file means the legacy format.
Accepted locations: a step directory ``checkpoint_<step>/`` (legacy, or Orbax with its
``state/``), an Orbax ``state/`` directory, or the legacy ``checkpoint`` file itself.
"""

from __future__ import annotations

import os
import re

import tensorstore as ts

from qmoe_jax.checkpoints.base import T5XCheckpoint
from qmoe_jax.checkpoints.errors import NotACheckpointError
from qmoe_jax.checkpoints.storage import (
    PathOrUrl,
    child,
    describe,
    format_names,
    is_local,
    list_names,
    location,
    parent,
    read_key,
    read_keys,
)
from qmoe_jax.checkpoints.t5x_legacy import MSGPACK_FILE, LegacyT5XCheckpoint
from qmoe_jax.checkpoints.t5x_orbax import METADATA_FILE, STATE_DIR, OrbaxT5XCheckpoint

_STEP_DIR = re.compile(r"^checkpoint_(\d+)/$")


def _not_a_checkpoint(where: dict, context: ts.Context) -> NotACheckpointError:
    if is_local(where) and os.path.isfile(where["path"].rstrip("/")):
        return NotACheckpointError(
            f"{where['path'].rstrip('/')} is a file, not a T5X checkpoint: pass the "
            "checkpoint_<step> directory of the model"
        )
    names = list_names(where, context)
    steps = sorted(
        (n for n in names if _STEP_DIR.match(n)), key=lambda n: int(_STEP_DIR.match(n).group(1))
    )
    hint = (
        f" It looks like a T5X model directory: open one of its step directories, e.g. "
        f"{describe(child(where, steps[-1]))}."
        if steps
        else ""
    )
    return NotACheckpointError(
        f"{describe(where)} is not a T5X checkpoint: expected a legacy T5X '{MSGPACK_FILE}' "
        "msgpack "
        f"file or an Orbax '{METADATA_FILE}' file (there or in '{STATE_DIR}/'), found "
        f"{format_names(names)}.{hint}"
    )


def open_t5x_checkpoint(
    path_or_url: PathOrUrl, *, context: ts.Context | None = None
) -> T5XCheckpoint:
    """Opens a T5X checkpoint, legacy (msgpack + zarr) or Orbax (OCDBT), without reading arrays.

    Args:
      path_or_url: a local path, a tensorstore kvstore URL (``file://``, ``gs://``,
        ``memory://``, ...) or a kvstore JSON spec, naming ``checkpoint_<step>/``,
        an Orbax ``state/`` directory, or a legacy ``checkpoint`` file.
      context: tensorstore context for every open (share one with the writer to
        use ``memory://``); a fresh one by default.

    Returns:
      A ``T5XCheckpoint``: ``keys()``/``spec()`` list the ``target`` arrays
      ("/"-joined param paths, shapes, dtypes); ``read``, ``read_expert`` and
      ``read_params`` read them; ``format`` is "legacy" or "orbax".

    Raises:
      NotACheckpointError: the location holds neither format (the message lists
        what it does hold).
      CorruptCheckpointError: the msgpack or ``_METADATA`` file is unreadable.
    """
    context = ts.Context() if context is None else context
    where = location(path_or_url)
    metadata, state_metadata, msgpack = read_keys(
        where, [METADATA_FILE, f"{STATE_DIR}/{METADATA_FILE}", MSGPACK_FILE], context
    )
    if metadata is not None:
        return OrbaxT5XCheckpoint(where, metadata, context)
    if state_metadata is not None:
        return OrbaxT5XCheckpoint(child(where, STATE_DIR + "/"), state_metadata, context)
    if msgpack is not None:
        return LegacyT5XCheckpoint(where, msgpack, context)
    directory, name = parent(where)
    if name == MSGPACK_FILE and directory["path"]:
        msgpack = read_key(directory, MSGPACK_FILE, context)
        if msgpack is not None:
            return LegacyT5XCheckpoint(directory, msgpack, context)
    raise _not_a_checkpoint(where, context)
