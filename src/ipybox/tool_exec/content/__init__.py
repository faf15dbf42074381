"""The full, typed content of an MCP tool result, as kernel code gets it from ``run_content()``.

A public import path; the code lives in ``ipybox.kernel._content``.
"""

from ipybox.kernel._content import (
    Audio,
    BlobResource,
    Content,
    Image,
    ResourceLink,
    Text,
    TextResource,
    ToolContent,
)

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
