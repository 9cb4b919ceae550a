"""A fake backend, a fake guest and a fake workload: the runner's whole life without root, QEMU or
SSH. Registered like the real ones: `lab.backends.register("fake", "fakes")` (this package, with
its `settings` and `backend` modules) and `lab.workloads.register(FakeWorkload())`; the
`fake_lab` fixture (tests/conftest.py) does both and undoes them after the test.

Failures are injected from lab.toml, as a user would write a host:

    [hosts.f]
    backend = "fake"
    fail = { c02 = "boot" }           # cell id (or "*") -> stage: clone, boot, ssh, verify, tune,
                                      # workloads, workloads@N (at measured repetition N), teardown
    interrupt = { c01 = "workloads" } # the same, raising Interrupted (as SIGINT/SIGTERM would)

and the fake workload's values from `[suite.params.fake-work]`. What the backend made and removed
is in JOURNAL, what it still holds in LIVE.
"""
