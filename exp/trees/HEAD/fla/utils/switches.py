"""On/off switches of the host path that tests and benchmarks flip inside a block."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def switched(cell: list, value: Any) -> Iterator[None]:
    """Set ``cell[0]`` (a module's one-item switch list) to ``value`` inside the block,
    and back to what it was after it."""
    previous = cell[0]
    cell[0] = value
    try:
        yield
    finally:
        cell[0] = previous
