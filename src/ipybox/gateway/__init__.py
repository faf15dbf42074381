"""Code that runs in the kernel gateway's process and the launchers it starts, outside the sandbox.

Trusted, and standard library only apart from the gateway itself (``_main`` imports Jupyter
Kernel Gateway): the launchers run as scripts (``python -I -S``) before a kernel starts.

- ``_main``: the gateway's entry point (``python -m ipybox.gateway._main``).
- ``_kernel_launch``: starts one sandboxed kernel in folders of its own, ended with the gateway.
- ``_limits``: memory and process limits for a kernel's tree (its script half runs here; the
  application imports its other half to decide how the limits are enforced).
"""
