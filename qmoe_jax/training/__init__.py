"""Fine-tuning compressed (and T5X) Switch models: frozen compressed experts, trainable dense parts,
expert LoRA."""

from qmoe_jax.training.finetuning import FinetuneOptions as FinetuneOptions
from qmoe_jax.training.finetuning import finetune as finetune
from qmoe_jax.training.tasks import Task as Task
from qmoe_jax.training.tasks import load_task as load_task
from qmoe_jax.training.trainable import select_trainable as select_trainable
