"""The gym workload's work items (a segment to sample) and its data cursor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.workloads.gym.sampler import SegmentSampler


@dataclass
class SegmentItem:
    """A work item: one segment to sample, made with weights of at least ``min_version``."""

    index: int
    min_version: int = 0
    pinned: bool = False  # issued again at its old place in line: keeps its min_version (see next())

    def pack(self) -> dict[str, Any]:
        return {"index": self.index, "min_version": self.min_version, "pinned": self.pinned}

    @classmethod
    def unpack(cls, packed: dict[str, Any]) -> SegmentItem:
        return cls(int(packed["index"]), int(packed["min_version"]), bool(packed.get("pinned", False)))


class SegmentSource:
    """The data cursor: segment indices in order, re-issued ones first; its state carries the sampler's."""

    def __init__(self, sampler: SegmentSampler):
        self.sampler = sampler
        self.cursor = 0
        self.reissue: list[SegmentItem] = []

    def next(self, n: int, min_version: int = 0) -> list[SegmentItem]:
        items, self.reissue = self.reissue[:n], self.reissue[n:]
        for item in items:
            if not item.pinned:  # a dead worker's item keeps the bound computed for its place in line
                item.min_version = max(item.min_version, min_version)
        while len(items) < n:
            items.append(SegmentItem(self.cursor, min_version))
            self.cursor += 1
        return items

    def give_back(self, items: list[SegmentItem], min_version: int = 0) -> None:
        back = [SegmentItem(i.index, max(i.min_version, min_version), i.pinned) for i in items]
        self.reissue = sorted([*back, *self.reissue], key=lambda i: i.index)

    def regenerate(self, stale: list[Any], min_version: int) -> None:
        self.give_back([SegmentItem(s.group_id) for s in stale], min_version)

    def unpack_item(self, packed: dict[str, Any]) -> SegmentItem:
        return SegmentItem.unpack(packed)

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "reissue": [i.pack() for i in self.reissue],
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.reissue = [self.unpack_item(p) for p in state["reissue"]]
        self.sampler.load_state_dict(state["sampler"])
