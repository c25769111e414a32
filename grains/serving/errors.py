"""What a served model refuses, and why; each leaf says which HTTP status the front answers.

::

    RedgrainError
    └── ServingError
        ├── BadInputError         wrong shape, datatype or input names      400
        ├── ModelNotFoundError    no model deployed under that name         404
        ├── RequestTooLargeError  more rows or bytes than the model takes   413
        └── ModelNotReadyError    deployed, weights not loaded (yet)        503
            └── ModelUnservableError  not loadable as deployed (a spec to fix)  503

Raised in a replica they cross the wire as ``RemoteGrainError`` naming their
type (the runtime rebuilds only its own error classes); :func:`from_remote`
turns one back into its class, which the HTTP front and
:class:`grains.serving.client.Predictor` do. All are the caller's or the
deployment's fault, never the replica's: the replica keeps serving.
"""

from __future__ import annotations

from silo import errors


class ServingError(errors.RedgrainError):
    status = 500


class BadInputError(ServingError):
    status = 400


class ModelNotFoundError(ServingError):
    status = 404

    def __init__(self, name: str = "") -> None:
        self.name = name
        super().__init__(f"no model {name!r} is deployed")


class RequestTooLargeError(ServingError):
    status = 413


class ModelNotReadyError(ServingError):
    status = 503


class ModelUnservableError(ModelNotReadyError):
    """The deployment cannot load as it stands (its model's inputs unreadable, a dataset or
    factory that fails): it needs a new deploy, not time. ``redgrain serve`` stops on it."""


_BY_NAME: dict[str, type[ServingError]] = {
    f"{cls.__module__}.{cls.__qualname__}": cls
    for cls in (BadInputError, ModelNotFoundError, RequestTooLargeError, ModelNotReadyError, ModelUnservableError)
}


def from_remote(exc: BaseException) -> BaseException:
    """The serving error a ``RemoteGrainError`` stands for, else ``exc`` itself."""
    if isinstance(exc, errors.RemoteGrainError):
        cls = _BY_NAME.get(exc.type_name)
        if cls is not None:
            out = cls.__new__(cls)
            Exception.__init__(out, exc.message)
            return out
    return exc
