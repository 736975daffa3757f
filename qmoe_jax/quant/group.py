"""Batched GPTQ over a group of experts (QMoE §4, "expert grouping").

Lingo: E experts per group (default 16), stacked as W[E, rows, cols] (each in
y = W·x orientation) with Hessians H[E, cols, cols] and tokens_per_expert[E]
(the tokens each Hessian was built from). One call quantizes the whole group.
On accelerators its experts are vmapped: one batched program, which fills the
device. On CPU (``sequential``, the default there) they run one after another
inside the call (``lax.map``): one expert already fills the cores, and each
op on a whole group streams E times the data through memory (batched, XLA
also copies the Cholesky's transposed operands first). On a 2-core CPU the
sequential call is the faster of the two (benchmarks/gptq_grouping.py times
both; docs/measurements.md), and it holds one expert's working copies at a
time instead of E. Both give the same bits: an expert's result does not
depend on its batch (quant/linalg.py). Experts with no tokens, or whose Hessian is not positive
definite after damping, are rounded to nearest (identity Hessian) and
flagged in ``fallback`` for the caller to count.

Multi-device (docs/calibration.md §6): the group's expert axis is sharded over the
``jax.sharding.Mesh`` axis "expert"; every device runs the solver on its own
experts (shard_map, no communication). A group whose size is not a multiple
of the device count is padded with zero experts, stripped after.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qmoe_jax.quant.gptq import GPTQConfig, gptq
from qmoe_jax.quant.grids import GridConfig

DEFAULT_GROUP_SIZE = 16
EXPERT_AXIS = "expert"


class GroupResult(NamedTuple):
    """GPTQ output for a group of E experts.

    Attributes:
      codes: uint8[E, rows, cols].
      grid_params: [E, rows, 2] (bfloat16 (min, max) for ternary, float32 (scale, zero) for minmax).
      fallback: bool[E], True where the expert was rounded to nearest (no tokens, or H not positive
        definite).
      loss: float32[E], GPTQ's proxy loss per expert.
    """

    codes: jax.Array
    grid_params: jax.Array
    fallback: jax.Array
    loss: jax.Array


def gptq_experts(
    weights: jax.Array,
    hessians: jax.Array,
    tokens_per_expert: jax.Array,
    grid: GridConfig,
    config: GPTQConfig = GPTQConfig(),
    sequential: bool = False,
) -> GroupResult:
    """GPTQ over a group of experts; pure and jit-able (``quantize_expert_group`` jits and shards
    it).

    Args:
      weights: float[E, rows, cols], y = W·x orientation (T5X ``wi[E, d, f]`` becomes
        ``wi.transpose(0, 2, 1)``).
      hessians: float32[E, cols, cols].
      tokens_per_expert: int[E]; experts with 0 tokens are rounded to nearest.
      grid: the per-row grid.
      config: GPTQ options.
      sequential: the experts one after another (``lax.map``, what CPUs run best) instead of
        vmapped; the same bits either way.

    Returns:
      GroupResult with a leading E axis.
    """
    identity = jnp.eye(hessians.shape[-1], dtype=jnp.float32)

    def expert(weights, hessian, tokens):
        no_tokens = tokens <= 0
        result = gptq(
            weights, jnp.where(no_tokens, identity, jnp.asarray(hessian, jnp.float32)), grid, config
        )
        return GroupResult(result.codes, result.grid_params, ~result.ok | no_tokens, result.loss)

    operands = (weights, hessians, jnp.asarray(tokens_per_expert))
    if sequential:
        return lax.map(lambda item: expert(*item), operands)
    return jax.vmap(expert)(*operands)


def default_sequential(devices) -> bool:
    """Whether ``quantize_expert_group`` runs a group's experts one after another on these devices:
    on CPUs."""
    return all(device.platform == "cpu" for device in devices)


def group_devices(mesh: Mesh | None = None) -> list:
    """The devices one ``quantize_expert_group(..., mesh=mesh)`` call runs on: the mesh's, or all
    local ones."""
    return list(mesh.devices.flat) if mesh is not None else jax.local_devices()


def expert_mesh(devices=None) -> Mesh:
    """A 1-D mesh with axis "expert" over ``devices`` (default: all local devices)."""
    devices = jax.local_devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (EXPERT_AXIS,))


_gptq_experts_jit = jax.jit(gptq_experts, static_argnames=("grid", "config", "sequential"))


@functools.cache
def _sharded_gptq_experts(mesh: Mesh, grid: GridConfig, config: GPTQConfig, sequential: bool):
    spec = PartitionSpec(EXPERT_AXIS)
    local = functools.partial(gptq_experts, grid=grid, config=config, sequential=sequential)
    sharded = jax.shard_map(
        local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False
    )
    sharding = NamedSharding(mesh, spec)
    return jax.jit(sharded, in_shardings=(sharding, sharding, sharding), out_shardings=sharding)


def quantize_expert_group(
    weights,
    hessians,
    tokens_per_expert,
    grid: GridConfig,
    config: GPTQConfig = GPTQConfig(),
    mesh: Mesh | None = None,
    sequential: bool | None = None,
) -> GroupResult:
    """Quantize a group of experts with GPTQ, sharded over devices when there are several.

    Args:
      weights: float[E, rows, cols], y = W·x orientation.
      hessians: float32[E, cols, cols], H_e = X_eᵀX_e.
      tokens_per_expert: int[E], tokens behind each Hessian (0 → round to nearest).
      grid: the per-row grid.
      config: GPTQ options.
      mesh: a 1-D mesh with axis "expert"; None uses all local devices when there
        are several (one device: a plain jit).
      sequential: each device's experts one after another instead of vmapped (module docstring);
        None: where the devices are CPUs. The same bits either way.

    Returns:
      GroupResult(codes uint8[E, rows, cols], grid_params [E, rows, 2], fallback bool[E], loss
      float32[E]); codes, grid_params and fallback are bit-identical whatever the mesh (see
      quant/linalg.py), the loss up to float rounding.
    """
    num_experts, _, cols = jnp.shape(weights)
    if jnp.shape(hessians) != (num_experts, cols, cols) or jnp.shape(tokens_per_expert) != (
        num_experts,
    ):
        raise ValueError(
            f"quantize_expert_group expects weights [E, rows, cols], hessians [E, cols, cols], "
            f"tokens_per_expert [E]; got {jnp.shape(weights)}, {jnp.shape(hessians)}, "
            f"{jnp.shape(tokens_per_expert)}"
        )
    if sequential is None:
        sequential = default_sequential(group_devices(mesh))
    if mesh is None and jax.local_device_count() == 1:
        return _gptq_experts_jit(
            weights,
            hessians,
            tokens_per_expert,
            grid=grid,
            config=config,
            sequential=bool(sequential),
        )
    if mesh is None:
        mesh = expert_mesh()
    if mesh.axis_names != (EXPERT_AXIS,):
        raise ValueError(
            f"mesh must have the single axis {EXPERT_AXIS!r}, got {mesh.axis_names}; build it "
            "with expert_mesh()"
        )
    padding = -num_experts % mesh.size
    if padding:
        weights = jnp.pad(jnp.asarray(weights), ((0, padding), (0, 0), (0, 0)))
        hessians = jnp.pad(jnp.asarray(hessians), ((0, padding), (0, 0), (0, 0)))
        tokens_per_expert = jnp.pad(jnp.asarray(tokens_per_expert), (0, padding))
    result = _sharded_gptq_experts(mesh, grid, config, bool(sequential))(
        weights, hessians, tokens_per_expert
    )
    return jax.tree.map(lambda leaf: leaf[:num_experts], result) if padding else result
