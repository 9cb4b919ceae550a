"""The libvirt backend: bhyve and QEMU/KVM hosts through libvirt-python. `settings` is what
lab.config reads (light: pydantic only); `backend` holds the Backend and is loaded when a lab uses
a libvirt host (its docstring maps the package's modules)."""
