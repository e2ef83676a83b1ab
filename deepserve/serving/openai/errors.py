"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure the server reports goes through `OpenAIError` (or is converted to one here), so clients see
one shape whatever went wrong: a bad field (400, named in `param`), a missing or wrong key (401), an
unknown model or route (404), a body too large (413), rate limiting (429, Retry-After), a full queue (503).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(HTTPException):
    """An error answered as an OpenAI error object. An HTTPException, so frameworks pass it through."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def not_supported(feature: str, param: str) -> OpenAIError:
    return OpenAIError(400, f"{feature} is not supported yet", param=param, code="not_supported")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(HTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected_error)


async def _on_openai_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, OpenAIError)
    return error_response(error)


async def _on_validation_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    return error_response(validation_error(error.errors()))


async def _on_http_exception(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    return error_response(OpenAIError(error.status_code, str(error.detail), headers=error.headers))


async def _on_unexpected_error(_: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error while serving a request", exc_info=error)
    return error_response(OpenAIError(500, f"internal server error: {type(error).__name__}"))


def _is_union_tag(part: Any) -> bool:
    """Pydantic names the branch of a union it tried (`str`, `list[int]`, `NamedToolChoice`); not a field."""
    if not isinstance(part, str):
        return False
    return part in _UNION_SCALAR_TAGS or "[" in part or "'" in part or part[:1].isupper() or "-" in part


_UNION_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def validation_error(errors: Any) -> OpenAIError:
    """Pydantic's error list -> one 400 naming the first offending field (`messages.0.role`)."""
    errors = list(errors)
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = ".".join(location) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = "field required"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return bad_request(f"{param}: {message}{more}" if param else f"{message}{more}", param)
