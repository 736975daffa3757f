"""benchmarks/decode_profile.py names traced operations by their optimized HLO and sums them per
kind and per decoded token."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_profile

HLO = "\n".join(
    [
        "HloModule jit_step",
        "ENTRY %main.9 (Arg_0.1: f32[1,768]) -> f32[1,768] {",
        "  %Arg_0.1 = f32[1,768]{1,0} parameter(0)",
        "  %ffi_call.7 = f32[1,768]{1,0} custom-call(f32[1,768]{1,0} %Arg_0.1, "
        's8[768,768]{1,0} %c), custom_call_target="qmoe_dense_matmul", '
        "api_version=API_VERSION_TYPED_FFI",
        "  %ffi_call.8 = f32[16,1,3072]{2,1,0} custom-call(u32[65536,2]{1,0} %m), "
        'custom_call_target="qmoe_matmul"',
        "  loop_add_fusion = f32[1,12,64,33]{3,2,1,0} fusion(f32[1,12,64,33]{3,2,1,0} %p), "
        "kind=kLoop, calls=%fused",
        "  ROOT %tuple.3 = (f32[1,768]{1,0}, s32[]) tuple(%ffi_call.7, %x)",
        "}",
    ]
)


def test_operation_kinds_name_targets_opcodes_and_shapes():
    kinds = decode_profile.operation_kinds(HLO)
    assert kinds["ffi_call.7"] == "qmoe_dense_matmul f32[1,768]"
    assert kinds["ffi_call.8"] == "qmoe_matmul f32[16,1,3072]"
    assert kinds["loop_add_fusion"] == "fusion f32[1,12,64,33]"
    assert kinds["Arg_0.1"] == "parameter f32[1,768]"
    assert "tuple.3" not in kinds  # a tuple result: named by the fallback
    assert decode_profile.kind_of("tuple.3", kinds) == "tuple"


def test_summarize_sums_per_kind_and_token_on_xla_threads_only():
    kinds = decode_profile.operation_kinds(HLO)
    events = [
        ("tf_XLAEigen/1", "ffi_call.7", 30_000),
        ("tf_XLAEigen/2", "ffi_call.7", 50_000),
        ("tf_XLAEigen/1", "ffi_call.8", 100_000),
        ("tf_XLAEigen/1", "loop_add_fusion", 10_000),
        ("tf_XLAEigen/1", "ThunkExecutor::Execute", 1_000_000),  # spans the others
        ("tf_XLAEigen/1", "end: ffi_call", 5_000),
        ("tf_XLAEigen/2", "while.261", 900_000),  # spans the others
        ("python", "ffi_call.7", 1_000_000),  # not an XLA thread
    ]
    rows = decode_profile.summarize(events, kinds, tokens=2)
    by_kind = {row["kind"]: row for row in rows}
    assert [row["kind"] for row in rows] == [
        "qmoe_matmul f32[16,1,3072]",
        "qmoe_dense_matmul f32[1,768]",
        "fusion f32[1,12,64,33]",
    ]
    assert by_kind["qmoe_dense_matmul f32[1,768]"]["ms_per_token"] == pytest.approx(0.04)
    assert by_kind["qmoe_dense_matmul f32[1,768]"]["calls_per_token"] == 1.0
    assert by_kind["qmoe_matmul f32[16,1,3072]"]["ms_per_token"] == pytest.approx(0.05)
    groups = {decode_profile.group_of(row["kind"]) for row in rows}
    assert groups == {
        "dense products (qmoe_dense_matmul)",
        "expert kernels (qmoe_matmul)",
        "other XLA operations",
    }
