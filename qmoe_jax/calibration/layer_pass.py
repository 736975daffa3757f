"""The layer-by-layer calibration pass that compresses a checkpoint (QMoE §3).

Lingo: every calibration token's hidden state lives in a ``TokenBuffer``;
layer by layer (encoder, then decoder), dense sublayers run per batch of
samples and update the buffer; at a sparse layer the tokens are routed, each
expert group is compressed from its gathered tokens, and the tokens' outputs
through the *quantized* experts are added back. Finished layers are written
atomically; on a re-run they are replayed from disk instead of recompressed
(one whose files fail their checksums is compressed again).
Weights come from the checkpoint one layer (dense) or one expert group
(sparse) at a time.

When several processes share the run (``expert_share``), each runs the whole
dense forward and its share of each sparse layer's experts, and writes through
the lead (``compression.shared_writer``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qmoe_jax.calibration.buffer import TokenBuffer
from qmoe_jax.calibration.expert_groups import ExpertCompressionConfig
from qmoe_jax.calibration.expert_share import ExpertShare
from qmoe_jax.calibration.sparse_layer import LayerTokens, compress_layer, replay_layer
from qmoe_jax.calibration.sublayers import (
    decoder_attend,
    dense_mlp,
    encoder_attend,
    final_norm,
    route,
)
from qmoe_jax.checkpoints import T5XCheckpoint
from qmoe_jax.checkpoints.format_v1 import CompressedCheckpoint, CompressedCheckpointError
from qmoe_jax.codec import DEFAULT_P0, Dictionary, adaptive_dictionary, build_dictionary
from qmoe_jax.models import SwitchConfig
from qmoe_jax.models.mlp import kernel_names


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """The calibration pass.

    Attributes:
      experts: how experts are quantized.
      dictionary: "static" (QMoE's p0 = 0.885) or "adaptive" (one dictionary
        per layer, built for the zero fraction of that layer's first expert group).
      batch_size: samples per dense-sublayer batch (also the routing batch).
    """

    experts: ExpertCompressionConfig = ExpertCompressionConfig()
    dictionary: str = "static"
    batch_size: int = 32

    def __post_init__(self):
        if self.dictionary not in ("static", "adaptive"):
            raise ValueError(f"dictionary must be 'static' or 'adaptive', got {self.dictionary!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")


@dataclasses.dataclass
class CalibrationData:
    """Padded calibration batches: int32 arrays [S, L] as ``batch_examples`` makes them,
    plus the premasks ``encoder_premask`` / ``decoder_premask`` bool[S, L]."""

    encoder_input_tokens: np.ndarray
    decoder_input_tokens: np.ndarray
    decoder_target_tokens: np.ndarray
    encoder_premask: np.ndarray
    decoder_premask: np.ndarray

    @property
    def num_samples(self) -> int:
        return self.encoder_input_tokens.shape[0]


def _to_compute(tree, dtype):
    import jax

    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), tree)


def _subtree(tree: dict, path: str) -> dict:
    for key in path.split("/"):
        tree = tree[key]
    return tree


class CalibrationPass:
    """Runs the pass over a T5X checkpoint into a compressed-checkpoint writer.

    ``writer`` is a ``compression.shared_writer.SharedWriter`` (its ``write_dense`` takes the
    function that reads the dense parameters, so that only the process that writes reads them);
    ``share`` is this process's share of every expert group (default: all of them).
    """

    def __init__(
        self,
        config: SwitchConfig,
        checkpoint: T5XCheckpoint,
        data: CalibrationData,
        settings: CalibrationConfig,
        writer,
        log: Callable[[str], None] = print,
        progress: bool = True,
        share: ExpertShare | None = None,
    ):
        self.config = config
        self.share = share or ExpertShare()
        self.checkpoint = checkpoint
        self.data = data
        self.settings = settings
        self.writer = writer
        self.log = log
        self.progress = progress
        self.dtype = config.jnp_dtype
        # stages outside the sparse layers' own (their read, hessian, gptq, encode, forward:
        # sparse_layer.py): dense = the calibration forward of attention and dense MLPs, read = the
        # non-expert weights, write = the dense parameters and each finished layer, replay =
        # finished layers re-run on resume
        self.seconds: dict[str, float] = {"dense": 0.0, "replay": 0.0, "read": 0.0, "write": 0.0}

    def _timed(self, stage: str, fn: Callable, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[stage] += time.perf_counter() - started

    # --- weights -------------------------------------------------------------------------
    def _dense_layer_params(self, stack: str, index: int) -> dict:
        prefix = f"{stack}/layers_{index}"
        keys = [
            k
            # A checkpoint reader is not iterable: keys() is its list of param paths.
            for k in self.checkpoint.keys()  # noqa: SIM118
            if k.startswith(prefix + "/") and "/mlp/expert/" not in k
        ]
        return _to_compute(_subtree(self.checkpoint.read_params(keys), prefix), self.dtype)

    def _expert_reader(self, stack: str, index: int):
        prefix = f"{stack}/layers_{index}/mlp/expert"

        def read(experts: range) -> dict[str, np.ndarray]:
            return {
                name: self.checkpoint.read_expert(
                    f"{prefix}/{name}/kernel", slice(experts.start, experts.stop)
                )
                for name in kernel_names(self.config)
            }

        return read

    # --- one layer -----------------------------------------------------------------------
    def _run_layer(
        self,
        stack: str,
        index: int,
        buffer: TokenBuffer,
        attend,
        premask_flat: np.ndarray,
        length: int,
    ) -> None:
        cfg = self.config
        sparse = cfg.is_sparse_layer(index, decoder=stack == "decoder")
        params = self._timed("read", self._dense_layer_params, stack, index)
        mlp_inputs = np.zeros_like(buffer.states) if sparse else None
        routing = {
            k: np.zeros(buffer.states.shape[0], t)
            for k, t in (("expert", np.int32), ("gate", np.float32), ("kept", bool))
        }
        started = time.perf_counter()
        for first, last in buffer.batches(self.settings.batch_size):
            rows, valid = buffer.padded_index(first, last, length)
            x = jnp.asarray(buffer.gather(rows, valid), self.dtype)
            residual, h = attend(params, x, first, last)
            if not sparse:
                out = residual + dense_mlp(cfg, params["mlp"], h)
                buffer.scatter(rows, valid, np.asarray(out, buffer.states.dtype))
                continue
            buffer.scatter(rows, valid, np.asarray(residual, buffer.states.dtype))
            mlp_inputs[rows[valid]] = np.asarray(h, np.float32)[valid]
            expert, gate, kept = route(cfg, params["mlp"]["router"], h)
            for key, value in (("expert", expert), ("gate", gate), ("kept", kept)):
                routing[key][rows[valid]] = np.asarray(value)[valid]
        self.seconds["dense"] += time.perf_counter() - started
        if not sparse:
            return
        tokens = LayerTokens(
            mlp_inputs, routing["expert"], routing["gate"], routing["kept"], premask_flat
        )
        name = f"{stack}.layers_{index}.mlp"
        started = time.perf_counter()
        stored = self._stored_layer(name) if name in self.writer.finished_layers() else None
        if stored is not None:
            outputs = replay_layer(cfg, self.settings.experts, tokens, *stored, share=self.share)
            self.seconds["replay"] += time.perf_counter() - started
            self.log(f"{name}: finished earlier, replayed from disk")
        else:
            groups = tqdm(
                total=cfg.num_experts,
                desc=f"  {name} experts",
                unit="expert",
                leave=False,
                disable=not self.progress,
            )
            result = compress_layer(
                cfg,
                self.settings.experts,
                tokens,
                self._expert_reader(stack, index),
                self._dictionary_for,
                on_group=groups.update,
                share=self.share,
            )
            groups.close()
            self._timed("write", self.writer.write_layer, name, result.arrays, result.stats)
            outputs = result.outputs
        buffer.states += outputs.astype(buffer.states.dtype)

    def _stored_layer(self, name: str) -> tuple[dict, Dictionary | None] | None:
        """(arrays, dictionary) of a finished layer, read back and verified; None when its arrays
        fail the checks (in any process of the run), and then the layer is unrecorded and
        compressed again like an unfinished one. A damaged dictionary is rebuilt from its p0 (the
        layer's codes stay valid)."""
        stored = CompressedCheckpoint(self.writer.directory)
        found = {}

        def read() -> tuple[str | None, str | None]:
            """(what is wrong with the layer's arrays, with its dictionary), None where nothing."""
            try:
                arrays, stats = stored.layer(name)
            except CompressedCheckpointError as damage:
                return damage.problem, None
            found["fingerprint"] = fingerprint = stats["dictionary"]
            found["layer"] = (arrays, None)
            if fingerprint is None:
                return None, None
            try:
                found["layer"] = (arrays, stored.dictionary(fingerprint))
            except CompressedCheckpointError as damage:
                return None, damage.problem
            return None, None

        outcomes = self.share.gather(read)
        problems = [problem for problem, _ in outcomes if problem is not None]
        if problems:
            self.log(f"{name}: {problems[0]}; compressing it again")
            self.writer.discard_layer(name)
            return None
        arrays, dictionary = found["layer"]
        damaged = [problem for _, problem in outcomes if problem is not None]
        if damaged:
            self.log(f"{name}: {damaged[0]}; rebuilding the dictionary from its p0")
            dictionary = self.writer.repair_dictionary(found["fingerprint"])
        return arrays, dictionary

    def _dictionary_for(self, p0: float) -> Dictionary:
        """The layer's dictionary, from its first group's zero fraction ``p0`` when adaptive."""
        if self.settings.dictionary == "static":
            dictionary = build_dictionary(DEFAULT_P0)
        else:
            dictionary = adaptive_dictionary(p0)
        self.writer.write_dictionary(dictionary)
        return dictionary

    # --- the whole pass ------------------------------------------------------------------
    def run(self) -> dict:
        cfg, data = self.config, self.data
        if not self.writer.has_dense():
            started, reading = time.perf_counter(), self.seconds["read"]
            self.writer.write_dense(lambda: self._timed("read", self.checkpoint.read_params))
            self.seconds["write"] += (
                time.perf_counter() - started - (self.seconds["read"] - reading)
            )
        embedding = np.asarray(
            self._timed("read", self.checkpoint.read, "token_embedder/embedding"), np.float32
        )
        encoder_lengths = (data.encoder_input_tokens > 0).sum(axis=1)
        decoder_lengths = (data.decoder_target_tokens > 0).sum(axis=1)
        enc_len, dec_len = data.encoder_input_tokens.shape[1], data.decoder_target_tokens.shape[1]
        relpos = {
            s: _to_compute(
                _subtree(
                    self._timed("read", self.checkpoint.read_params, [f"{s}/relpos_bias"]),
                    f"{s}/relpos_bias",
                ),
                self.dtype,
            )
            for s in ("encoder", "decoder")
        }

        encoder = TokenBuffer(encoder_lengths, cfg.d_model)
        encoder_valid = data.encoder_input_tokens > 0
        encoder.states[:] = embedding[data.encoder_input_tokens[encoder_valid]]
        layers = [("encoder", i) for i in range(cfg.num_encoder_layers)] + [
            ("decoder", i) for i in range(cfg.num_decoder_layers)
        ]
        bar = tqdm(layers, desc="layers", unit="layer", disable=not self.progress)

        def encoder_attend_batch(params, x, first, last):
            tokens = jnp.asarray(data.encoder_input_tokens[first:last])
            return encoder_attend(cfg, params, relpos["encoder"], x, tokens)

        premask = data.encoder_premask[encoder_valid]
        for stack, index in layers[: cfg.num_encoder_layers]:
            bar.set_postfix_str(f"{stack}.layers_{index}")
            self._run_layer(stack, index, encoder, encoder_attend_batch, premask, enc_len)
            bar.update()

        norm = _to_compute(
            self._timed("read", self.checkpoint.read_params, ["encoder/encoder_norm"])["encoder"][
                "encoder_norm"
            ],
            self.dtype,
        )
        encoded = TokenBuffer(encoder_lengths, cfg.d_model)
        for first, last in encoder.batches(self.settings.batch_size):
            rows, valid = encoder.padded_index(first, last, enc_len)
            x = final_norm(
                cfg,
                norm,
                jnp.asarray(encoder.gather(rows, valid), self.dtype),
                jnp.asarray(valid[..., None], self.dtype),
            )
            encoded.scatter(rows, valid, np.asarray(x, np.float32))
        del encoder

        decoder = TokenBuffer(decoder_lengths, cfg.d_model)
        decoder_valid = data.decoder_target_tokens > 0
        decoder.states[:] = embedding[data.decoder_input_tokens[decoder_valid]]
        del embedding

        def decoder_attend_batch(params, x, first, last):
            rows, valid = encoded.padded_index(first, last, enc_len)
            memory = jnp.asarray(encoded.gather(rows, valid), self.dtype)
            return decoder_attend(
                cfg,
                params,
                relpos["decoder"],
                x,
                memory,
                jnp.asarray(data.encoder_input_tokens[first:last]),
                jnp.asarray(data.decoder_input_tokens[first:last]),
                jnp.asarray(data.decoder_target_tokens[first:last]),
            )

        premask = data.decoder_premask[decoder_valid]
        for stack, index in layers[cfg.num_encoder_layers :]:
            bar.set_postfix_str(f"{stack}.layers_{index}")
            self._run_layer(stack, index, decoder, decoder_attend_batch, premask, dec_len)
            bar.update()
        bar.close()
        return {"seconds": dict(self.seconds)}
