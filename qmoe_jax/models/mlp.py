"""The T5 MLP's kernel names and hidden units, shared by every MLP implementation.

A plain MLP is ``wo(act(x wi))``; a gated one (``SwitchConfig.gated_mlp``, two
``mlp_activations``) is ``wo(act0(x wi_0) * act1(x wi_1))``. Dense MLPs, dense
and compressed experts, and calibration all name their kernels and form their
hidden units here, so they agree with T5X's parameter tree and with each other.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from qmoe_jax.models.configs import SwitchConfig


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """flaxformer's activation names: relu, gelu (tanh approximation), silu, linear."""
    return {"relu": jax.nn.relu, "gelu": nn.gelu, "silu": jax.nn.silu, "linear": lambda x: x}[name]


def input_kernel_names(config: SwitchConfig) -> tuple[str, ...]:
    """The MLP's input kernels, in ``mlp_activations`` order: ``("wi",)`` or ``("wi_0",
    "wi_1")``."""
    return ("wi_0", "wi_1") if config.gated_mlp else ("wi",)


def kernel_names(config: SwitchConfig) -> tuple[str, ...]:
    """Every kernel of the MLP: the input kernels, then ``wo``."""
    return input_kernel_names(config) + ("wo",)


def hidden_units(config: SwitchConfig, project: Callable[[str], jax.Array]) -> jax.Array:
    """``act(x wi)``, or ``act0(x wi_0) * act1(x wi_1)`` when gated.

    ``project(name)`` computes ``x`` times the input kernel ``name`` (one of
    ``input_kernel_names(config)``), in whatever layout the caller stores it.
    """
    hidden = None
    for name, act in zip(input_kernel_names(config), config.mlp_activations, strict=True):
        units = activation(act)(project(name))
        hidden = units if hidden is None else hidden * units
    return hidden
