"""The cheap signals of a source checkpoint's files and the digests of what is read from it, on
local legacy and Orbax checkpoints and on a kvstore without files (memory://)."""

import os
import shutil

import numpy as np
import pytest
import tensorstore as ts
from helpers.switch_fixtures import TINY, random_params

from qmoe_jax.checkpoints import open_t5x_checkpoint, source_files, write_t5x_checkpoint
from qmoe_jax.checkpoints.read_digests import ChangedArrayError, DigestedReads, array_digest
from qmoe_jax.checkpoints.source_files import OCDBT_GROUP, describe_differences, differences

EXPERT_WI = "encoder/layers_1/mlp/expert/wi/kernel"
EMBEDDING = "token_embedder/embedding"


@pytest.fixture(scope="module")
def params():
    return random_params(TINY)


def test_an_unchanged_legacy_checkpoint_has_the_same_snapshot_and_a_rewritten_array_is_named(
    params, tmp_path
):
    path = write_t5x_checkpoint(tmp_path / "a", params, 1, dtype="bfloat16")
    first = source_files.snapshot(open_t5x_checkpoint(path))
    assert source_files.snapshot(open_t5x_checkpoint(path)) == first
    assert set(first) == {"the file checkpoint"} | set(open_t5x_checkpoint(path).keys())
    array = os.path.join(path, "target.encoder.layers_1.mlp.expert.wi.kernel")
    chunk = os.path.join(array, "2.0.0")
    shutil.copy(chunk, chunk + ".new")
    os.replace(chunk + ".new", chunk)  # the same bytes in a new file
    found = differences(first, source_files.snapshot(open_t5x_checkpoint(path)))
    assert found == [f"{EXPERT_WI} (the mtime_ns, ctime_ns, inode of its files)"]
    os.remove(chunk)
    found = differences(first, source_files.snapshot(open_t5x_checkpoint(path)))
    assert found == [f"{EXPERT_WI} (5 files, now 4)"]


def test_an_orbax_checkpoint_names_its_shared_data_files(params, tmp_path):
    path = write_t5x_checkpoint(tmp_path / "a", params, 1, format="orbax", dtype="bfloat16")
    first = source_files.snapshot(open_t5x_checkpoint(path))
    assert set(first) == {"the file _METADATA", "the file manifest.ocdbt", OCDBT_GROUP}
    shutil.rmtree(tmp_path / "a")
    changed = dict(
        params, token_embedder={"embedding": np.asarray(params["token_embedder"]["embedding"]) * 2}
    )
    write_t5x_checkpoint(tmp_path / "a", changed, 1, format="orbax", dtype="bfloat16")
    found = differences(first, source_files.snapshot(open_t5x_checkpoint(path)))
    assert f"{OCDBT_GROUP} (" in describe_differences(found), found


def test_a_kvstore_without_files_compares_generations():
    context = ts.Context()
    params = random_params(TINY)
    path = write_t5x_checkpoint("memory://source/tiny", params, 1, context=context)
    checkpoint = open_t5x_checkpoint(path, context=context)
    first = source_files.snapshot(checkpoint)
    assert set(first[EXPERT_WI]) == {"files", "generation"}
    assert source_files.snapshot(checkpoint) == first
    store = ts.KvStore.open(path + "target.encoder.layers_1.mlp.expert.wi.kernel/", context=context)
    store = store.result()
    store[b"1.0.0"] = store[b"1.0.0"]  # written again, the same bytes
    assert differences(first, source_files.snapshot(checkpoint)) == [
        f"{EXPERT_WI} (the generation of its files)"
    ]


def test_digests_of_a_stack_read_in_groups_equal_the_digest_of_the_whole(params, tmp_path):
    path = write_t5x_checkpoint(tmp_path / "a", params, 1, dtype="bfloat16")
    seen = {}
    reads = DigestedReads(open_t5x_checkpoint(path), on_digest=seen.__setitem__)
    whole = open_t5x_checkpoint(path).read(EXPERT_WI)
    reads.read_expert(EXPERT_WI, slice(0, 3))
    assert EXPERT_WI not in seen  # not read to the end yet
    reads.read_expert(EXPERT_WI, 3)
    assert seen[EXPERT_WI] == array_digest(whole)
    reads.read_expert(EXPERT_WI, slice(1, 4))  # not from the first expert: not hashed
    reads.read(EMBEDDING)
    assert seen[EMBEDDING] == array_digest(open_t5x_checkpoint(path).read(EMBEDDING))

    recorded = dict(seen, **{EMBEDDING: "0" * 64})
    checked = DigestedReads(open_t5x_checkpoint(path), recorded.get)
    for expert in range(4):
        checked.read_expert(EXPERT_WI, expert)
    assert checked.compared == {EXPERT_WI}
    with pytest.raises(ChangedArrayError, match=f"the array {EMBEDDING} of the checkpoint"):
        checked.read_params([EMBEDDING])
