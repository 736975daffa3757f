"""The writers' Orbax trees (checkpoints/orbax_trees.py): bounded data files, no copy of the
arrays before a save, and training checkpoints that restore as those Orbax's defaults wrote."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from qmoe_jax.checkpoints import compressed_trees, orbax_trees
from qmoe_jax.training.run_directory import TRAIN_STATE, RunDirectory


def _state(seed: int = 0) -> dict:
    key = jax.random.PRNGKey(seed)
    return {
        "trainable": {"w": jax.random.normal(key, (64, 48)), "b": jnp.arange(5.0)},
        "opt_state": {"count": jnp.int32(3), "mu": jax.random.normal(key, (64, 48)) * 2},
    }


def _abstract(state: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def _assert_equal_trees(restored: dict, state: dict) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert isinstance(got, jax.Array)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_host_views_share_the_arrays_memory():
    state = _state()
    views = orbax_trees.host_views(state)
    for view, leaf in zip(jax.tree.leaves(views), jax.tree.leaves(state)):
        assert isinstance(view, np.ndarray)
        assert view.ctypes.data == leaf.unsafe_buffer_pointer()
    assert orbax_trees.host_views({"x": np.ones(3), "n": 4})["n"] == 4


def test_host_views_keep_arrays_split_over_devices(tmp_path):
    """An array sharded over 2 host devices is not one buffer: it stays a jax.Array."""
    script = textwrap.dedent(
        """
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from qmoe_jax.checkpoints import orbax_trees
        mesh = Mesh(np.asarray(jax.devices()), ("x",))
        split = jax.device_put(np.arange(8.0), NamedSharding(mesh, PartitionSpec("x")))
        whole = jax.device_put(np.arange(8.0), NamedSharding(mesh, PartitionSpec()))
        views = orbax_trees.host_views({"split": split, "whole": whole})
        print(type(views["split"]).__name__, type(views["whole"]).__name__)
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ArrayImpl", "ndarray"]


def _run_directory(path) -> RunDirectory:
    os.makedirs(path, exist_ok=True)
    return RunDirectory(str(path), {"settings": {}, "source": {}})


def test_training_checkpoints_round_trip(tmp_path):
    state = _state()
    run = _run_directory(tmp_path / "run")
    run.save(7, state)
    assert run.latest_step() == 7
    _assert_equal_trees(run.restore(7, _abstract(state)), state)
    # the state is not consumed by the save: the next step may donate it
    np.testing.assert_array_equal(np.asarray(state["trainable"]["b"]), np.arange(5.0))


def test_training_checkpoints_of_orbax_defaults_restore(tmp_path):
    """A run checkpointed with StandardSave (qmoe_jax before orbax_trees) resumes."""
    state = _state(1)
    manager = ocp.CheckpointManager(
        str(tmp_path / "run" / TRAIN_STATE),
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True),
    )
    manager.save(4, args=ocp.args.StandardSave(state), force=True)
    manager.wait_until_finished()
    manager.close()
    run = _run_directory(tmp_path / "run")
    assert run.latest_step() == 4
    _assert_equal_trees(run.restore(4, _abstract(state)), state)


def test_arrays_over_the_data_file_size_are_split_into_bounded_files(tmp_path, monkeypatch):
    monkeypatch.setattr(orbax_trees, "DATA_FILE_BYTES", 1 << 19)
    codes = np.random.default_rng(0).integers(0, 1 << 16, (4, 1 << 20), dtype=np.uint16)  # 8 MiB
    path = str(tmp_path / "tree")
    compressed_trees.save_tree(path, {"codes": codes, "small": np.arange(3, dtype=np.int32)})
    data = [  # OCDBT data files: <path>/ocdbt.process_<i>/d/<hash>
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        if os.path.basename(folder) == "d"
        for name in names
    ]
    assert len(data) >= 8  # the 8 MiB array alone takes 8 chunks of 1 MiB
    assert max(data) <= (1 << 20) + 4096  # a chunk, its zstd framing and small records
    restored = ocp.Checkpointer(orbax_trees.handler()).restore(path)
    np.testing.assert_array_equal(restored["codes"], codes)


def _zarr_chunks(path) -> dict:
    """{array key: chunk shape} of an Orbax OCDBT tree, from its zarr metadata."""
    import json

    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(path)}/"})
    store = store.result()
    chunks = {}
    for key in store.list().result():
        if key.endswith(b"/.zarray"):
            chunks[key[: -len(b"/.zarray")].decode()] = json.loads(store.read(key).result().value)[
                "chunks"
            ]
    return chunks


def test_expert_stacks_are_chunked_by_whole_experts_whatever_their_length(tmp_path, monkeypatch):
    # 65537 is prime: the only chunks dividing [8, 65537] under the size limit along the longer
    # axis are one codeword wide, which is what Orbax's own choice gives
    monkeypatch.setattr(orbax_trees, "DATA_FILE_BYTES", 1 << 19)
    rng = np.random.default_rng(0)
    tree = {
        "wi": {
            "codes": rng.integers(0, 1 << 16, (8, 65537), dtype=np.uint16),
            "row_offsets": np.tile(np.arange(5, dtype=np.int32), (8, 1)),
        }
    }
    checkpointer = ocp.Checkpointer(orbax_trees.handler())
    checkpointer.save(tmp_path / "default", args=orbax_trees.save_args(tree))
    checkpointer.save(tmp_path / "stacks", args=orbax_trees.save_args(tree, expert_stacks=True))
    assert _zarr_chunks(tmp_path / "default")["wi.codes"] == [8, 1]
    chunks = _zarr_chunks(tmp_path / "stacks")
    assert chunks == {"wi.codes": [1, 65537], "wi.row_offsets": [1, 5]}
    restored = checkpointer.restore(tmp_path / "stacks")
    np.testing.assert_array_equal(restored["wi"]["codes"], tree["wi"]["codes"])
    np.testing.assert_array_equal(restored["wi"]["row_offsets"], tree["wi"]["row_offsets"])
