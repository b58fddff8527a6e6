"""One node store as a whole: its segments and clients (``NodeStore``), each client's supply of entries and
chunk, repair, the janitor, ``check``, inbound-transfer dedup, prefaulting, the protocols between the
metadata and the levels, and how values become bytes and come back as views."""
