"""The host's book of pages: who holds each page (reference counts), which are free, and the prefix cache.

A page is in exactly one of three states:
    held     refcount > 0: in the page table of that many running sequences (a shared prompt prefix has several)
    cached   refcount 0, but its contents are a known full page of some token sequence (the prefix cache keeps it
             until the page is needed: least recently released first)
    free     refcount 0 and no contents anyone can find

The prefix cache finds a full page by the hash chain of the tokens up to its end: key_j = H(key_{j-1}, tokens of
page j). K/V under the causal mask depend only on a token and the tokens before it, so two sequences whose first
(j+1) * page_size tokens agree may share pages 0..j. A page is registered once it is full and written.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class PageBook:
    """Reference counts, the free list and the prefix cache of `num_pages` pages (host state, no device work)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int64)
        self.free = collections.deque(range(num_pages))
        self.cached = collections.OrderedDict()  # page -> None: unreferenced cached pages, least recent first
        self.by_key = {}  # prefix key -> page
        self.key_of = {}  # page -> prefix key

    # ---- counts ------------------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Pages that can be handed out now (free, or cached and unreferenced: evicted on demand)."""
        return len(self.free) + len(self.cached)

    @property
    def held(self) -> int:
        return int(np.count_nonzero(self.refcount))

    # ---- holding and releasing ---------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A page for new contents, held once: a free one, else the least recently released cached one."""
        if self.free:
            page = self.free.popleft()
        elif self.cached:
            page, _ = self.cached.popitem(last=False)
            del self.by_key[self.key_of.pop(page)]
        else:
            raise RuntimeError("no page available (the scheduler checks `available` first)")
        self.refcount[page] = 1
        return page

    def hold(self, page: int) -> None:
        """One more holder of a page with contents (a prefix-cache hit)."""
        if self.refcount[page] == 0:
            del self.cached[page]
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; with none left the page is cached (if registered) or free."""
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} released more often than it was held")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.key_of:
                self.cached[page] = None  # most recently released: evicted last
            else:
                self.free.append(page)

    # ---- the prefix cache --------------------------------------------------------------------------------------
    @staticmethod
    def chain(previous: bytes, tokens) -> bytes:
        """The key of a full page: its tokens chained to the key of the pages before it."""
        return hashlib.blake2b(previous + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()

    def lookup(self, key: bytes):
        """The page cached under `key`, or None."""
        return self.by_key.get(key)

    def register(self, page: int, key: bytes) -> None:
        """Make a held, full, written page findable under `key` (if no other page already is)."""
        if key not in self.by_key and page not in self.key_of:
            self.by_key[key] = page
            self.key_of[page] = key
