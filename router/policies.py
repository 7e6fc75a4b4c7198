"""``make_policy``: the routing policy a ``RouterConfig`` names.

The one module that knows every policy: ``router/policy.py`` holds the interface they share,
``router/prefix_policy.py`` and ``router/baselines.py`` the policies, and this factory imports
both, so none of them imports another's implementation (no import circle). An unknown name
cannot reach it: ``RouterConfig`` validates ``policy`` on construction.
"""

from __future__ import annotations

from router.baselines import LeastLoadedPolicy, Pow2Policy, RoundRobinPolicy
from router.config import RouterConfig
from router.policy import RoutingPolicy
from router.prefix_policy import PrefixPolicy

POLICIES: dict[str, type] = {
    "prefix": PrefixPolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "pow2": Pow2Policy,
}
"""``RouterConfig.policy`` names -> policy classes."""


def make_policy(config: RouterConfig) -> RoutingPolicy:
    """The policy ``config.policy`` names."""
    return POLICIES[config.policy](config)
