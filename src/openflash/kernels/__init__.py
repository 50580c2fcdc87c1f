"""Native kernels for the stored weight formats (native.py builds and loads them; gemv.c is the code)."""
