"""Public paths of the kernel gateway manager and the kernel client.

- ``ipybox.kernel_mgr.server.KernelGateway``: starts a Jupyter Kernel Gateway.
- ``ipybox.kernel_mgr.client.KernelClient``: runs code in one kernel.

The code lives in ``ipybox.app``; these modules re-export it.
"""
