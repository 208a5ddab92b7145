"""Integrations of pyinfinity into other frameworks.

``pyinfinity.integrations.deepspeed``: pyinfinity's swap engine as DeepSpeed's NVMe I/O backend
(``install()`` / ``uninstall()``, or ``PYINFINITY_DEEPSPEED=1`` at import). Submodules are not
imported here, so ``import pyinfinity.integrations`` never imports a framework.
"""
