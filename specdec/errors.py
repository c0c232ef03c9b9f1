"""Domain errors raised by engines (no grpc here); servicers map them to gRPC status codes."""
from __future__ import annotations


class SpecdecError(Exception):
    """Base class. `code_name` is the gRPC status code name the servicer uses."""
    code_name = "INTERNAL"


class InvalidRequest(SpecdecError):
    code_name = "INVALID_ARGUMENT"


class SessionNotFound(SpecdecError):
    code_name = "NOT_FOUND"


class CacheMismatch(SpecdecError):
    """The worker's cache does not hold the prefix the caller expects (evicted, restarted, drifted)."""
    code_name = "FAILED_PRECONDITION"


class CapacityExceeded(SpecdecError):
    code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        if retry_after_ms is not None:  # sent as the retry-after-ms trailer (grpc_util)
            self.retry_after_ms = retry_after_ms


class WorkerUnavailable(SpecdecError):
    code_name = "UNAVAILABLE"


class WorkerInternalError(SpecdecError):
    """A worker answered INTERNAL (or another status that means a bug or a misconfiguration, not an
    outage): retrying will not help, and the worker is not unhealthy because of it."""
    code_name = "INTERNAL"


class DeadlineExceeded(SpecdecError):
    code_name = "DEADLINE_EXCEEDED"


class SessionBusy(SpecdecError):
    """Another request is generating on the same session right now."""
    code_name = "FAILED_PRECONDITION"


class SessionInputConflict(SpecdecError):
    """A turn's input is not the kind the session holds (chat messages after a raw prompt, or back)."""
    code_name = "FAILED_PRECONDITION"
