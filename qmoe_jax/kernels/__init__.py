"""The fused decode-and-multiply ops (``ops``) over the XLA FFI bindings of the native kernels
(``bindings``).

``ops`` is the public layer: matvec, matmul, dequantize with their jnp twins, vmap and autodiff
rules. ``bindings`` registers the FFI targets of the ``qmoe_jax_ext`` extension and states their
shapes.
"""
