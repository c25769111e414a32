"""The whole redgrain error tree.

::

    RedgrainError
    ├── GrainCallError
    │   ├── GrainTimeoutError        the call's deadline passed before an answer came
    │   ├── RemoteGrainError         the grain method raised; carries type, message, traceback
    │   ├── GrainDeactivatedError    the activation went away and the call could not be re-routed
    │   ├── DeadlockError            a non-reentrant call chain came back to a grain already in it
    │   ├── UnknownGrainError        no such grain type (or not allowed on this silo)
    │   ├── UnknownMethodError       the grain type (or observer) has no such public async method
    │   │   └── MethodRemovedError   only versions older than the grain's active one have it: it never moves back
    │   ├── ObserverGoneError        the observer's process is gone, or it was disposed: drop it
    │   └── OverloadedError          back-pressure: too many calls in flight or queued
    │       └── LoadShedError        a silo turned the call away unrun (over a limit): routers retry it with backoff
    ├── SiloError
    │   ├── SiloUnavailableError     a peer broke it: connection refused / reset, silo dead
    │   │   └── SiloNotServingError  the call never ran: refused (draining, fenced) or never sent: retry elsewhere
    │   │       └── VersionMismatchError  its version of the grain type must not serve the call: retry re-places it
    │   ├── SiloClosedError          we closed it: the local silo or client is stopping
    │   ├── MembershipError          the membership table refused or lost us
    │   ├── AuthenticationError      the cluster secret did not match
    │   └── StartupTaskError         an @on_silo_start task failed: the silo did not start
    ├── StorageError                 state could not be read or written (Redis down, slow)
    │   └── StateConflictError       etag or fencing check failed
    ├── CodecError                   bad frame / unknown type / oversized message
    ├── StreamGapError               retention trimmed items before an explicit subscription read them
    └── ConfigError                  bad settings, bad job spec, bad import path

Workloads add their own leaves under ``RedgrainError`` next to their code
(``grains.training.strategies.allreduce.rendezvous.GroupAbandonedError``): the runtime knows none.

Errors are named for who is at fault: ``SiloClosedError`` means *we* closed
it, ``SiloUnavailableError`` means the *peer* broke. Leaf classes build their
own message from their fields.
"""

from __future__ import annotations


class RedgrainError(Exception):
    """Root of every error redgrain raises on purpose."""


# --- calls -----------------------------------------------------------------


class GrainCallError(RedgrainError):
    """A grain call did not produce a result."""


class GrainTimeoutError(GrainCallError):
    def __init__(self, target: str = "", method: str = "", timeout_s: float = 0.0) -> None:
        self.target = target
        self.method = method
        self.timeout_s = timeout_s
        super().__init__(f"call {target}.{method} got no answer within {timeout_s:.3g}s")


class RemoteGrainError(GrainCallError):
    """A grain method raised; this carries what the remote side knew about it."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        super().__init__(f"{type_name}: {message}")

    def __str__(self) -> str:
        text = f"{self.type_name}: {self.message}"
        if self.traceback_text:
            text += "\n--- remote traceback ---\n" + self.traceback_text.rstrip()
        return text


class GrainDeactivatedError(GrainCallError):
    def __init__(self, target: str = "", reason: str = "") -> None:
        self.target = target
        self.reason = reason
        super().__init__(f"activation of {target} went away ({reason}) and the call was not re-routed")


class DeadlockError(GrainCallError):
    def __init__(self, target: str = "", chain: list[str] | None = None) -> None:
        self.target = target
        self.chain = list(chain or [])
        path = " -> ".join([*self.chain, target])
        super().__init__(f"call chain would deadlock on non-reentrant grain {target}: {path}")


class UnknownGrainError(GrainCallError):
    def __init__(self, type_name: str = "", detail: str = "") -> None:
        self.type_name = type_name
        msg = f"unknown grain type {type_name!r}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class UnknownMethodError(GrainCallError):
    def __init__(
        self, type_name: str = "", method: str = "", versions: list[int] | None = None, kind: str = "grain type"
    ) -> None:
        self.type_name = type_name
        self.method = method
        self.versions = list(versions or [])
        """The versions of the type the caller knew (after reading the manifests again)."""
        msg = f"{kind} {type_name!r} has no public async method {method!r}"
        if self.versions:
            known = ", ".join(map(str, self.versions))
            msg += f" in any version the cluster publishes (versions known: {known})"
        super().__init__(msg)


class MethodRemovedError(UnknownMethodError):
    """The grain is active on a version that removed the method, and only older versions have
    it. A grain never moves back to an older version while its own is hosted (else callers of
    the removed method and of a new one would move it back and forth, one activation per
    call); the call did not run. Upgrade the caller, or call a method its version has."""

    def __init__(
        self, grain: str = "", method: str = "", version: int = 0, versions: list[int] | None = None
    ) -> None:
        self.type_name = grain.split("/", 1)[0]
        self.method = method
        self.versions = list(versions or [])
        """The versions that have the method (all older than ``version``)."""
        self.grain = grain
        self.version = version
        """The version the grain is active on."""
        with_it = ", ".join(map(str, self.versions))
        GrainCallError.__init__(
            self,
            f"grain {grain} is active on {self.type_name} version {version}, which has no method {method!r}"
            f" (versions with it: {with_it}); a grain never moves back to an older version while its"
            " own is hosted: upgrade the caller",
        )


class ObserverGoneError(GrainCallError):
    """The observer cannot be called any more: its client closed or died (its connection is
    gone), its process was replaced, or it was disposed. Not worth retrying: ``ObserverSet``
    drops it, and its owner subscribes a new one if it is still there."""

    def __init__(self, observer: str = "", detail: str = "") -> None:
        self.observer = observer
        self.detail = detail
        msg = f"observer {observer} is gone"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class OverloadedError(GrainCallError):
    def __init__(self, what: str = "", limit: int = 0) -> None:
        self.what = what
        self.limit = limit
        super().__init__(f"{what} is over its limit of {limit}; retry later")


class LoadShedError(OverloadedError):
    """A silo turned the call away before any grain code ran, because it was over a limit.

    Never run, so routers retry it with backoff until the call's deadline (then
    the caller gets GrainTimeoutError, as for any call answered too late).
    """


# --- silos -----------------------------------------------------------------


class SiloError(RedgrainError):
    """Something about a silo or a connection to one."""


class SiloUnavailableError(SiloError):
    """The peer broke: refused, reset, or declared dead. A call in flight may have run."""

    def __init__(self, address: str = "", detail: str = "") -> None:
        self.address = address
        self.detail = detail
        msg = f"silo {address} is unavailable" if address else "silo unavailable"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class SiloNotServingError(SiloUnavailableError):
    """The silo turned the call away before any grain code ran (it is draining or fenced), or
    the call never left this process (its connection broke before or in its own write).

    Never delivered, so routers retry it elsewhere even though it is a
    SiloUnavailableError (which, in general, may have run).
    """


class VersionMismatchError(SiloNotServingError):
    """The silo's version of the grain type must not serve this call (docs/internals.md, Versions).

    Either its version lacks the method (another version has it: the activation
    here, if any, was deactivated first) or a newer version that has it is hosted
    elsewhere and this silo creates no new activation of an older one. Nothing
    ran, so routers place the call again by the version rule.
    """

    def __init__(
        self, address: str = "", type_name: str = "", method: str = "", version: int = 1, wanted: int | None = None
    ) -> None:
        self.type_name = type_name
        self.method = method
        self.version = version
        self.wanted = wanted if wanted is not None else 0
        where = f"version {wanted}" if wanted else "another version"
        super().__init__(
            address, f"it hosts {type_name} version {version}; a call of {method!r} goes to {where}"
        )


class SiloClosedError(SiloError):
    """We closed it: the local silo, client or connection is shutting down."""

    def __init__(self, what: str = "connection") -> None:
        self.what = what
        super().__init__(f"{what} is closed")


class MembershipError(SiloError):
    """The membership table refused us or declared us dead."""


class AuthenticationError(SiloError):
    def __init__(self, peer: str = "", detail: str = "cluster secret mismatch") -> None:
        self.peer = peer
        super().__init__(f"authentication with {peer or 'peer'} failed: {detail}")


class StartupTaskError(SiloError):
    """An ``@on_silo_start`` task raised or ran too long: the silo's start failed."""

    def __init__(self, task: str, reason: str) -> None:
        self.task = task
        self.reason = reason
        super().__init__(f"startup task {task} failed, so the silo did not start: {reason}")


# --- storage ---------------------------------------------------------------


class StorageError(RedgrainError):
    """Grain state could not be read or written."""


class StateConflictError(StorageError):
    def __init__(self, grain: str = "", detail: str = "etag or fencing token mismatch") -> None:
        self.grain = grain
        self.detail = detail
        super().__init__(f"state write for {grain} refused: {detail}")


# --- the rest --------------------------------------------------------------


class CodecError(RedgrainError):
    """A frame or value could not be encoded or decoded."""


class StreamGapError(RedgrainError):
    """Retention trimmed items of a stream before this explicit subscription read them. The
    subscription has moved past the gap: iterate it again for the items after it."""

    def __init__(self, namespace: str, key: str, after: str, before: str | None, lost: int | None) -> None:
        self.namespace, self.key, self.after, self.before, self.lost = namespace, key, after, before, lost
        count = "items" if lost is None else f"{lost} item{'' if lost == 1 else 's'}"
        upto = "the newest" if before is None else f"before {before}"
        super().__init__(f"stream {namespace}/{key}: {count} after {after} and {upto} were trimmed unread")


class ConfigError(RedgrainError):
    """Bad settings, a bad job spec or an import path that does not resolve."""


# Wire codes for errors that cross the network as themselves rather than as
# RemoteGrainError. The receiving side rebuilds the class from the code.
WIRE_CODES: dict[str, type[RedgrainError]] = {
    "timeout": GrainTimeoutError,
    "deactivated": GrainDeactivatedError,
    "deadlock": DeadlockError,
    "unknown_grain": UnknownGrainError,
    "unknown_method": UnknownMethodError,
    "method_removed": MethodRemovedError,
    "observer_gone": ObserverGoneError,
    "overloaded": OverloadedError,
    "shed": LoadShedError,
    "unavailable": SiloUnavailableError,
    "not_serving": SiloNotServingError,
    "version_mismatch": VersionMismatchError,
    "closed": SiloClosedError,
    "storage": StorageError,
    "state_conflict": StateConflictError,
    "codec": CodecError,
    "config": ConfigError,
    "auth": AuthenticationError,
}
CODE_OF: dict[type[RedgrainError], str] = {cls: code for code, cls in WIRE_CODES.items()}

# --- training ----------------------------------------------------------------


__all__ = [
    "AuthenticationError",
    "CodecError",
    "ConfigError",
    "DeadlockError",
    "GrainCallError",
    "GrainDeactivatedError",
    "GrainTimeoutError",
    "LoadShedError",
    "MembershipError",
    "MethodRemovedError",
    "ObserverGoneError",
    "OverloadedError",
    "RedgrainError",
    "RemoteGrainError",
    "SiloClosedError",
    "SiloError",
    "SiloNotServingError",
    "SiloUnavailableError",
    "StateConflictError",
    "StorageError",
    "UnknownGrainError",
    "UnknownMethodError",
    "VersionMismatchError",
]
