"""T5X checkpoints: lazy reading (legacy msgpack + zarr, and Orbax/OCDBT) and writing.

``open_t5x_checkpoint(path_or_url)`` detects the format and lists every array of
the ``target`` tree by "/"-joined param path without reading data; ``read``,
``read_expert`` and ``read_params`` read one array, one expert slice, or the
dense parameters. ``write_t5x_checkpoint`` writes either format as t5x does.
"""

from qmoe_jax.checkpoints.base import ArrayInfo as ArrayInfo
from qmoe_jax.checkpoints.base import T5XCheckpoint as T5XCheckpoint
from qmoe_jax.checkpoints.errors import CheckpointError as CheckpointError
from qmoe_jax.checkpoints.errors import CorruptCheckpointError as CorruptCheckpointError
from qmoe_jax.checkpoints.errors import MissingArrayError as MissingArrayError
from qmoe_jax.checkpoints.errors import NotACheckpointError as NotACheckpointError
from qmoe_jax.checkpoints.errors import ShapeMismatchError as ShapeMismatchError
from qmoe_jax.checkpoints.reader import open_t5x_checkpoint as open_t5x_checkpoint
from qmoe_jax.checkpoints.shapes import check_shapes as check_shapes
from qmoe_jax.checkpoints.shapes import path_shapes as path_shapes
from qmoe_jax.checkpoints.t5x_legacy import LegacyT5XCheckpoint as LegacyT5XCheckpoint
from qmoe_jax.checkpoints.t5x_orbax import OrbaxT5XCheckpoint as OrbaxT5XCheckpoint
from qmoe_jax.checkpoints.writer import t5x_chunk_shape as t5x_chunk_shape
from qmoe_jax.checkpoints.writer import write_t5x_checkpoint as write_t5x_checkpoint
