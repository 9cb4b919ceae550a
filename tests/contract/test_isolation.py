"""The isolation axis (lab.isolation) without VMs: the axis expands on the fake backend, the
container's commands (podman run/exec/rm argv), a container cell's workloads entering it through
the Guest seam, a missing runtime making the cell n/a, and the plan-time refusals (exit 2, one
line, nothing created). The real container in a real guest: tests/vm/test_isolation_vm.py."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import fakes.backend as fake
import pytest
from fakes.guest import WAN_16M_IN_A_NETNS
from support.cli import lab_cli

from lab import analysis, images, isolation, plan, proc, runner, workloads
from lab.model import Isolation, Runtime
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


def test_docker_argv_differs_from_podman_only_where_the_clis_do():
    docker = Runtime.DOCKER
    argv = isolation.run_argv("n", "bridge", ["/usr"], {"lab.run": "r"}, runtime=docker)
    podman = isolation.run_argv("n", "bridge", ["/usr"], {"lab.run": "r"})
    # unconfined like podman's (where AppArmor is on without apparmor_parser), else the same options
    assert argv == ["docker", *podman[1:6], "--security-opt", "apparmor=unconfined", *podman[6:]]
    assert isolation.exec_argv("n", "true", stdin=True, runtime=docker) == [
        "docker",
        "exec",
        "--interactive",
        "n",
        "sh",
        "-c",
        "true",
    ]
    assert isolation.remove_argv("n", docker) == ["docker", "rm", "--force", "n"]  # docker rm has no --time
    assert isolation.listed_argv("lab-x", docker) == [
        "docker",
        "ps",
        "--all",
        "--filter",
        "name=^lab-x$",
        "--format",
        "{{.Names}}",
    ]
    # docker's daemon, not the caller, makes the container: it cannot join the bare-metal cell's cgroup
    with pytest.raises(ValueError, match="daemon"):
        isolation.run_argv("n", "host", [], {}, host_cgroup=True, runtime=docker)


def test_the_runtime_axis_means_something_only_for_container_cells(fake_lab):
    fake_lab.write(matrix='isolation = ["vm", "container"]\nruntime = ["podman", "docker"]', suite="bare_metal = true")
    units = plan.units(fake_lab.load())
    # the VM cell of runtime docker is not a cell (its index stays taken: ids do not move)
    assert [(u.id, u.label) for u in units] == [
        ("c01", "f/debian12/virtio/2c/1024m/virtio/linked/default"),
        ("c03", "f/debian12/virtio/2c/1024m/virtio/linked/default/isolation=container"),
        ("c04", "f/debian12/virtio/2c/1024m/virtio/linked/default/isolation=container/runtime=docker"),
        ("bm01", "f/bare-metal"),
        ("bm02", "f/bare-metal/isolation=container"),
        ("bm03", "f/bare-metal/isolation=container/runtime=docker"),
    ]
    assert units[2].axes()["runtime"] == "docker" and units[5].axes()["runtime"] == "docker"
    assert units[2].axes()["runtime"] == "docker" and "runtime" not in units[1].axes()
    assert ("runtime", ["podman", "docker"]) in plan.comparisons(units)
    # a lab that lists docker alone still has its VM cell, with no runtime
    fake_lab.write(matrix='isolation = ["vm", "container"]\nruntime = ["docker"]')
    assert [u.label.rsplit("/", 2)[-2:] for u in plan.units(fake_lab.load())] == [
        ["linked", "default"],
        ["isolation=container", "runtime=docker"],
    ]


def test_docker_and_podman_cells_side_by_side(fake_lab):
    fake_lab.write(
        matrix='isolation = ["vm", "container"]\nruntime = ["podman", "docker"]',
        host='podman = ["vm"]\ndocker = ["vm"]',
    )
    cfg, store, rid = run(fake_lab)
    cells = {c.cell_id: c for c in store.cells(rid)}
    assert {k: c.status for k, c in cells.items()} == {"c01": "done", "c03": "done", "c04": "done"}
    box = cells["c04"].facts["isolation"]
    assert box["runtime"] == "docker" and box["docker"].startswith("docker ") and "podman" not in box
    assert box["inside"] == "/.dockerenv present" and box["removed"] is True
    # docker's store got the base image from the golden image's tarball, in the tune stage
    assert box["imported_s"] >= 0 and "imported_s" not in cells["c03"].facts["isolation"]
    imports = [c for c in fake.GUESTS[f"lab-{rid}-c04"].commands if " import " in c]
    assert imports == [isolation.import_argv(Runtime.DOCKER)]
    assert cells["c03"].facts["isolation"]["runtime"] == "podman"
    made = [x for x in fake.GUESTS[f"lab-{rid}-c04"].commands if " run --detach " in x]
    assert len(made) == 1 and made[0].startswith("docker run ") and "--cgroups" not in made[0]
    assert "docker rm --force" in " ".join(fake.GUESTS[f"lab-{rid}-c04"].commands)
    samples = [s for s in store.samples(rid) if s.cell_id == "c04"]
    assert samples and {s.labels["container_runtime"] for s in samples} == {"docker"}
    a = analysis.side(rid, 0, store.cells(rid), store.samples(rid), {}, {"runtime": "podman"})
    b = analysis.side(rid, 0, store.cells(rid), store.samples(rid), {}, {"runtime": "docker"})
    # the VM cell has no runtime: neither side has it
    assert {(x and x.cell_id, y and y.cell_id) for _, x, y in analysis.pair(a, b)} == {("c03", "c04")}
    out = lab_cli("compare", rid, "--a", "runtime=podman", "--b", "runtime=docker", "-c", str(fake_lab.path))
    assert out.returncode == 0, out.stderr
    assert "ops_per_s" in out.stdout


def test_docker_missing_or_on_bare_metal_makes_the_cell_na_with_the_reason(fake_lab):
    fake_lab.write(
        matrix='isolation = ["vm", "container"]\nruntime = ["docker"]',
        suite="bare_metal = true",
        host='podman = ["vm", "bare-metal"]\ndocker = ["bare-metal"]',
    )
    cfg, store, rid = run(fake_lab)
    cells = {c.cell_id: c for c in store.cells(rid)}
    assert cells["c01"].status == "done" and cells["bm01"].status == "done"
    assert cells["c02"].status == "n/a"
    assert cells["c02"].error == "isolation container: docker is not installed on the guest"
    # the host has docker, but its daemon would make the container outside the cell's namespace and cgroup
    assert cells["bm02"].status == "n/a" and "outside the bare-metal cell's network namespace" in cells["bm02"].error
    assert not [s for s in store.samples(rid) if s.cell_id in ("c02", "bm02")] and fake.LIVE == {}
    assert not [c for c in fake.GUESTS[f"lab-{rid}-bm02"].commands if c.startswith("docker run")]
    # an n/a container cell beside the VM: the comparison still answers (as the real-VM test asks)
    out = lab_cli("compare", rid, "--a", "isolation=vm", "--b", "isolation=container", "-c", str(fake_lab.path))
    assert out.returncode == 0, out.stderr


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
    def problem(name: str, params: dict, **kw) -> str:
        return isolation.workload_problem(workloads.get(name).own_containers(params), **kw)

    assert problem("sysbench-cpu", {}) == ""
    assert problem("git-clone", {"network": ["guest"]}) == ""
    assert problem("scp", {}) == ""  # the container runs an sshd of its own
    assert problem("scp", {}, bare_metal=True) == ""  # skipped on bare metal (no SSH)
    # workloads that start containers run inside with nested podman (podman's cells and docker's), not
    # on bare metal
    places = {"network": ["guest", "default", "host"]}
    for wl, params in (("git-clone", places), ("podman-build", {"network": ["host"]}), ("container-start", {})):
        assert workloads.get(wl).own_containers(params)
        assert problem(wl, params) == ""
        assert "bare-metal host" in problem(wl, params, bare_metal=True)
    assert not workloads.get("git-clone").own_containers({"network": ["guest"]})
    assert problem("sysbench-cpu", {}, bare_metal=True) == ""
    assert isolation.kind_problem(Isolation.CONTAINER) == ""
    # zones are the SmartOS host's to make (Capabilities.machine_isolation), not refused as a kind
    assert "FreeBSD" in isolation.kind_problem(Isolation.JAIL) and isolation.kind_problem(Isolation.ZONE) == ""
    assert isolation.os_problem(Isolation.CONTAINER, "debian") == ""
    assert "jails" in isolation.os_problem(Isolation.CONTAINER, "freebsd")
    assert isolation.os_problem(Isolation.ZONE, "debian") == ""
    assert "lx zones" in isolation.os_problem(Isolation.ZONE, "freebsd")


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


def test_a_guest_without_the_tarball_makes_the_docker_cell_na(fake_lab, monkeypatch):
    from fakes.guest import FakeGuest

    monkeypatch.setattr(FakeGuest, "tarball", False)  # a golden image built before docker cells
    fake_lab.write(matrix='isolation = ["container"]\nruntime = ["docker"]', host='docker = ["vm"]')
    cfg, store, rid = run(fake_lab)
    (c,) = store.cells(rid)
    assert c.status == "n/a" and c.error == (
        "isolation container: the guest has no localhost/lab-base:latest in docker's store and no "
        "/var/lib/lab/lab-base.tar.zst to import it from (rebuild the golden image)"
    )
    assert not [x for x in fake.GUESTS[f"lab-{rid}-c01"].commands if " run --detach " in x] and fake.LIVE == {}


def test_network_bridge_is_passed_to_podman(fake_lab):
    fake_lab.write(matrix='isolation = ["container"]', extra='[isolation]\nnetwork = "bridge"\n')
    cfg, store, rid = run(fake_lab)
    c = store.cells(rid)[0]
    assert c.status == "done" and c.facts["isolation"]["network"] == "bridge"
    made = next(x for x in fake.GUESTS[f"lab-{rid}-c01"].commands if x.startswith("podman run"))
    assert "--network=bridge --publish 80:80 --publish 443:443" in made


def test_a_container_for_scp_runs_an_sshd_of_its_own():
    from fakes.guest import FakeGuest

    from lab.guest import Guest, HostGuest, SshLogin
    from lab.osfacts import facts

    argv = isolation.run_argv("n", "bridge", ["/usr"], {}, sshd=True)
    assert "2222:2222" in argv and "/etc/ssh:/etc/ssh:ro" in argv and "/root/.ssh:/root/.ssh:ro" in argv
    assert "2222:2222" not in isolation.run_argv("n", "bridge", ["/usr"], {})
    machine = FakeGuest(address="10.0.0.2", facts=facts("debian"), nic_driver="virtio_net", vcpus=2, memory_mib=1024)
    place = isolation.enter(Isolation.CONTAINER, machine, name="c1", os_name="debian", sshd=True)
    assert place.facts["sshd"] == {"port": 2222, "pid": 4343, "host_keys": "the machine's"}
    assert "mkdir -p /run/sshd && /usr/sbin/sshd -t -p 2222 && /usr/sbin/sshd -p 2222" in " ".join(machine.inside)
    assert machine.inside[-1] == "cat /run/sshd.pid 2>/dev/null"  # read once it is started (it daemonizes)
    assert machine.inside[-3] == (  # the base image has no privilege-separation user: the machine's
        "grep -q '^sshd:' /etc/passwd || echo sshd:x:100:65534::/run/sshd:/usr/sbin/nologin >> /etc/passwd"
    )
    assert place.guest.ssh_login() == SshLogin("10.0.0.2", 2222, "root", None, host_key_alias="10.0.0.2")
    place.remove()
    # what scp's own connection is checked with: the machine's known_hosts entry, named as the file names it
    ssh_machine = Guest("10.77.0.10", key=Path("/k"), port=2200, known_hosts="[10.77.0.10]:2200 ssh-ed25519 AAAA\n")
    box = isolation.ContainerGuest(ssh_machine, "c1", "debian", sshd=True)
    assert box.ssh_login() == SshLogin("10.77.0.10", 2222, "root", Path("/k"), host_key_alias="[10.77.0.10]:2200")
    ssh_machine.close()
    bare = isolation.ContainerGuest(HostGuest("10.0.0.3", netns="lab-x"), "c2", "debian", sshd=True)
    assert bare.ssh_login() is None  # scp's prepare skips it


def test_nested_podman_argv():
    argv = isolation.run_argv("n", "bridge", ["/usr"], {}, nested="/var/tmp/lab-nested/n")
    assert "--privileged" in argv and argv[-3:] == ["localhost/lab-base:latest", "sleep", "infinity"]
    pairs = {(a, b) for a, b in zip(argv, argv[1:], strict=False) if a in ("--env", "--volume")}
    assert {
        ("--env", "CONTAINERS_STORAGE_CONF=/etc/lab-nested/storage.conf"),
        ("--env", "CONTAINERS_CONF=/etc/lab-nested/containers.conf"),
        ("--volume", "/var/tmp/lab-nested/n/etc:/etc/lab-nested:ro"),
        ("--volume", "/var/tmp/lab-nested/n/store:/var/lib/containers/storage"),  # its own, writable
        ("--volume", "/var/lib/containers/storage:/var/lib/lab-machine-store:ro"),  # the machine's images
        ("--volume", "/etc/containers/policy.json:/etc/containers/policy.json:ro"),
        ("--volume", "/var/tmp/lab-nested/n/networks:/etc/containers/networks"),
    } <= pairs
    assert "--privileged" not in isolation.run_argv("n", "bridge", ["/usr"], {})
    # a docker cell's: the same options to docker's CLI, podman inside as in podman's
    docker = isolation.run_argv("n", "bridge", ["/usr"], {}, runtime=Runtime.DOCKER, nested="/var/tmp/lab-nested/n")
    assert docker[:2] == ["docker", "run"] and "--privileged" in docker
    assert pairs <= {(a, b) for a, b in zip(docker, docker[1:], strict=False) if a in ("--env", "--volume")}


def test_nested_setup_writes_what_the_argv_names(tmp_path):
    import tomllib

    d = tmp_path / "lab nested" / "c1"  # a space: the command quotes it
    (d / "store").mkdir(parents=True)
    (d / "store" / "left-over").write_text("x")
    proc.run(["sh", "-c", isolation.nested_setup(str(d))])
    assert sorted(p.name for p in (d / "etc").iterdir()) == ["containers.conf", "storage.conf"]
    network = json.loads((d / "networks" / "podman.json").read_text())  # clear of podman0's 10.88.0.0/16
    assert network["network_interface"] == "labnest0" and network["subnets"][0]["subnet"] == "10.90.0.0/24"
    assert list((d / "store").iterdir()) == []  # a store of its own, empty
    storage = tomllib.loads((d / "etc" / "storage.conf").read_text())
    assert storage["storage"]["graphroot"] == "/var/lib/containers/storage"
    assert storage["storage"]["options"]["additionalimagestores"] == ["/var/lib/lab-machine-store"]
    engine = tomllib.loads((d / "etc" / "containers.conf").read_text())["engine"]
    assert engine == {"cgroup_manager": "cgroupfs", "events_logger": "file"}
    # podman 4.3.1's answer to NESTED_INFO inside such a container in the golden image
    assert isolation.parse_nested_info("overlay cgroupfs\nlabnest0 10.90.0.0/24\n") == {
        "driver": "overlay",
        "cgroup_manager": "cgroupfs",
        "network": "labnest0 10.90.0.0/24",
    }
    assert isolation.parse_nested_info("overlay cgroupfs\n") == {}
    assert isolation.parse_nested_info("Error: open /etc/containers/networks/netavark.lock\n") == {}


@pytest.mark.parametrize("runtime", ["podman", "docker"])
def test_a_container_cell_whose_workloads_start_containers_gets_nested_podman(fake_lab, runtime):
    fake_lab.write(
        matrix=f'isolation = ["container"]\nruntime = ["{runtime}"]',
        host=f'{runtime} = ["vm"]',
        extra='[suite.params.fake-work]\nnetwork = ["guest", "default"]\n',
    )
    cfg, store, rid = run(fake_lab)
    (c,) = store.cells(rid)
    assert c.status == "done", c.error
    nested = c.facts["isolation"]["nested"]
    assert nested["driver"] == "overlay" and nested["cgroup_manager"] == "cgroupfs" and nested["privileged"] is True
    commands = fake.GUESTS[f"lab-{rid}-c01"].commands
    made = next(x for x in commands if x.startswith(f"{runtime} run"))
    assert f"/var/tmp/lab-nested/lab-{rid}-c01/store:/var/lib/containers/storage" in made and "--privileged" in made
    # its store goes after the container that had it mounted
    assert commands.index(f"rm -rf /var/tmp/lab-nested/lab-{rid}-c01") > commands.index(
        next(x for x in commands if x.startswith(f"{runtime} rm"))
    )


def test_a_container_cell_without_such_workloads_stays_unprivileged(fake_lab):
    fake_lab.write(matrix='isolation = ["container"]')
    cfg, store, rid = run(fake_lab)
    (c,) = store.cells(rid)
    assert c.status == "done" and "nested" not in c.facts["isolation"]
    assert not [x for x in fake.GUESTS[f"lab-{rid}-c01"].commands if "--privileged" in x or "lab-nested" in x]


def test_sysctls_go_to_a_bridge_containers_own_namespace_only():
    argv = isolation.run_argv("n", "bridge", [], {}, sysctls={"net.ipv4.tcp_rmem": "4096\t87380  16777216"})
    assert argv[argv.index("--sysctl") + 1] == "net.ipv4.tcp_rmem=4096 87380 16777216"
    assert "--sysctl" not in isolation.run_argv("n", "bridge", [], {}, sysctls={})
    with pytest.raises(ValueError, match="bridge"):  # "host" shares the machine's namespace: nothing to set
        isolation.run_argv("n", "host", [], {}, sysctls={"net.ipv4.tcp_rmem": "4096 87380 16777216"})


def test_the_netns_probe_and_its_output():
    keys = ["net.core.rmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_congestion_control"]
    command = isolation.netns_probe(keys)
    assert command.startswith("unshare --net sh -c ") and "test -w" in command  # rmem_max reads 0444 in a netns
    assert shlex.split(command)[6:] == ["/proc/sys/net/core/rmem_max", "/proc/sys/net/ipv4/tcp_rmem"] + [
        "/proc/sys/net/ipv4/tcp_congestion_control"
    ]
    # printed by the probe on this machine (Linux 6.18), as root
    out = "/proc/sys/net/ipv4/tcp_rmem\n/proc/sys/net/ipv4/tcp_congestion_control\n"
    assert isolation.netns_keys(keys, out) == ["net.ipv4.tcp_rmem", "net.ipv4.tcp_congestion_control"]


@pytest.mark.root
def test_the_netns_probe_on_this_machine():
    keys = ["net.core.rmem_max", "net.ipv4.tcp_rmem", "net.core.somaxconn", "net.no.such_key"]
    res = proc.run(["sh", "-c", isolation.netns_probe(keys)], timeout=30)
    # rmem_max is kernel-wide (read-only in a namespace of its own here, Linux 6.x; absent on 6.1)
    assert isolation.netns_keys(keys, res.stdout) == ["net.ipv4.tcp_rmem", "net.core.somaxconn"], res.stdout


def test_a_bridge_container_gets_the_tuning_its_namespace_can_have(fake_lab):
    fake_lab.write(matrix='isolation = ["container"]\ntuning = ["wan-16m"]', extra='[isolation]\nnetwork = "bridge"\n')
    cfg, store, rid = run(fake_lab)
    c = store.cells(rid)[0]
    assert c.status == "done", c.error
    box = c.facts["isolation"]
    assert (box["sysctls"], box["sysctls_kernel_wide"]) == WAN_16M_IN_A_NETNS
    made = next(x for x in fake.GUESTS[f"lab-{rid}-c01"].commands if x.startswith("podman run"))
    assert "--sysctl 'net.ipv4.tcp_rmem=4096 4194304 16777216'" in made and "rmem_max" not in made


def test_a_bridge_container_gets_the_asked_congestion_control(fake_lab):
    fake_lab.write(matrix='isolation = ["container"]\ncc = ["bbr"]', extra='[isolation]\nnetwork = "bridge"\n')
    cfg, store, rid = run(fake_lab)
    c = store.cells(rid)[0]
    assert c.status == "done", c.error
    assert c.facts["isolation"]["sysctls"] == {"net.ipv4.tcp_congestion_control": "bbr"}
    made = next(x for x in fake.GUESTS[f"lab-{rid}-c01"].commands if x.startswith("podman run"))
    assert "--sysctl net.ipv4.tcp_congestion_control=bbr" in made


def test_a_host_network_container_shares_the_tuned_namespace(fake_lab):
    fake_lab.write(matrix='isolation = ["container"]\ntuning = ["wan-16m"]')
    cfg, store, rid = run(fake_lab)
    c = store.cells(rid)[0]
    assert c.status == "done" and "sysctls" not in c.facts["isolation"]
    guest = fake.GUESTS[f"lab-{rid}-c01"]
    assert not [x for x in guest.commands if x.startswith("unshare")]
    assert "--sysctl" not in next(x for x in guest.commands if x.startswith("podman run"))


# -- refused before anything is made ---------------------------------------------------------------


@pytest.mark.parametrize(
    "matrix, suite, extra, key, words",
    [
        ('isolation = ["vm", "jail"]', "", "", "matrix.isolation[1]", "FreeBSD"),
        ('isolation = ["zone"]', "", "", "matrix.isolation[0]", "only a SmartOS host makes zones"),
        ('isolation = ["container"]\nimage = ["freebsd14"]', "", "", "matrix.isolation[0]", "no podman"),
        (
            'isolation = ["container"]',
            'workloads = ["podman-build"]\nbare_metal = true',
            "",
            "suite.workloads[0]",
            "bare-metal",
        ),
        ('isolation = ["vm"]', "", '[isolation]\nnetwork = "slirp"\n', "isolation.network", "host"),
        ('isolation = ["cage"]', "", "", "matrix.isolation", "cage"),
        ('runtime = ["podman", "docker"]', "", "", "matrix.runtime[1]", "only container cells"),
        ('isolation = ["container"]\nruntime = ["lxc"]', "", "", "matrix.runtime", "lxc"),
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
    # a VM cell has no container runtime: it does not read "runtime=podman"
    docker = vm + "/isolation=container/runtime=docker"
    assert results.short_labels([vm, vm + "/isolation=container", docker]) == {
        vm: "isolation=vm",
        vm + "/isolation=container": "isolation=container/runtime=podman",
        docker: "isolation=container/runtime=docker",
    }


def reproduce_container_cell(tmp_path, box: dict, raws: list, runtime: str | None = None) -> Path:
    """`lab reproduce` of cell c02 of a stored run whose container had `box` as its facts; the
    directory it wrote."""
    from lab import reproduce

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
        **({"runtime": runtime} if runtime == "docker" else {}),
    }
    s.add_cell("abcd1234", "c02", 2, "x/isolation=container", axes)
    facts = {"accel": "tcg", "image_digest": "d" * 64, "image_sha256": "e" * 64, "isolation": box}
    s.cell_update("abcd1234", "c02", status="done", facts=facts)
    for raw in raws:
        s.add_raw("abcd1234", "c02", 0, raw)
    out = tmp_path / "repro"
    reproduce.reproduce(s, "latest", "c02", out, ssh_key=Path("/k/lab_key"))
    s.close()
    for script in ("tune.sh", "workloads.sh"):
        assert proc.run(["sh", "-n", str(out / script)], check=False).ok
    return out


@pytest.mark.parametrize("runtime", ["podman", "docker", None])  # None: a run from before runtimes: podman
def test_lab_reproduce_of_a_container_cell_makes_the_container_and_enters_it(tmp_path, runtime):
    from lab.model import RawOutput

    box = {
        "kind": "container",
        "network": "host",
        "binds": ["/usr", "/srv/www"],
        "nginx": "in the container",
        **({"runtime": runtime} if runtime else {}),
    }
    raws = [
        RawOutput("sysbench-cpu", "sysbench cpu --threads=1 run", ""),
        RawOutput("http", "wrk -t1 -c10 -d2s --latency http://10.77.0.10/", ""),
    ]
    out = reproduce_container_cell(tmp_path, box, raws, runtime)
    tune, work = (out / "tune.sh").read_text(), (out / "workloads.sh").read_text()
    assert isolation.STOP_NGINX in tune
    cli = runtime or "podman"
    unconfined = " --security-opt apparmor=unconfined" if cli == "docker" else ""
    assert (
        f"{cli} run --detach --name lab-c02 --network=host{unconfined} "
        "--volume /usr:/usr:ro --volume /srv/www:/srv/www:ro localhost/lab-base:latest sleep infinity"
    ) in tune
    assert f"# isolation: the workloads ran in a {cli} container" in tune
    assert f"{cli} exec lab-c02 sh -c 'mkdir -p /var/lib/nginx /var/log/nginx && /usr/sbin/nginx'" in tune
    assert f"{cli} exec lab-c02 sh -c 'sysbench cpu --threads=1 run'" in work
    assert "# lab side: wrk -t1 -c10 -d2s --latency http://10.77.0.10/" in work


def test_lab_reproduce_of_a_nested_bridge_container_cell(tmp_path):
    """A cell whose workloads started containers inside it, on the bridge with a tuned namespace:
    the reproduction makes its nested store first, then the container as the cell had it."""
    from lab.model import RawOutput

    box = {"kind": "container", "network": "bridge", "binds": ["/usr"], "runtime": "podman"}
    box.update(sysctls={"net.ipv4.tcp_rmem": "4096 87380 16777216"}, nested={"driver": "overlay"}, sshd={"port": 2222})
    out = reproduce_container_cell(tmp_path, box, [RawOutput("container-start", "hyperfine -N x", "")])
    tune = (out / "tune.sh").read_text()
    setup = isolation.nested_setup("/var/tmp/lab-nested/lab-c02")
    made = next(ln for ln in tune.splitlines() if ln.startswith("podman run --detach"))
    assert tune.index(setup) < tune.index(made)
    assert "--privileged" in made and "--sysctl 'net.ipv4.tcp_rmem=4096 87380 16777216'" in made
    assert "/var/tmp/lab-nested/lab-c02/store:/var/lib/containers/storage" in made and "2222:2222" in made
    assert (
        "podman exec lab-c02 sh -c 'grep -q '\"'\"'^sshd:'\"'\"' /etc/passwd || echo \"$0\" >> /etc/passwd' "
        "\"$(grep '^sshd:' /etc/passwd)\""
    ) in tune
    assert "podman exec lab-c02 sh -c 'mkdir -p /run/sshd && /usr/sbin/sshd -t -p 2222" in tune
