"""A changed source is never resumed into: its files are compared before any work, what was read is
compared as it is read again, and --verify full compares everything the finished layers were made
from (docs/recovery.md, "Resumed")."""

import os
import re
import shutil

import numpy as np
import pytest
import tensorstore as ts
from helpers.compression_runs import all_arrays, assert_same_arrays, options
from helpers.switch_fixtures import TINY, random_params

from qmoe_jax.checkpoints import source_files, write_t5x_checkpoint
from qmoe_jax.checkpoints import writer as t5x_writer
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointWriter
from qmoe_jax.compression.job import compress_checkpoint
from qmoe_jax.compression.source_check import SourceChangedError

QUIET = dict(log=lambda line: None, progress=False, config=TINY)
EXPERT_WI = "encoder/layers_1/mlp/expert/wi/kernel"
QUERY = "encoder/layers_0/attention/query/kernel"
CHUNK_BYTES = 1024  # several chunks per dense array, as in a real checkpoint, whose first chunk
# is then all that the checkpoint's content fingerprint samples


@pytest.fixture(scope="module")
def reference(tiny_setup, tmp_path_factory):
    """An uninterrupted run of the tiny model (seed 0): what a resumed run of it must equal."""
    directory = tmp_path_factory.mktemp("reference") / "out"
    compress_checkpoint(options(tiny_setup, directory), **QUIET)
    return directory


def write_source(directory, monkeypatch) -> str:
    """The tiny model (seed 0) as a T5X checkpoint in small chunks; returns its path."""
    with monkeypatch.context() as patch:
        patch.setattr(t5x_writer, "DESIRED_CHUNK_BYTES", CHUNK_BYTES)
        return write_t5x_checkpoint(str(directory), random_params(TINY), step=1, dtype="bfloat16")


def change_in_place(checkpoint: str, **scaled) -> None:
    """Applies ``scaled[path] = (index along the first axis, factor)`` to the stored arrays of
    ``checkpoint``, rewriting only the chunks that hold those entries.

    The other files keep their bytes. Writing the changed model afresh would not do: the same
    values saved twice may be stored as other gzip bytes, and the content fingerprint samples the
    stored bytes."""
    for path, (index, factor) in scaled.items():
        store = ts.open(
            {
                "driver": "zarr",
                "kvstore": {
                    "driver": "file",
                    "path": os.path.join(checkpoint, "target." + path.replace("/", ".")),
                },
            },
            open=True,
        ).result()
        if isinstance(index, slice):  # tensorstore's indices do not count from the end
            start, stop, _ = index.indices(store.shape[0])
            index = slice(start, stop)
        values = store[index].read().result()
        store[index].write((values.astype(np.float32) * factor).astype(values.dtype)).result()


def changed_copy(checkpoint: str, directory, **scaled) -> str:
    """A copy of the model directory that holds ``checkpoint``, at ``directory``, with
    ``change_in_place(**scaled)`` applied; returns the copy's checkpoint path."""
    shutil.copytree(model_dir(checkpoint), directory, copy_function=shutil.copyfile)  # new files
    copy = os.path.join(str(directory), os.path.basename(checkpoint.rstrip("/")))
    change_in_place(copy, **scaled)
    return copy + "/"


def interrupted_run(tiny_setup, tmp_path, monkeypatch):
    """(options, source path) of a run of the tiny model stopped after its first sparse layer."""
    source = write_source(tmp_path / "source", monkeypatch)
    run = options(tiny_setup, tmp_path / "out", checkpoint=source)
    write_layer = CompressedCheckpointWriter.write_layer

    def write_then_interrupt(writer, *args):
        write_layer(writer, *args)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(CompressedCheckpointWriter, "write_layer", write_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            compress_checkpoint(run, **QUIET)
    assert CompressedCheckpoint(run.output_dir).layer_names() == ["encoder.layers_1.mlp"]
    return run, source


def model_dir(source: str) -> str:
    """The directory that holds the checkpoint_<step> directory ``source``."""
    return os.path.dirname(source.rstrip("/"))


def replace_source(source: str, **scaled) -> None:
    """Replaces the model directory of ``source`` by a changed copy of it, as a user replaces a
    checkpoint: every file new, the changed chunks with new bytes."""
    root = model_dir(source)
    original = root + ".original"
    os.rename(root, original)
    changed_copy(os.path.join(original, os.path.basename(source.rstrip("/"))), root, **scaled)
    shutil.rmtree(original)


def test_fingerprint_alone_cannot_tell_these_changes(tmp_path, monkeypatch):
    """The premise of the tests below: the content fingerprint of the header stays the same."""
    from qmoe_jax.checkpoints import open_t5x_checkpoint
    from qmoe_jax.checkpoints.fingerprint import source_fingerprint

    source = write_source(tmp_path / "a", monkeypatch)
    first = source_fingerprint(open_t5x_checkpoint(source))
    for name, change in [("b", {EXPERT_WI: (2, 2.0)}), ("c", {QUERY: (slice(-4, None), 2.0)})]:
        changed = changed_copy(source, tmp_path / name, **change)
        path = next(iter(change))
        assert not np.array_equal(
            open_t5x_checkpoint(changed).read(path), open_t5x_checkpoint(source).read(path)
        )
        assert source_fingerprint(open_t5x_checkpoint(changed)) == first


@pytest.mark.parametrize(
    "changed, path",
    [({EXPERT_WI: (2, 2.0)}, EXPERT_WI), ({QUERY: (slice(-4, None), 2.0)}, QUERY)],
    ids=["an expert of the finished layer", "the last rows of a dense attention kernel"],
)
def test_a_replaced_source_is_refused_and_verify_full_names_the_changed_array(
    tiny_setup, tmp_path, monkeypatch, changed, path
):
    run, source = interrupted_run(tiny_setup, tmp_path, monkeypatch)
    manifest = (tmp_path / "out" / "manifest.json").read_text()
    replace_source(source, **changed)
    with pytest.raises(SourceChangedError) as refused:
        compress_checkpoint(run, **QUIET)
    message = str(refused.value)
    assert f"the checkpoint at {source} changed since this run started: " in message
    # the rewritten files may get their old inode numbers back from the file system
    assert re.search(r"\(the mtime_ns, ctime_ns(, inode)? of its files\)", message), message
    assert "re-run with --verify full, which re-reads the " in message
    run_full = options(tiny_setup, tmp_path / "out", checkpoint=source, verify="full")
    with pytest.raises(
        SourceChangedError, match=f"the array {path} of the checkpoint .* holds other values"
    ):
        compress_checkpoint(run_full, **QUIET)
    assert (tmp_path / "out" / "manifest.json").read_text() == manifest  # nothing was written


def read_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_one_chunk_rewritten_in_place_with_its_mtime_restored_is_named(
    tiny_setup, tmp_path, monkeypatch
):
    run, source = interrupted_run(tiny_setup, tmp_path, monkeypatch)
    other = changed_copy(source, tmp_path / "other", **{QUERY: (slice(-4, None), 2.0)})
    array = "target.encoder.layers_0.attention.query.kernel"
    changed = [
        name
        for name in os.listdir(os.path.join(source, array))
        if read_bytes(os.path.join(source, array, name))
        != read_bytes(os.path.join(other, array, name))
    ]
    assert changed and "0.0" not in changed  # not the first chunk
    for name in changed:
        target = os.path.join(source, array, name)
        before = os.stat(target)
        with open(target, "r+b") as f:  # the same file (inode), new bytes
            f.truncate(0)
            f.write(read_bytes(os.path.join(other, array, name)))
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(SourceChangedError, match=f"changed since this run started: {QUERY} \\("):
        compress_checkpoint(run, **QUIET)


def test_a_dense_array_read_again_is_compared_even_where_file_signals_cannot_tell(
    tiny_setup, tmp_path, monkeypatch
):
    """On a store whose files look the same after a change, the dense arrays that replaying the
    finished layer reads again are still compared by content."""
    run, source = interrupted_run(tiny_setup, tmp_path, monkeypatch)
    recorded = CompressedCheckpoint(run.output_dir).manifest["source_snapshot"]
    replace_source(source, **{QUERY: (slice(-4, None), 2.0)})
    monkeypatch.setattr(source_files, "snapshot", lambda checkpoint: recorded)
    with pytest.raises(
        SourceChangedError,
        match=f"the array {QUERY} of the checkpoint .* holds other values than when this run "
        "read it before .*, so the finished parts of .* were made from another version of it",
    ):
        compress_checkpoint(run, **QUIET)


def test_a_moved_source_resumes_and_a_copy_resumes_after_verify_full(
    tiny_setup, reference, tmp_path, monkeypatch
):
    run, source = interrupted_run(tiny_setup, tmp_path, monkeypatch)
    step = os.path.basename(source.rstrip("/"))
    moved = tmp_path / "moved"
    os.rename(model_dir(source), moved)  # mv: the same files
    moved_source = str(moved / step)
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)  # new files, the same content
    copied_source = str(copy / step)

    on_copy = options(tiny_setup, run.output_dir, checkpoint=copied_source)
    with pytest.raises(SourceChangedError, match="if it was only copied or touched"):
        compress_checkpoint(on_copy, **QUIET)
    lines = []
    compress_checkpoint(
        options(tiny_setup, run.output_dir, checkpoint=copied_source, verify="full"),
        log=lines.append,
        progress=False,
        config=TINY,
    )
    assert any("unchanged (SHA-256); resuming" in line for line in lines), lines
    assert_same_arrays(all_arrays(run.output_dir), all_arrays(reference))
    compress_checkpoint(on_copy, **QUIET)  # the copy's files are now the recorded ones

    shutil.rmtree(copy)
    output = tmp_path / "second"
    second = options(tiny_setup, output, checkpoint=moved_source)
    write_layer = CompressedCheckpointWriter.write_layer

    def write_then_interrupt(writer, *args):
        write_layer(writer, *args)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(CompressedCheckpointWriter, "write_layer", write_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            compress_checkpoint(second, **QUIET)
    os.rename(moved, tmp_path / "moved_again")
    again = str(tmp_path / "moved_again" / step)
    compress_checkpoint(options(tiny_setup, output, checkpoint=again), **QUIET)
    assert_same_arrays(all_arrays(output), all_arrays(reference))


def test_a_source_changed_while_the_run_reads_it_is_an_error(tiny_setup, tmp_path, monkeypatch):
    source = write_source(tmp_path / "source", monkeypatch)
    other = write_source(tmp_path / "other", monkeypatch)
    array = "target.decoder.layers_1.mlp.expert.wo.kernel"
    write_layer = CompressedCheckpointWriter.write_layer

    def write_then_touch(writer, name, *args):
        write_layer(writer, name, *args)
        if name == "encoder.layers_1.mlp":  # the decoder's experts are read after this
            shutil.rmtree(os.path.join(source, array))
            shutil.copytree(os.path.join(other, array), os.path.join(source, array))

    monkeypatch.setattr(CompressedCheckpointWriter, "write_layer", write_then_touch)
    run = options(tiny_setup, tmp_path / "out", checkpoint=source)
    with pytest.raises(
        SourceChangedError,
        match=r"changed while this run read it: decoder/layers_1/mlp/expert/wo/kernel .* may mix "
        r"two versions of it; delete",
    ):
        compress_checkpoint(run, **QUIET)
    assert not CompressedCheckpoint(run.output_dir).complete


def test_processes_that_see_different_sources_are_refused():
    from qmoe_jax.compression.job import _check_same_source

    _check_same_source(["a" * 64] * 3, "/data/source")
    with pytest.raises(ValueError, match=r"process 2 sees another checkpoint .* than process 0"):
        _check_same_source(["a" * 64, "a" * 64, "b" * 64], "/data/source")
