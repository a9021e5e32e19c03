"""What the boundary servers of a replica refused: counted per kind for ``metrics.csv``
(``security/refused_connections``, ``security/refused_frames``; the shared-memory all-reduce's
``security/refused_datagrams`` beside them), the most recent kept for :meth:`comm_stats`, and
each peer logged once (``logging`` at WARNING, logger ``msrl.security``: the replica's log, in
Ray's log folder), all bounded, whatever a peer sends.
"""

from __future__ import annotations

import collections
import logging

__all__ = ["Refusals", "KINDS"]

#: the kinds of refusal: a connection or stream refused at its start (no or a bad greeting, a
#: wrong token, another user's process, a producer of no boundary), or a frame refused on a
#: stream that was let in (malformed, oversized, ignored credits; the stream is then closed)
KINDS = ("connections", "frames")

_log = logging.getLogger("msrl.security")


class Refusals:
    """Bounded records of one server's refusals.

    Args:
        server: who refused, for the log line (``"boundary server of learner replica 0"``).
        keep: how many recent ``(peer, reason)`` pairs :attr:`recent` holds.
        log_peers: how many distinct peers get their one log line (later ones are counted only).

    Attributes:
        counts: kind -> refusals so far.
        recent: the last ``keep`` ``(peer, reason)`` pairs, oldest first.
    """

    def __init__(self, server: str, keep: int = 256, log_peers: int = 64) -> None:
        self.server = server
        self.counts = dict.fromkeys(KINDS, 0)
        self.recent: collections.deque[tuple[str, str]] = collections.deque(maxlen=keep)
        self._logged: set[str] = set()
        self._log_peers = log_peers

    def add(self, kind: str, peer: str, why: str) -> None:
        """Counts one refusal of ``kind`` (one of :data:`KINDS`) of ``peer``; logs it if the peer
        is new and fewer than ``log_peers`` were logged."""
        self.counts[kind] += 1
        self.recent.append((peer, why))
        if peer not in self._logged and len(self._logged) < self._log_peers:
            self._logged.add(peer)
            _log.warning("msrl %s refused %s: %s (further refusals of this peer are counted, not logged)",
                         self.server, peer, why)
