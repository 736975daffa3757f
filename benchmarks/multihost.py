"""What each process of a multi-process compression reads, holds and spends, for N = 1, 2, 4.

Writes a synthetic switch-base-shaped checkpoint (d_model 768, d_ff 3072, random bf16 weights,
one expert per zarr chunk; by default 32 experts per sparse layer, 2 encoder and 2 decoder layers
of which one each is sparse), then compresses it with N local processes that form one JAX run on
127.0.0.1 (``jax.distributed``, gloo collectives, ``--devices`` host devices each), for each N of
``--processes``. Every process reports:

- the bytes of source arrays it read: expert slices, and the dense (non-expert) arrays, counted as
  the arrays' stored bytes (bfloat16) returned by the checkpoint reader;
- the most expert bytes it read for one group (what it holds of a layer's experts at once);
- every byte its read system calls returned (``rchar`` of /proc/self/io, all files: the source's
  compressed chunks, the calibration text, Python's own);
- its peak resident memory (VmHWM) and its seconds per phase (the run's report).

The expert bytes fall as 1/N; the dense bytes do not, since every process runs the whole dense
calibration forward (docs/multihost.md). On a machine with fewer cores than processes the wall time
shows no speed-up. Results go to benchmarks/results/multihost.json (``--quick``:
multihost_quick.json), with the machine facts of benchmarks/common.py.

    python benchmarks/multihost.py                  # 32 experts, N = 1, 2, 4
    python benchmarks/multihost.py --quick          # 8 experts, 8 samples: a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time

from common import REPO, work_dir, write_result

MARKER = ".qmoe_multihost_benchmark"


def synthetic_config(experts: int, layers: int):
    from qmoe_jax.models import get_config

    return dataclasses.replace(
        get_config("switch-base-8"),
        name=f"switch-base-synthetic-{experts}",
        num_experts=experts,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        num_encoder_sparse_layers=layers // 2,
        num_decoder_sparse_layers=layers // 2,
        checkpoint_path=None,
        checkpoint_step=None,
    )


def write_checkpoint(folder: str, experts: int, layers: int) -> None:
    """The synthetic checkpoint and its config JSON under ``folder`` (run in a child, so that the
    parent's memory stays small and the workers' peak RSS is their own)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from streaming import synthetic_params

    from qmoe_jax.checkpoints import write_t5x_checkpoint

    config = synthetic_config(experts, layers)
    write_t5x_checkpoint(os.path.join(folder, "t5x"), synthetic_params(config, 0), step=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(config), f)


class CountingReads:
    """A T5X checkpoint whose reads are counted: stored bytes of expert slices (and per group of
    them) and of whole arrays."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.expert_bytes = 0
        self.dense_bytes = 0
        self.groups: dict[tuple[str, int, int], int] = {}

    def __getattr__(self, name):
        return getattr(self.checkpoint, name)

    def read(self, path, index=None):
        array = self.checkpoint.read(path, index)
        self.dense_bytes += array.nbytes
        return array

    def read_params(self, paths=None):
        import jax

        tree = self.checkpoint.read_params(paths)
        self.dense_bytes += sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
        return tree

    def read_expert(self, path, experts):
        array = self.checkpoint.read_expert(path, experts)
        self.expert_bytes += array.nbytes
        if isinstance(experts, slice):
            layer = path.rsplit("/mlp/", 1)[0]
            key = (layer, experts.start, experts.stop)
            self.groups[key] = self.groups.get(key, 0) + array.nbytes
        return array


def _read_chars() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def worker(argv: list[str]) -> None:
    """One process of the run: compresses and writes its own figures to ``--result_file``."""
    from qmoe_jax.distributed import runtime

    argv = runtime.join_from_argv(argv)
    parser = argparse.ArgumentParser()
    for name in ("checkpoint", "config", "output_dir", "result_file"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--num_samples", type=int, required=True)
    args = parser.parse_args(argv)

    from qmoe_jax.compression import job
    from qmoe_jax.compression.options import CompressionOptions

    opened, open_checkpoint = {}, job.open_t5x_checkpoint

    def counting_open(path):
        opened["reads"] = CountingReads(open_checkpoint(path))
        return opened["reads"]

    job.open_t5x_checkpoint = counting_open  # the job opens its source through this name
    options = CompressionOptions(
        checkpoint=args.checkpoint,
        config=args.config,
        num_samples=args.num_samples,
        output_dir=args.output_dir,
        eval_examples=0,
    )
    chars = _read_chars()
    started = time.perf_counter()
    report = job.compress_checkpoint(options, log=lambda line: print(line, flush=True))
    reads = opened["reads"]
    figures = {
        "process": runtime.process_index(),
        "processes": runtime.process_count(),
        "expert_bytes_read": reads.expert_bytes,
        "dense_bytes_read": reads.dense_bytes,
        "largest_group_part_bytes": max(reads.groups.values(), default=0),
        "read_chars": _read_chars() - chars,
        "peak_rss_bytes": _peak_rss_bytes(),
        "wall_seconds": time.perf_counter() - started,
        "seconds": report["seconds"],
    }
    with open(args.result_file, "w") as f:
        json.dump(figures, f, indent=1)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_processes(count: int, devices: int, folder: str, num_samples: int, timeout: float):
    """Starts ``count`` workers as one run and waits for them (killing all on timeout)."""
    output_dir = os.path.join(folder, f"compressed_{count}")
    port = _free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    )
    children, logs = [], []
    for index in range(count):
        command = [sys.executable, os.path.abspath(__file__), "--worker"]
        command += ["--checkpoint", os.path.join(folder, "t5x", "checkpoint_1")]
        command += ["--config", os.path.join(folder, "config.json")]
        command += ["--output_dir", output_dir, "--num_samples", str(num_samples)]
        command += ["--result_file", os.path.join(folder, f"result_{count}_{index}.json")]
        if count > 1:
            command += [
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={count}",
                f"--process_id={index}",
            ]
        log = open(os.path.join(folder, f"log_{count}_{index}.txt"), "w")  # noqa: SIM115
        logs.append(log)
        children.append(
            subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder)
        )
    deadline = time.monotonic() + timeout
    try:
        for child in children:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for child in children:
            child.kill()
        raise SystemExit(f"{count} processes still running after {timeout} s") from None
    finally:
        for log in logs:
            log.close()
    if any(child.returncode for child in children):
        with open(os.path.join(folder, f"log_{count}_0.txt")) as f:
            raise SystemExit(f"the run of {count} processes failed:\n{f.read()[-4000:]}")
    results = []
    for index in range(count):
        with open(os.path.join(folder, f"result_{count}_{index}.json")) as f:
            results.append(json.load(f))
    with open(os.path.join(output_dir, "manifest.json")) as f:
        manifest = json.load(f)
    checksums = {name: record["checksums"] for name, record in manifest["layers"].items()}
    return results, checksums


def main() -> None:
    if "--worker" in sys.argv:
        worker([arg for arg in sys.argv[1:] if arg != "--worker"])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument(
        "--layers", type=int, default=2, help="encoder and decoder layers (every other one sparse)"
    )
    parser.add_argument("--num_samples", type=int, default=32)
    parser.add_argument("--processes", default="1,2,4", help="comma-separated N")
    parser.add_argument("--devices", type=int, default=1, help="host devices per process")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    parser.add_argument("--work_dir", default=work_dir("multihost"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.experts, args.num_samples = 8, 8
    folder = os.path.abspath(args.work_dir)
    foreign = os.path.isdir(folder) and os.listdir(folder)
    if foreign and not os.path.exists(os.path.join(folder, MARKER)):
        raise SystemExit(f"--work_dir {folder} holds files this benchmark did not make")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    open(os.path.join(folder, MARKER), "w").close()

    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import multihost; "
            "multihost.write_checkpoint(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))",
            os.path.dirname(os.path.abspath(__file__)),
            folder,
            str(args.experts),
            str(args.layers),
        ],
        check=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])),
    )
    print(f"synthetic checkpoint written in {time.perf_counter() - started:.0f} s", flush=True)

    runs, reference = {}, None
    for count in [int(n) for n in args.processes.split(",")]:
        results, checksums = run_processes(
            count, args.devices, folder, args.num_samples, args.timeout
        )
        reference = reference or checksums
        runs[count] = {"processes": results, "same_checksums_as_first": checksums == reference}
        for r in results:
            mib = {
                key: r[key] / 2**20 for key in r if key.endswith("bytes") or key.endswith("_read")
            }
            print(
                f"N={count} process {r['process']}: experts {mib['expert_bytes_read']:8.1f} MiB "
                f"(largest group part {mib['largest_group_part_bytes']:6.1f} MiB), dense read "
                f"{mib['dense_bytes_read']:7.1f} MiB, read() {r['read_chars'] / 2**20:8.1f} MiB, "
                f"peak RSS {mib['peak_rss_bytes']:7.1f} MiB, {r['wall_seconds']:6.1f} s",
                flush=True,
            )
    result = {
        "config": dataclasses.asdict(synthetic_config(args.experts, args.layers)),
        "num_samples": args.num_samples,
        "devices_per_process": args.devices,
        "runs": runs,
        "max_rss_of_benchmark_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    write_result("multihost_quick" if args.quick else "multihost", result)
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
