"""The connection to a host's libvirt: opened on first use, reopened when it died, its refusals
turned into lab errors. libvirt-python is an optional dependency, imported on first use."""

from __future__ import annotations

from typing import Any

from lab.errors import AuthError, BackendError, LabError, UnreachableError


def libvirt_module() -> Any:
    """libvirt-python, with its default error printing silenced (we raise its errors instead)."""
    try:
        import libvirt  # noqa: PLC0415 - optional dependency, loaded when a libvirt host is used
    except ImportError as exc:
        raise LabError(
            "libvirt-python is not installed (needed by the libvirt backend)",
            hint="run `make setup` (pip install -e '.[libvirt]')",
        ) from exc
    if not getattr(libvirt, "_lab_quiet", False):
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        libvirt._lab_quiet = True
    return libvirt


def libvirt_qemu_module() -> Any:
    """libvirt-python's QEMU-only calls (the guest agent), part of the same package."""
    libvirt_module()
    import libvirt_qemu  # noqa: PLC0415 - optional dependency, as above

    return libvirt_qemu


def error_code(exc: Exception) -> int:
    get = getattr(exc, "get_error_code", None)  # libvirtError's; other exceptions have none
    return get() if get else -1


def error_message(exc: Exception) -> str:
    get = getattr(exc, "get_error_message", None)
    return (get() if get else None) or str(exc)


class Connection:
    def __init__(self, uri: str):
        self.uri = uri
        self._conn: Any = None
        self.lib_version: int | None = None  # the host's libvirt, known once probe() asked

    @property
    def safe_uri(self) -> str:
        """The URI without its query (a keyfile path stays out of facts and messages)."""
        return self.uri.split("?", 1)[0]

    def get(self) -> Any:
        """The open virConnect. AuthError or UnreachableError when libvirt cannot be reached."""
        libvirt = libvirt_module()
        if self._conn is not None:
            try:
                if self._conn.isAlive():
                    return self._conn
            except libvirt.libvirtError:
                pass
            self._conn = None
        try:
            self._conn = libvirt.open(self.uri)
        except libvirt.libvirtError as exc:
            msg = error_message(exc)
            if (
                error_code(exc) in (libvirt.VIR_ERR_AUTH_FAILED, getattr(libvirt, "VIR_ERR_AUTH_CANCELLED", -2))
                or "authentication" in msg.lower()
                or "permission denied" in msg.lower()
            ):
                raise AuthError(
                    f"libvirt refused {self.safe_uri}: {msg}",
                    hint="check the SSH key / polkit rights for the libvirt socket",
                ) from None
            raise UnreachableError(
                f"cannot connect to libvirt at {self.safe_uri}: {msg}",
                hint="is libvirtd running on the host (libvirtd -d / service libvirtd start)?",
            ) from None
        return self._conn

    def probe(self) -> str:
        """Ask the host's libvirt its version (kept in lib_version) and its driver type ("bhyve",
        "qemu", "test")."""
        libvirt = libvirt_module()
        conn = self.get()
        try:
            self.lib_version = conn.getLibVersion()
            return conn.getType().lower()
        except libvirt.libvirtError as exc:
            raise UnreachableError(f"libvirt at {self.safe_uri} does not answer: {error_message(exc)}") from None

    def lookup(self, name: str) -> Any | None:
        """The domain named `name`, or None when there is none."""
        libvirt = libvirt_module()
        try:
            return self.get().lookupByName(name)
        except libvirt.libvirtError as exc:
            if error_code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise BackendError(f"libvirt lookup of {name!r} failed: {error_message(exc)}") from None

    def domains(self, host_name: str) -> list[Any]:
        libvirt = libvirt_module()
        try:
            return self.get().listAllDomains(0)
        except libvirt.libvirtError as exc:
            raise BackendError(f"listing domains on {host_name!r} failed: {error_message(exc)}") from None

    def remove_domain(self, name: str, driver: str, uuid: str = "") -> str | None:
        """Power off and undefine the domain `name`: how it was undefined ("nvram", "plain",
        "gone"), None if there was none. With `uuid`, a domain of that name with another UUID is
        not the one meant: BackendError, nothing touched."""
        libvirt = libvirt_module()
        dom = self.lookup(name)
        if dom is None:
            return None
        if uuid and dom.UUIDString() != uuid:
            raise BackendError(
                f"domain {name!r} is another domain now (UUID {dom.UUIDString()}, not {uuid}): left alone"
            )
        try:
            if dom.isActive():
                dom.destroy()
        except libvirt.libvirtError as exc:
            if error_code(exc) not in (libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_ERR_NO_DOMAIN):
                raise
        try:
            return _undefine(dom, driver)
        except libvirt.libvirtError as exc:
            if error_code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
                return "gone"
            raise

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a dead connection: nothing left to release
                pass
            self._conn = None


def _undefine(dom: Any, driver: str) -> str:
    """Undefine with NVRAM removal where the driver knows the flag; a plain undefine on drivers
    that refuse any flag (older bhyve, the test driver)."""
    libvirt = libvirt_module()
    flags = libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
    if driver == "qemu":
        flags |= libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
    try:
        dom.undefineFlags(flags)
        return "nvram"
    except libvirt.libvirtError as exc:
        if error_code(exc) == libvirt.VIR_ERR_NO_DOMAIN:
            return "gone"
        if error_code(exc) not in (
            libvirt.VIR_ERR_INVALID_ARG,
            libvirt.VIR_ERR_NO_SUPPORT,
            libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED,
        ):
            raise
    dom.undefine()
    return "plain"
