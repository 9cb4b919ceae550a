"""The isolation axis (lab.isolation) without VMs: the axis expands on the fake backend, the
container's commands (podman run/exec/rm argv), a container cell's workloads entering it through
the Guest seam, a missing runtime making the cell n/a, and the plan-time refusals (exit 2, one
line, nothing created). The real container in a real guest: tests/test_isolation_vm.py."""

from __future__ import annotations

import shlex

import fakes.backend as fake
import pytest
from conftest import lab_cli

from lab import analysis, images, isolation, plan, runner
from lab.model import Isolation
from lab.store import Store


def run(lab):
    cfg = lab.load()
    store = Store(cfg.results_dir)
    return cfg, store, runner.run_lab(cfg, store)


# -- pure ------------------------------------------------------------------------------------------


def test_the_base_image_is_the_one_the_golden_image_imports():
    assert isolation.BASE_IMAGE == images.DEBIAN12.container.name


def test_podman_argv():
    argv = isolation.run_argv("lab-r-c02", "host", ["/usr", "/srv/www"], {"lab.run": "r", "lab.cell": "c02"})
    assert argv == [
        "podman",
        "run",
        "--detach",
        "--name",
        "lab-r-c02",
        "--network=host",
        "--label",
        "lab.cell=c02",
        "--label",
        "lab.run=r",
        "--volume",
        "/usr:/usr:ro",
        "--volume",
        "/srv/www:/srv/www:ro",
        "localhost/lab-base:latest",
        "sleep",
        "infinity",
    ]
    bridge = isolation.run_argv("n", "bridge", [], {}, host_cgroup=True)
    assert bridge[5:11] == ["--network=bridge", "--publish", "80:80", "--publish", "443:443", "--cgroups=disabled"]
    with pytest.raises(ValueError):
        isolation.run_argv("n", "slirp4netns", [], {})
    assert isolation.exec_argv("n", "echo 'a b'") == ["podman", "exec", "n", "sh", "-c", "echo 'a b'"]
    assert isolation.exec_argv("n", "cat > f", stdin=True)[:3] == ["podman", "exec", "--interactive"]
    assert isolation.remove_argv("n") == ["podman", "rm", "--force", "--time", "0", "n"]
    assert isolation.parse_inspect("abc running 42 host\n") == {
        "id": "abc",
        "state": "running",
        "pid": 42,
        "network": "host",
    }
    assert isolation.parse_inspect("Error: no such container") == {}


def test_the_wrapper_enters_the_container_except_for_the_cpu_snapshot():
    from fakes.guest import FakeGuest

    from lab.osfacts import facts

    machine = FakeGuest(address="10.0.0.2", facts=facts("debian"), nic_driver="virtio_net", vcpus=2, memory_mib=1024)
    machine.containers["lab-r-c01"] = "f" * 64
    g = isolation.ContainerGuest(machine, "lab-r-c01", "debian")
    assert (g.address, g.os, g.known_hosts) == ("10.0.0.2", "debian", None)
    g.run("sysbench cpu run")
    assert machine.commands[-1] == "sysbench cpu run" and machine.inside == ["sysbench cpu run"]
    g.put_text("x", "/tmp/f")
    assert machine.inside[-1] == "cat > /tmp/f"
    # the same kernel counters, read without `podman exec`'s own CPU in the load's window
    snap = "sh -c " + shlex.quote(facts("debian").cpu_ticks_cmd)
    g.run(snap)
    assert machine.inside[-1] == "cat > /tmp/f" and machine.commands[-1] == snap
    assert g.execs == 2


def test_workload_refusals():
    assert isolation.workload_problem("sysbench-cpu", {}) == ""
    assert isolation.workload_problem("git-clone", {"network": ["guest"]}) == ""
    assert "network default, host" in isolation.workload_problem("git-clone", {"network": ["guest", "default", "host"]})
    assert "sshd" in isolation.workload_problem("scp", {})
    assert isolation.kind_problem(Isolation.CONTAINER) == ""
    assert "FreeBSD" in isolation.kind_problem(Isolation.JAIL) and "SmartOS" in isolation.kind_problem(Isolation.ZONE)
    assert isolation.os_problem(Isolation.CONTAINER, "debian") == ""
    assert "jails" in isolation.os_problem(Isolation.CONTAINER, "freebsd")


# -- the axis on the fake backend ------------------------------------------------------------------


def test_the_axis_expands_and_labels_only_non_default_cells(fake_lab):
    fake_lab.write(matrix='nic = ["virtio", "e1000"]\nisolation = ["vm", "container"]', suite="bare_metal = true")
    cfg = fake_lab.load()
    units = plan.units(cfg)
    assert [(u.id, u.label) for u in units] == [
        ("c01", "f/debian12/virtio/2c/1024m/virtio/linked/default"),
        ("c02", "f/debian12/virtio/2c/1024m/virtio/linked/default/isolation=container"),
        ("c03", "f/debian12/e1000/2c/1024m/virtio/linked/default"),
        ("c04", "f/debian12/e1000/2c/1024m/virtio/linked/default/isolation=container"),
        ("bm01", "f/bare-metal"),
        ("bm02", "f/bare-metal/isolation=container"),
    ]
    assert units[1].axes()["isolation"] == "container" and "isolation" not in units[0].axes()
    assert plan.equivalents(cfg, units) == {}  # a container cell is never its VM cell's duplicate
    assert ("isolation", ["vm", "container"]) in plan.comparisons(units)
    shown = lab_cli("plan", "-c", str(fake_lab.path))
    assert shown.returncode == 0 and "isolation" in shown.stdout and "container" in shown.stdout


def test_a_container_cell_runs_its_workloads_inside_and_removes_it(fake_lab):
    fake_lab.write(matrix='isolation = ["vm", "container"]', suite="bare_metal = true")
    cfg, store, rid = run(fake_lab)
    cells = {c.cell_id: c for c in store.cells(rid)}
    assert {k: c.status for k, c in cells.items()} == {"c01": "done", "c02": "done", "bm01": "done", "bm02": "n/a"}
    box = cells["c02"].facts["isolation"]
    assert box["kind"] == "container" and box["state"] == "running" and box["network"] == "host"
    assert box["inside"] == "/run/.containerenv present" and box["removed"] is True and box["execs"] >= 3
    vm_guest, box_guest = fake.GUESTS[f"lab-{rid}-c01"], fake.GUESTS[f"lab-{rid}-c02"]
    assert vm_guest.inside == [] and "isolation" not in cells["c01"].facts
    # every repetition (warm-up included) ran inside the container, and nothing is left of it
    assert [c for c in box_guest.inside if c.startswith("fake-work")] == ["fake-work -1", "fake-work 0", "fake-work 1"]
    assert box_guest.containers == {} and fake.LIVE == {}
    assert "systemctl stop nginx" in " ".join(box_guest.commands)  # the container's nginx takes its place
    samples = [s for s in store.samples(rid) if s.cell_id == "c02"]
    assert samples and {s.labels["container"] for s in samples} == {box["id"][:12]}
    assert {s.labels["isolation"] for s in samples} == {"container"}
    # this host has no podman: its container cell is n/a with the reason, never a zero
    assert cells["bm02"].error == "isolation container: podman is not installed on this host"
    assert not [s for s in store.samples(rid) if s.cell_id == "bm02"]
    # --a isolation=vm --b isolation=container pairs the VM with its container and bare metal with its own
    a = analysis.side(rid, 0, store.cells(rid), store.samples(rid), {}, {"isolation": "vm"})
    b = analysis.side(rid, 0, store.cells(rid), store.samples(rid), {}, {"isolation": "container"})
    assert {(x and x.cell_id, y and y.cell_id) for _, x, y in analysis.pair(a, b)} == {("c01", "c02"), ("bm01", "bm02")}
    out = lab_cli("compare", rid, "--a", "isolation=vm", "--b", "isolation=container", "-c", str(fake_lab.path))
    assert out.returncode == 0, out.stderr
    assert "ops_per_s" in out.stdout
    # the host itself is the baseline, not the container on it
    assert {
        o.reference
        for o in analysis.overheads(store.cells(rid), store.samples(rid), analysis.parse_selector(["kind=bare-metal"]))
    } == {"f/bare-metal"}


def test_a_guest_without_podman_makes_the_container_cell_na(fake_lab):
    fake_lab.write(matrix='isolation = ["vm", "container"]', host="podman = []")
    cfg, store, rid = run(fake_lab)
    cells = {c.cell_id: c for c in store.cells(rid)}
    assert cells["c01"].status == "done"
    assert (
        cells["c02"].status == "n/a"
        and cells["c02"].error == "isolation container: podman is not installed on the guest"
    )
    assert not [s for s in store.samples(rid) if s.cell_id == "c02"] and fake.LIVE == {}


def test_network_bridge_is_passed_to_podman(fake_lab):
    fake_lab.write(matrix='isolation = ["container"]', extra='[isolation]\nnetwork = "bridge"\n')
    cfg, store, rid = run(fake_lab)
    c = store.cells(rid)[0]
    assert c.status == "done" and c.facts["isolation"]["network"] == "bridge"
    made = next(x for x in fake.GUESTS[f"lab-{rid}-c01"].commands if x.startswith("podman run"))
    assert "--network=bridge --publish 80:80 --publish 443:443" in made


# -- refused before anything is made ---------------------------------------------------------------


@pytest.mark.parametrize(
    "matrix, suite, extra, key, words",
    [
        ('isolation = ["vm", "jail"]', "", "", "matrix.isolation[1]", "FreeBSD"),
        ('isolation = ["zone"]', "", "", "matrix.isolation[0]", "SmartOS"),
        ('isolation = ["container"]\nimage = ["freebsd14"]', "", "", "matrix.isolation[0]", "no podman"),
        ('isolation = ["container"]', 'workloads = ["sysbench-cpu", "scp"]', "", "suite.workloads[1]", "sshd"),
        ('isolation = ["container"]', 'workloads = ["git-clone"]', "", "suite.workloads[0]", "network default, host"),
        (
            'isolation = ["container"]\ntuning = ["wan-16m"]',
            "",
            '[isolation]\nnetwork = "bridge"\n',
            "isolation.network",
            "own network namespace",
        ),
        ('isolation = ["vm"]', "", '[isolation]\nnetwork = "slirp"\n', "isolation.network", "host"),
        ('isolation = ["cage"]', "", "", "matrix.isolation", "cage"),
    ],
)
def test_refused_at_plan_time_in_one_line(fake_lab, matrix, suite, extra, key, words):
    fake_lab.write(matrix=matrix, suite=suite, extra=extra)
    for cmd in ("plan", "run"):
        res = lab_cli(cmd, "-c", str(fake_lab.path))
        assert res.returncode == 2, (res.stdout, res.stderr)
        err = res.stderr.strip()
        assert len(err.splitlines()) == 1 and key in err and words in err, err
    assert fake.JOURNAL == [] and not (fake_lab.dir / "results").exists()


def test_short_labels_line_optional_axes_up():
    from lab import results

    vm = "local/debian12/virtio/2c/1024m/virtio/linked/default"
    assert results.short_labels(
        [vm, vm + "/isolation=container", "local/bare-metal", "local/bare-metal/isolation=container"]
    ) == {
        vm: "isolation=vm",
        vm + "/isolation=container": "isolation=container",
        "local/bare-metal": "bare-metal",
        "local/bare-metal/isolation=container": "bare-metal/isolation=container",
    }
    # an optional axis at its default is named, not an empty label
    assert results.short_labels([vm, vm + "/cc=bbr"]) == {vm: "cc=default", vm + "/cc=bbr": "cc=bbr"}


def test_lab_reproduce_of_a_container_cell_makes_the_container_and_enters_it(tmp_path):
    from pathlib import Path

    from lab import proc, reproduce
    from lab.model import RawOutput

    s = Store(tmp_path / "results")
    s.create_run(
        "abcd1234",
        "t",
        config_path="lab.toml",
        config_text="",
        seed=1,
        lab_version="x",
        manifest={"images": {"debian12": {"digest": "d" * 64, "sha256": "e" * 64}}},
    )
    axes = {
        "host": "vg",
        "image": "debian12",
        "nic": "virtio",
        "vcpus": 2,
        "memory_mib": 1024,
        "disk_bus": "virtio",
        "clone": "linked",
        "tuning": "default",
        "isolation": "container",
    }
    s.add_cell("abcd1234", "c02", 2, "x/isolation=container", axes)
    s.cell_update(
        "abcd1234",
        "c02",
        status="done",
        facts={
            "accel": "tcg",
            "image_digest": "d" * 64,
            "image_sha256": "e" * 64,
            "isolation": {
                "kind": "container",
                "network": "host",
                "binds": ["/usr", "/srv/www"],
                "nginx": "in the container",
            },
        },
    )
    s.add_raw("abcd1234", "c02", 0, RawOutput("sysbench-cpu", "sysbench cpu --threads=1 run", ""))
    s.add_raw("abcd1234", "c02", 0, RawOutput("http", "wrk -t1 -c10 -d2s --latency http://10.77.0.10/", ""))
    out = tmp_path / "repro"
    reproduce.reproduce(s, "latest", "c02", out, ssh_key=Path("/k/lab_key"))
    tune, work = (out / "tune.sh").read_text(), (out / "workloads.sh").read_text()
    assert isolation.STOP_NGINX in tune
    assert (
        "podman run --detach --name lab-c02 --network=host --volume /usr:/usr:ro --volume /srv/www:/srv/www:ro "
        "localhost/lab-base:latest sleep infinity"
    ) in tune
    assert "podman exec lab-c02 sh -c 'mkdir -p /var/lib/nginx /var/log/nginx && /usr/sbin/nginx'" in tune
    assert "podman exec lab-c02 sh -c 'sysbench cpu --threads=1 run'" in work
    assert "# lab side: wrk -t1 -c10 -d2s --latency http://10.77.0.10/" in work
    for script in ("tune.sh", "workloads.sh"):
        assert proc.run(["sh", "-n", str(out / script)], check=False).ok
    s.close()
