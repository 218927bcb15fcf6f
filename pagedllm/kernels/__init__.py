"""Native CPU kernels (C++/OpenMP via ctypes) with pure-torch twins.

``ops`` calls the native library when it is available and the inputs suit it, else the
twin in ``reference``; tests run both on the same inputs and compare.
"""
