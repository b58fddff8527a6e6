"""OS primitives, knowing nothing of the store's records: ctypes (robust mutexes, futexes, madvise), POSIX
shared-memory segments and semaphores, safe opens against planted files, process identity, signal deferral,
bulk copies."""
