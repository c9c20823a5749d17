"""The documents of one split of a text source: what every source in :mod:`nmprune.data` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Corpus:
    """Documents of one split and the separator the reference protocol joins them with."""

    documents: list[str]
    separator: str = "\n\n"

    def text(self) -> str:
        return self.separator.join(self.documents)
