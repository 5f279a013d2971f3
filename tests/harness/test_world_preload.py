"""Ranks forked from a preloaded server (`RankSetup(preload=...)`) hold the preloaded modules
from the start, yet see the caller's environment and working directory as they are at each
call, not as they were when the server started (its first world)."""

from __future__ import annotations

import os

from fsdp_bridge.harness.world import RankSetup, spawn

PRELOADED = "fsdp_bridge.plan"
SETUP = RankSetup(preload=("torch", PRELOADED))


def _what_the_rank_sees(rank, world_size):
    return {"variable": os.environ.get("FSDP_BRIDGE_PRELOAD_TEST"), "cwd": os.getcwd(),
            "pid": os.getpid(), "parent": os.getppid()}


def test_forked_ranks_take_the_callers_current_environment_and_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_BRIDGE_PRELOAD_TEST", "first")
    first = spawn(_what_the_rank_sees, 2, (), SETUP)
    assert [seen["variable"] for seen in first] == ["first", "first"]
    assert first[0]["parent"] != os.getpid()  # forked by the server, not by this process
    monkeypatch.setenv("FSDP_BRIDGE_PRELOAD_TEST", "second")
    monkeypatch.chdir(tmp_path)
    second = spawn(_what_the_rank_sees, 2, (), SETUP)
    assert [seen["variable"] for seen in second] == ["second", "second"]
    assert {seen["cwd"] for seen in second} == {str(tmp_path)}
    assert second[0]["parent"] == first[0]["parent"]  # the same server, started once


def test_fresh_ranks_are_children_of_the_caller():
    seen = spawn(_what_the_rank_sees, 2)
    assert {rank["parent"] for rank in seen} == {os.getpid()}
