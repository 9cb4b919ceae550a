"""The application workloads (git-clone, podman-build, container-start, scp, bulk-http) without a VM:
pure command generation for Linux and FreeBSD guests, the generated repository, git daemon and a
clone over loopback, and run() against scripted guests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_workloads_unit import FakeClient, ScriptedGuest, ctx

import lab
from lab import images, proc
from lab.errors import UsageError
from lab.guest import SshLogin
from lab.workloads import bulk_http, container_start, containers, git_clone, gitrepo, load_all, podman_build, scp

TINY = {"files": 12, "file_kib": 4, "commits": 3}


def test_registered_with_defaults():
    wl = load_all()
    for name in ("git-clone", "podman-build", "container-start", "scp", "bulk-http"):
        assert wl[name].name == name and isinstance(wl[name].defaults, dict)


def test_base_image_name_matches_the_image_recipe():
    assert containers.BASE_IMAGE == images.DEBIAN12.container.name
    assert containers.CACHE_DIR == images.DEBIAN12.container.cache_dir
    script = (lab.PACKER_DIR / "scripts/provision-debian.sh").read_text()
    assert f"base_image={containers.BASE_IMAGE}\n" in script


# ---------------------------------------------------------------------------------------------
# containers: per-OS places


def test_place_prefix_linux_and_freebsd():
    assert containers.place_prefix("debian", "guest") == ""
    assert containers.place_prefix("debian", "default") == "podman run --rm localhost/lab-base:latest "
    assert containers.place_prefix("debian", "host") == "podman run --rm --network=host localhost/lab-base:latest "
    assert containers.place_prefix("freebsd", "default") == "jexec labvnet "
    assert containers.place_prefix("freebsd", "host") == "jexec labhost "
    with pytest.raises(UsageError, match="openbsd"):
        containers.place_prefix("openbsd", "default")


def test_podman_run_options():
    assert containers.podman_run("none", runtime="runc", transient=True) == [
        "podman",
        "--transient-store",
        "run",
        "--rm",
        "--runtime=runc",
        "--network=none",
        "localhost/lab-base:latest",
    ]


def test_jail_setup_scripts_are_idempotent_and_shaped_like_the_study():
    vnet = containers.jail_setup_script("default")
    assert vnet.startswith("jls -j labvnet >/dev/null 2>&1 && exit 0;")
    for part in (
        "kldload -n pf if_epair",
        "ifconfig epair create",
        "vnet vnet.interface=$b",
        "jexec labvnet ifconfig $b inet 10.88.0.2/24 up",
        "jexec labvnet route -q add default 10.88.0.1",
        "net.inet.ip.forwarding=1",
        "nat on $up inet from 10.88.0.0/24 to any -> ($up)",
        "rdr on $up inet proto tcp from any to ($up) port 8080 -> 10.88.0.2 port 80",
        "pfctl -q -f -",
    ):
        assert part in vnet, part
    host = containers.jail_setup_script("host")
    assert "ip4=inherit" in host and "vnet" not in host and host.startswith("jls -j labhost")
    # valid sh (parsed, not run: there is no FreeBSD here)
    for script in (vnet, host):
        assert proc.run(["sh", "-n", "-c", script], check=False).returncode == 0


def test_lro_scripts():
    assert containers.lro_script("freebsd", "off").endswith(
        "ifconfig $up -lro; if ifconfig $up | grep -q '[<,]LRO[,>]'; then echo lro=on; else echo lro=off; fi"
    )
    assert "route -n get default" in containers.lro_script("freebsd", "on")
    linux = containers.lro_script("debian", "on")
    assert "ethtool -K $up lro on" in linux and "large-receive-offload" in linux
    assert "ethtool -K" not in containers.lro_script("debian", "as-is")
    with pytest.raises(UsageError, match="lro"):
        containers.lro_script("debian", "maybe")


def test_lro_readback_on_this_machine_parses():
    # the Linux read-back runs here against loopback's routing table; ethtool may be absent: "unknown"
    out = proc.run(["sh", "-c", containers.lro_script("debian", "as-is")], check=False).stdout
    assert containers.parse_lro(out) in ("on", "off", "unknown")
    assert containers.parse_lro("lro=off\n") == "off" and containers.parse_lro("") == "unknown"


def test_freebsd_ifconfig_lro_flag_detection():
    # `ifconfig vtnet0` options lines (FreeBSD 14 format, constructed): LRO present / absent.
    on = (
        "vtnet0: flags=1008843<UP,BROADCAST,RUNNING,SIMPLEX,MULTICAST,LOWER_UP> metric 0 mtu 1500\n"
        "\toptions=4c07bb<RXCSUM,TXCSUM,VLAN_MTU,VLAN_HWTAGGING,JUMBO_MTU,VLAN_HWCSUM,TSO4,TSO6,LRO,VLAN_HWTSO,LINKSTATE,TXCSUM_IPV6>\n"
    )
    off = on.replace("LRO,", "")
    test = "if printf '%s' \"$T\" | grep -q '[<,]LRO[,>]'; then echo lro=on; else echo lro=off; fi"
    assert proc.run(["sh", "-c", test], env={"T": on}).stdout.strip() == "lro=on"
    assert proc.run(["sh", "-c", test], env={"T": off}).stdout.strip() == "lro=off"


# ---------------------------------------------------------------------------------------------
# git-clone


def test_git_clone_commands_linux_default_three_places():
    cmds = git_clone.GIT_CLONE.commands(ctx())
    assert [t for t, _ in cmds] == ["guest", "default", "host"]
    guest, default, host = (c for _, c in cmds)
    assert guest.startswith("sh -c ") and "head -n1 /proc/stat" in guest
    assert "/usr/bin/time -p git clone -q git://10.77.0.1:9418/lab.git" in guest
    assert default.startswith("podman run --rm localhost/lab-base:latest sh -c ")
    assert host.startswith("podman run --rm --network=host localhost/lab-base:latest sh -c ")
    assert default.removeprefix("podman run --rm localhost/lab-base:latest ") == guest


def test_git_clone_commands_freebsd_jails_and_lro():
    c = ctx({"network": ["default"], "lro": ["on", "off"], "port": 9419}, os="freebsd")
    cmds = git_clone.GIT_CLONE.commands(c)
    assert [t for t, _ in cmds] == ["default-lroon", "default-lrooff"]
    assert all(cmd.startswith("jexec labvnet sh -c ") and "sysctl -n kern.cp_time" in cmd for _, cmd in cmds)
    assert "git://10.77.0.1:9419/lab.git" in cmds[0][1]


@pytest.mark.parametrize(
    "params",
    [
        {"network": ["podman"]},
        {"network": []},
        {"lro": ["fast"]},
        {"files": 0},
        {"commits": 50, "files": 10},
        {"port": 0},
        {"file_kib": "16"},
    ],
)
def test_git_clone_bad_params(params):
    with pytest.raises(UsageError, match="git-clone"):
        git_clone.GIT_CLONE.params(ctx(params))


def test_git_clone_load_runs_here_against_a_real_git_daemon(tmp_path):
    """The exact load script, run by sh on this machine, cloning from git daemon on 127.0.0.1."""
    if shutil.which("git") is None or not shutil.os.access("/usr/bin/time", shutil.os.X_OK):
        pytest.skip("git or /usr/bin/time missing")
    repo = gitrepo.ensure(gitrepo.check_shape("t", TINY), root=tmp_path)
    port = _free_port()
    c = ctx(client=FakeClient("127.0.0.1"))
    with gitrepo.serve(c, repo, port, "git-clone") as server:
        res = proc.run(["sh", "-c", git_clone.clone_load(gitrepo.url("127.0.0.1", port))], check=False)
        assert "Ready to rumble" in server.log()
    assert res.returncode == 0, res.stdout + res.stderr
    r = git_clone.parse_clone_output(res.stdout)
    assert r["pack_bytes"] > TINY["files"] * TINY["file_kib"] * 1024  # incompressible data
    assert r["seconds"] > 0 and r["mb_s"] == pytest.approx(r["pack_bytes"] / 1e6 / r["seconds"])
    import socket

    with socket.socket() as s:  # the daemon is gone with the block
        assert s.connect_ex(("127.0.0.1", port)) != 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# the generated repository


def test_repository_is_deterministic_and_builds(tmp_path):
    a = gitrepo.ensure(dict(TINY), root=tmp_path / "a")
    b = gitrepo.ensure(dict(TINY), root=tmp_path / "b")
    assert a.head == b.head  # same shape, same commit id on any machine
    # blobs (data + sources) + commits + trees (root, data/, data/d000/ and src/ in the first
    # commit; root, data/, data/d000/ again in each later one)
    assert a.objects == TINY["files"] + len(gitrepo.sources()) + TINY["commits"] + 4 + 3 * (TINY["commits"] - 1)
    log = proc.run(["git", "-C", a.path, "log", "--format=%H %at %an"], check=True).stdout.splitlines()
    assert len(log) == TINY["commits"] and log[0].startswith(a.head)
    assert gitrepo.ensure(dict(TINY), root=tmp_path / "a").head == a.head  # cached, not regenerated
    work = tmp_path / "w"
    proc.run(["git", "clone", "-q", a.path, work], check=True)
    files = sorted(p.relative_to(work).as_posix() for p in work.rglob("*.bin"))
    assert len(files) == TINY["files"] and files[0] == "data/d000/f00000.bin"
    assert (work / "data/d000/f00000.bin").stat().st_size == TINY["file_kib"] * 1024
    if shutil.which("cc") and shutil.which("make"):
        proc.run(["make", "-C", work], check=True, timeout=120)
        out = (work / "checksum.txt").read_text().split()
        assert out[1] == str(TINY["files"]) and len(out[0]) == 16
        proc.run(["make", "-C", work, "install", f"PREFIX={tmp_path / 'inst'}"], check=True)
        assert (tmp_path / "inst/bin/lab-app").is_file()


def test_daemon_argv_binds_the_client_address_only(tmp_path):
    repo = gitrepo.Repo(tmp_path / "x" / "lab.git", "0" * 40, 1, 1)
    argv = gitrepo.daemon_argv(repo, "10.77.0.1", 9418)
    assert "--listen=10.77.0.1" in argv and "--port=9418" in argv and "--strict-paths" in argv
    assert argv[-1] == str(repo.path) and f"--base-path={tmp_path / 'x'}" in argv
    assert gitrepo.url("fd00::1", 9418) == "git://[fd00::1]:9418/lab.git"


# ---------------------------------------------------------------------------------------------
# podman-build


def test_containerfile_linux_and_freebsd():
    lin = podman_build.containerfile("debian", "git://10.77.0.1:9418/lab.git").splitlines()
    assert lin == [
        "FROM localhost/lab-base:latest",
        "RUN dpkg -i /var/cache/lab-debs/*.deb",
        "RUN git clone -q git://10.77.0.1:9418/lab.git /src",
        "RUN make -C /src CC=tcc",
        "RUN make -C /src CC=tcc install PREFIX=/usr/local",
        "COPY extra.c /extra/extra.c",
        "RUN tcc -o /usr/local/bin/lab-extra /extra/extra.c && /usr/local/bin/lab-extra",
    ]
    assert len(lin) == len(podman_build.STEPS)
    bsd = podman_build.containerfile("freebsd", "git://10.77.0.1:9418/lab.git")
    assert "RUN pkg add /var/cache/lab-pkgs/*.pkg" in bsd and "RUN cc -o" in bsd


def test_podman_build_commands():
    cmds = podman_build.PODMAN_BUILD.commands(ctx())
    assert [t for t, _ in cmds] == ["podman-default", "podman-host", "docker-default", "docker-host"]
    load = dict(cmds)
    assert (
        "podman build --pull=never --no-cache -t localhost/lab-build:latest -f Containerfile ."
        in load["podman-default"]
    )
    assert "--network=host ." in load["podman-host"]
    assert "DOCKER_BUILDKIT=0 docker build --no-cache" in load["docker-host"]
    assert "$EPOCHREALTIME" in load["podman-default"]
    assert "$(date +%s)" in podman_build.build_load("freebsd", "podman", "host")


def test_stamper_stamps_each_line_here():
    res = proc.run(["sh", "-c", f"printf 'a b\\n\\nc\\n' | {podman_build.stamper('debian')}"])
    lines = res.stdout.splitlines()
    assert len(lines) == 3 and lines[0].split(" ", 1)[1] == "a b" and lines[1].endswith(" ")
    assert all(float(ln.split(" ", 1)[0]) > 1.7e9 for ln in lines)


def test_podman_build_records_docker_as_na_with_a_scripted_guest():
    g = ScriptedGuest([])
    c = ctx({"engines": ["docker"], **TINY}, guest=g)
    c.facts["repo"] = gitrepo.Repo(shutil.os.path.abspath("."), "0" * 40, 1, 1)
    c.facts["engines"] = podman_build.probe_engines(c, ["docker"])  # what prepare() finds: no docker
    assert c.facts["engines"] == {"docker": False} and g.commands == ["sh -c 'command -v docker'"]
    g.commands.clear()
    raw = podman_build.PODMAN_BUILD.run(c, 0)
    assert g.commands == []  # nothing ran in the guest
    assert raw.stdout == "" and raw.extra == {
        "na.docker-default": "docker is not installed in the guest",
        "na.docker-host": "docker is not installed in the guest",
    }
    m = {s.metric: s for s in podman_build.PODMAN_BUILD.parse(raw)}
    assert set(m) == {"na_docker-default", "na_docker-host"}
    assert m["na_docker-host"].labels == {
        "engine": "docker",
        "network": "host",
        "na": "docker is not installed in the guest",
    }


def test_podman_build_needs_dockers_daemon_not_only_its_cli():
    # a container cell's container has the machine's /usr (the docker CLI), not its daemon's socket
    inside = ScriptedGuest([("command -v", "/usr/bin/x\n", 0), ("test -S", "", 1)])
    c = ctx({}, guest=inside)
    assert podman_build.probe_engines(c, ["podman", "docker"]) == {"podman": True, "docker": False}
    assert c.facts["engines_missing"] == {"docker": "docker has no daemon socket here (/var/run/docker.sock)"}
    machine = ScriptedGuest([("command -v", "/usr/bin/x\n", 0), ("test -S", "", 0)])
    c = ctx({}, guest=machine)
    assert podman_build.probe_engines(c, ["podman", "docker"]) == {"podman": True, "docker": True}
    assert c.facts["engines_missing"] == {}


# ---------------------------------------------------------------------------------------------
# container-start


def test_container_start_commands_cover_every_combination():
    cmds = container_start.CONTAINER_START.commands(ctx({"runs": 3, "warmup": 1}))
    assert len(cmds) == 2 * 3 * 2
    load = dict(cmds)
    crun_host = load["crun-host-persistent"]
    assert (
        'hyperfine -N --style none --runs 3 --warmup 1 --export-json "$d/out.json" '
        "'podman run --rm --runtime=crun --network=host localhost/lab-base:latest true'"
    ) in crun_host
    # its JSON goes to a fresh private directory, never a fixed path (the bare-metal host's /var/tmp)
    assert crun_host.startswith('(d=$(mktemp -d "${LAB_SCRATCH:-/var/tmp}/lab-hyperfine.XXXXXX") || exit 1;')
    assert "/var/tmp/lab-hyperfine.json" not in crun_host
    assert (
        "'podman --transient-store run --rm --runtime=runc localhost/lab-base:latest true'"
        in load["runc-default-transient"]
    )


def test_container_start_docker_rows_start_from_dockers_store():
    params = {"runs": 1, "warmup": 0, "engines": ["podman", "docker"]}
    cmds = dict(container_start.CONTAINER_START.commands(ctx(params)))
    assert len(cmds) == 2 * 3 * 2 + 2 * 3  # podman: runtime x network x store; docker: its one store
    assert "'docker run --rm --runtime=crun --network=none localhost/lab-base:latest true'" in cmds["crun-none-docker"]
    assert "'docker run --rm --runtime=runc localhost/lab-base:latest true'" in cmds["runc-default-docker"]
    assert "crun-host-persistent" in cmds  # podman's tags are the ones they always were


def test_container_start_says_why_docker_cannot_start_a_combination():
    ok = {"version": "20.10.24+dfsg1", "runtimes": ["crun", "runc"], "image": True}
    assert container_start.docker_na(ok, "crun") == ""
    assert "no OCI runtime 'ocijail'" in container_start.docker_na(ok, "ocijail")
    assert "has no localhost/lab-base" in container_start.docker_na({**ok, "image": False}, "runc")
    missing = {"missing": "docker is not installed in the guest"}
    assert container_start.docker_na(missing, "runc") == "docker is not installed in the guest"
    # a container cell's container has the machine's docker CLI, not its daemon's socket
    inside = ScriptedGuest([("command -v", "/usr/bin/docker\n", 0), ("test -S", "", 1)])
    assert container_start.probe_docker(ctx({}, guest=inside)) == {
        "missing": "docker has no daemon socket here (/var/run/docker.sock)"
    }


@pytest.mark.parametrize(
    "params",
    [
        {"network": ["bridge"]},
        {"store": ["tmpfs"]},
        {"runtime": ["kata"]},
        {"engines": ["lxc"]},
        {"runs": 0},
        {"warmup": -1},
    ],
)
def test_container_start_bad_params(params):
    with pytest.raises(UsageError, match="container-start"):
        container_start.CONTAINER_START.params(ctx(params))


def test_container_start_marks_missing_runtime_and_transient_store_na():
    wrapped = (
        "@@lab-cpu-before@@\ncpu  10 0 10 80\n@@lab-load@@\n"
        + (
            pytest.importorskip("pathlib").Path(__file__).parents[1]
            / "data/hyperfine/linux-1.15.0-podman-crun-host.json"
        ).read_text()
        + "@@lab-cpu-after@@\ncpu  60 0 30 110\n@@lab-rc=0@@\n"
    )
    g = ScriptedGuest([("hyperfine", wrapped, 0)])
    c = ctx({"runtime": ["crun", "runc"], "network": ["host"], "store": ["persistent", "transient"]}, guest=g)
    c.facts.update(
        runtimes={"crun": "crun version 1.8.1", "runc": ""},
        podman="4.3.1",
        transient="Error: unknown flag: --transient-store",
    )
    raw = container_start.CONTAINER_START.run(c, 0)
    assert len([x for x in g.commands if "hyperfine" in x]) == 1
    m = {s.metric: s for s in container_start.CONTAINER_START.parse(raw)}
    assert m["na_crun-host-transient"].labels["na"] == (
        "podman 4.3.1 has no --transient-store (Error: unknown flag: --transient-store)"
    )
    assert m["na_runc-host-persistent"].labels["na"] == "OCI runtime runc is not installed in the guest"
    assert (
        "start_ms_crun-host-persistent" in m
        and m["start_ms_crun-host-persistent"].labels["runtime_version"] == "crun version 1.8.1"
    )
    assert m["cpu_busy_pct_crun-host-persistent"].value == pytest.approx(100 * 70 / 100)


# ---------------------------------------------------------------------------------------------
# scp and bulk-http


class G:
    """A guest whose sshd is reached at 10.77.0.10:22 (as lab.guest.Guest says)."""

    login = SshLogin("10.77.0.10", 22, "root", Path("/k"))

    def ssh_login(self):
        return self.login


def test_scp_argv_both_directions():
    cmds = dict(scp.SCP.commands(ctx({"cipher": "aes128-gcm@openssh.com"}, guest=G()), local="/tmp/f"))
    assert cmds["tx"][-2:] == ["root@10.77.0.10:/var/tmp/lab-scp.bin", "/dev/null"]
    assert cmds["rx"][-2:] == ["/tmp/f", "root@10.77.0.10:/dev/null"]
    for argv in cmds.values():
        assert argv[0] == "scp" and "LogLevel=VERBOSE" in argv and "ControlPath=none" in argv
        assert argv[argv.index("-c") + 1] == "aes128-gcm@openssh.com" and argv[argv.index("-i") + 1] == "/k"
    assert (
        scp.scp_argv(
            key="/k", user="root", address="fd00::a", port=2222, direction="tx", local="/dev/null", remote="/x"
        )[-2]
        == "root@[fd00::a]:/x"
    )


def test_scp_checks_the_guest_host_key_when_the_context_has_them(tmp_path):
    unchecked = dict(scp.SCP.commands(ctx({}, guest=G())))["tx"]
    assert "StrictHostKeyChecking=no" in unchecked and "UserKnownHostsFile=/dev/null" in unchecked
    c = ctx({}, guest=G())
    c.known_hosts = tmp_path / "known_hosts"
    checked = dict(scp.SCP.commands(c))["tx"]
    assert "StrictHostKeyChecking=yes" in checked and f"UserKnownHostsFile={tmp_path / 'known_hosts'}" in checked
    assert "StrictHostKeyChecking=no" not in checked and not [a for a in checked if "HostKeyAlias" in a]

    class InContainer(G):  # a container cell's sshd: the machine's keys, on another port
        login = SshLogin("10.77.0.10", 2222, "root", Path("/k"), host_key_alias="10.77.0.10")

    c.guest = InContainer()
    boxed = dict(scp.SCP.commands(c))["tx"]
    assert boxed[boxed.index("-P") + 1] == "2222" and "HostKeyAlias=10.77.0.10" in boxed


def test_scp_is_skipped_where_the_machine_is_not_reached_by_ssh():
    from lab.errors import LabError
    from lab.guest import HostGuest

    bare = HostGuest("10.0.0.1", netns="lab-x")  # the bare-metal cell's: it skips what raises in prepare
    with pytest.raises(LabError, match="scp: its load is an sshd, and this machine is not reached by SSH"):
        scp.SCP.prepare(ctx({}, guest=bare))


@pytest.mark.parametrize("params", [{"size_mib": 0}, {"directions": ["up"]}, {"cipher": "aes; rm -rf /"}])
def test_scp_bad_params(params):
    with pytest.raises(UsageError, match="scp"):
        scp.SCP.params(ctx(params))


def test_bulk_http_commands_and_places():
    cmds = dict(bulk_http.BULK_HTTP.commands(ctx({"count": 2, "scheme": ["http", "https"]})))
    assert cmds["guest-http"] == [
        "curl",
        "-sS",
        "-k",
        "--max-time",
        "900",
        "-w",
        "%{json}\\n",
        "-o",
        "/dev/null",
        "http://10.77.0.10/bulk/64m.bin",
        "-o",
        "/dev/null",
        "http://10.77.0.10/bulk/64m.bin",
    ]
    assert cmds["guest-https"][-1] == "https://10.77.0.10/bulk/64m.bin"
    bsd = dict(bulk_http.BULK_HTTP.commands(ctx({"network": ["guest", "default"], "lro": ["off"]}, os="freebsd")))
    assert bsd["default-http-lrooff"][-1] == "http://10.77.0.10:8080/bulk/64m.bin"
    assert set(bsd) == {"guest-http-lrooff", "default-http-lrooff"}
    with pytest.raises(UsageError, match="FreeBSD-only"):
        bulk_http.BULK_HTTP.params(ctx({"network": ["default"]}))


def test_estimates_are_positive():
    from lab import workloads

    for name in ("git-clone", "podman-build", "container-start", "scp", "bulk-http"):
        wl = workloads.get(name)
        assert wl.estimate_seconds(dict(wl.defaults)) > 0


def test_show_puts_each_variants_cpu_beside_it_and_none_beside_na_rows():
    from lab import results
    from lab.store import CellRow, SampleRow

    cell = CellRow("r", "c01", 1, "local/debian12/virtio", {}, "done", None, None, {})

    def row(metric, value, unit="s"):
        return SampleRow("r", "c01", "git-clone", metric, value, unit, False, 0, {})

    rows = {
        r.metric: r
        for r in results.show_rows(
            results.series(
                [
                    row("clone_seconds_podman-host", 2.0),
                    row("clone_seconds_guest", 1.0),
                    row("na_docker-host", 1.0, "n/a"),
                    row("cpu_busy_pct_podman-host", 70.0, "%"),
                    row("cpu_busy_pct_guest", 40.0, "%"),
                    row("cpu_busy_pct", 55.0, "%"),
                ],
                [cell],
            )
        )
    }
    assert rows["clone_seconds_podman-host"].cpu_busy == 70.0
    assert rows["clone_seconds_guest"].cpu_busy == 40.0
    assert rows["na_docker-host"].cpu_busy is None
    assert set(rows) == {"clone_seconds_podman-host", "clone_seconds_guest", "na_docker-host"}
