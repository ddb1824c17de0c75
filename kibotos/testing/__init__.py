"""Test helpers that ship with kibotos (real fakes, not mocks), usable from tests/, bench/
and a third-party plugin's own tests.

* `waiting`: the one wait of the test suite (`wait_until`, `wait_until_sync`).
* `clock`: `ThreadAwareClock`, an autojump clock that holds its jump while a worker
  thread runs (tests/conftest.py's ``autojump_clock``).
* `fake_node`, `sim_instances`: a simulated node playing the control session against a
  real ctrl, with simulated Instances; `asgi_websocket` reaches an in-process ctrl's
  session endpoint over in-memory streams.
* The conformance suites of the plugin seams (docs/plugins.md, "Testing a plugin"):
  `supervisor_suite` (`check_supervisor`), `vmm_suite` (`check_vmm_backend`),
  `pool_driver_suite` (`check_pool_driver`), and what they share, `conformance`
  (`BackendFactory`, `check_id`).

Import from the modules; this package imports nothing, so ``import kibotos.testing``
costs nothing and pulls in no test dependency.
"""
