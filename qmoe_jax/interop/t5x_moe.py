"""flaxformer's Switch MoE layer with its experts on the fused decode-and-multiply kernels.

``CompressedMoeLayer`` is a ``flaxformer.architectures.moe.moe_layers.MoeLayer``
with the same fields, router, group and capacity rules, dispatch, combine and
sown metrics; ``_call_experts`` differs, and calls of few tokens skip the
dispatch (the per-token path, below). flaxformer's ``_call_experts`` runs the vmapped
``MlpBlock`` on dense ``expert/<kernel>/kernel`` parameters; this one runs each
expert kernel as one ``ops.matmul`` over the codes, which it reads from the
non-trainable collection ``qmoe_experts`` (``interop/t5x_layout.py``):
``<layer>/<kernel>/{codes uint16[E, n], row_offsets int32[E, rows+1], minmax
bfloat16[E, rows, 2]}``, annotated with the logical axes ``('expert',
'unmodeled', ...)`` so that T5X's MoE partitioner shards them over the mesh's
``expert`` axis. The layer has no expert parameters, so nothing of the experts
reaches T5X's optimizer.

The reshapes and sharding constraints around the experts are flaxformer's
(copied from ``MoeLayer._call_experts``), so that T5X's all-to-alls are
unchanged; the expert products run under ``jax.shard_map`` over the mesh axes
of the logical ``expert`` and ``expert_replicas`` axes when the mesh has more
than one device along them, so that each device decodes only its own experts.

Only the capacity slots in use are computed. flaxformer's dispatch leaves an
empty slot all zero; the layer moves each expert's nonzero rows to the front
(a stable sort, per block of rows that one device holds), runs the MLP on the
first ``size`` rows of each block, where ``size`` is the smallest of a few
compiled sizes (the rows per block, then quarters of it down to 1;
``lax.switch``) that holds the largest count, and passes the counts to the
kernels, which skip the rows past them; an expert with no token is not
decoded at all. Without this a decoding step, whose one token per sequence
fills at most a few of the E × 4E slots flaxformer gives it, would decode all
E experts over 4E rows each. The MLP maps a zero row to zero (every
activation here has ``act(0) = 0``, or one factor of a gated product has), so
a routed token whose input is exactly zero gets the same output skipped; with
an activation where that fails, every slot is computed. The outputs agree
with every slot's up to float32 rounding: the kernels add a lone token's
products in another order than a block of tokens'. ``skip_empty_slots=False``
computes every slot too (benchmarks/t5x_decode.py compares the two).

A call without dropout can take the per-token path instead: flaxformer's router gives each
token its expert and gate (and the metrics it sows), each nonzero token that was not dropped is
multiplied by its own expert, then scaled by its gate; a dropped token gets 0. The
``[G, E, C, H]`` dispatch and combine, E² · C · H values once the groups reach E, are not built.
On the CPU the routed kernel (``ops.matmul_routed``; ``slot_rows.each_token_routed``) does the
products with the tokens where they are, each expert named decoded once for all its tokens, so
every such call takes the path: decoding steps, and ``t5x.eval``'s and ``t5x.infer``'s scoring
and prefill. Elsewhere each token's expert codes are gathered out of the stacks
(``slot_rows.each_token_its_expert``), which pays off for few tokens only: calls of up to E
tokens (a decoding step of up to E sequences, which flaxformer pads to E groups of one token).
``per_token_limit`` sets the limit on every platform (0: never). The path needs a top-1
``TokensChooseMaskedRouter``, an MLP that maps zero to zero and experts held whole on each
device; otherwise the dispatch above runs, as it does for training with dropout.

The layer needs each sparse layer's code shapes when T5X initializes the model
(abstractly, before the checkpoint is read): it reads them, and the layer's
dictionary, from ``checkpoint`` (the gin macro ``QMOE_CHECKPOINT``) through
``t5x_layout.read_layout``, which reads manifests and metadata only.

The expert ``MlpBlock`` that flaxformer's gin configures is kept as a
description of the experts: its ``activations`` (``wi`` or ``wi_0``/``wi_1``),
``intermediate_dim``, ``intermediate_dropout_rate`` and ``final_dropout_rate``
are used; it is never called. Import this module only where flaxformer is
installed; the gin files of ``configs/t5x/`` do.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import partitioning as flax_partitioning
from flaxformer.architectures.moe import moe_layers, routing
from flaxformer.components import dense

from qmoe_jax.codec import CompressedExperts
from qmoe_jax.interop.slot_rows import (
    each_token_its_expert,
    each_token_routed,
    hidden_units,
    maps_zero_to_zero,
    on_rows_in_use,
)
from qmoe_jax.interop.t5x_expert_matmul import expert_matmul, local_matmul
from qmoe_jax.interop.t5x_layout import (
    ARRAYS,
    COLLECTION,
    KernelLayout,
    LayerLayout,
    LayoutError,
    read_layout,
)
from qmoe_jax.kernels import ops

_DTYPES = {"codes": jnp.uint16, "row_offsets": jnp.int32, "minmax": jnp.bfloat16}
_AXES = {
    "codes": ("expert", "unmodeled"),
    "row_offsets": ("expert", "unmodeled"),
    "minmax": ("expert", "unmodeled", None),
}


class CompressedKernelVariables(nn.Module):
    """The code arrays of one expert kernel, in the ``qmoe_experts`` collection.

    At initialization they are zeros of the layout's shapes (T5X replaces them
    with the checkpoint's when it restores); afterwards they must be passed in.
    """

    kernel: KernelLayout
    num_experts: int

    @nn.compact
    def __call__(self) -> CompressedExperts:
        shapes = self.kernel.shapes(self.num_experts)
        if not self.is_initializing() and not self.has_variable(COLLECTION, "codes"):
            raise LayoutError(
                f"{'/'.join(self.path)}: the compressed experts are missing; they live in the "
                f"{COLLECTION!r} collection, which must be passed to apply (inside T5X: use the "
                "model of qmoe_jax.interop.t5x_model, which the gin files of configs/t5x/ bind)"
            )
        arrays = {
            name: flax_partitioning.variable_with_axes(
                COLLECTION,
                name,
                jnp.zeros,
                shapes[name],
                _DTYPES[name],
                axes=_AXES[name],
            ).value
            for name in ARRAYS
        }
        for name, array in arrays.items():
            if tuple(array.shape) != shapes[name]:
                raise LayoutError(
                    f"{'/'.join(self.path)}/{name} has shape {tuple(array.shape)}, but the layout "
                    f"says {shapes[name]}; QMOE_CHECKPOINT must name the checkpoint whose codes "
                    "these are"
                )
        return CompressedExperts(
            arrays["codes"].astype(jnp.uint16),
            arrays["row_offsets"].astype(jnp.int32),
            # A restore dtype may have cast the bfloat16 min/max; the values are bfloat16-exact.
            arrays["minmax"].astype(jnp.bfloat16),
            self.kernel.cols,
        )


class CompressedMoeLayer(moe_layers.MoeLayer):
    """``MoeLayer`` whose experts run from compressed codes on the fused kernels.

    Attributes (besides ``MoeLayer``'s):
      checkpoint: where the layout of the codes is read (``QMOE_CHECKPOINT``): a
        compressed directory or a T5X checkpoint of a compressed model.
      skip_empty_slots: compute only the capacity slots a token fills (the module's
        docstring); False computes every slot.
      per_token_limit: calls of at most this many tokens (flaxformer's padding included)
        without dropout take the per-token path (the module's docstring); None: every call
        where the routed kernel runs (the CPU), elsewhere the number of experts, which a
        decoding step of up to E sequences is padded to; 0: never.
    """

    checkpoint: str = ""
    skip_empty_slots: bool = True
    per_token_limit: int | None = None

    def _layer_layout(self, hidden: int) -> LayerLayout:
        if not self.checkpoint:
            raise LayoutError(
                "CompressedMoeLayer.checkpoint is not set; bind QMOE_CHECKPOINT to the compressed "
                "directory (the gin files of configs/t5x/ default it to the checkpoint restored)"
            )
        expert = self.expert
        if not isinstance(expert, dense.MlpBlock):
            raise LayoutError(
                f"compressed experts are T5 MLPs (dense.MlpBlock); this layer's expert is a "
                f"{type(expert).__name__}"
            )
        for field, value, allowed in (
            ("use_bias", expert.use_bias, False),
            ("precomputed_intermediates", expert.precomputed_intermediates, False),
            ("intermediate_conv", expert.intermediate_conv, None),
            ("use_aqt", bool(expert.use_aqt), False),
        ):
            if value != allowed:
                raise LayoutError(
                    f"expert/dense.MlpBlock.{field} = {value!r} is not supported by compressed "
                    f"experts (Switch Transformers use {allowed!r})"
                )
        layout = read_layout(self.checkpoint)
        name = ".".join(self.path)
        layer = layout.layer(name)
        expected = (
            ["wi"]
            if len(expert.activations) == 1
            else [f"wi_{i}" for i in range(len(expert.activations))]
        )
        expected.append("wo")
        problems = []
        if layer.num_experts != self.num_experts:
            problems.append(
                f"NUM_EXPERTS is {self.num_experts}, the checkpoint has {layer.num_experts}"
            )
        if sorted(layer.kernel_names()) != sorted(expected):
            problems.append(
                f"the expert activations {tuple(expert.activations)} need kernels {expected}, the "
                f"checkpoint has {list(layer.kernel_names())} (expert/dense.MlpBlock.activations)"
            )
        else:
            out = expert.out_dim or hidden
            for kernel, (rows, cols) in {
                **{k: (expert.intermediate_dim, hidden) for k in expected[:-1]},
                "wo": (out, expert.intermediate_dim),
            }.items():
                stored = layer.kernel(kernel)
                if (stored.rows, stored.cols) != (rows, cols):
                    problems.append(
                        f"{kernel} is [{rows}, {cols}] in the model (EMBED_DIM, EXPERT_MLP_DIM) "
                        f"but [{stored.rows}, {stored.cols}] in the checkpoint"
                    )
        if problems:
            raise LayoutError(
                f"sparse layer {name} does not match the compressed checkpoint {layout.path}: "
                + "; ".join(problems)
            )
        return layer

    def _mask_and_dispatch_to_experts(
        self, token_inputs, enable_dropout: bool, expert_capacity: int, **kwargs
    ):
        """flaxformer's masked routing, dispatch and combine; on the per-token path, each token
        multiplied by its own expert instead of the ``[G, E, C, H]`` dispatch."""
        num_groups, tokens_per_group, *hidden_dims = token_inputs.shape
        tokens = num_groups * tokens_per_group
        if self.per_token_limit is not None:
            within_limit = tokens <= self.per_token_limit
        else:  # the routed kernel gathers nothing, so it takes calls of any size
            within_limit = self._routed() or tokens <= self.num_experts
        per_token = (
            within_limit
            and not enable_dropout
            and len(hidden_dims) == 1
            and self.skip_empty_slots
            and maps_zero_to_zero(self.expert.activations)
            and isinstance(self.router, routing.TokensChooseMaskedRouter)
            and self.router.num_selected_experts == 1
            and expert_matmul(".".join(self.path))[0] is local_matmul
        )
        if not per_token:
            return super()._mask_and_dispatch_to_experts(
                token_inputs, enable_dropout, expert_capacity, **kwargs
            )
        router_mask = self.router(
            token_inputs, self.num_experts, expert_capacity, apply_jitter=False
        )
        self._sow_dispatch_metrics(router_mask, token_inputs, expert_capacity)
        # A kept token has one nonzero combine entry, its gate; a dropped one none, and it
        # names no expert (index E).
        gates = router_mask.combine_array.sum(-1).reshape(tokens, self.num_experts)
        gate = gates.sum(-1, keepdims=True)
        expert_index = jnp.where(gate[:, 0] > 0, jnp.argmax(gates, -1), self.num_experts)
        outputs = self._token_experts(token_inputs.reshape(tokens, -1), expert_index)
        combined = outputs * gate
        return combined.reshape(num_groups, tokens_per_group, -1)

    def _sow_dispatch_metrics(self, router_mask, token_inputs, expert_capacity: int) -> None:
        """The metrics flaxformer's masked dispatch sows, from the same router mask."""
        num_groups, tokens_per_group = token_inputs.shape[:2]
        dispatch = router_mask.dispatch_mask
        if self.router.ignore_padding_tokens:  # padding tokens are all zero
            real = jnp.sum(jnp.abs(token_inputs), axis=-1) > 0
            num_tokens = jnp.asarray(real, token_inputs.dtype).sum()
        else:
            num_tokens = float(num_groups * tokens_per_group)
        dispatched = dispatch.sum()
        self._sow_expert_metrics(
            router_mask.auxiliary_loss,
            router_mask.router_z_loss,
            1.0 - jnp.max(dispatch, axis=(-1, -2)).sum() / num_tokens,
            router_mask.combine_array.sum() / dispatched,
            dispatched / (self.num_experts * expert_capacity * num_groups),
        )

    def _token_experts(self, x: jax.Array, expert_index: jax.Array) -> jax.Array:
        """Token n's expert MLP ``expert_index[n]`` on ``x [N, H]`` → ``[N, H]``."""
        found = self._expert_weights(x.shape[-1])
        if found is None:
            return jnp.zeros_like(x)
        weights, dictionary, kernels = found
        products = each_token_routed if self._routed() else each_token_its_expert
        out = products(
            weights, dictionary, kernels, jax.lax.convert_element_type(x, self.dtype), expert_index
        )
        return jax.lax.convert_element_type(out, x.dtype)

    @staticmethod
    def _routed() -> bool:
        """Whether the routed kernel runs here (the CPU): the per-token path then gathers
        nothing, and takes calls of any size."""
        return ops.has_routed_kernels(jax.default_backend())

    def _expert_weights(self, hidden: int):
        """``(weights, dictionary, kernels)``: each expert kernel's ``CompressedExperts``
        (declared in ``qmoe_experts``), the dictionary, and the input kernels as ``(name,
        activation)`` pairs; None while the model initializes, when only the variables are
        declared."""
        layer = self._layer_layout(hidden)
        dictionary = read_layout(self.checkpoint).dictionary(layer.dictionary)
        weights = {
            kernel: CompressedKernelVariables(shape, layer.num_experts, name=kernel)()
            for kernel, shape in layer.kernels
        }
        if self.is_initializing():
            # Initialization only declares the variables; zero codes are not valid code streams.
            return None
        activations = self.expert.activations
        names = ["wi"] if len(activations) == 1 else [f"wi_{i}" for i in range(len(activations))]
        return weights, dictionary, list(zip(names, activations))

    def _call_experts(self, inputs, enable_dropout: bool, **kwargs):
        """As flaxformer's ``MoeLayer._call_experts`` ([G, E, C, H] in and out), with the
        experts on the fused kernels."""
        del kwargs  # decode/prefill: an MLP keeps no cache
        num_groups, num_experts, capacity, *hidden_dims = inputs.shape
        inputs_dtype = inputs.dtype
        inputs = jax.lax.convert_element_type(inputs, self.dtype)
        inputs = flax_partitioning.with_sharding_constraint(
            inputs, ("batch", "unmodeled", "length", *self.input_hidden_dims_axes)
        )
        if self.num_expert_partitions != num_experts:
            inputs = inputs.reshape(
                self.num_expert_partitions,
                num_groups // num_experts,
                num_experts // self.num_expert_partitions,
                num_experts,
                capacity,
                *hidden_dims,
            )
            inputs = jnp.swapaxes(inputs, 1, 2)
        inputs = inputs.reshape(
            num_experts, num_groups // num_experts, num_experts, capacity, *hidden_dims
        )
        axes = ("expert", "expert_replicas", "unmodeled", "length", *self.input_hidden_dims_axes)
        inputs = flax_partitioning.with_sharding_constraint(inputs, axes)
        inputs = jnp.swapaxes(inputs, 0, 2)
        inputs = flax_partitioning.with_sharding_constraint(inputs, axes)
        inputs = inputs.reshape(num_experts, num_groups * capacity, *hidden_dims)
        inputs = flax_partitioning.with_sharding_constraint(
            inputs, ("expert", "expert_replicas", "unmodeled")
        )

        outputs = self._compressed_experts(inputs, enable_dropout)

        output_dims = outputs.shape[2:]
        outputs = outputs.reshape(num_experts, num_groups, capacity, *output_dims)
        outputs = flax_partitioning.with_sharding_constraint(
            outputs, ("expert", "expert_replicas", "length", *self.output_hidden_dims_axes)
        )
        outputs = outputs.reshape(
            num_experts, num_groups // num_experts, num_experts, capacity, *output_dims
        )
        axes = ("expert", "expert_replicas", "unmodeled", "length", *self.output_hidden_dims_axes)
        outputs = flax_partitioning.with_sharding_constraint(outputs, axes)
        outputs = jnp.swapaxes(outputs, 0, 2)
        outputs = flax_partitioning.with_sharding_constraint(outputs, axes)
        if self.num_expert_partitions != num_experts:
            outputs = outputs.reshape(
                self.num_expert_partitions,
                num_experts // self.num_expert_partitions,
                num_groups // num_experts,
                num_experts,
                capacity,
                *output_dims,
            )
            outputs = jnp.swapaxes(outputs, 1, 2)
        outputs = outputs.reshape(num_groups, num_experts, capacity, *output_dims)
        outputs = flax_partitioning.with_sharding_constraint(
            outputs, ("batch", "unmodeled", "length", *self.output_hidden_dims_axes)
        )
        return jax.lax.convert_element_type(outputs, inputs_dtype)

    def _compressed_experts(self, x: jax.Array, enable_dropout: bool) -> jax.Array:
        """The expert MLPs ``[E, T, H] → [E, T, H]``, each kernel one fused call for all experts."""
        expert = self.expert
        found = self._expert_weights(x.shape[-1])
        if found is None:
            return jnp.zeros_like(x)
        weights, dictionary, kernels = found
        matmul, blocks = expert_matmul(".".join(self.path))
        # MlpBlock's dropouts: each expert's mask is broadcast along its tokens. The intermediate
        # one is drawn here, on ones of the mask's shape (the same random bits as on the hidden
        # activations), so that the MLP below holds no module call and can run in lax.switch.
        keep = 1.0 - expert.intermediate_dropout_rate
        kept = nn.Dropout(rate=expert.intermediate_dropout_rate, broadcast_dims=(-2,))(
            jnp.ones((x.shape[0], 1, expert.intermediate_dim), x.dtype),
            deterministic=not enable_dropout,
        )
        if not enable_dropout or expert.intermediate_dropout_rate == 0.0:
            kept = None  # the ones unchanged

        def mlp(tokens: jax.Array, counts: jax.Array | None) -> jax.Array:
            def project(kernel: str, rows: jax.Array) -> jax.Array:
                return matmul(weights[kernel], rows, dictionary, counts)

            hidden = hidden_units(lambda name: project(name, tokens), kernels)
            if kept is not None:  # as nn.Dropout: kept entries divided by keep, the others 0
                hidden = jnp.where(kept != 0, hidden / keep, jnp.zeros_like(hidden))
            return project("wo", hidden)

        if self.skip_empty_slots and maps_zero_to_zero(expert.activations):
            out = on_rows_in_use(mlp, x, blocks)
        else:
            out = mlp(x, None)
        return nn.Dropout(rate=expert.final_dropout_rate, broadcast_dims=(-2,))(
            out, deterministic=not enable_dropout
        )


def switch_moe_layer(config, activations=("relu",)) -> moe_layers.MoeLayer:
    """flaxformer's ``MoeLayer`` as switch_base.gin configures it (top-1
    ``TokensChooseMaskedRouter``, no jitter, no batch-prioritized routing, float32), at the
    shape, capacity factors, group size and minimum capacity of ``config`` (a
    ``models.SwitchConfig``), with no dropout."""

    router = routing.TokensChooseMaskedRouter(
        router_weights=routing.RouterWeights(use_bias=False, dtype=jnp.float32),
        num_selected_experts=1,
        jitter_noise=0.0,
        batch_prioritized_routing=False,
        ignore_padding_tokens=False,
        dtype=jnp.float32,
    )
    expert = dense.MlpBlock(
        use_bias=False,
        intermediate_dim=config.d_ff,
        activations=activations,
        intermediate_dropout_rate=0.0,
        final_dropout_rate=0.0,
        dtype=jnp.float32,
    )
    return moe_layers.MoeLayer(
        num_experts=config.num_experts,
        max_group_size=config.group_size,
        train_capacity_factor=config.train_capacity_factor,
        eval_capacity_factor=config.eval_capacity_factor,
        expert=expert,
        router=router,
        num_expert_partitions=config.num_experts,
        num_model_partitions=1,
        min_expert_capacity=config.min_expert_capacity,
        dropout_rate=0.0,
        dtype=jnp.float32,
    )


def compressed_moe_layer(layer: moe_layers.MoeLayer, checkpoint: str) -> CompressedMoeLayer:
    """``layer`` (flaxformer's gin-configured ``MoeLayer``) as a ``CompressedMoeLayer``.

    Every field of ``layer`` carries over, so flaxformer's gin files and the
    user's overrides of ``moe_layers.MoeLayer`` configure the compressed layer
    as they configure the dense one.
    """
    if not isinstance(layer, moe_layers.MoeLayer):
        raise TypeError(f"expected a flaxformer MoeLayer, got {type(layer).__name__}")
    fields = {
        f.name: getattr(layer, f.name)
        for f in dataclasses.fields(layer)
        if f.init and f.name not in ("parent", "name", "checkpoint")
    }
    return CompressedMoeLayer(**fields, checkpoint=checkpoint)
