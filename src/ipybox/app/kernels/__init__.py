"""The kernels subsystem of the application side."""
