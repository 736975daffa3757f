"""A switch-c-2048-shaped compressed model larger than this machine's RAM, generating from a mapped
checkpoint.

The synthetic checkpoint has c-2048's shapes (d_model 2080, d_ff 6144, 2048
experts per sparse layer, every block sparse, 30 heads of 64) and as many
blocks as make its size on disk exceed the machine's RAM (MemTotal): it is
written directly in the mapped layout (docs/format.md §9), with random dense
weights (bfloat16) and expert codes that the real encoder made from random
ternary weights at QMoE's zero fraction (P(0) = 0.885, static dictionary).

Encoding hundreds of GB of weights would take hours on this machine, so a
pool of --pool distinct experts is encoded and its streams are reused across
the experts and layers of the file (expert e of sparse layer l takes pool
entry (e + 7·l) mod pool). Every expert still has its own offset in the file,
and the page cache counts file offsets, so a routed expert not read before is
a real disk read.

A child process (so that the peak RSS is its own) opens it with
``--experts mapped`` and greedy-decodes --decode_length tokens at batch 1
from a random prompt of --prompt_length tokens:

  compile          the first run (prompt A): compiles, and reads and verifies the experts it
                   routes
  cold, first use  prompt B after the file's pages were dropped from the page cache: each
                   routed expert is read with pread and its SHA-256 checked (lazy verification)
  cold, verified   prompt B again after dropping the pages again: verified experts come in by
                   read-ahead (MADV_WILLNEED) and page faults
  warm             prompt B again, pages cached
  no expert work   prompt B with expert layers that return zeros (routing, dispatch, combine
                   still run): attention, dense layers and the rest of the step

Dropping the page cache: /proc/sys/vm/drop_caches needs privileges this
benchmark does not assume; it releases this process's mappings
(MADV_DONTNEED) and then evicts the files' pages with
posix_fadvise(POSIX_FADV_DONTNEED), and reports which it used. Disk reads come
from /proc/self/io (read_bytes), compared with the bytes the distinct routed
experts hold (codewords in use, row offsets, min/max).

    python benchmarks/larger_than_ram.py     # builds ~28 GB in --work_dir, measures, deletes it

A full disk while building stops the benchmark and removes what it made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import time
import zlib

import numpy as np
from common import REPO, cpu_model, result_path, write_result
from inference import random_dense  # the inference benchmark's synthetic parameters

P0 = 0.885
GIB = 2**30


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))


def c2048_shaped(blocks: int, experts: int = 2048):
    """c-2048's shapes with ``blocks`` blocks (encoder gets the smaller half), every block
    sparse."""
    from qmoe_jax.models import get_config

    encoder = blocks // 2
    return dataclasses.replace(
        get_config("switch-c-2048"),
        name=f"switch-c-2048-shaped-{blocks}-blocks",
        num_encoder_layers=encoder,
        num_decoder_layers=blocks - encoder,
        num_encoder_sparse_layers=encoder,
        num_decoder_sparse_layers=blocks - encoder,
        num_experts=experts,
        checkpoint_path=None,
        checkpoint_step=None,
    )


# ---------------------------------------------------------------- building the checkpoint


def encode_pool(size: int, d_model: int, d_ff: int, seed: int = 0):
    """``size`` experts, each {kernel: (codes, row_offsets, minmax)} encoded from random ternary
    weights."""
    import ml_dtypes

    from qmoe_jax.codec import build_dictionary, encode_experts

    dictionary = build_dictionary(P0)
    rng = np.random.default_rng(seed)
    zero, low = round(P0 * 65536), round((P0 + (1 - P0) / 2) * 65536)
    pool = []
    for _ in range(size):
        expert = {}
        for kernel, (rows, cols) in (("wi", (d_ff, d_model)), ("wo", (d_model, d_ff))):
            draws = rng.integers(0, 65536, (1, rows, cols), dtype=np.uint16)
            codes = np.where(draws < zero, 0, np.where(draws < low, 1, 2)).astype(np.uint8)
            scale = rng.random((1, rows, 1), dtype=np.float32) * 0.05 + 0.01
            minmax = np.concatenate([-scale, scale], axis=-1).astype(ml_dtypes.bfloat16)
            stack = encode_experts(codes, minmax, dictionary)
            used = int(np.asarray(stack.row_offsets)[0, -1])
            expert[kernel] = (
                np.asarray(stack.codes)[0, :used].copy(),
                np.asarray(stack.row_offsets)[0].copy(),
                np.asarray(stack.minmax)[0].copy(),
            )
        pool.append(expert)
    return dictionary, pool


def general_compressor_gain(pool, mini: str | None) -> dict:
    """Size after zlib (level 9) and xz (preset 6) over the raw size, for the pool's code streams
    and, when given, a real compressed checkpoint's."""

    def ratios(streams):
        raw = b"".join(streams)
        return {
            "bytes": len(raw),
            "zlib_9": len(zlib.compress(raw, 9)) / len(raw),
            "xz_6": len(lzma.compress(raw, preset=6)) / len(raw),
        }

    out = {"random ternary, P(0) = 0.885": ratios([e[k][0].tobytes() for e in pool[:4] for k in e])}
    if mini and os.path.isfile(os.path.join(mini, "manifest.json")):
        from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint

        checkpoint = CompressedCheckpoint(mini)
        streams = []
        for name in checkpoint.layer_names():
            arrays, _ = checkpoint.layer(name)
            for kernel in arrays.values():
                for codes, offsets in zip(kernel["codes"], kernel["row_offsets"]):
                    streams.append(np.asarray(codes[: offsets[-1]]).tobytes())
        out[f"GPTQ codes of {os.path.relpath(mini, REPO)}"] = ratios(streams)
    return out


def layer_plan(config, pool):
    """(kernels, codewords) of one sparse layer: [(kernel, rows, cols, codes_per_expert)], kernel ->
    [E]."""
    kernels = [
        ("wi", config.d_ff, config.d_model, max(len(e["wi"][0]) for e in pool)),
        ("wo", config.d_model, config.d_ff, max(len(e["wo"][0]) for e in pool)),
    ]
    return kernels, {
        k: [len(pool[e % len(pool)][k][0]) for e in range(config.num_experts)] for k, *_ in kernels
    }


def write_checkpoint(directory: str, config, dictionary, pool) -> None:
    from tqdm import tqdm

    from qmoe_jax.checkpoints.mapped_layout import LayerIndex, MappedCheckpointWriter
    from qmoe_jax.checkpoints.output_dir import locked

    os.makedirs(directory, exist_ok=True)
    sparse = [
        f"{stack}.layers_{i}.mlp"
        for stack, count in (
            ("encoder", config.num_encoder_layers),
            ("decoder", config.num_decoder_layers),
        )
        for i in range(count)
    ]
    with locked(directory):
        writer = MappedCheckpointWriter(
            directory,
            {
                "model": dataclasses.asdict(config),
                "source": f"synthetic: a pool of {len(pool)} experts of random "
                f"ternary codes at P(0) = {P0}, reused",
                "grid": {"kind": "ternary", "bits": None},
                "settings": {"synthetic": True},
            },
        )
        writer.write_dense(random_dense(config, np.random.default_rng(1)))
        fingerprint = writer.write_dictionary(dictionary)
        with tqdm(
            total=len(sparse)
            * LayerIndex.plan("", config.num_experts, *layer_plan(config, pool)).bytes,
            desc="write",
            unit="B",
            unit_scale=True,
            file=sys.stdout,
            mininterval=10,
        ) as bar:
            for number, name in enumerate(sparse):
                shift = 7 * number % len(pool)
                rotated = pool[shift:] + pool[:shift]
                kernels, codewords = layer_plan(config, rotated)
                experts = (rotated[e % len(rotated)] for e in range(config.num_experts))
                writer.write_layer(
                    name, kernels, codewords, experts, {"dictionary": fingerprint}, bar.update
                )
        writer.finalize()


# ---------------------------------------------------------------- measuring, in a child process


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def memory_status() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        key: int(fields[key].split()[0]) * 1024 / GIB
        for key in ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    }


def drop_page_cache(residency) -> str:
    residency.release_all()
    for layer in residency.layers.values():
        os.posix_fadvise(layer.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return (
        "MADV_DONTNEED on this process's mappings, "
        "then posix_fadvise(POSIX_FADV_DONTNEED) on the expert files"
    )


def measure(directory: str, prompt_length: int, decode_length: int, expert_cache_gb: float) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from qmoe_jax.inference import open_model
    from qmoe_jax.inference.strategies import DecodingConfig, generate
    from qmoe_jax.models import SwitchTransformer

    started = time.perf_counter()
    model = open_model(directory, experts="mapped", expert_cache_gb=expert_cache_gb)
    residency = model.residency
    result = {"open_seconds": time.perf_counter() - started, "after_open": memory_status()}
    rng = np.random.default_rng(0)
    prompt_a, prompt_b = (
        np.append(rng.integers(3, 32000, prompt_length - 1), 1)[None].astype(np.int32)
        for _ in range(2)
    )
    config = DecodingConfig(method="greedy", max_decode_length=decode_length, eos_id=-1)

    def run(name: str, module, prompt, drop: bool = False) -> np.ndarray:
        how = drop_page_cache(residency) if drop else None
        residency.touched = set()
        io, seconds = read_bytes(), residency.stats["seconds"]
        verified = residency.stats["verified_bytes"]
        began = time.perf_counter()
        tokens = np.asarray(
            jax.block_until_ready(generate(module, model.params, prompt, config).tokens)
        )
        wall = time.perf_counter() - began
        routed = sum(residency.expert_bytes(layer, expert) for layer, expert in residency.touched)
        result[name] = {
            "seconds": wall,
            "tokens_per_second": decode_length / wall,
            "read_bytes": read_bytes() - io,
            "routed_experts": len(residency.touched),
            "routed_expert_bytes": routed,
            "read_over_routed": (read_bytes() - io) / routed if routed else None,
            "host_seconds": residency.stats["seconds"] - seconds,
            "verified_bytes": residency.stats["verified_bytes"] - verified,
            "memory": memory_status(),
        }
        if how:
            result["cache_drop"] = how
        print(
            f"  {name}: {wall:.2f} s, read {result[name]['read_bytes'] / 2**20:.0f} MiB for "
            f"{routed / 2**20:.0f} MiB of routed experts",
            file=sys.stderr,
            flush=True,
        )
        return tokens

    run("compile", model.module, prompt_a)
    cold = run("cold_first_use", model.module, prompt_b, drop=True)
    again = run("cold_verified", model.module, prompt_b, drop=True)
    warm = run("warm", model.module, prompt_b)
    result["same_tokens"] = bool((cold == again).all() and (cold == warm).all())

    class IdleExperts(nn.Module):
        config: object

        @nn.compact
        def __call__(self, expert_inputs, counts=None, *, enable_dropout: bool = False):
            return jnp.zeros_like(expert_inputs)

    idle = SwitchTransformer(model.config, experts_cls=IdleExperts)
    run("no_expert_work_compile", idle, prompt_a)
    run("no_expert_work", idle, prompt_b)
    result["peak"] = memory_status()
    result["residency"] = dict(residency.stats)
    return result


# ---------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--work_dir",
        default="/tmp/qmoe_larger_than_ram",
        help="where the synthetic checkpoint is built (removed at the end unless --keep)",
    )
    parser.add_argument("--pool", type=int, default=16, help="distinct experts encoded and reused")
    parser.add_argument(
        "--blocks", type=int, help="encoder + decoder blocks (default: enough to exceed RAM)"
    )
    parser.add_argument(
        "--max_disk_gb", type=float, default=31.0, help="refuse to build more than this"
    )
    parser.add_argument("--prompt_length", type=int, default=16)
    parser.add_argument("--decode_length", type=int, default=32)
    parser.add_argument("--expert_cache_gb", type=float, default=4.0)
    parser.add_argument(
        "--num_experts",
        type=int,
        default=2048,
        help="experts per sparse layer (fewer: a quick check of the script, not the measurement)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the checkpoint (and reuse a kept one)"
    )
    parser.add_argument("--output", default=result_path("larger_than_ram"), help="the JSON result")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(
                measure(args.child, args.prompt_length, args.decode_length, args.expert_cache_gb)
            )
        )
        return

    from qmoe_jax.checkpoints.mapped_layout import LayerIndex, is_mapped_checkpoint

    ram = mem_total()
    print(f"encoding a pool of {args.pool} c-2048-shaped experts ...", flush=True)
    began = time.perf_counter()
    dictionary, pool = encode_pool(args.pool, 2080, 6144)
    encode_seconds = time.perf_counter() - began
    gains = general_compressor_gain(pool, os.path.join(REPO, "runs", "compressed", "switch-mini-8"))
    probe = c2048_shaped(2, args.num_experts)
    kernels, codewords = layer_plan(probe, pool)
    layer_bytes = LayerIndex.plan("", probe.num_experts, kernels, codewords).bytes
    blocks = args.blocks or math.ceil(
        1.08 * ram / layer_bytes
    )  # 8% over RAM, dense parameters not counted
    config = c2048_shaped(blocks, args.num_experts)
    needed = blocks * layer_bytes
    print(
        f"RAM {ram / GIB:.1f} GiB; {blocks} sparse layers of {layer_bytes / GIB:.2f} GiB = "
        f"{needed / GIB:.1f} GiB "
        "of experts",
        flush=True,
    )
    directory = os.path.abspath(args.work_dir)
    reuse = args.keep and is_mapped_checkpoint(directory)
    if not reuse:
        if needed > args.max_disk_gb * 1e9:
            sys.exit(
                f"error: {needed / 1e9:.1f} GB is more than --max_disk_gb {args.max_disk_gb:g}"
            )
        if os.path.exists(directory):
            sys.exit(f"error: {directory} exists; remove it or choose another --work_dir")
        free = shutil.disk_usage(os.path.dirname(directory)).free
        if free < needed + 5e9:
            sys.exit(
                f"error: {free / 1e9:.1f} GB free on the disk of {directory}, "
                f"{needed / 1e9 + 5:.1f} GB needed"
            )
        began = time.perf_counter()
        try:
            write_checkpoint(directory, config, dictionary, pool)
        except BaseException as error:
            shutil.rmtree(directory, ignore_errors=True)
            if isinstance(error, OSError):
                sys.exit(f"error: building the checkpoint failed ({error}); removed {directory}")
            raise
        write_seconds = time.perf_counter() - began
    else:
        write_seconds = None
    on_disk = sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(directory)
        for name in names
    )
    try:
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            directory,
            "--prompt_length",
            str(args.prompt_length),
            "--decode_length",
            str(args.decode_length),
            "--expert_cache_gb",
            str(args.expert_cache_gb),
        ]
        child = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
        if child.returncode:
            sys.exit(f"error: the measuring process failed with exit code {child.returncode}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
            print(f"removed {directory}")

    rows = ["compile", "cold_first_use", "cold_verified", "warm", "no_expert_work"]
    print(
        f"\nCPU: {cpu_model()}, {os.cpu_count()} cores, RAM {ram / GIB:.1f} GiB; checkpoint "
        f"{on_disk / GIB:.1f} GiB on "
        f"disk ({on_disk / ram:.2f}x RAM), {config.name}, pool of {args.pool} distinct experts"
    )
    print(
        f"batch 1, prompt {args.prompt_length} tokens, {args.decode_length} greedy tokens; cache "
        "drop: "
        f"{result.get('cache_drop')}"
    )
    print(
        f"{'run':<18}{'s':>8}{'tok/s':>8}{'read MiB':>10}{'experts':>9}{'their MiB':>11}"
        f"{'read/routed':>13}"
        f"{'host s':>8}{'VmHWM GiB':>11}"
    )
    for name in rows:
        r = result[name]
        ratio = f"{r['read_over_routed']:.2f}" if r["read_over_routed"] is not None else "-"
        print(
            f"{name:<18}{r['seconds']:>8.2f}{r['tokens_per_second']:>8.2f}"
            f"{r['read_bytes'] / 2**20:>10.0f}{r['routed_experts']:>9}"
            f"{r['routed_expert_bytes'] / 2**20:>11.0f}{ratio:>13}{r['host_seconds']:>8.2f}"
            f"{r['memory']['VmHWM']:>11.2f}"
        )
    warm, idle = result["warm"], result["no_expert_work"]
    split = {
        "rest of the step (attention, dense layers, routing, dispatch, loop)": idle["seconds"],
        "expert layers, pages cached (kernels decoding the codes, host copy and checks)": warm[
            "seconds"
        ]
        - idle["seconds"],
        "  of which host (callbacks: checks, read-ahead, copying gathered experts)": warm[
            "host_seconds"
        ],
        "disk, verified experts (cold verified - warm)": result["cold_verified"]["seconds"]
        - warm["seconds"],
        "first use: pread + SHA-256 (cold first use - cold verified)": result["cold_first_use"][
            "seconds"
        ]
        - result["cold_verified"]["seconds"],
    }
    result["time_split_seconds"] = split
    print(
        "where the time of one run goes (seconds; differences of the rows above, so noisy on a "
        "shared machine):"
    )
    for what, seconds in split.items():
        print(f"  {what}: {seconds:.2f}")
    peak = result["peak"]
    print(
        f"peak RSS {peak['VmHWM']:.2f} GiB (at the end: anonymous {peak['RssAnon']:.2f}, "
        "file-backed "
        f"{peak['RssFile']:.2f}); same tokens cold and warm: {result['same_tokens']}"
    )
    print("general compressors on the code streams (compressed size / raw size):")
    for what, gain in gains.items():
        print(
            f"  {what}: zlib -9 {gain['zlib_9']:.3f}, xz -6 {gain['xz_6']:.3f} "
            f"({gain['bytes'] / 2**20:.1f} MiB)"
        )
    write_result(
        "larger_than_ram",
        {
            "ram_bytes": ram,
            "config": config.name,
            "blocks": blocks,
            "pool": args.pool,
            "on_disk_bytes": on_disk,
            "encode_pool_seconds": encode_seconds,
            "write_seconds": write_seconds,
            "general_compressors": gains,
            "result": result,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
