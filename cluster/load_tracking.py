"""Where an application's ``router.load.LoadTracker`` lives in a process that routes to it.

Owns one thing: ``load_tracker(app_name)``, the tracker that both halves of the ingress feed.
The request router Serve builds for the handle to ``EngineReplica``
(``cluster.request_router``) reports decisions, confirmations and completions to it; the
ingress hands the same object to its ``EngineClient``, which reports each call's first
output. Serve constructs the request router itself, from pickled keyword arguments, so a
live object cannot be handed to it: this per-process map from application name to tracker
is the one place the two meet. It lives in a module of its own because Serve ships
``cluster/request_router.py`` to the handle's process pickled by value, with copies of that
module's globals, so a map there would not be the one the ingress sees.

How it fails: a process that routes without an ingress (a bare handle) gets a tracker nobody
reports first outputs to; ``router.load`` says how such requests are priced.
"""

from __future__ import annotations

import threading

from router.load import LoadTracker

_TRACKERS: dict[str, LoadTracker] = {}
_LOCK = threading.Lock()


def load_tracker(app_name: str) -> LoadTracker:
    """This process's tracker of the requests it sends to ``app_name``'s engine replicas,
    created on first use."""
    with _LOCK:
        tracker = _TRACKERS.get(app_name)
        if tracker is None:
            tracker = _TRACKERS[app_name] = LoadTracker()
        return tracker
