"""Build hook: the optional C helpers, the kernel's fast path and copier and the MPI prober (metadata lives in
setup.cfg).

``optional=True``: where no C compiler is available the build goes on and
shmstore runs on its pure-Python kernel, with the same behaviour.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("shmstore.meta._fast", ["shmstore/meta/_fast.c"], optional=True),
                   Extension("shmstore.primitives._copy", ["shmstore/primitives/_copy.c"], optional=True),
                   Extension("shmstore.mpi._probe", ["shmstore/mpi/_probe.c"], optional=True)])
