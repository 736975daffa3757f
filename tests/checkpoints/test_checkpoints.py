"""Tests of qmoe_jax.checkpoints: T5X legacy and Orbax round trips, lazy slice reads, errors."""

import json
import os
import re
import shutil

import hypothesis.extra.numpy as hnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore as ts
from flax import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

from qmoe_jax.checkpoints import (
    CheckpointError,
    CorruptCheckpointError,
    MissingArrayError,
    NotACheckpointError,
    ShapeMismatchError,
    open_t5x_checkpoint,
    t5x_chunk_shape,
    write_t5x_checkpoint,
)

E, D, HK, F, V, H = 4, 8, 8, 16, 32, 2
EXPERT_WI = "encoder/layers_1/mlp/expert/wi/kernel"


def _attention(rng, dtype):
    return {
        name: {"kernel": rng.normal(size=(HK, D) if name == "out" else (D, HK)).astype(dtype)}
        for name in ("query", "key", "value", "out")
    }


def _mlp(rng, dtype, sparse):
    if not sparse:
        return {
            "wi": {"kernel": rng.normal(size=(D, F)).astype(dtype)},
            "wo": {"kernel": rng.normal(size=(F, D)).astype(dtype)},
        }
    return {
        "router": {"router_weights": {"w": {"kernel": rng.normal(size=(D, E)).astype(dtype)}}},
        "expert": {
            "wi": {"kernel": rng.normal(size=(E, D, F)).astype(dtype)},
            "wo": {"kernel": rng.normal(size=(E, F, D)).astype(dtype)},
        },
    }


def switch_tree(seed=0, dtype=np.float32):
    """A 2+2-layer Switch param tree with the real T5X names (docs/t5x.md §2); layers_1 is
    sparse."""
    rng = np.random.default_rng(seed)

    def scale():
        return {"scale": rng.normal(size=(D,)).astype(dtype)}

    encoder = {
        "relpos_bias": {"rel_embedding": rng.normal(size=(H, 32)).astype(dtype)},
        "encoder_norm": scale(),
    }
    decoder = {
        "relpos_bias": {"rel_embedding": rng.normal(size=(H, 32)).astype(dtype)},
        "decoder_norm": scale(),
    }
    for i in range(2):
        encoder[f"layers_{i}"] = {
            "attention": _attention(rng, dtype),
            "pre_attention_layer_norm": scale(),
            "pre_mlp_layer_norm": scale(),
            "mlp": _mlp(rng, dtype, sparse=i == 1),
        }
        decoder[f"layers_{i}"] = {
            "self_attention": _attention(rng, dtype),
            "encoder_decoder_attention": _attention(rng, dtype),
            "pre_self_attention_layer_norm": scale(),
            "pre_cross_attention_layer_norm": scale(),
            "pre_mlp_layer_norm": scale(),
            "mlp": _mlp(rng, dtype, sparse=i == 1),
        }
    return {
        "token_embedder": {"embedding": rng.normal(size=(V, D)).astype(dtype)},
        "encoder": encoder,
        "decoder": decoder,
    }


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def bytes_read(driver):
    metrics = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{driver}/bytes_read")
    return sum(v["value"] for m in metrics for v in m["values"])


@pytest.fixture(scope="module")
def legacy_bf16(tmp_path_factory):
    """A pristine legacy bf16 checkpoint; tests that damage it work on a copy."""
    params = switch_tree()
    path = write_t5x_checkpoint(tmp_path_factory.mktemp("legacy"), params, 1000, dtype="bfloat16")
    return path, params


def copy_of(path, tmp_path):
    return str(shutil.copytree(path, tmp_path / "checkpoint_1000")) + "/"


@pytest.mark.parametrize("fmt", ["legacy", "orbax"])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_round_trip(tmp_path, fmt, dtype):
    params = switch_tree(seed=1)
    path = write_t5x_checkpoint(tmp_path, params, 7, fmt, dtype)
    assert path.rstrip("/") == str(tmp_path / "checkpoint_7")
    ckpt = open_t5x_checkpoint(path)
    assert (ckpt.format, ckpt.step) == (fmt, 7)
    stored = np.dtype(dtype or np.float32)
    want = {p: a.astype(stored) for p, a in flat(params).items()}
    assert ckpt.keys() == sorted(want)
    for p, info in ckpt.spec().items():
        assert (info.shape, info.dtype) == (want[p].shape, stored)
        np.testing.assert_array_equal(ckpt.read(p), want[p])
    for e in range(E):
        np.testing.assert_array_equal(ckpt.read_expert(EXPERT_WI, e), want[EXPERT_WI][e])
    np.testing.assert_array_equal(ckpt.read_expert(EXPERT_WI, slice(1, 3)), want[EXPERT_WI][1:3])
    dense = flat(ckpt.read_params())
    assert sorted(dense) == sorted(p for p in want if "/expert/" not in p)
    for p, array in dense.items():
        np.testing.assert_array_equal(array, want[p])
    layer = flat(ckpt.read_params(["decoder/layers_1"]))
    assert sorted(layer) == sorted(p for p in want if p.startswith("decoder/layers_1/"))


def test_round_trip_through_memory_kvstore():
    context = ts.Context()
    params = switch_tree(seed=2, dtype=ml_dtypes.bfloat16)
    path = write_t5x_checkpoint("memory://models/tiny", params, 3, context=context)
    assert path == "memory://models/tiny/checkpoint_3/"
    ckpt = open_t5x_checkpoint(path, context=context)
    assert ckpt.format == "legacy" and ckpt.step == 3
    np.testing.assert_array_equal(ckpt.read_expert(EXPERT_WI, 3), flat(params)[EXPERT_WI][3])


@settings(max_examples=25, deadline=None)
@given(
    array=hnp.arrays(
        st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int32]),
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=6),
        elements=st.integers(-1000, 1000),
    ),
    experts_per_chunk=st.sampled_from([None, 1]),
)
def test_legacy_round_trip_property(array, experts_per_chunk):
    context = ts.Context()
    params = {"mlp": {"expert": {"wi": {"kernel": array}}}, "norm": {"scale": array.reshape(-1)}}
    path = write_t5x_checkpoint(
        "memory://m", params, 1, experts_per_chunk=experts_per_chunk, context=context
    )
    ckpt = open_t5x_checkpoint(path, context=context)
    np.testing.assert_array_equal(ckpt.read("mlp/expert/wi/kernel"), array)
    np.testing.assert_array_equal(
        ckpt.read_expert("mlp/expert/wi/kernel", array.shape[0] - 1), array[-1]
    )
    np.testing.assert_array_equal(ckpt.read_params()["norm"]["scale"], array.reshape(-1))


def test_legacy_layout_is_t5x(legacy_bf16):
    """The msgpack and zarr files are what t5x's Checkpointer.save writes (t5x/checkpoints.py)."""
    path, _ = legacy_bf16
    with open(os.path.join(path, "checkpoint"), "rb") as f:
        raw = f.read()
    ordered = msgpack.unpackb(raw, object_pairs_hook=lambda pairs: [k for k, _ in pairs])
    assert ordered == ["version", "optimizer"]
    contents = serialization.msgpack_restore(raw)
    assert contents["version"] == 3
    assert list(contents["optimizer"]) == ["state", "target"]
    step = contents["optimizer"]["state"]["step"]
    assert step == 1000 and step.dtype == np.int32
    assert list(contents["optimizer"]["target"]) == ["decoder", "encoder", "token_embedder"]
    assert contents["optimizer"]["target"]["encoder"]["layers_1"]["mlp"]["expert"]["wi"][
        "kernel"
    ] == {
        "driver": "zarr",
        "dtype": "bfloat16",
        "kvstore": {"driver": "file", "path": "target.encoder.layers_1.mlp.expert.wi.kernel/"},
        "metadata": {
            "chunks": [1, D, F],
            "compressor": {"id": "gzip", "level": 1},
            "shape": [E, D, F],
        },
    }
    array_dir = os.path.join(path, "target.encoder.layers_1.mlp.expert.wi.kernel")
    assert sorted(os.listdir(array_dir)) == [".zarray"] + [f"{e}.0.0" for e in range(E)]
    with open(os.path.join(array_dir, ".zarray")) as f:
        zarray = json.load(f)
    assert (zarray["dtype"], zarray["compressor"]["id"], zarray["fill_value"]) == (
        "bfloat16",
        "gzip",
        None,
    )
    with open(os.path.join(array_dir, "0.0.0"), "rb") as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip magic


def test_t5x_chunk_shape():
    assert t5x_chunk_shape((4, 6), 6) == (2, 3)
    assert t5x_chunk_shape((4, 4), 4) == (2, 2)  # ties shrink the first dimension first
    assert t5x_chunk_shape((5,), 4) == (1,)
    assert t5x_chunk_shape((1, 768, 3072), 16 * 2**20) == (1, 768, 3072)
    assert t5x_chunk_shape((32128, 4096), 16 * 2**20) == (4016, 4096)  # 32128 = 2^7 * 251


@given(shape=st.lists(st.integers(1, 60), min_size=1, max_size=3), target=st.integers(1, 5000))
def test_t5x_chunk_shape_divides_and_fits(shape, target):
    chunks = t5x_chunk_shape(shape, target)
    assert all(size % c == 0 for size, c in zip(shape, chunks))
    assert np.prod(chunks) <= target


def test_expert_read_with_every_other_array_and_chunk_deleted(legacy_bf16, tmp_path):
    path, params = legacy_bf16
    path = copy_of(path, tmp_path)
    keep = "target.encoder.layers_1.mlp.expert.wi.kernel"
    for name in os.listdir(path):
        if name not in (keep, "checkpoint"):
            shutil.rmtree(os.path.join(path, name))
    for e in (0, 1, 3):
        os.remove(os.path.join(path, keep, f"{e}.0.0"))
    ckpt = open_t5x_checkpoint(path)
    assert len(ckpt.keys()) == len(flat(params))
    want = flat(params)[EXPERT_WI].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ckpt.read_expert(EXPERT_WI, 2), want[2])
    with pytest.raises(CorruptCheckpointError, match="missing or damaged"):
        ckpt.read_expert(EXPERT_WI, 1)
    with pytest.raises(CorruptCheckpointError, match="incomplete"):
        ckpt.read("token_embedder/embedding")


def test_expert_read_bytes_are_its_chunks_only(legacy_bf16):
    path, params = legacy_bf16
    array_dir = os.path.join(path, "target.encoder.layers_1.mlp.expert.wi.kernel")

    def size(name):
        return os.path.getsize(os.path.join(array_dir, name))

    ckpt = open_t5x_checkpoint(path)
    before = bytes_read("file")
    expert = ckpt.read_expert(EXPERT_WI, 2)
    assert bytes_read("file") - before == size(".zarray") + size("2.0.0")
    before = bytes_read("file")
    group = ckpt.read_expert(EXPERT_WI, slice(0, 2))
    assert bytes_read("file") - before == size("0.0.0") + size("1.0.0")  # metadata already open
    want = flat(params)[EXPERT_WI].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(expert, want[2])
    np.testing.assert_array_equal(group, want[:2])


def test_orbax_expert_stacks_are_chunked_per_expert(tmp_path):
    ckpt = open_t5x_checkpoint(write_t5x_checkpoint(tmp_path, switch_tree(), 1, "orbax"))
    assert ckpt.info(EXPERT_WI).chunks == (1, D, F)
    assert ckpt.info("token_embedder/embedding").chunks == (V, D)


def test_single_host_chunking_puts_experts_in_one_chunk(tmp_path):
    params = switch_tree()
    ckpt = open_t5x_checkpoint(write_t5x_checkpoint(tmp_path, params, 1, experts_per_chunk=None))
    assert ckpt.info(EXPERT_WI).chunks == (E, D, F)
    np.testing.assert_array_equal(ckpt.read_expert(EXPERT_WI, 1), flat(params)[EXPERT_WI][1])


def test_keys_without_data(legacy_bf16, tmp_path):
    path, params = legacy_bf16
    path = copy_of(path, tmp_path)
    for name in os.listdir(path):
        if name != "checkpoint":
            shutil.rmtree(os.path.join(path, name))
    ckpt = open_t5x_checkpoint(path)
    assert ckpt.keys() == sorted(flat(params))
    assert (
        ckpt.info(EXPERT_WI).shape == (E, D, F) and ckpt.info(EXPERT_WI).dtype == ml_dtypes.bfloat16
    )


def test_orbax_keys_without_data(tmp_path):
    path = write_t5x_checkpoint(tmp_path, switch_tree(), 1, "orbax")
    for name in os.listdir(os.path.join(path, "state")):
        if name != "_METADATA":
            target = os.path.join(path, "state", name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    ckpt = open_t5x_checkpoint(path)
    assert ckpt.keys() == sorted(flat(switch_tree()))
    with pytest.raises(CorruptCheckpointError, match="cannot open"):
        ckpt.read(EXPERT_WI)


def test_detection_of_every_accepted_location(legacy_bf16, tmp_path):
    path, _ = legacy_bf16
    assert open_t5x_checkpoint(os.path.join(path, "checkpoint")).format == "legacy"
    assert open_t5x_checkpoint("file://" + path).format == "legacy"
    orbax = write_t5x_checkpoint(tmp_path, switch_tree(), 5, "orbax")
    state = open_t5x_checkpoint(os.path.join(orbax, "state"))
    assert (state.format, state.step) == ("orbax", 5)


def test_inline_arrays_as_t5x_writes_unpartitioned_params(tmp_path):
    """T5X stores arrays without partitioning axes inline in the msgpack (ext type 1)."""
    embedding = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    contents = {
        "version": 3,
        "optimizer": {
            "state": {"step": np.int32(4)},
            "target": {"token_embedder": {"embedding": embedding}},
        },
    }
    (tmp_path / "checkpoint").write_bytes(serialization.msgpack_serialize(contents, in_place=True))
    ckpt = open_t5x_checkpoint(tmp_path)
    assert ckpt.step == 4 and ckpt.info("token_embedder/embedding").chunks is None
    np.testing.assert_array_equal(ckpt.read("token_embedder/embedding", np.s_[1:]), embedding[1:])


def test_missing_array_names_close_matches(legacy_bf16):
    ckpt = open_t5x_checkpoint(legacy_bf16[0])
    with pytest.raises(
        MissingArrayError, match="close matches: encoder/layers_1/mlp/expert/wi/kernel"
    ):
        ckpt.read("encoder/layers_1/mlp/experts/wi/kernel")
    with pytest.raises(MissingArrayError):
        ckpt.read_params(["encoder/layers_7"])


def test_read_expert_errors(legacy_bf16):
    ckpt = open_t5x_checkpoint(legacy_bf16[0])
    with pytest.raises(CheckpointError, match="not an expert stack"):
        ckpt.read_expert("encoder/layers_0/mlp/wi/kernel", 0)
    with pytest.raises(CheckpointError, match=r"out of range: .* holds 4 experts"):
        ckpt.read_expert(EXPERT_WI, 4)
    with pytest.raises(CheckpointError, match="invalid"):
        ckpt.read_expert(EXPERT_WI, slice(2, 6))


def expected_shapes(num_experts=E, **overrides):
    tree = flat(switch_tree())
    shapes = {p: a.shape for p, a in tree.items()}
    for p in shapes:
        if "/expert/" in p:
            shapes[p] = (num_experts,) + shapes[p][1:]
    shapes.update(overrides)
    return {p: s for p, s in shapes.items() if s is not None}


def test_check_shapes(legacy_bf16):
    ckpt = open_t5x_checkpoint(legacy_bf16[0])
    ckpt.check_shapes(expected_shapes())
    with pytest.raises(ShapeMismatchError) as error:
        ckpt.check_shapes(expected_shapes(num_experts=8), config_name="switch-tiny-8")
    message = str(error.value)
    assert (
        "4 arrays differ, e.g. decoder/layers_1/mlp/expert/wi/kernel has shape (4, 8, 16) in the "
        "checkpoint but the config switch-tiny-8 expects (8, 8, 16)"
    ) in message
    assert "\n" not in message
    assert "the checkpoint has 4 experts per sparse layer but the config 8" in message
    with pytest.raises(ShapeMismatchError, match="untied logits"):
        ckpt.check_shapes(expected_shapes(**{"decoder/logits_dense/kernel": (D, V)}))
    with pytest.raises(
        ShapeMismatchError, match="is in the checkpoint but the config does not expect"
    ):
        ckpt.check_shapes(expected_shapes(**{"token_embedder/embedding": None}))
    ckpt.check_shapes(expected_shapes(**{"token_embedder/embedding": None}), allow_extra=True)


def test_check_shapes_explains_layer_layout(legacy_bf16):
    ckpt = open_t5x_checkpoint(legacy_bf16[0])
    deeper = expected_shapes(**{"encoder/layers_2/pre_mlp_layer_norm/scale": (D,)})
    with pytest.raises(ShapeMismatchError, match="2 encoder layers but the config 3"):
        ckpt.check_shapes(deeper)
    sparse_first = {
        p.replace("layers_0/mlp/wi", "layers_0/mlp/expert/wi"): s
        for p, s in expected_shapes().items()
    }
    with pytest.raises(
        ShapeMismatchError, match="coder/layers_0 is dense in the checkpoint but sparse"
    ):
        ckpt.check_shapes(sparse_first)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "checkpoint_20" / "state").mkdir(parents=True)
    (tmp_path / "checkpoint_20" / "state" / "_METADATA").write_text("{}")
    (tmp_path / "checkpoint_100").mkdir()
    (tmp_path / "checkpoint_100" / "checkpoint").write_bytes(b"\x80")
    with pytest.raises(NotACheckpointError) as error:
        open_t5x_checkpoint(tmp_path)
    message = str(error.value)
    assert "'checkpoint' msgpack file or an Orbax '_METADATA'" in message
    assert "checkpoint_100/, checkpoint_20/, notes.txt" in message
    assert "model directory" in message and "checkpoint_100/" in message
    with pytest.raises(NotACheckpointError, match="empty or does not exist"):
        open_t5x_checkpoint(tmp_path / "nowhere")
    with pytest.raises(NotACheckpointError):
        open_t5x_checkpoint("memory://nothing/", context=ts.Context())


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\x82\xa7version\x03\xa9optim", "not a readable msgpack"),  # truncated
        (b"", "not a readable msgpack"),
        (msgpack.packb({"params": {}}), "not a T5X checkpoint"),
        (b'model_checkpoint_path: "model.ckpt-0"\n', "TensorFlow checkpoint"),
        (
            serialization.msgpack_serialize(
                {
                    "version": 2,
                    "optimizer": {
                        "target": {
                            "w": {
                                "driver": "zarr",
                                "dtype": "uint16",
                                "kvstore": {"driver": "file", "path": "target.w/"},
                                "metadata": {"shape": [2], "chunks": [2]},
                            }
                        }
                    },
                }
            ),
            "version-2 T5X checkpoint",
        ),
    ],
)
def test_corrupt_msgpack(tmp_path, content, match):
    (tmp_path / "checkpoint").write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=match):
        open_t5x_checkpoint(tmp_path)


def test_corrupt_chunk_and_metadata(legacy_bf16, tmp_path):
    path = copy_of(legacy_bf16[0], tmp_path)
    with open(
        os.path.join(path, "target.encoder.layers_1.mlp.expert.wi.kernel", "1.0.0"), "wb"
    ) as f:
        f.write(b"not gzip")
    with open(os.path.join(path, "target.token_embedder.embedding", ".zarray"), "w") as f:
        json.dump(
            {
                "zarr_format": 2,
                "shape": [V + 1, D],
                "chunks": [V + 1, D],
                "dtype": "bfloat16",
                "compressor": {"id": "gzip", "level": 1},
                "fill_value": None,
                "filters": None,
                "order": "C",
            },
            f,
        )
    ckpt = open_t5x_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match="missing or damaged"):
        ckpt.read_expert(EXPERT_WI, 1)
    with pytest.raises(CorruptCheckpointError, match="inconsistent"):
        ckpt.read("token_embedder/embedding")


def test_orbax_checkpoint_with_missing_data_file_fails_loudly(tmp_path):
    path = write_t5x_checkpoint(tmp_path, switch_tree(), 1, "orbax")
    data_files = [
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(path, "state"))
        for name in names
        if os.path.basename(root) == "d"
    ]
    for name in data_files:
        os.remove(name)
    with pytest.raises(CorruptCheckpointError):
        open_t5x_checkpoint(path).read(EXPERT_WI)


def test_writer_errors(tmp_path):
    params = switch_tree()
    write_t5x_checkpoint(tmp_path, params, 1)
    with pytest.raises(CheckpointError, match="already exists"):
        write_t5x_checkpoint(tmp_path, params, 1)
    with pytest.raises(CheckpointError, match=re.escape("without '/' or '.'")):
        write_t5x_checkpoint(tmp_path, {"a.b": np.zeros(2)}, 2)
    with pytest.raises(CheckpointError, match="Orbax writer needs a local directory"):
        write_t5x_checkpoint("memory://x", params, 2, "orbax", context=ts.Context())
    with pytest.raises(CheckpointError, match="format must be one of"):
        write_t5x_checkpoint(tmp_path, params, 2, "zarr")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1"]  # no staging directory left behind
