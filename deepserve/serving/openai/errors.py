"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure the server reports goes through `OpenAIError` (or is converted to one here), so clients see
one shape whatever went wrong: a bad field (400, named in `param`), a missing or wrong key (401), an
unknown model or route (404), a body too large (413), rate limiting (429, Retry-After), a full queue (503).
As OpenAI does, a bad key and an unknown model are `invalid_request_error`s too; `code` tells them apart.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
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


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


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


def _error_code(error_type: str) -> str:
    """OpenAI's codes for pydantic's error types: a value of the wrong JSON type (`int_type`, `bool_type`,
    `list_type`, `model_type`, ...; `*_parsing` in lax mode) is `invalid_type`, an absent field (`missing`,
    or a union whose tag field is absent) `missing_required_parameter`, anything else (bounds, lengths,
    literals, custom checks) `invalid_value`."""
    if error_type in ("missing", "union_tag_not_found"):
        return "missing_required_parameter"
    if error_type.endswith(("_type", "_parsing")) or error_type in ("int_from_float", "is_instance_of"):
        return "invalid_type"
    return "invalid_value"


def _param(loc: Sequence[Any]) -> str | None:
    """OpenAI's spelling of a location: `messages[0].content` (fields dotted, list indices bracketed)."""
    param = ""
    for part in loc:
        if part == "body" or _is_union_tag(part):
            continue
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


def _location(error: dict[str, Any]) -> list[Any]:
    # Errors raised above the field they are about (a message's role, checked before the union picks its
    # branch) name that field in ctx["param"].
    extra = (error.get("ctx") or {}).get("param")
    return [*error.get("loc", ()), *([extra] if extra else [])]


def _most_specific(errors: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Of the errors for the branches of the innermost union the first error is in, the one of the branch
    that got furthest (a value error before a type error at equal depth): for `prompt: [[false]]`, the error
    at `prompt[0][0]`, not "prompt should be a string". Returns it and the errors of that union (or just it)."""
    first = errors[0]
    loc = list(first.get("loc", ()))
    tag_at = max((i for i, part in enumerate(loc) if _is_union_tag(part)), default=None)
    if tag_at is None:
        return first, [first]
    branches = [e for e in errors if list(e.get("loc", ()))[:tag_at] == loc[:tag_at]
                and len(e.get("loc", ())) > tag_at]
    best = max(branches, key=lambda e: (len(e["loc"]), _error_code(e["type"]) != "invalid_type"))
    if len(best["loc"]) == tag_at + 1 and _error_code(best["type"]) == "invalid_type":
        # No branch got past its type check: say which types would do.
        kinds = " | ".join(dict.fromkeys(str(e["loc"][tag_at]).replace("constrained-", "") for e in branches))
        return {**best, "msg": f"Input should be one of: {kinds}"}, branches
    return best, branches


def validation_error(errors: Any) -> OpenAIError:
    """Pydantic's error list -> one 400 naming the offending field (`messages[0].role`), with an OpenAI code."""
    errors = list(errors)
    if not errors:
        return bad_request("invalid request")
    if errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    chosen, alternatives = _most_specific(errors)
    param = _param(_location(chosen))
    message = chosen.get("msg", "invalid value")
    if chosen.get("type") == "missing" and message == "Field required":
        message = "field required"
    # A union's branches fail together: count the other fields in error, not pydantic's errors.
    others = len({_param(_location(e)) for e in errors if not any(e is a for a in alternatives)} - {param})
    more = f" (and {others} more problem{'s' if others > 1 else ''})" if others else ""
    return bad_request(f"{param}: {message}{more}" if param else f"{message}{more}", param,
                       code=_error_code(chosen.get("type", "")))
