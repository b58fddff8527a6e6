"""The shared metadata, record by record: the binary layout, keys, the object table and its chains, the
extent allocator, the futex-style locks, and the C operations on them (``_fast.c``)."""
