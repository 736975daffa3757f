"""Quantization: grids, round-to-nearest, Hessians, GPTQ for one matrix, and vmapped expert
groups."""

from qmoe_jax.quant.gptq import GPTQConfig as GPTQConfig
from qmoe_jax.quant.gptq import GPTQResult as GPTQResult
from qmoe_jax.quant.gptq import gptq as gptq
from qmoe_jax.quant.gptq import hessian_factor as hessian_factor
from qmoe_jax.quant.grids import GridConfig as GridConfig
from qmoe_jax.quant.grids import dequantize_codes as dequantize_codes
from qmoe_jax.quant.grids import grid_params as grid_params
from qmoe_jax.quant.grids import quantize as quantize
from qmoe_jax.quant.group import DEFAULT_GROUP_SIZE as DEFAULT_GROUP_SIZE
from qmoe_jax.quant.group import EXPERT_AXIS as EXPERT_AXIS
from qmoe_jax.quant.group import GroupResult as GroupResult
from qmoe_jax.quant.group import expert_mesh as expert_mesh
from qmoe_jax.quant.group import gptq_experts as gptq_experts
from qmoe_jax.quant.group import quantize_expert_group as quantize_expert_group
from qmoe_jax.quant.hessian import TOKEN_CAP_FACTOR as TOKEN_CAP_FACTOR
from qmoe_jax.quant.hessian import accumulate_hessian as accumulate_hessian
from qmoe_jax.quant.hessian import cap_tokens as cap_tokens
from qmoe_jax.quant.hessian import expert_hessians as expert_hessians
from qmoe_jax.quant.hessian import hessian as hessian
from qmoe_jax.quant.hessian import token_cap as token_cap
from qmoe_jax.quant.rtn import rtn as rtn
