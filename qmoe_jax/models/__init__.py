"""SwitchTransformer in Flax with T5X's parameter tree: configs, layers, MoE, experts, decoding."""

from qmoe_jax.models.configs import SwitchConfig as SwitchConfig
from qmoe_jax.models.configs import config_names as config_names
from qmoe_jax.models.configs import get_config as get_config
from qmoe_jax.models.experts import ExpertKernel as ExpertKernel
from qmoe_jax.models.experts import MlpExperts as MlpExperts
from qmoe_jax.models.incremental import decode_step as decode_step
from qmoe_jax.models.incremental import init_cache as init_cache
from qmoe_jax.models.moe import ROUTER_METRICS as ROUTER_METRICS
from qmoe_jax.models.moe import MoeLayer as MoeLayer
from qmoe_jax.models.moe import Routing as Routing
from qmoe_jax.models.moe import combine as combine
from qmoe_jax.models.moe import dispatch as dispatch
from qmoe_jax.models.moe import expert_capacity as expert_capacity
from qmoe_jax.models.moe import expert_counts as expert_counts
from qmoe_jax.models.moe import num_groups as num_groups
from qmoe_jax.models.moe import route_top1 as route_top1
from qmoe_jax.models.moe import router_metrics as router_metrics
from qmoe_jax.models.switch import SwitchTransformer as SwitchTransformer
from qmoe_jax.models.switch import param_shapes as param_shapes
