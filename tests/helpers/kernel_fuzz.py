"""Garbage kernel operands, run as a program: every FFI target on random codes,
row offsets, dictionaries, counts and expert indexes, under each instruction set named in the
JSON list $ISAS. Prints one JSON line: outcomes (error / ok, and exact / wrong
for good operands with garbage counts) and the first line of each error.

tests/kernels/test_ops_fuzz.py runs it in a child process (a crash must not take the
test run down); .ci/asan_fuzz runs it against an AddressSanitizer build of the
extension, which turns any out-of-bounds read or write into a failure.

    ISAS='["avx2", "portable"]' python tests/helpers/kernel_fuzz.py   # from tests/
"""

import collections
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from helpers import compressed_data
from qmoe_jax.codec import build_dictionary
from qmoe_jax.kernels import bindings

dictionary = build_dictionary(0.885)
masks, slots, words = (np.asarray(a) for a in bindings.dictionary_operands(dictionary))
rng = np.random.default_rng(0)
outcomes = collections.Counter()
messages = set()


def call(target, dense, result, dictionary_forms, codes, offsets, minmax, **attributes):
    fn = jax.ffi.ffi_call(target, result, vmap_method="expand_dims")
    return np.asarray(fn(*dictionary_forms, codes, offsets, minmax, *dense, **attributes))


def garbage_index(tokens: int) -> np.ndarray:
    """int32[tokens] expert indexes: in range for a stack of 2, past it, negative, the extremes."""
    return rng.choice(np.array([-(2**31), -1, 0, 1, 2, 2**31 - 1], np.int32), tokens)


def run_all(forms, codes, offsets, minmax):
    batch = codes.shape[:-1]
    x = rng.standard_normal((*batch, 5, cols)).astype(np.float32)
    g = rng.standard_normal((*batch, 3, rows)).astype(np.float32)
    cases = [
        (
            "qmoe_matmul",
            (x, compressed_data.garbage_counts(rng, batch)),
            jax.ShapeDtypeStruct((*batch, 5, rows), jnp.float32),
            {},
        ),
        (
            "qmoe_matmul",
            (x[..., :1, :], compressed_data.garbage_counts(rng, batch)),
            jax.ShapeDtypeStruct((*batch, 1, rows), jnp.float32),
            {},
        ),
        (
            "qmoe_matmul_t",
            (g, compressed_data.garbage_counts(rng, batch)),
            jax.ShapeDtypeStruct((*batch, 3, cols), jnp.float32),
            {},
        ),
        (
            "qmoe_dequantize",
            (),
            jax.ShapeDtypeStruct((*batch, rows, cols), jnp.bfloat16),
            dict(cols=np.int64(cols)),
        ),
        # The routed products: tokens [6, width] naming experts of the stack (garbage indexes
        # among them); without a batch dim minmax is no stack, which must be an error too.
        (
            "qmoe_matmul_routed",
            (x.reshape(-1, cols)[:6], garbage_index(6)),
            jax.ShapeDtypeStruct((6, rows), jnp.float32),
            {},
        ),
        (
            "qmoe_matmul_routed_t",
            (rng.standard_normal((6, rows)).astype(np.float32), garbage_index(6)),
            jax.ShapeDtypeStruct((6, cols), jnp.float32),
            {},
        ),
    ]
    for target, dense, result, attributes in cases:
        try:
            call(target, dense, result, forms, codes, offsets, minmax, **attributes)
            outcomes["ok"] += 1
        except Exception as error:
            outcomes["error"] += 1
            messages.add(str(error).splitlines()[0][:80])


# Short rows, and long ones (about 70 codewords each): kernels may decode
# a long row in chunks with fewer checks, so garbage must be caught there too.
for rows, cols, n_codes, cases in ((7, 33, 40, 60), (5, 1500, 420, 28)):
    good, good_dense = compressed_data.matrix(rng, dictionary, rows, cols)
    good_codes = np.zeros(n_codes, np.uint16)
    good_codes[: len(good.codes)] = good.codes
    for isa in json.loads(os.environ["ISAS"]):
        os.environ["QMOE_CPU_ISA"] = isa
        for case in range(cases):
            kind = case % 8
            minmax = rng.integers(0, 2**16, (rows, 2), dtype=np.uint16).view(ml_dtypes.bfloat16)
            codes, offsets = compressed_data.corrupt_stream(
                rng, kind, good_codes, good.row_offsets, len(good.codes)
            )
            forms = (masks, slots, words)
            if kind == 4:
                forms = (
                    rng.integers(0, 2**32, masks.shape, dtype=np.uint32),
                    rng.integers(0, 256, slots.shape, dtype=np.uint8),
                    rng.integers(0, 2**32, words.shape, dtype=np.uint32),
                )
            elif kind == 5:
                forms = (
                    masks,
                    rng.integers(0, 256, slots.shape, dtype=np.uint8),
                    rng.integers(0, 2**32, words.shape, dtype=np.uint32),
                )
            elif kind == 6:
                # Words that claim 4 plus (or 4 minus) weights in codewords of
                # length 0, one row of all the codewords: 4 list entries per
                # codeword and no weights, past the lists' slack on long rows.
                claim = rng.choice([5 * 4, 4])
                forms = (
                    masks,
                    slots,
                    (np.uint32(claim << 20) | rng.integers(0, 2**20, words.shape)).astype(
                        np.uint32
                    ),
                )
                offsets = np.full(rows + 1, n_codes, np.int32)
                offsets[0] = 0
            run_all(forms, codes, offsets, minmax)
            run_all(
                forms,
                codes[None].repeat(2, 0),
                offsets[None].repeat(2, 0),
                minmax[None].repeat(2, 0),
            )
        # Good operands, garbage counts: the tokens in use are exact, the others zero.
        stack = [a[None].repeat(3, 0) for a in (good_codes, good.row_offsets, good.minmax)]
        for _ in range(20):
            counts = compressed_data.garbage_counts(rng, (3,))
            x = rng.standard_normal((3, 5, cols)).astype(np.float32)
            result = jax.ShapeDtypeStruct((3, 5, rows), jnp.float32)
            try:
                y = call("qmoe_matmul", (x, counts), result, (masks, slots, words), *stack)
            except Exception as error:
                outcomes["error"] += 1
                messages.add(str(error).splitlines()[0][:80])
                continue
            in_use = np.arange(5) < np.clip(counts.astype(np.int64), 0, 5)[:, None]
            expected = np.where(in_use[..., None], x @ good_dense.T, 0)
            outcomes["exact" if np.allclose(y, expected, rtol=1e-5, atol=1e-5) else "wrong"] += 1
        # Good operands, garbage indexes: tokens naming an expert exact, the others zero.
        for _ in range(10):
            index = garbage_index(6)
            x = rng.standard_normal((6, cols)).astype(np.float32)
            result = jax.ShapeDtypeStruct((6, rows), jnp.float32)
            y = call("qmoe_matmul_routed", (x, index), result, (masks, slots, words), *stack)
            named = (index >= 0) & (index < 3)
            expected = np.where(named[:, None], x @ good_dense.T, 0)
            outcomes["exact" if np.allclose(y, expected, rtol=1e-5, atol=1e-5) else "wrong"] += 1
print(json.dumps(dict(outcomes=outcomes, messages=sorted(messages))))
