"""The one exception tree of butter.

Every error a client can see is a :class:`ButterError` with structured fields; the
HTTP edge maps it to the OpenAI envelope (or the Anthropic one on ``/v1/messages``)
in one place, ``butter.http.errors``. Nothing matches on exception text.
"""

from __future__ import annotations


class ButterError(Exception):
    """Base of every error butter raises on purpose."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(ButterError):
    """The request body is malformed or a field has the wrong type or value."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationError(ButterError):
    """``--api-key`` is set and the request did not carry it."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ForbiddenError(ButterError):
    """A cross-site ``Origin`` or a ``Host`` the server does not answer to."""

    status_code = 403
    error_type = "permission_error"
    code = "forbidden"


class ClientDisconnectedError(InvalidRequestError):
    """The client closed the connection before its request body arrived (nobody reads
    the answer; it exists so the request ends without a traceback)."""

    code = "client_disconnected"

    def __init__(self) -> None:
        super().__init__("The client closed the connection before the body arrived.")


class ContextLengthExceededError(InvalidRequestError):
    """The prompt (plus the requested completion) can never fit the context."""

    code = "context_length_exceeded"

    def __init__(self, *, prompt_tokens: int, requested_tokens: int, context_window: int) -> None:
        super().__init__(
            f"This model's maximum context length is {context_window} tokens. However, you "
            f"requested {prompt_tokens + requested_tokens} tokens ({prompt_tokens} in the "
            f"messages, {requested_tokens} in the completion). Please reduce the length of "
            "the messages or completion.",
            param="messages",
        )
        self.prompt_tokens = prompt_tokens
        self.requested_tokens = requested_tokens
        self.context_window = context_window


class TemplateError(InvalidRequestError):
    """The chat template refused the conversation (its ``raise_exception``)."""

    code = "chat_template_error"


class ModelNotFoundError(ButterError):
    """No resolver knows the requested model id, or swapping is disabled."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model_id: str, reason: str | None = None) -> None:
        message = f"The model `{model_id}` does not exist or is not available here."
        if reason:
            message = f"{message} {reason}"
        super().__init__(message, param="model")
        self.model_id = model_id


class ModelLoadError(ButterError):
    """The id resolved to something, but the back end could not load it."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "model_load_failed"

    def __init__(self, model_id: str, reason: str) -> None:
        super().__init__(f"Could not load model `{model_id}`: {reason}", param="model")
        self.model_id = model_id
        self.reason = reason


class ModelDownloadError(ButterError):
    """A hub id could not be downloaded: no network, offline mode, a gated repository.

    The hub (not the client's request) failed, so it is a 502, as a proxy reports an
    upstream it could not use; the message is one line naming the id.
    """

    status_code = 502
    error_type = "server_error"
    code = "model_download_failed"

    def __init__(self, model_id: str, reason: str) -> None:
        super().__init__(f"Could not download `{model_id}`: {reason}.", param="model")
        self.model_id = model_id
        self.reason = reason


class BackendUnavailableError(ButterError):
    """No registered back end can load this kind of checkpoint."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "backend_unavailable"


class RequestAbortedError(ButterError):
    """The request was aborted by the server (the resident model is being swapped)."""

    status_code = 503
    error_type = "server_error"
    code = "request_aborted"


class EngineStoppedError(RequestAbortedError):
    """The engine stopped (shutdown or swap) before the request could run."""

    code = "engine_stopped"


class InternalError(ButterError):
    """An unexpected failure; its details go to the log, never to the client."""

    status_code = 500
    error_type = "server_error"
    code = "internal_error"

    def __init__(self, message: str = "The server had an internal error.") -> None:
        super().__init__(message)


class ReplicaLostError(ButterError):
    """The Ray Serve replica running the request died or could not be reached (Serve
    replaces it; other replicas' requests go on)."""

    status_code = 503
    error_type = "server_error"
    code = "replica_lost"

    def __init__(self, message: str = "The replica serving this request was lost.") -> None:
        super().__init__(message)


class ForwardedError(ButterError):
    """A :class:`ButterError` a Ray Serve replica raised, as the ingress re-raises it: the
    same status, type, code, param and message as on one process."""

    def __init__(self, message: str, *, status_code: int, error_type: str,
                 code: str | None, param: str | None) -> None:
        super().__init__(message, param=param)
        self.status_code = status_code
        self.error_type = error_type
        self.code = code
