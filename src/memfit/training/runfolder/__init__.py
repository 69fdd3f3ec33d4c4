"""The run folder, one job: what a run writes in ``--output`` and reads back, safely.

``folder`` (whose folder it is, its lock, what memfit may write or remove there), ``ledger`` (the run's own
manifest, ``.memfit-files.json``), ``layout`` (where checkpoints live), ``checkpoint`` (atomic, verified,
rotated saves; loading one for a resume; the final export), ``manifest`` (a checkpoint's integrity),
``readback`` (the schemas of the files read back) and ``space`` (free space before a save).
"""
