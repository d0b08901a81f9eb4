"""hyperrec.testing: test helpers shared by hyperrec packages (dev-only).

- :func:`run_on_ranks` runs a function on N real gloo ranks on the CPU.
- :func:`fake_mesh` builds an N-rank ``DeviceMesh`` in one process (fake backend).
- Comparators: :func:`rel_error`, :func:`snr_db`, :func:`max_abs_error`,
  :func:`assert_close_to_reference` (the 2x-the-reference-error rule), :func:`poison_like`.
- Benchmarks: :func:`machine_info`, :func:`write_result` (JSON with machine and versions).
- :mod:`hyperrec.testing.bad_inputs`: table-driven bad-input catalogues and fuzzing helpers.
- :mod:`hyperrec.testing.env`: environment flags read as their owners read them
  (``TRITON_INTERPRET``).
"""

from hyperrec.testing._version import __version__
from hyperrec.testing.bench import machine_info, write_result
from hyperrec.testing.distributed import RankError, fake_mesh, run_on_ranks
from hyperrec.testing.numeric import (
    assert_close_to_reference,
    max_abs_error,
    poison_like,
    rel_error,
    snr_db,
)

__all__ = [
    "RankError",
    "__version__",
    "assert_close_to_reference",
    "fake_mesh",
    "max_abs_error",
    "poison_like",
    "rel_error",
    "run_on_ranks",
    "snr_db",
    "machine_info",
    "write_result",
]
