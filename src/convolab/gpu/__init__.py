"""GPU side of convolab: CUDA C kernels (../kernels/*.cu) compiled at run time through NVRTC.

Nothing in this package imports CuPy at module import time, so `import convolab` works on
machines without CUDA.
"""
