"""How many of each MLP's hidden units are exactly zero on real text, layer by layer: the share
of ``wo``'s rows that a product skipping zero hidden units would not read or decode.

A T5 MLP is wo · relu(wi · x). Each zero hidden unit multiplies one row of wo (one row of wo
stored [d_ff, d_model], one column of it as the kernels store it, [d_model, d_ff]), so a
decoding step that skipped them would read or decode only the rest. Nothing in qmoe_jax skips
them today; this measures what it could save. Counted over the tokens a layer holds: an
expert's capacity slots that hold no token are zeros, and are left out.

The model is opened as ``python -m qmoe_jax.evaluate`` opens it (the same flags; the bundled
model by default) and runs forward, teacher-forced, over the first --num_samples validation
examples. Every MLP forms its hidden units through ``qmoe_jax.models.mlp``; this script wraps
that module's ReLU for the run and names each call by the Flax module that makes it. Gated MLPs
(GeLU) are not counted: their hidden units are rarely exactly zero.

    python benchmarks/activation_sparsity.py                                  # bundled model
    python benchmarks/activation_sparsity.py --checkpoint runs/compressed/switch-mini-8
    python benchmarks/activation_sparsity.py --checkpoint gs://.../checkpoint_611800 \\
        --tokenizer sentencepiece.model --c4 /data/c4/en --num_samples 256
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_model, result_path, write_result


class ZeroCounter:
    """Wraps ``qmoe_jax.models.mlp.activation`` so that ReLU's hidden units are counted per
    calling module: {module path: [zero units, live units]}."""

    def __init__(self):
        self.counts = collections.defaultdict(lambda: [0, 0])
        self._modules = []  # the Flax modules whose methods are being traced, innermost last

    def intercept(self, next_fun, args, kwargs, context):
        self._modules.append(context.module)
        try:
            return next_fun(*args, **kwargs)
        finally:
            self._modules.pop()

    @contextlib.contextmanager
    def counting(self):
        """Counts, while inside, every ReLU hidden unit the models' MLPs form as they are traced."""
        import flax.linen as nn

        from qmoe_jax.models import mlp

        original = mlp.activation
        mlp.activation = self.activation(original)
        try:
            with nn.intercept_methods(self.intercept):
                yield self
        finally:
            mlp.activation = original

    def _record(self, label, zeros, live):
        self.counts[label][0] += int(zeros)
        self.counts[label][1] += int(live)

    def activation(self, original):
        def counted(name: str):
            act = original(name)
            if name != "relu":
                return act

            def relu(pre):
                label = "/".join(self._modules[-1].path) if self._modules else "?"
                hidden = act(pre)
                live = jnp.any(pre != 0, axis=-1, keepdims=True)  # rows that hold a token
                zeros = jnp.sum((hidden == 0) & live)
                units = jnp.sum(live) * hidden.shape[-1]
                jax.debug.callback(functools.partial(self._record, label), zeros, units)
                return hidden

            return relu

        return counted


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from qmoe_jax.data import Tokenizer, bundled
    from qmoe_jax.inference import add_model_arguments, mean_cross_entropy, open_model_from_args
    from qmoe_jax.inference.evaluation import validation_set

    add_model_arguments(parser)
    parser.add_argument("--c4", help="C4 directory or glob (default: the bundled validation)")
    parser.add_argument("--num_samples", type=int, default=64)
    parser.add_argument("--inputs_length", type=int, default=bundled.INPUTS_LENGTH)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--output", default=result_path("activation_sparsity"))
    args = parser.parse_args()

    tokenizer = Tokenizer(args.tokenizer or bundled.tokenizer_path())
    source = f"c4:{args.c4}" if args.c4 else "bundled"
    validation = validation_set(source, tokenizer, args.num_samples, args.inputs_length)
    model = open_model_from_args(args)
    counter = ZeroCounter()
    with counter.counting():
        loss = mean_cross_entropy(
            model.module,
            model.params,
            validation.examples,
            args.batch_size,
            validation.encoder_length,
            validation.decoder_length,
        )
    jax.effects_barrier()

    layers = []
    for label, (zeros, units) in sorted(counter.counts.items()):
        layers.append(
            {
                "module": label,
                "experts": "expert" in label,
                "zero_fraction": zeros / max(units, 1),
                "live_units": units,
            }
        )
    print(
        f"CPU: {cpu_model()}; {model.config.name}, {len(validation.examples)} examples of "
        f"{source}, loss {loss:.4f}; hidden units that are exactly zero, of the tokens each "
        "layer holds:"
    )
    for layer in layers:
        print(f"  {layer['module']:<48}{layer['zero_fraction']:>8.1%}")
    for kind, rows in (
        ("experts", [r for r in layers if r["experts"]]),
        ("dense MLPs", [r for r in layers if not r["experts"]]),
    ):
        if rows:
            fractions = [r["zero_fraction"] for r in rows]
            print(
                f"{kind}: {min(fractions):.1%} to {max(fractions):.1%} over {len(rows)} "
                f"layers (mean {np.mean(fractions):.1%})"
            )
    if not layers:
        print("no ReLU MLP ran (a gated model's hidden units are not counted)")
    write_result(
        "activation_sparsity",
        {
            "checkpoint": args.checkpoint or bundled.checkpoint_path(),
            "config": model.config.name,
            "source": source,
            "examples": len(validation.examples),
            "loss": loss,
            "layers": layers,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
