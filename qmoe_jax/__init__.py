"""qmoe_jax: sub-1-bit compression of trillion-parameter Mixture-of-Experts models in JAX."""

__version__ = "0.1.0"
