"""Using a model: opening any checkpoint, and its evaluation loss."""

from qmoe_jax.inference.evaluation import Example as Example
from qmoe_jax.inference.evaluation import ValidationSet as ValidationSet
from qmoe_jax.inference.evaluation import bundled_validation_examples as bundled_validation_examples
from qmoe_jax.inference.evaluation import evaluate_batches as evaluate_batches
from qmoe_jax.inference.evaluation import make_eval_step as make_eval_step
from qmoe_jax.inference.evaluation import mean_cross_entropies as mean_cross_entropies
from qmoe_jax.inference.evaluation import mean_cross_entropy as mean_cross_entropy
from qmoe_jax.inference.evaluation import padded_batches as padded_batches
from qmoe_jax.inference.evaluation import token_cross_entropy as token_cross_entropy
from qmoe_jax.inference.evaluation import validation_documents as validation_documents
from qmoe_jax.inference.evaluation import validation_examples as validation_examples
from qmoe_jax.inference.evaluation import validation_set as validation_set
from qmoe_jax.inference.loading import EXPERT_PARALLEL as EXPERT_PARALLEL
from qmoe_jax.inference.loading import OpenedModel as OpenedModel
from qmoe_jax.inference.loading import add_model_arguments as add_model_arguments
from qmoe_jax.inference.loading import is_compressed_checkpoint as is_compressed_checkpoint
from qmoe_jax.inference.loading import load_t5x_params as load_t5x_params
from qmoe_jax.inference.loading import open_model as open_model
from qmoe_jax.inference.loading import open_model_from_args as open_model_from_args
