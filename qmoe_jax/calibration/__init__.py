"""The calibration pass: token buffer, sublayers, expert-group compression, the layer-by-layer
run."""

from qmoe_jax.calibration.buffer import TokenBuffer as TokenBuffer
from qmoe_jax.calibration.data import calibration_data as calibration_data
from qmoe_jax.calibration.expert_groups import ExpertCompressionConfig as ExpertCompressionConfig
from qmoe_jax.calibration.layer_pass import CalibrationConfig as CalibrationConfig
from qmoe_jax.calibration.layer_pass import CalibrationData as CalibrationData
from qmoe_jax.calibration.layer_pass import CalibrationPass as CalibrationPass
