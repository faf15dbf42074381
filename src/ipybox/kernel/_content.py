"""The full, typed content of an MCP tool result, as kernel code gets it from ``run_content()``.

A tool result holds a list of content parts (text, images, audio, links to resources and
embedded resources) and, optionally, structured content. Generated modules return it from
``run_content()`` / ``await arun_content()``; ``run()`` keeps returning only the text (or the
``Result`` model). Binary data arrives as ``bytes``, decoded from the base64 of the MCP
message. Imported inside kernels: standard library only.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

__all__ = [
    "Audio",
    "BlobResource",
    "Content",
    "Image",
    "ResourceLink",
    "Text",
    "TextResource",
    "ToolContent",
]


class _Value:
    """Immutable value with equality and a repr from its ``__slots__``.

    Plain classes rather than dataclasses: this module is imported by every kernel that
    imports a generated tool module, and creating a dataclass costs about 0.6 ms.
    """

    __slots__: tuple[str, ...] = ()

    def __init__(self, *values: Any) -> None:
        for name, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Value)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __repr__(self) -> str:
        fields = []
        for name in self.__slots__:
            value = getattr(self, name)
            fields.append(f"{name}=<{len(value)} bytes>" if isinstance(value, bytes) else f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(fields)})"


class _Binary(_Value):
    __slots__ = ()
    data: bytes

    def save(self, path: str | Path) -> Path:
        """Write the bytes to ``path`` (parent folders are created); returns its absolute path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(self.data)
        return target.resolve()


class Text(_Value):
    """A text part.

    Attributes:
        text: The text.
    """

    __slots__ = ("text",)
    text: str

    def __init__(self, text: str) -> None:
        super().__init__(text)


class Image(_Binary):
    """An image part; ``display(image)`` shows it in the notebook (PNG images also reach
    ``CodeExecutionResult.images``); ``save(path)`` writes it to a file.

    Attributes:
        data: The image's bytes.
        mime_type: Its MIME type, e.g. ``image/png``.
    """

    __slots__ = ("data", "mime_type")
    mime_type: str

    def __init__(self, data: bytes, mime_type: str) -> None:
        super().__init__(data, mime_type)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        data: Any = self.data
        if self.mime_type == "image/svg+xml":
            data = self.data.decode("utf-8", "replace")
        return {self.mime_type: data, "text/plain": repr(self)}


class Audio(_Binary):
    """An audio part; ``save(path)`` writes it to a file.

    Attributes:
        data: The audio's bytes.
        mime_type: Its MIME type, e.g. ``audio/wav``.
    """

    __slots__ = ("data", "mime_type")
    mime_type: str

    def __init__(self, data: bytes, mime_type: str) -> None:
        super().__init__(data, mime_type)


class ResourceLink(_Value):
    """A link to a resource the MCP server offers (its content is not included).

    Attributes:
        uri: The resource's URI.
        name: Its name.
        mime_type: Its MIME type, if the server said.
        description: What it is, if the server said.
        size: Its size in bytes, if the server said.
    """

    __slots__ = ("uri", "name", "mime_type", "description", "size")  # noqa: RUF023  (constructor order)
    uri: str
    name: str
    mime_type: str | None
    description: str | None
    size: int | None

    def __init__(
        self,
        uri: str,
        name: str,
        mime_type: str | None = None,
        description: str | None = None,
        size: int | None = None,
    ) -> None:
        super().__init__(uri, name, mime_type, description, size)


class TextResource(_Value):
    """An embedded resource with text content.

    Attributes:
        uri: The resource's URI.
        text: Its text.
        mime_type: Its MIME type, if the server said.
    """

    __slots__ = ("uri", "text", "mime_type")  # noqa: RUF023  (constructor order)
    uri: str
    text: str
    mime_type: str | None

    def __init__(self, uri: str, text: str, mime_type: str | None = None) -> None:
        super().__init__(uri, text, mime_type)


class BlobResource(_Binary):
    """An embedded resource with binary content; ``save(path)`` writes it to a file.

    Attributes:
        uri: The resource's URI.
        data: Its bytes.
        mime_type: Its MIME type, if the server said.
    """

    __slots__ = ("uri", "data", "mime_type")  # noqa: RUF023  (constructor order)
    uri: str
    mime_type: str | None

    def __init__(self, uri: str, data: bytes, mime_type: str | None = None) -> None:
        super().__init__(uri, data, mime_type)


Content = Text | Image | Audio | ResourceLink | TextResource | BlobResource
"""One piece of a tool's result: any of the content types above."""


class ToolContent(_Value):
    """Everything one tool call returned.

    Attributes:
        parts: The content parts, in the order the tool returned them.
        structured: The structured content (a ``dict``), if the tool returned any.
    """

    __slots__ = ("parts", "structured")
    parts: list[Content]
    structured: dict[str, Any] | None

    def __init__(self, parts: list[Content] | None = None, structured: dict[str, Any] | None = None) -> None:
        super().__init__(parts if parts is not None else [], structured)

    def __hash__(self) -> int:
        raise TypeError("ToolContent is not hashable (it holds a list and a dict)")

    @property
    def text(self) -> str | None:
        """The text parts joined by newlines, or ``None`` when there are none."""
        texts = [part.text for part in self.parts if isinstance(part, Text)]
        return "\n".join(texts) if texts else None

    @property
    def images(self) -> list[Image]:
        """The image parts."""
        return [part for part in self.parts if isinstance(part, Image)]

    @property
    def audio(self) -> list[Audio]:
        """The audio parts."""
        return [part for part in self.parts if isinstance(part, Audio)]

    @property
    def resources(self) -> list[ResourceLink | TextResource | BlobResource]:
        """The resource links and embedded resources."""
        return [part for part in self.parts if isinstance(part, ResourceLink | TextResource | BlobResource)]


def _part(block: dict[str, Any]) -> Content:
    """One MCP content block (its JSON form) to a content part."""
    kind = block.get("type")
    if kind == "text":
        return Text(block["text"])
    if kind == "image":
        return Image(base64.b64decode(block["data"]), block["mimeType"])
    if kind == "audio":
        return Audio(base64.b64decode(block["data"]), block["mimeType"])
    if kind == "resource_link":
        return ResourceLink(
            block["uri"], block["name"], block.get("mimeType"), block.get("description"), block.get("size")
        )
    if kind == "resource":
        resource = block["resource"]
        if "blob" in resource:
            return BlobResource(resource["uri"], base64.b64decode(resource["blob"]), resource.get("mimeType"))
        return TextResource(resource["uri"], resource["text"], resource.get("mimeType"))
    raise ValueError(f"unknown content type {kind!r}")


def from_json(content: list[dict[str, Any]], structured: dict[str, Any] | None) -> ToolContent:
    """Build a `ToolContent` from the tool server's answer (MCP content blocks as JSON).

    Raises:
        ValueError: A block is not valid MCP content.
    """
    try:
        return ToolContent([_part(block) for block in content], structured)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed content block ({exc!r})") from exc
