"""All binary layout of a node store: the metadata segment, its records, and the objects in the arena.

Nothing else in shmstore computes an offset into shared memory: the other modules call what this package
exports (as ``layout.X``), pure functions over a buffer and an offset.

- :mod:`.fields`: every record, declared once as a table of fields, and the constants they hold;
- :mod:`.sections`: where each section of the metadata segment starts (:class:`Layout`);
- :mod:`.access`: reads and writes that take more than one field store.
"""
from .access import *  # noqa: F403
from .access import __all__ as _access
from .fields import *  # noqa: F403
from .fields import __all__ as _fields
from .sections import *  # noqa: F403
from .sections import __all__ as _sections

__all__ = _fields + _sections + _access
