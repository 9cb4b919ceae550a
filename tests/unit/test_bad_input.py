"""Bad CLI invocations (the lab.toml corpus is tests/data/bad-config, checked by test_config.py):
each must exit 2 with exactly one line on stderr naming the argument or value, no traceback, and
create nothing (support.badinput.check says what that means).

They run in this process through click's CliRunner (lab_cli). The cases that reach the local
backend's checks before they can fail need root (tests/contract/test_bad_input_host.py) or root
and the golden image (a resume of an unknown run: tests/vm/test_bad_input_vm.py); each of the
latter has a twin on the fake backend here."""

from __future__ import annotations

import pytest
from support import badinput

# (id, argv, expected fragment of the one line, lab.toml variant)
CASES = [
    ("resume-unknown-run-fake", ["run", "--resume", "nope"], "no run 'nope'", "fake"),
    ("resume-ambiguous-fake", ["run", "--resume", "r"], "is ambiguous", "fake"),
    ("run-id-path", ["run", "--run-id", "../x"], "--run-id '../x'", "local"),
    ("run-id-upper", ["run", "--run-id", "ABC"], "--run-id 'ABC'", "local"),
    ("run-id-taken", ["run", "--run-id", "r1"], "already has a run of that id", "local"),
    # issue 35: a "-" made another run's sweep take this run's machines for its own
    ("run-id-dash", ["run", "--run-id", "nightly-1"], "--run-id 'nightly-1': is not a usable run id", "local"),
    ("report-over-a-symlink", ["report", "r1", "-o", "planted.html"], "is a symbolic link", "local-planted-link"),
    ("report-over-a-fifo", ["report", "r1", "-o", "planted.html"], "is a FIFO", "local-planted-fifo"),
    ("plan-check-unreachable-smartos-makes-no-state", ["plan", "--check"], "port {port}", "smartos-closed"),
    ("run-id-and-resume", ["run", "--run-id", "abc", "--resume", "r1"], "exclude each other", "local"),
    ("run-missing-config", ["run", "-c", "missing.toml"], "missing.toml: (file)", "local"),
    ("run-config-is-dir", ["run", "-c", "."], "is a directory", "local"),
    ("run-unknown-option", ["run", "--cells", "2"], "No such option '--cells'", "local"),
    ("plan-missing-config", ["plan", "-c", "nope.toml"], "nope.toml: (file)", "local"),
    ("show-unknown-run", ["show", "nope"], "no run 'nope'", "local"),
    ("show-no-store", ["show", "--results", "elsewhere"], "no runs in elsewhere", "local"),
    ("compare-unknown-run", ["compare", "nope", "r1"], "no run 'nope'", "local"),
    ("compare-unknown-b", ["compare", "r1", "nope"], "no run 'nope'", "local"),
    ("compare-one-run", ["compare", "r1"], "needs two runs", "local"),
    ("compare-selector-no-value", ["compare", "r1", "--a", "nic"], "nic", "local"),
    ("compare-selector-no-match", ["compare", "r1", "--a", "nic=ne2k", "--b", "nic=virtio"], "nic=ne2k", "local"),
    ("compare-baseline-and-b", ["compare", "r1", "r2", "--baseline"], "--baseline", "local"),
    ("compare-margin-zero", ["compare", "r1", "r2", "--margin", "0"], "--margin 0: must be a percentage", "local"),
    ("compare-margin-100", ["compare", "r1", "--baseline", "--margin", "100"], "--margin 100", "local"),
    ("compare-margin-text", ["compare", "r1", "r2", "--margin", "tight"], "'tight' is not a valid float", "local"),
    ("report-unknown-run", ["report", "nope"], "no run 'nope'", "local"),
    ("history-unknown-host", ["history", "pve9"], "no series of host pve9", "local"),
    ("history-bad-cell", ["history", "--cell", "nic"], "--cell 'nic': expected AXIS=VALUE", "local"),
    ("history-last-1", ["history", "--last", "1"], "--last", "local"),
    ("history-no-store", ["history", "--results", "elsewhere"], "no runs in elsewhere", "local"),
    ("import-not-a-store", ["import", "nowhere"], "nowhere: not a results store", "local"),
    ("import-itself", ["import", "results"], "is this results store itself", "local"),
    ("prune-without-keep", ["prune"], "--keep", "local"),
    ("prune-keep-0", ["prune", "--keep", "0"], "--keep", "local"),
    ("prune-no-store", ["prune", "--keep", "1", "--results", "elsewhere"], "no runs in elsewhere", "local"),
    ("reparse-unknown-run", ["reparse", "nope"], "no run 'nope'", "local"),
    ("reparse-missing-arg", ["reparse"], "RUN_REF", "local"),
    ("unknown-command", ["frobnicate"], "No such command 'frobnicate'", "local"),
    ("gc-unknown-option", ["gc", "--all"], "No such option '--all'", "local"),
    ("snapshot-unknown-host", ["snapshot", "pve9"], "no host 'pve9'", "local"),
    ("images-build-unknown", ["images", "build", "windows11"], "windows11", "local"),
    ("images-render-unknown", ["images", "render", "windows11", "out"], "windows11", "local"),
    ("images-publish-unknown-host", ["images", "publish", "debian12", "pve9"], "no host 'pve9'", "local"),
    ("token-env-unset", ["run"], "LAB_TEST_UNSET_TOKEN", "pve-env"),
    ("token-file-missing", ["run"], "cannot read secret file", "pve-file"),
    ("proxmox-unreachable", ["run"], "127.0.0.1:{port}", "pve-closed"),
    # nothing stored from a host that did not answer; the line names file, key and value
    ("snapshot-unreachable", ["snapshot", "pve1"], "hosts.pve1.url = 'https://127.0.0.1:{port}'", "pve-closed"),
    # issue 16: what is wrong with the arguments is said before any host is asked
    ("resume-unknown-before-host-checks", ["run", "--resume", "nope"], "no run 'nope'", "pve-closed"),
    ("resume-ambiguous-before-host-checks", ["run", "--resume", "r"], "is ambiguous", "pve-closed"),
    ("resume-unknown-before-secrets", ["run", "--resume", "nope"], "no run 'nope'", "pve-env"),
    ("run-id-taken-before-host-checks", ["run", "--run-id", "r1"], "already has a run of that id", "pve-closed"),
    ("show-results-is-a-file", ["show", "--results", "lab.toml"], "lab.toml", "local"),
    ("snapshot-token-file-missing", ["snapshot", "pve1"], "cannot read secret file", "pve-file"),
    ("snapshot-token-env-unset", ["snapshot", "pve1"], "LAB_TEST_UNSET_TOKEN", "pve-env"),
    ("plan-check-token-env-unset", ["plan", "--check"], "LAB_TEST_UNSET_TOKEN", "pve-env"),
    ("run-token-env-empty", ["run"], 'names no variable after "env:"', "pve-env-empty"),
    ("plan-token-file-empty", ["plan"], 'names no file after "file:"', "pve-file-empty"),
    ("run-secret-file-relative-to-lab-toml", ["run", "-c", "sub/lab.toml"], "sub/pve.token", "pve-file-relative"),
    # issue 35: a special file where the secret's regular file is meant: never read (a FIFO would
    # hang the run, /dev/zero never end it)
    ("run-secret-file-device", ["run"], "/dev/zero: is a character device", "pve-file-device"),
    ("run-secret-file-directory", ["run"], "is a directory", "pve-file-directory"),
    ("run-secret-file-fifo", ["run"], "is a FIFO (named pipe)", "pve-file-fifo"),
    ("snapshot-secret-file-fifo", ["snapshot", "pve1"], "is a FIFO (named pipe)", "pve-file-fifo"),
    ("run-secret-file-unknown-user", ["run"], "~nosuchuser-lab/t", "pve-file-unknown-user"),
    # --set: the override named, its value checked as the file's would be, before anything is made
    ("run-set-not-toml", ["run", "--set", "matrix.start=warm"], "--set matrix.start = 'warm'", "local"),
    ("run-set-bad-value", ["run", "--set", 'matrix.nic=["rtl9999"]'], "(--set matrix.nic): matrix.nic", "local"),
    ("plan-set-no-equals", ["plan", "--set", "suite.repetitions"], "expected KEY=VALUE", "local"),
    ("run-set-unknown-key", ["run", "--set", "suite.repetitons=2"], "(--set suite.repetitons)", "local"),
    ("run-set-not-a-table", ["run", "--set", "lab.results.x=1"], "lab.results is not a table", "local"),
    ("run-set-makes-a-table", ["run", "--set", "lab.name.x=1"], "(--set lab.name.x): lab.name", "local"),
    # a literal secret given on the command line is refused and never echoed (the check: no "dead-beef")
    (
        "run-set-literal-token",
        ["run", "--set", 'hosts.pve1.token="lab@pve!t=00000000-dead-beef-0000-000000000000"'],
        "hosts.pve1.token",
        "pve-env",
    ),
]


def test_the_table_is_large_enough():
    names = [badinput.values(c)[0] for c in CASES]
    assert len(CASES) >= 45 and len(set(names)) == len(CASES)


@pytest.fixture
def place(tmp_path):
    return badinput.make_place(tmp_path)


@pytest.mark.parametrize("argv,fragment,variant", [badinput.param(c) for c in CASES])
def test_bad_invocation_exit_2_one_line_nothing_created(place, argv, fragment, variant, request):
    badinput.check(place, argv, fragment, variant, request)
