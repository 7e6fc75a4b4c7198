"""The engine process's nice value (``EngineConfig.engine_nice``): asked for at start, taken
when the OS allows, logged and left when it refuses."""

from __future__ import annotations

import logging
import os

import pytest

from worker import engine_process
from worker.config import EngineConfig, parse_engine_nice, resolve_engine_nice


def test_a_nice_value_the_os_refuses_is_logged_and_the_process_keeps_its_own(monkeypatch, caplog):
    def refuse(which, who, value):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger=engine_process.log.name):
        assert engine_process.ask_for_priority(-5) == 0
    assert "stays at nice 0" in caplog.text and "CAP_SYS_NICE" in caplog.text


def test_a_lower_nice_value_is_set_and_a_higher_or_none_left_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "getpriority", lambda which, who: 0)
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: calls.append(value))
    assert engine_process.ask_for_priority(-5) == -5
    assert engine_process.ask_for_priority(3) == 0  # never lowers the priority it inherited
    assert engine_process.ask_for_priority(None) == 0
    assert calls == [-5]


@pytest.mark.parametrize("nice", [-21, 20])
def test_engine_nice_outside_the_os_range_is_refused(nice):
    with pytest.raises(ValueError, match="engine_nice"):
        EngineConfig(model="smollm2", engine_nice=nice)


@pytest.mark.parametrize(
    ("device", "threads", "cores", "nice"),
    [
        ("cuda:0", 8, 16, -5),  # a GPU engine's host loop leaves the cores to the path
        ("cpu", 1, 2, -5),  # one torch thread on two cores
        ("cpu", 2, 2, None),  # torch threads on every core: an equal of the request path
        ("cpu", 4, 2, None),
    ],
)
def test_auto_asks_for_priority_only_for_an_engine_that_leaves_cores(device, threads, cores, nice):
    assert resolve_engine_nice("auto", device, threads, cores) == nice
    assert resolve_engine_nice(3, device, threads, cores) == 3  # a number is taken as is
    assert resolve_engine_nice(None, device, threads, cores) is None


def test_engine_nice_reads_auto_or_a_number():
    assert parse_engine_nice("auto") == "auto" and parse_engine_nice("-3") == -3
    assert EngineConfig(model="smollm2", engine_nice="auto").engine_nice == "auto"
    with pytest.raises(ValueError, match="engine_nice"):
        EngineConfig(model="smollm2", engine_nice="fast")
