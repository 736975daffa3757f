"""T5X's checkpoint manager, restoring a compressed directory as it is.

``CompressedCheckpointManager`` is T5X's ``OrbaxCheckpointManagerInterface``
(the default ``checkpoint_manager_cls`` of ``utils.RestoreCheckpointConfig``
and ``utils.SaveCheckpointConfig``) with two additions, bound through gin
(``configs/t5x/compressed_experts.gin``):

- **restore** of a directory written by ``python -m qmoe_jax.compress``: the
  non-expert parameters become the train state's ``params`` (cast to the
  model's dtypes, or to the restore dtype), each sparse layer's code arrays its
  ``flax_mutables['qmoe_experts']``, placed with the partitioner's shardings
  (codes sharded over the expert axis); checksums and dictionary fingerprints are
  verified as ``python -m qmoe_jax.evaluate`` verifies them. The step is the
  source checkpoint's. A training state gets its optimizer's initial state for
  the parameters (the codes have none: they are not parameters). The
  directory is read once, a layer at a time; nothing is exported or dequantized.
  Any other path (T5X's own checkpoints, e.g. a fine-tuning's) is restored by
  T5X's code.
- **save** writes T5X's checkpoint as T5X does, waits for it, and adds
  ``checkpoint_<step>/qmoe_jax/`` (``t5x_layout.write_sidecar``): the layout of
  the codes, their SHA-256 as saved, and the dictionaries, so that the
  checkpoint opens on its own in ``t5x.eval`` and ``python -m qmoe_jax.evaluate``.

Only T5X's Orbax checkpoints are handled (``use_orbax=True``, T5X's default):
T5X's legacy checkpointer refuses ``uint16`` arrays, which the codes are.
"""

from __future__ import annotations

import os

import flax
import jax
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils
from t5x import checkpoints
from t5x import train_state as train_state_lib
from t5x.checkpoints_utils import get_checkpoint_dir

from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint
from qmoe_jax.interop.t5x_layout import (
    COLLECTION,
    LayoutError,
    compressed_directory,
    read_layout,
    write_sidecar,
)

MAX_LISTED = 6


def _listed(paths) -> str:
    paths = sorted(paths)
    more = f" and {len(paths) - MAX_LISTED} more" if len(paths) > MAX_LISTED else ""
    return ", ".join(paths[:MAX_LISTED]) + more


def _place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class CompressedCheckpointManager(checkpoints.OrbaxCheckpointManagerInterface):
    """T5X's Orbax checkpoint manager that also restores qmoe_jax compressed directories.

    Constructed by T5X with its usual arguments. When ``directory`` names a
    compressed directory (``t5x.eval``/``t5x.infer`` make the manager on
    ``CHECKPOINT_PATH``, the directory or ``<it>/checkpoint_<step>``) the
    manager only restores, and creates no Orbax manager there, so nothing is
    written into the compressed directory.
    """

    def __init__(self, directory, train_state, partitioner, *, checkpoint: str = "", **kwargs):
        """``checkpoint``: where the model's layers read their layout (``QMOE_CHECKPOINT``); the
        layout saved beside each checkpoint is read from there."""
        self._qmoe_layout_source = checkpoint
        self._qmoe_train_state = train_state
        self._qmoe_partitioner = partitioner
        self._qmoe_restore_dtype = kwargs.get("restore_dtype")
        self._qmoe_directory = compressed_directory(os.fspath(directory))
        self._qmoe_read_only = self._qmoe_directory is not None
        if not self._qmoe_read_only:
            super().__init__(directory, train_state, partitioner, **kwargs)

    # --- what T5X asks of a manager over a compressed directory (restore only) ---

    @property
    def directory(self):
        if self._qmoe_read_only:
            from etils import epath

            return epath.Path(self._qmoe_directory)
        return super().directory

    def all_steps(self):
        return [] if self._qmoe_read_only else super().all_steps()

    def latest_step(self):
        return None if self._qmoe_read_only else super().latest_step()

    def should_save(self, step: int) -> bool:
        return False if self._qmoe_read_only else super().should_save(step)

    def wait_until_finished(self):
        if not self._qmoe_read_only:
            super().wait_until_finished()

    def close(self):
        if not self._qmoe_read_only:
            super().close()

    def save(self, train_state, state_transformation_fns=(), force: bool = True) -> bool:
        if self._qmoe_read_only:
            raise ValueError(
                f"{self._qmoe_directory} is a qmoe_jax compressed directory, which T5X never "
                "writes into; give t5x.train a new MODEL_DIR"
            )
        saved = super().save(train_state, state_transformation_fns, force)
        if saved and COLLECTION in (train_state.flax_mutables or {}):
            super().wait_until_finished()
            codes = jax.tree.map(_host_array, flax.core.unfreeze(train_state.flax_mutables))
            if jax.process_index() == 0:
                step = int(checkpoints.get_local_data(train_state.step))
                write_sidecar(
                    os.fspath(get_checkpoint_dir(os.fspath(super().directory), step)),
                    read_layout(self._layout_source()),
                    codes[COLLECTION],
                )
            multihost_utils.sync_global_devices("qmoe_jax sidecar written")
        return saved

    def restore(
        self,
        step=None,
        path=None,
        fallback_state=None,
        state_transformation_fns=(),
        lazy_parameters=False,
    ):
        if path is None and step is None and self._qmoe_read_only:
            path = self._qmoe_directory
        compressed = None if path is None else compressed_directory(os.fspath(path))
        if compressed is not None:
            if state_transformation_fns:
                raise ValueError(
                    "state_transformation_fns (e.g. an assignment_map) are not applied to a "
                    f"compressed directory ({path}); restore it without them"
                )
            return self._restore_compressed(compressed)
        return super().restore(
            step, path, fallback_state, state_transformation_fns, lazy_parameters
        )

    def restore_from_tf_checkpoint(self, path_or_dir, strict=True, translator=None):
        if self._qmoe_read_only:
            raise ValueError(f"{path_or_dir} is a TensorFlow checkpoint, not a compressed one")
        return super().restore_from_tf_checkpoint(path_or_dir, strict, translator)

    def _layout_source(self) -> str:
        if not self._qmoe_layout_source:
            raise LayoutError(
                "CompressedCheckpointManager.checkpoint is not bound; bind it to QMOE_CHECKPOINT "
                "(configs/t5x/compressed_train.gin does)"
            )
        return self._qmoe_layout_source

    # --- the compressed restore ---

    def _restore_compressed(self, path: str) -> train_state_lib.TrainState:
        shapes = self._qmoe_train_state
        partitioner = self._qmoe_partitioner
        mesh = partitioner.mesh
        axes = partitioner.get_mesh_axes(shapes)
        shape_dict, axes_dict = shapes.state_dict(), axes.state_dict()
        layout = read_layout(path)
        checkpoint = CompressedCheckpoint(path)

        def sharding(spec):
            return jax.sharding.NamedSharding(mesh, spec or jax.sharding.PartitionSpec())

        # Parameters: the checkpoint's non-expert arrays, as the model declares them.
        wanted = traverse_util.flatten_dict(flax.core.unfreeze(shape_dict["target"]), sep="/")
        wanted_axes = traverse_util.flatten_dict(flax.core.unfreeze(axes_dict["target"]), sep="/")
        stored = traverse_util.flatten_dict(checkpoint.dense_params(), sep="/")
        problems = []
        if set(wanted) - set(stored):
            problems.append(
                f"the model has parameters the checkpoint lacks: "
                f"{_listed(set(wanted) - set(stored))}"
            )
        if set(stored) - set(wanted):
            problems.append(
                f"the checkpoint has parameters the model lacks: "
                f"{_listed(set(stored) - set(wanted))}"
            )
        for name in sorted(set(wanted) & set(stored)):
            if tuple(wanted[name].shape) != tuple(np.shape(stored[name])):
                problems.append(
                    f"{name} is {tuple(wanted[name].shape)} in the model but "
                    f"{tuple(np.shape(stored[name]))} in the checkpoint"
                )
        if problems:
            raise LayoutError(
                f"the model gin does not describe the compressed checkpoint {path}: "
                + "; ".join(problems[:MAX_LISTED])
                + " (check NUM_EMBEDDINGS, EMBED_DIM, NUM_HEADS, HEAD_DIM, MLP_DIM, the layer "
                "counts and the logits layer of the model gin)"
            )
        params = {}
        for name in sorted(wanted):
            dtype = wanted[name].dtype
            if self._qmoe_restore_dtype is not None and np.issubdtype(dtype, np.floating):
                dtype = self._qmoe_restore_dtype
            params[name] = _place(
                np.asarray(stored.pop(name)).astype(dtype), sharding(wanted_axes[name])
            )
        params = traverse_util.unflatten_dict(params, sep="/")

        # Codes: each sparse layer's arrays, verified, into the qmoe_experts collection.
        mutables = flax.core.unfreeze(shape_dict.get("flax_mutables", {}))
        mutable_axes = flax.core.unfreeze(axes_dict.get("flax_mutables", {}))
        code_shapes = traverse_util.flatten_dict(mutables.get(COLLECTION, {}))
        code_axes = traverse_util.flatten_dict(mutable_axes.get(COLLECTION, {}))
        model_layers = {".".join(key[:-2]) for key in code_shapes}
        if model_layers != set(layout.layers):
            raise LayoutError(
                f"the model's compressed sparse layers ({_listed(model_layers) or 'none'}) are not "
                f"the checkpoint's ({_listed(layout.layers)}); the model gin must include "
                "configs/t5x/compressed_*.gin and match NUM_ENCODER_SPARSE_LAYERS and "
                "NUM_DECODER_SPARSE_LAYERS"
            )
        codes = {}
        for name in sorted(layout.layers):
            arrays, _ = checkpoint.layer(name)
            prefix = tuple(name.split("."))
            for kernel, kernel_arrays in arrays.items():
                for array_name, array in kernel_arrays.items():
                    key = (*prefix, kernel, array_name)
                    if key not in code_shapes:
                        raise LayoutError(f"the model has no {'/'.join(key)} in {COLLECTION}")
                    expected = code_shapes[key]
                    array = np.asarray(array)
                    if tuple(expected.shape) != array.shape or expected.dtype != array.dtype:
                        raise LayoutError(
                            f"{'/'.join(key)} is {expected.dtype}{tuple(expected.shape)} in the "
                            f"model but {array.dtype}{array.shape} in {path}; QMOE_CHECKPOINT "
                            "must name this checkpoint"
                        )
                    codes[key] = _place(array, sharding(code_axes.get(key)))
            del arrays
        restored = {
            "target": params,
            "flax_mutables": {**mutables, COLLECTION: traverse_util.unflatten_dict(codes)},
        }
        step = _place(np.asarray(layout.step, np.int32), sharding(None))
        if isinstance(shapes, train_state_lib.FlaxOptimTrainState):
            restored["state"] = self._initial_optimizer_state(params, axes_dict)
            restored["state"]["step"] = step
        else:
            restored["state"] = {"step": step}
        return shapes.restore_state(restored)

    def _initial_optimizer_state(self, params, axes_dict) -> dict:
        """The optimizer's state for fresh ``params`` (T5X's own ``init_state``), partitioned."""
        optimizer_def = self._qmoe_train_state._optimizer.optimizer_def

        def initial(params):
            return optimizer_def.state_dict(params, optimizer_def.init_state(params))["state"]

        partitioned = self._qmoe_partitioner.partition(
            initial,
            in_axis_resources=(axes_dict["target"],),
            out_axis_resources=axes_dict["state"],
        )
        return dict(partitioned(params))


def _host_array(value) -> np.ndarray:
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(value)
