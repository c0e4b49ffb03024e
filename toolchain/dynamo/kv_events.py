"""The CPU engine's KV-block events, relayed to Dynamo's KV router.

The engine's KvCacheManager registers a block under a hash of its tokens and of everything before it when the
block is filled (and keeps it matchable after its request ends, until evicted); that is what a later request with
the same prefix reuses. This listener tells the router each such registration ("stored": the block's tokens, its
hash and its parent's) and each end of one ("removed"), through Dynamo's KvEventPublisher, so the router's index of
which worker holds which prefix is the engine's own.

Only full blocks are published: the router hashes a request's prompt in full blocks of kv_block_size tokens, while
the engine also keeps a request's last, partly filled block for partial reuse (TensorRT-LLM's
enable_partial_reuse), which no full-block hash can match. The hashes are the engine's own (Python's hash of
(parent, tokens), a signed 64-bit value as the publisher wants): the router keys blocks by the hash of their
tokens and uses the engine's hashes only to link a block to its parent and to remove it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class KvEventRelay:
    """A KvCacheManager `events` listener publishing to a dynamo.llm.KvEventPublisher (or anything with
    publish_stored / publish_removed). Runs on the batcher thread; a failed publish is logged, never raised
    into the engine step."""

    def __init__(self, publisher: Any, tokens_per_block: int):
        self.publisher = publisher
        self.tokens_per_block = tokens_per_block
        self.stored_blocks = 0
        self.removed_blocks = 0
        self._lock = threading.Lock()

    def stored(self, key: int, parent: int, tokens: tuple) -> None:
        if len(tokens) != self.tokens_per_block:
            return
        try:
            self.publisher.publish_stored(list(tokens), [self.tokens_per_block], [key],
                                          parent_hash=parent if parent else None)
        except Exception as err:  # the router then routes on less; the request must not fail for it
            log.warning("KV stored event not published: %s", err)
            return
        with self._lock:
            self.stored_blocks += 1

    def removed(self, key: int, tokens: tuple) -> None:
        if len(tokens) != self.tokens_per_block:
            return
        try:
            self.publisher.publish_removed([key])
        except Exception as err:
            log.warning("KV removed event not published: %s", err)
            return
        with self._lock:
            self.removed_blocks += 1
