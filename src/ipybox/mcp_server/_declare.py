"""Declaring an MCP tool once: its handler's typed signature is its input schema.

As the MCP SDK's ``Tool.from_function`` does, the arguments model is a Pydantic model made
from the handler's parameters (``Annotated[type, Field(description=..., ge=...)]`` and
defaults), and the published schema is that model's JSON schema. Unlike the SDK's model, this
one is closed and strict: an argument the tool does not take is refused, and a value of the
wrong JSON type (``"10"`` or ``true`` for a number) is not converted but refused by name.
Keyword-only parameters of the handler (``progress``) are not arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import mcp_types as types
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

Handler = Callable[..., Awaitable[types.CallToolResult]]
_H = TypeVar("_H", bound=Handler)

_ARGUMENTS = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True)
class Declared:
    """One tool: what `tools/list` shows, how its arguments are checked, and its handler.

    Attributes:
        tool: The tool as listed.
        arguments: The model that checks a call's arguments (its schema is ``tool.input_schema``).
        handler: The unbound method of the session object that runs the tool.
        takes_progress: Whether the handler takes a ``progress`` keyword.
    """

    tool: types.Tool
    arguments: type[BaseModel]
    handler: Handler
    takes_progress: bool

    def signature(self) -> str:
        """The tool as a call, the way the README writes it: ``name(required, optional=default)``."""
        schema = self.tool.input_schema
        required = schema.get("required", [])
        parts = [
            name if name in required else f"{name}={prop['default']!r}"
            for name, prop in schema.get("properties", {}).items()
        ]
        return f"{self.tool.name}({', '.join(parts)})"

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The handler's keyword arguments for a call's `arguments`.

        Raises:
            ValueError: Saying which arguments are missing, unknown or of the wrong type, and
                how the tool is called.
        """
        try:
            return dict(self.arguments.model_validate(arguments))
        except ValidationError as exc:
            problems = " ".join(_problem(self.tool.name, error) for error in exc.errors(include_url=False))
            raise ValueError(f"{problems} Call it as {self.signature()}.") from None


def declare(
    registry: dict[str, Declared],
    *,
    title: str,
    description: str,
    read_only: bool,
    destructive: bool | None = None,
    idempotent: bool | None = None,
    open_world: bool,
) -> Callable[[_H], _H]:
    """Declare the decorated method as the tool of its name, in `registry`.

    Args:
        registry: Where the tool is recorded under its name (the method's).
        title: A short human-readable name (the tool's title and its annotations' title).
        description: What the agent reads about the tool.
        read_only: Whether the tool leaves everything as it was.
        destructive: Whether it may destroy state or data (not given for read-only tools).
        idempotent: Whether calling it again with the same arguments changes nothing more.
        open_world: Whether it reaches beyond the workspace and kernel (the network, processes).
    """

    def decorate(handler: _H) -> _H:
        parameters = list(inspect.signature(handler, eval_str=True).parameters.values())[1:]  # after self
        fields: dict[str, Any] = {
            p.name: (p.annotation, ... if p.default is p.empty else p.default)
            for p in parameters
            if p.kind is p.POSITIONAL_OR_KEYWORD
        }
        arguments = create_model(f"{handler.__name__}Arguments", __config__=_ARGUMENTS, **fields)
        annotations = types.ToolAnnotations(
            title=title,
            read_only_hint=read_only,
            destructive_hint=destructive,
            idempotent_hint=idempotent,
            open_world_hint=open_world,
        )
        tool = types.Tool(
            name=handler.__name__,
            title=title,
            description=description,
            input_schema=arguments.model_json_schema(),
            annotations=annotations,
        )
        takes_progress = any(p.name == "progress" and p.kind is p.KEYWORD_ONLY for p in parameters)
        registry[tool.name] = Declared(tool, arguments, handler, takes_progress)
        return handler

    return decorate


def _problem(tool: str, error: Any) -> str:
    name = ".".join(str(part) for part in error["loc"])
    got = error.get("input")
    match error["type"]:
        case "missing":
            return f"The argument {name!r} is missing."
        case "extra_forbidden":
            return f"{tool} takes no argument {name!r}."
        case "greater_than_equal":
            return f"The argument {name!r} must be at least {error['ctx']['ge']}, not {got!r}."
        case "greater_than":
            return f"The argument {name!r} must be greater than {error['ctx']['gt']:g}, not {got!r}."
        case _:
            # The type errors: "Input should be a valid string" and the like.
            wanted = str(error["msg"]).removeprefix("Input should be ")
            return f"The argument {name!r} must be {wanted}, not {type(got).__name__}."
