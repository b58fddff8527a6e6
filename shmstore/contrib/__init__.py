"""Integrations with other projects; each needs its own extra (``shmstore[proxystore]``)."""
