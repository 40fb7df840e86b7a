"""Shared by the crash tests: a writer process that kills itself at a chosen engine step."""
import shadecache as sc
from shadecache import _core


def attach_armed(name, point, countdown):
    """Attaches to cache `name` in this (child) process and, when `point` is non-zero, arms the
    engine's crash point `point` to SIGKILL the process after `countdown` passes through it."""
    cache = sc.Cache.attach(name)
    if point:
        _core._arm_crash_point(point, countdown)
    return cache
