"""``cupy.cuda.memory`` stand-in: CuPy's out-of-memory error class."""


class OutOfMemoryError(MemoryError):
    __module__ = "cupy.cuda.memory"

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes).")
