"""The kernel interface: what a kernel family declares (``base``), how its launches are
built once for running and compiling ahead (``launch``), how a name finds it
(``registry``), its docs table (``docs``); ``api`` is all of it in one import."""
