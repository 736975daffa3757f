"""The output-directory rules (``checkpoints.output_dir``) with several processes writing.

The lead (process 0) alone checks that the directory may be written, creates
it and holds its lock, for the whole run; the other processes wait for its
verdict and raise its refusal, so that no process writes into a directory
that another refused, and a second run is refused by the first's lock as
before. The lead keeps the lock until every process is done with the
directory. Within the run, what each process writes there is the command's
choice (docs/multihost.md): the compression writes from the lead alone; a
fine-tuning run's Orbax checkpoints come from every process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from qmoe_jax.checkpoints import output_dir
from qmoe_jax.checkpoints.output_dir import OutputKind
from qmoe_jax.distributed import exchange, runtime


@contextlib.contextmanager
def claimed(directory: str, kind: OutputKind) -> Iterator[str]:
    """``output_dir.claimed`` for every process of the run (collective); yields the directory's
    absolute path."""
    if runtime.process_count() == 1:
        with output_dir.claimed(directory, kind) as path:
            yield path
        return
    held = contextlib.ExitStack()
    with held:
        path = exchange.decided(lambda: held.enter_context(output_dir.claimed(directory, kind)))
        yield path
        exchange.barrier("qmoe_jax: every process is done with the output directory")
