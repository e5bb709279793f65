"""Kernels for tests/engine/test_aot.py: every argument kind the library's entries pack, a tuple
returned, an exception raised (not collected by pytest: no test here)."""

from spark_stretch.engine.jit import njit


@njit(nogil=True)
def divide(a, b):
    return a // b  # (b == 0: numba raises ZeroDivisionError)


@njit(nogil=True)
def mixed(x, f, f32, u, flag, small, grid, pair):
    total = 0.0
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            total += grid[i, j]
    grid[0, 0] = -1.0  # (written through: the caller's array)
    lo = pair[0][0] + pair[1][-1]
    return x + small + (1 if flag else 0) + lo + (u >> 60), int(total * f + f32)
