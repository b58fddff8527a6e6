"""One process's verbs on a node store, above the levels: ``Kernel`` (get, delete, info, list, export, sink),
``Puts`` (reserve, write, seal), batches, pins, and the client state they share."""
