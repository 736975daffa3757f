"""One command, several processes: joining JAX's multi-process runtime (``runtime``), what the
processes tell each other (``exchange``) and the output-directory rules among them
(``output_dir``). docs/multihost.md is the user's side."""

from qmoe_jax.distributed.exchange import PeerError as PeerError
from qmoe_jax.distributed.exchange import checked as checked
from qmoe_jax.distributed.exchange import decided as decided
from qmoe_jax.distributed.exchange import gathered as gathered
from qmoe_jax.distributed.runtime import is_lead as is_lead
from qmoe_jax.distributed.runtime import label as label
from qmoe_jax.distributed.runtime import lead_only as lead_only
from qmoe_jax.distributed.runtime import process_count as process_count
from qmoe_jax.distributed.runtime import process_index as process_index
