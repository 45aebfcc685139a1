"""The names ``EngineConfig.schedule_policy`` takes: the orders of :mod:`bcg.runtime.serving.policy`, named here
because the config sits below the serving package, and without torch because ``bcg load --help`` lists them.

Example:
    >>> SCHEDULE_POLICIES
    ('fifo', 'shortest')
"""

from __future__ import annotations

__all__ = ["SCHEDULE_POLICIES"]

SCHEDULE_POLICIES = ("fifo", "shortest")
