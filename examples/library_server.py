"""A small library-catalogue MCP server that ships with ipybox for the quickstart.

It is a real MCP server built with the MCP Python SDK, speaking stdio, and needs no
network: the catalogue is in memory. Its tools return structured results, so
`generate_mcp_sources` writes a typed `Result` model for them.

Run it directly with ``python examples/library_server.py`` (it speaks MCP on stdin/stdout).
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field

server = MCPServer("library", log_level="WARNING")


class Book(BaseModel):
    id: str
    title: str
    author: str
    year: int
    tags: list[str]


class BookDetails(Book):
    rating: float = Field(description="Average reader rating, 0 to 5.")
    pages: int
    summary: str


class SearchResult(BaseModel):
    books: list[Book]
    total: int


class Loan(BaseModel):
    book_id: str
    borrower: str
    due_in_days: int


_CATALOGUE = [
    BookDetails(
        id="b1",
        title="Fluent Python",
        author="Luciano Ramalho",
        year=2022,
        tags=["python", "programming"],
        rating=4.7,
        pages=1012,
        summary="Idiomatic Python 3, from data model to concurrency.",
    ),
    BookDetails(
        id="b2",
        title="Python Crash Course",
        author="Eric Matthes",
        year=2023,
        tags=["python", "beginner"],
        rating=4.5,
        pages=552,
        summary="A hands-on introduction to programming in Python.",
    ),
    BookDetails(
        id="b3",
        title="Designing Data-Intensive Applications",
        author="Martin Kleppmann",
        year=2017,
        tags=["databases", "distributed-systems"],
        rating=4.8,
        pages=616,
        summary="The ideas behind reliable, scalable and maintainable data systems.",
    ),
    BookDetails(
        id="b4",
        title="Architecture Patterns with Python",
        author="Harry Percival, Bob Gregory",
        year=2020,
        tags=["python", "architecture"],
        rating=4.4,
        pages=304,
        summary="Domain-driven design and event-driven microservices in Python.",
    ),
    BookDetails(
        id="b5",
        title="The Pragmatic Programmer",
        author="David Thomas, Andrew Hunt",
        year=2019,
        tags=["programming", "craft"],
        rating=4.6,
        pages=352,
        summary="Practical advice for software developers.",
    ),
]
_BY_ID = {book.id: book for book in _CATALOGUE}
_LOANS: list[Loan] = []


@server.tool()
def search_books(query: str, limit: int = 10) -> SearchResult:
    """Search the catalogue by words in the title, author or tags."""
    words = query.lower().split()
    hits = [
        Book(**book.model_dump(include={"id", "title", "author", "year", "tags"}))
        for book in _CATALOGUE
        if all(w in f"{book.title} {book.author} {' '.join(book.tags)}".lower() for w in words)
    ]
    return SearchResult(books=hits[:limit], total=len(hits))


@server.tool()
def get_book(book_id: str) -> BookDetails:
    """Get the full record of a book: rating, page count and summary."""
    if book_id not in _BY_ID:
        raise ToolError(f"No book with id {book_id!r}; search_books lists the ids.")
    return _BY_ID[book_id]


@server.tool()
def borrow_book(book_id: str, borrower: str, days: int = 14) -> Loan:
    """Lend a book to a borrower for a number of days."""
    if book_id not in _BY_ID:
        raise ToolError(f"No book with id {book_id!r}; search_books lists the ids.")
    loan = Loan(book_id=book_id, borrower=borrower, due_in_days=days)
    _LOANS.append(loan)
    return loan


if __name__ == "__main__":
    server.run("stdio")
