"""A module whose import registers ``abort()`` as a C exit handler, as a library's static
destructors are: a process that imported it and then ran the C exit handlers dies of SIGABRT."""

import ctypes

libc = ctypes.CDLL(None)
libc.on_exit(ctypes.cast(libc.abort, ctypes.c_void_p), None)
