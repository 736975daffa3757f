"""T5X's MoE encoder-decoder model, passing the compressed experts' codes to every forward pass.

T5X keeps variable collections other than ``params`` in
``TrainState.flax_mutables`` and hands them to a model's ``loss_fn``,
``eval_fn``, ``score_batch`` and ``predict_batch[_with_aux]`` only when these
take a ``flax_mutables`` argument; its stock models do not ("Default t5x
models don't support flax_mutables", t5x/trainer.py). ``CompressedMoeModel``
is ``t5x.contrib.moe.models.MoeEncoderDecoderModel`` with that argument: each
of those methods runs the stock code with every ``module.apply`` given the
``qmoe_experts`` collection besides ``params``. The codes are read, never
differentiated or updated: ``loss_fn`` returns the collection it was given.

``compressed_model(model)`` turns the gin-configured stock model into one, so
that flaxformer's and the user's bindings of ``models.MoeEncoderDecoderModel``
still apply (``configs/t5x/compressed_experts.gin``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from t5x.contrib.moe import models

from qmoe_jax.interop.t5x_layout import COLLECTION


class _ModuleWithVariables:
    """The model's flax module, with extra variable collections merged into every ``apply``."""

    def __init__(self, module, variables: Mapping[str, Any]):
        self._module = module
        self._variables = dict(variables)

    def apply(self, variables, *args, **kwargs):
        return self._module.apply({**self._variables, **variables}, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class CompressedMoeModel(models.MoeEncoderDecoderModel):
    """``MoeEncoderDecoderModel`` whose forward passes see the ``qmoe_experts`` collection."""

    @contextlib.contextmanager
    def _with(self, flax_mutables):
        collections = {k: v for k, v in (flax_mutables or {}).items() if k == COLLECTION}
        if not collections:
            yield
            return
        module = self.module
        self.module = _ModuleWithVariables(module, collections)
        try:
            yield
        finally:
            self.module = module

    def loss_fn(self, params, batch, dropout_rng, flax_mutables=None):
        with self._with(flax_mutables):
            loss, metrics = super().loss_fn(params, batch, dropout_rng)
        if flax_mutables is None:
            return loss, metrics
        return loss, (metrics, flax_mutables)

    def eval_fn(self, params, batch, flax_mutables=None):
        with self._with(flax_mutables):
            return super().loss_fn(params, batch, None)

    def score_batch(self, params, batch, return_intermediates=False, flax_mutables=None):
        with self._with(flax_mutables):
            return super().score_batch(params, batch, return_intermediates)

    def predict_batch(self, params, batch, rng=None, flax_mutables=None):
        return self.predict_batch_with_aux(params, batch, rng, flax_mutables=flax_mutables)[0]

    def predict_batch_with_aux(
        self,
        params,
        batch,
        rng=None,
        decoder_params=None,
        return_all_decodes=False,
        num_decodes=1,
        prompt_with_targets=False,
        flax_mutables=None,
    ):
        with self._with(flax_mutables):
            return super().predict_batch_with_aux(
                params,
                batch,
                rng,
                decoder_params,
                return_all_decodes,
                num_decodes,
                prompt_with_targets,
            )


def compressed_model(model: models.MoeEncoderDecoderModel) -> CompressedMoeModel:
    """The gin-configured ``model`` as a ``CompressedMoeModel`` with the same settings."""
    if not isinstance(model, models.MoeEncoderDecoderModel):
        raise TypeError(
            f"compressed experts need T5X's MoeEncoderDecoderModel, got {type(model).__name__}"
        )
    compressed = CompressedMoeModel.__new__(CompressedMoeModel)
    compressed.__dict__.update(vars(model))
    return compressed
