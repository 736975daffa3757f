"""SwitchTransformer in Flax with T5X's parameter tree: configs, layers, MoE, experts."""

from qmoe_jax.models.configs import SwitchConfig as SwitchConfig
from qmoe_jax.models.configs import config_names as config_names
from qmoe_jax.models.configs import get_config as get_config
from qmoe_jax.models.experts import ExpertKernel as ExpertKernel
from qmoe_jax.models.experts import MlpExperts as MlpExperts
from qmoe_jax.models.moe import ROUTER_METRICS as ROUTER_METRICS
from qmoe_jax.models.moe import MoeLayer as MoeLayer
from qmoe_jax.models.moe import expert_capacity as expert_capacity
from qmoe_jax.models.moe import num_groups as num_groups
from qmoe_jax.models.moe import router_metrics as router_metrics
from qmoe_jax.models.switch import SwitchTransformer as SwitchTransformer
