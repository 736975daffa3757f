"""The main job: a T5X checkpoint and calibration text in, a compressed checkpoint and its report
out."""

from qmoe_jax.compression.job import compress_checkpoint as compress_checkpoint
from qmoe_jax.compression.options import CompressionOptions as CompressionOptions
