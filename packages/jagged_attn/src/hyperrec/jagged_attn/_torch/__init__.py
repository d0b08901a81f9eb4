"""The reference backend (``backend="torch"``), laid out like the Triton backend.

:mod:`hyperrec.jagged_attn.reference` behind ``torch.library`` custom ops: ``ops.py``
registers the ops, ``_launch.py`` runs one
:class:`~hyperrec.jagged_attn._opschema.AttentionCall`.
"""
