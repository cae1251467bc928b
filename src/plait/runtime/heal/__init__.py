"""Data-parallel replicas that heal without a restart (``plait train --heal``).

* `plait.runtime.heal.supervisor`: the parent process; hosts the store, starts and replaces replicas.
* `plait.runtime.heal.quorum`: the replicas agree on who is alive, through that store.
* `plait.runtime.heal.replicas`: a process group per membership epoch; failures, redone steps, joins.
* `plait.runtime.heal.transfer`: the live state sent to a replica that lacks it, tensor by tensor.

docs/failures.md ("Healing replicas") says what it guarantees and what it costs.
"""

# An internal package (no __all__), used by `plait train --heal`: its names, for the app and the tests.
from plait.runtime.heal.quorum import Epoch, Quorum  # noqa: F401
from plait.runtime.heal.replicas import Replicas, split  # noqa: F401
from plait.runtime.heal.supervisor import Membership, Supervisor  # noqa: F401
from plait.runtime.heal.transfer import LiveState  # noqa: F401
