"""Where a decoding step's time goes: a jax.profiler trace of greedy batch-1 decoding, summed per
kind of operation and divided by the decoded tokens.

The models and forms are inference.py's (the same checkpoints, made if missing). The process
dumps XLA's optimized HLO, which names every traced operation, so that each one is reported by
kind and result shape: the FFI products by target (``qmoe_dense_matmul f32[1,768]`` is a dense
product with 768 outputs, ``qmoe_matmul f32[16,1,3072]`` an expert stack's), XLA's own operations
by opcode (``fusion f32[1,12,64,33]``).

The trace covers one call of ``generate`` for --tokens tokens, so the encoder and the cache's
set-up are in it once; their share per token shrinks with --tokens. The profiler adds its own
cost to every operation: the sum of the kinds is more than the untraced time per token printed
beside it (measured the way inference.py measures it). Compare kinds within one profile, not
with other runs.

    python benchmarks/decode_profile.py
    python benchmarks/decode_profile.py --form "compressed bf16" --tokens 65
    python benchmarks/decode_profile.py --model bundled --form "compressed int8"
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
from common import cpu_model, result_path, work_dir, write_result
from inference import DENSE_DTYPES, FORMS, MODELS, checkpoint_for

# One line of optimized HLO text: "%name = f32[1,768]{1,0} custom-call(...), ..." (the layout and
# ROOT are optional; tuple results are left to the fallback).
HLO_LINE = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+\[[\d,]*\])(?:\{[^}]*\})? ([\w\-]+)\((.*)$"
)
TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Operations whose traced time is that of the operations inside them.
CONTAINERS = ("while", "conditional", "call")


def operation_kinds(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: "<opcode or custom-call target> <result shape>"}."""
    kinds = {}
    for line in hlo_text.splitlines():
        match = HLO_LINE.match(line)
        if match is None:
            continue
        name, shape, opcode, rest = match.groups()
        target = TARGET.search(rest) if opcode == "custom-call" else None
        kinds[name] = f"{target.group(1) if target else opcode} {shape}"
    return kinds


def kind_of(name: str, kinds: dict[str, str]) -> str:
    """A traced event's kind: its HLO instruction's, else its name without the numeric suffix."""
    return kinds.get(name) or re.sub(r"\.\d+$", "", name)


def summarize(events, kinds: dict[str, str], tokens: int) -> list[dict]:
    """Per kind: ms per token and calls per token, largest first. ``events`` are (thread name,
    event name, nanoseconds); only XLA's intra-op threads (tf_XLAEigen...) count, and neither the
    executor's spans nor control flow (``CONTAINERS``), whose time is their operations'."""
    seconds = collections.Counter()
    calls = collections.Counter()
    for thread, name, nanoseconds in events:
        if not thread.startswith("tf_XLAEigen") or name.startswith(("ThunkExecutor", "end:")):
            continue
        kind = kind_of(name, kinds)
        if kind.split()[0] in CONTAINERS:
            continue
        seconds[kind] += nanoseconds * 1e-9
        calls[kind] += 1
    return [
        {"kind": kind, "ms_per_token": 1e3 * s / tokens, "calls_per_token": calls[kind] / tokens}
        for kind, s in seconds.most_common()
    ]


def group_of(kind: str) -> str:
    if kind.startswith("qmoe_dense_matmul"):
        return "dense products (qmoe_dense_matmul)"
    if kind.startswith(("qmoe_matmul", "qmoe_dequantize")):
        return "expert kernels (qmoe_matmul)"
    if kind.startswith(("dot ", "convolution ")):
        return "XLA dots"
    return "other XLA operations"


def trace_events(directory: str):
    import jax

    (path,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(path)
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                yield line.name, event.name, event.duration_ns


def profile(path: str, args, scratch: str) -> tuple[list[dict], float, float]:
    """(``summarize``'s rows, untraced ms per decoded token, traced seconds) of ``args.form`` on
    the checkpoint at ``path``; the HLO dump and the trace go under ``scratch``."""
    dump = os.path.join(scratch, "hlo")
    # Before jax starts: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    import jax

    from qmoe_jax.inference import open_model
    from qmoe_jax.inference.strategies import DecodingConfig, generate

    experts, dense = args.form.split()
    model = open_model(
        path, experts=experts, dense_dtype=DENSE_DTYPES[dense], expert_parallel="off"
    )
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab - 100, (1, args.prompt_length)).astype(np.int32)

    def run(length: int) -> float:
        config = DecodingConfig(max_decode_length=length, eos_id=-1)
        started = time.perf_counter()
        jax.block_until_ready(generate(model.module, model.params, prompt, config).tokens)
        return time.perf_counter() - started

    def best(length: int, repeats: int = 5) -> float:
        return min(run(length) for _ in range(repeats))

    best(1, 2)  # compiles the two programs
    best(args.tokens, 2)
    untraced_ms = 1e3 * (best(args.tokens) - best(1)) / (args.tokens - 1)
    trace = os.path.join(scratch, "trace")
    jax.profiler.start_trace(trace)
    traced_seconds = run(args.tokens)
    jax.profiler.stop_trace()

    hlo = ""
    for file in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
        with open(file) as f:
            hlo += f.read()
    rows = summarize(trace_events(trace), operation_kinds(hlo), args.tokens)
    return rows, untraced_ms, traced_seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="base-shaped")
    parser.add_argument("--form", choices=FORMS, default="compressed int8")
    parser.add_argument("--experts", type=int, default=16, help="experts of the base-shaped model")
    parser.add_argument("--tokens", type=int, default=33, help="decoded tokens in the trace")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--top", type=int, default=25, help="kinds printed")
    parser.add_argument("--work_dir", default=work_dir("inference"))
    parser.add_argument("--output", default=result_path("decode_profile"))
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")

    path = checkpoint_for(args.model, args)
    scratch = tempfile.mkdtemp(prefix="decode_profile_")
    try:
        rows, untraced_ms, traced_seconds = profile(path, args, scratch)
    finally:  # the HLO dump and the trace are tens of MB
        shutil.rmtree(scratch, ignore_errors=True)
    groups = collections.Counter()
    for row in rows:
        groups[group_of(row["kind"])] += row["ms_per_token"]
    events = sum(row["calls_per_token"] for row in rows)

    cpu = cpu_model()
    print(
        f"\nCPU: {cpu}, {os.cpu_count()} cores; {args.model} {args.form}; one traced generate() "
        f"of {args.tokens} tokens ({1e3 * traced_seconds / args.tokens:.2f} ms per token traced, "
        f"{untraced_ms:.2f} ms per decoded token untraced); {events:.0f} operations per token"
    )
    print(f"\n{'ms/token':>9}  group")
    for group, ms in groups.most_common():
        print(f"{ms:>9.3f}  {group}")
    print(f"\n{'ms/token':>9} {'calls':>6}  kind (top {args.top})")
    for row in rows[: args.top]:
        print(f"{row['ms_per_token']:>9.3f} {row['calls_per_token']:>6.1f}  {row['kind']}")
    write_result(
        "decode_profile",
        {
            "model": args.model,
            "form": args.form,
            "tokens": args.tokens,
            "untraced_ms_per_decoded_token": untraced_ms,
            "traced_seconds": traced_seconds,
            "operations_per_token": events,
            "groups_ms_per_token": dict(groups.most_common()),
            "kinds": rows,
        },
        args.output,
    )


if __name__ == "__main__":
    sys.exit(main())
