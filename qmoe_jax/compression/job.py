"""The main job as a function: checkpoint + calibration text → compressed checkpoint + report.

``python -m qmoe_jax.compress`` parses its flags into ``CompressionOptions`` and
calls ``compress_checkpoint``; everything here is importable and tested.

In a run of several processes (``qmoe_jax.distributed``) every process calls
``compress_checkpoint`` with the same options: each checks the source and
builds the calibration data, the lead claims the output directory and writes
it (``compression.shared_writer``), each compresses its share of every expert
group (``calibration.expert_share``), and the final evaluation's batches are
split over the processes. The output is bit-identical to one process's.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from qmoe_jax.calibration.data import calibration_data
from qmoe_jax.calibration.expert_share import ExpertShare
from qmoe_jax.calibration.layer_pass import CalibrationPass
from qmoe_jax.checkpoints import CheckpointError, T5XCheckpoint, open_t5x_checkpoint, source_files
from qmoe_jax.checkpoints.fingerprint import source_fingerprint
from qmoe_jax.checkpoints.format_v1 import COMPRESSED_OUTPUT, CompressedCheckpointWriter
from qmoe_jax.checkpoints.manifest_rebuild import rebuild_lost_manifest
from qmoe_jax.checkpoints.nonfinite import FiniteWeights
from qmoe_jax.checkpoints.read_digests import ChangedArrayError
from qmoe_jax.compression import source_check
from qmoe_jax.compression.options import (
    FLOAT_DTYPES,
    GRIDS,
    CompressionOptions,
    default_gptq_memory_mb,
)
from qmoe_jax.compression.report import build_report, summary_table, write_report
from qmoe_jax.compression.resume import check_resume
from qmoe_jax.compression.shared_writer import SharedWriter
from qmoe_jax.data import (
    Tokenizer,
    bundled,
    c4_documents,
    corpus,
    text_file_documents,
)
from qmoe_jax.data.sources import c4_shard_paths
from qmoe_jax.distributed import exchange, runtime
from qmoe_jax.distributed.claimed_dir import claimed
from qmoe_jax.inference import load_t5x_params, validation_set
from qmoe_jax.inference.compressed_params import load_compressed_model
from qmoe_jax.inference.evaluation import batch_sums, make_eval_step, mean_of_sums, padded_batches
from qmoe_jax.inference.loading import check_config, infer_config
from qmoe_jax.models import SwitchConfig, SwitchTransformer
from qmoe_jax.models.configs import resolve_config


def _text_paths(pattern: str) -> list[str]:
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no text files match {pattern!r}")
    return paths


def _documents(spec: str):
    if spec == "bundled":
        return corpus.documents("train")
    kind, _, location = spec.partition(":")
    if kind == "c4":
        return c4_documents(location, split="train")
    return text_file_documents(_text_paths(location))


def _check_source(checkpoint: T5XCheckpoint, config: SwitchConfig) -> None:
    """Every array's shape and dtype against ``config``, its zarr metadata and its stored chunks."""
    check_config(checkpoint, config)
    other = [
        f"{path} ({info.dtype.name})"
        for path, info in checkpoint.spec().items()
        if info.dtype.name not in FLOAT_DTYPES
    ]
    if other:
        raise CheckpointError(
            f"the checkpoint {checkpoint.url} holds parameters of a non-float dtype: "
            f"{', '.join(other[:5])}; T5X parameters are float32 or bfloat16"
        )
    checkpoint.check_stored()


def _check_text(options: CompressionOptions, tokenizer: Tokenizer, config: SwitchConfig) -> None:
    """The tokenizer fits the model, and the calibration and validation text is there."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.model_path} has {tokenizer.vocab_size} ids (sentinels "
            "included) "
            f"but the model only {config.vocab_size}; pass the model's own tokenizer with "
            "--tokenizer"
        )
    texts = [(options.calibration, "train")]
    if options.evaluation_examples():
        texts.append((options.evaluation_data(), "validation"))
    for spec, split in texts:
        kind, _, location = spec.partition(":")
        if kind == "c4":
            c4_shard_paths(location, split)
        elif kind == "text":
            _text_paths(location)
        else:
            corpus.texts_dir()


def _parameter_counts(checkpoint: T5XCheckpoint) -> tuple[int, int]:
    spec = checkpoint.spec()
    total = sum(int(np.prod(info.shape)) for info in spec.values())
    experts = sum(int(np.prod(info.shape)) for info in spec.values() if info.is_expert_stack)
    return total, experts


def sparse_layer_names(config: SwitchConfig) -> list[str]:
    """The sparse layers in the order the calibration pass compresses them, e.g.
    ``encoder.layers_1.mlp``."""
    return [
        f"{stack}.layers_{index}.mlp"
        for stack in ("encoder", "decoder")
        for index in config.sparse_layers(decoder=stack == "decoder")
    ]


def _resume_advice(writer: SharedWriter, config: SwitchConfig) -> str:
    """What to do after an interrupt or an OS error once the output exists: where a re-run
    resumes."""
    layers = sparse_layer_names(config)
    remaining = [name for name in layers if name not in writer.finished_layers()]
    if not remaining:
        return f"re-run the same command to finish (all {len(layers)} sparse layers are done)"
    return (
        f"re-run the same command to resume from layer {remaining[0]} "
        f"({len(layers) - len(remaining)} of "
        f"{len(layers)} sparse layers done)"
    )


def _check_same_source(fingerprints: list[str], path: str) -> None:
    """Raises ``ValueError`` unless every process of the run sees a source with the same content
    fingerprint (``fingerprints``, in process order)."""
    differing = [index for index, found in enumerate(fingerprints) if found != fingerprints[0]]
    if differing:
        raise ValueError(
            f"the source checkpoint {path} differs between the processes of this run: process "
            f"{differing[0]} sees another checkpoint (content fingerprint) than process 0; give "
            "every process the same checkpoint (one shared path, or identical copies)"
        )


def _resuming(writer: SharedWriter, config: SwitchConfig, path: str) -> str:
    started_from = writer.started_from
    moved = (
        f"; the same checkpoint was at {started_from} when the run started"
        if started_from != path
        else ""
    )
    return (
        f"resuming: {len(writer.finished_layers())} of {len(sparse_layer_names(config))} sparse "
        "layer(s) "
        f"already finished{moved}"
    )


def compress_checkpoint(
    options: CompressionOptions,
    log: Callable[[str], None] = print,
    progress: bool = True,
    config: SwitchConfig | None = None,
) -> dict:
    """Compresses (or resumes compressing) a checkpoint; returns the report (also written to disk).

    Before any work it checks the whole source checkpoint's metadata against
    the config, the tokenizer and the text, that the output directory is ours
    to write (``checkpoints.output_dir``), and on resume that the stored run is
    this one (``resume.check_resume``) and its finished parts are intact
    (damaged ones are redone). An interrupt or OS error on the way carries a
    note on how to go on (``cli.run_cli`` prints it).

    ``config`` overrides ``options.config`` with a config object (e.g. one not in the registry).

    With several processes, only the lead logs and shows progress, and only the lead returns the
    report; the others return ``{"process": ..., "seconds": ...}``, their own time per stage.
    """
    started = time.perf_counter()
    log = runtime.lead_only(log)
    progress = progress and runtime.is_lead()
    writer = None
    try:
        path = options.checkpoint or bundled.checkpoint_path()

        def prepare():  # in every process: each reads the source and the text itself
            source = open_t5x_checkpoint(path)
            chosen = config
            if chosen is None:
                chosen = resolve_config(options.config) if options.config else infer_config(source)
            _check_source(source, chosen)
            tokenizer = Tokenizer(options.tokenizer or bundled.tokenizer_path())
            _check_text(options, tokenizer, chosen)
            return source, chosen, tokenizer, source_fingerprint(source)

        source, config, tokenizer, fingerprint = exchange.checked(prepare)
        _check_same_source(exchange.allgather_objects(fingerprint), path)
        output_dir = options.output_dir or os.path.join("runs", "compressed", config.name)
        gptq_memory_mb = exchange.decided(
            lambda: options.gptq_memory_mb or default_gptq_memory_mb()
        )
        header = {
            "model": dataclasses.asdict(config),
            "source": path,
            "source_fingerprint": fingerprint,
            "tokenizer_sha256": corpus.file_sha256(tokenizer.model_path),
            "grid": dataclasses.asdict(GRIDS[options.grid]),
            "settings": options.header_settings(
                tokenizer=os.path.basename(tokenizer.model_path), gptq_memory_mb=gptq_memory_mb
            ),
        }
        files = source_files.snapshot(source) if runtime.is_lead() else {}  # the lead checks
        processes = runtime.process_count()
        log(
            f"model {config.name} from {path}; {jax.device_count()} device(s)"
            + (f" in {processes} processes" if processes > 1 else "")
            + f"; output {output_dir}"
        )
        with claimed(output_dir, COMPRESSED_OUTPUT) as directory:
            rebuilt = exchange.decided(lambda: rebuild_lost_manifest(directory))
            if rebuilt:
                log(rebuilt)
            writer = SharedWriter(
                lambda: CompressedCheckpointWriter(
                    directory,
                    header,
                    log=log,
                    check_resume=lambda stored: check_resume(
                        stored, header, options.nonfinite, output_dir
                    ),
                ),
                directory,
            )
            files_differ = exchange.decided(  # the lead's files: it checks what it recorded
                lambda: source_check.check_files(writer.writer, source, files, options.verify, log)
            )
            for damage in writer.verify(full=options.verify == "full"):
                log(f"repairing {damage}")
            if writer.has_dense() or writer.finished_layers():
                log(_resuming(writer, config, path))
            report = _compress(
                options,
                config,
                source,
                tokenizer,
                writer,
                gptq_memory_mb,
                log,
                progress,
                (files, files_differ),
            )
            report["seconds"]["total"] = time.perf_counter() - started
            if not runtime.is_lead():
                return {"process": runtime.label(), "seconds": report["seconds"]}
            write_report(report, output_dir)
    except ChangedArrayError as error:
        raise source_check.changed_array(error, writer.directory if writer else "") from None
    except (KeyboardInterrupt, OSError, exchange.PeerError) as error:
        if writer is not None:
            error.add_note(_resume_advice(writer, config))
        elif isinstance(error, KeyboardInterrupt):
            error.add_note("nothing was written yet; re-run the same command to start")
        raise
    log(summary_table(report))
    log(next_steps(report, output_dir))
    return report


def _compress(
    options: CompressionOptions,
    config: SwitchConfig,
    source: T5XCheckpoint,
    tokenizer: Tokenizer,
    writer: SharedWriter,
    gptq_memory_mb: int,
    log: Callable[[str], None],
    progress: bool,
    files: tuple[dict, bool],
) -> dict:
    """The work of ``compress_checkpoint`` once everything is checked: calibrate, compress,
    report (the lead's; the other processes' holds their ``seconds`` only). ``files``: the
    snapshot of the source's files, and whether it differs from the recorded one
    (``source_check.check_files``)."""
    reads = source_check.digested(source, writer)
    weights = FiniteWeights(reads, options.nonfinite, on_zeroed=writer.record_zeroed)
    if options.verify == "full":

        def check_all() -> None:  # the lead reads the whole source once
            recorded = set(writer.recorded_reads())
            weights.check_all()
            source_check.confirm_content(writer.writer, reads, recorded, *files, log)

        exchange.decided(check_all)

    data_started = time.perf_counter()
    data = exchange.checked(
        lambda: calibration_data(
            _documents(options.calibration),
            tokenizer,
            options.span_corruption(),
            options.num_samples,
            spread=options.calibration == "bundled",
            premask=options.premask,
        )
    )
    log(
        f"{data.num_samples} calibration samples, {int((data.encoder_input_tokens > 0).sum())} "
        "encoder and "
        f"{int((data.decoder_target_tokens > 0).sum())} decoder tokens"
    )
    data_seconds = time.perf_counter() - data_started

    result = CalibrationPass(
        config,
        weights,
        data,
        options.calibration_config(gptq_memory_mb),
        writer,
        log=log,
        progress=progress,
        share=ExpertShare.of_run(),
    ).run()
    exchange.decided(lambda: source_check.check_unchanged_while_read(writer.writer, source))
    total, experts = _parameter_counts(source)
    seconds = {"data": data_seconds} | result["seconds"]
    report, summary = {"seconds": dict(seconds)}, None
    if runtime.is_lead():
        report = build_report(writer.manifest, total, experts, seconds)
        summary = {"moe": report["moe"], "model": report["model"]}
    finalize_started = time.perf_counter()
    writer.finalize(summary)
    report["seconds"]["write"] += time.perf_counter() - finalize_started
    if options.evaluation_examples():
        evaluation_started = time.perf_counter()
        report["evaluation"] = _evaluate(
            options, weights, config, tokenizer, writer.directory, progress
        )
        report["seconds"]["evaluation"] = time.perf_counter() - evaluation_started
    return report


def _evaluate(
    options: CompressionOptions,
    source: FiniteWeights,
    config: SwitchConfig,
    tokenizer: Tokenizer,
    output_dir: str,
    progress: bool,
) -> dict:
    """Validation loss of the original and the compressed model (dequantized experts) on the same
    examples, as ``python -m qmoe_jax.evaluate`` computes it; the original's non-finite weights are
    handled as in the run. With several processes, each scores every N-th batch (with both
    models, read whole) and the sums are added in batch order: the one-process figures."""
    validation = validation_set(
        options.evaluation_data(), tokenizer, options.evaluation_examples(), options.inputs_length
    )
    params = {
        "original": load_t5x_params(source, config),
        "compressed": load_compressed_model(output_dir).params,
    }
    if not validation.examples:
        raise ValueError("no validation examples to evaluate")
    batches = padded_batches(
        validation.examples,
        options.batch_size,
        validation.encoder_length,
        validation.decoder_length,
    )
    step = make_eval_step(SwitchTransformer(config))
    index, count = runtime.process_index(), runtime.process_count()
    losses = {}
    for name, tree in params.items():
        mine = batches[index::count]
        shown = tqdm(mine, desc=f"evaluate {name}", unit="batch") if progress else mine
        parts = exchange.gathered(lambda tree=tree, shown=shown: batch_sums(step, tree, shown))
        losses[name] = mean_of_sums(
            [parts[batch % count][batch // count] for batch in range(len(batches))]
        )
    for name, loss in losses.items():
        if not math.isfinite(loss):
            raise ValueError(
                f"the {name} model's validation loss is {loss}, so the evaluation is not reported; "
                f"the compressed checkpoint {output_dir} is complete (re-run with --eval_examples "
                "0 "
                "to write its report without the evaluation)"
            )
    return {
        "data": validation.source,
        "examples": len(validation.examples),
        "original_loss": losses["original"],
        "compressed_loss": losses["compressed"],
    }


def next_steps(report: dict, output_dir: str) -> str:
    """What the user got, and the commands that use it."""
    lines = []
    evaluation = report.get("evaluation")
    if evaluation:
        increase = evaluation["compressed_loss"] - evaluation["original_loss"]
        lines.append(
            f"validation loss (nats/token, {evaluation['examples']} held-out examples of "
            f"{evaluation['data']}): original {evaluation['original_loss']:.4f}, "
            f"compressed {evaluation['compressed_loss']:.4f} ({increase:+.4f})"
        )
    lines += [
        "compressed checkpoint: " + output_dir,
        "use it:",
        f"  python -m qmoe_jax.evaluate --checkpoint {output_dir}",
        f'  python -m qmoe_jax.generate --checkpoint {output_dir} --prompt "... <extra_id_0> ..."',
    ]
    return "\n".join(lines)
