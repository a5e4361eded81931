"""Services shared by several test modules of one pytest session (a plugin loaded by tests/conftest.py).

`shared_replicas`: two sampler replicas (vLLM on CPU, the tiny model, max_model_len 512, weights.pause_mode=keep,
subscribed to weight sync on fixed ports) and a rewarder scoring with reward_fns.char_diversity. Starting them costs
an engine pair's start-up (tens of seconds on 2 cores); tests/learner/test_async.py, test_loop.py and
test_dynamic_sampling.py each started the same pair for themselves. What may vary per test lives in the learner's
config (data, rollout, actor, staleness, ports of its own), which each module writes; what is the replicas' own
(pause_mode, max_model_len, the model) is fixed here for every user.

Rules for a user (docs/testing.md, "Shared services"):

- Request `shared_replicas` per test (function scope): before each test it replaces a replica that is no longer
  running (a test that SIGKILLs one leaves the next a whole pair: same port, same replica id, version 0), so a kill
  never leaks into another test. Freezing, partitioning or reconfiguring a replica is not allowed here: such a test
  starts its own (tests/learner/test_hung_replicas.py, the simulated hosts).
- Weight versions carry over between learners: a fresh learner meeting replicas that outlived an earlier one
  publishes its weights as a version above every replica's first (learner/weight_sync.py, sync_initial_weights).
  Assert versions relative to `newest_version()` read before the run, never as absolute numbers.

The pair lives from its first user's set-up to its last user's tear-down (found at collection), not to the end of
the session, so its engines do not sit next to the engines of the modules that run after it.
"""

from __future__ import annotations

import os
import signal

import pytest
from loop_support import fixed_port, sampler_info, start_rewarder
from support import ServiceProcess, free_port

_USERS = "shared_replicas"
_state: dict = {"last": None, "pair": None}


class SharedReplicas:
    """The two replicas and the rewarder; `samplers[i]` is replica `r{i}`."""

    def __init__(self, tiny_model):
        self.weights = {"announce_port": fixed_port(), "control_port": fixed_port(), "pause_mode": "keep"}
        self._args = [f"model.path={tiny_model}", "model.dtype=float32", "sampler.host=127.0.0.1",
                      "sampler.enforce_eager=true", "sampler.max_model_len=512", "sampler.shutdown_grace_s=1",
                      *(f"weights.{key}={value}" for key, value in self.weights.items())]
        self.model_path, self.max_model_len = str(tiny_model), 512
        self.samplers = [self._sampler(i, free_port()) for i in range(2)]
        self.rewarder = start_rewarder(free_port())
        self.replaced = 0
        try:
            for svc in [self.rewarder, *self.samplers]:  # started in parallel above, awaited here
                svc.wait_ready(timeout=400)
        except BaseException:
            self.close()
            raise

    def _sampler(self, i: int, port: int) -> ServiceProcess:
        return ServiceProcess("sampler", [*self._args, f"sampler.port={port}", f"sampler.replica_id=r{i}"], port)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.samplers]

    def whole(self) -> SharedReplicas:
        """Replace every replica that is no longer running (killed by the test before), on its port and id."""
        for i, svc in enumerate(self.samplers):
            if svc.proc.poll() is not None:
                try:  # its process group too: an engine core left behind would hold the port and the memory
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.samplers[i] = self._sampler(i, svc.port).wait_ready(timeout=400)
                self.replaced += 1
        assert self.rewarder.proc.poll() is None, f"the shared rewarder exited:\n{self.rewarder.logs()[-3000:]}"
        return self

    def newest_version(self) -> int:
        """The newest weight version any replica holds (0: none published since they started)."""
        return max(sampler_info(address).weight_version for address in self.addresses)

    def fresh_run_base(self) -> int:
        """What a fresh (not resumed) learner starting now adds to each step's weight version: 0 when the replicas
        hold version 0 (step s publishes s), else newest + 1 (it first publishes its initial weights as newest + 1,
        then step s publishes newest + 1 + s)."""
        newest = self.newest_version()
        return newest + 1 if newest else 0

    def close(self) -> None:
        services = [self.rewarder, *self.samplers] if hasattr(self, "rewarder") else self.samplers
        for svc in services:  # SIGTERM all first: they shut down in parallel
            if svc.proc.poll() is None:
                svc.proc.terminate()
        for svc in services:
            svc.stop(timeout=30)


@pytest.fixture(scope="session")
def _shared_replicas_session(child_processes, tiny_model):
    pair = _state["pair"] = SharedReplicas(tiny_model)
    yield pair
    pair.close()
    _state["pair"] = None


@pytest.fixture
def shared_replicas(_shared_replicas_session) -> SharedReplicas:
    """The session's replica pair and rewarder, whole (see the module docstring for who may use them)."""
    return _shared_replicas_session.whole()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Remember the last test that uses the pair (after tests/tiers.py sorted the items)."""
    users = [item for item in items if _USERS in getattr(item, "fixturenames", ())]
    _state["last"] = users[-1].nodeid if users else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the pair once its last user is done, instead of at the session's end."""
    yield
    if item.nodeid == _state["last"] and _state["pair"] is not None:
        _state["pair"].close()
