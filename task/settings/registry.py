"""One registry type for every extension point: methods (``task.settings.methods``), codec kinds
(``task.codecs``, each with its compressor), federated protocols (``server.protocols``) and cell
runners (``sim.runners.cells``) -- each one entry per name, registered once, as Opacus registers its
accountants (``register_accountant`` / ``create_accountant``). Pure Python: the command line imports it."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind, in registration order."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; registering the same entry again is a no-op, another one an error."""
        if name in self._entries and self._entries[name] is not entry and self._entries[name] != entry:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove an entry (tests that register a toy one clean up after themselves)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry of ``name``; KeyError names every registered one."""
        if name not in self._entries:
            raise KeyError(f"unknown {self.what} {name!r}; registered: {', '.join(self._entries)}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def items(self):
        return self._entries.items()

    def values(self):
        return self._entries.values()
