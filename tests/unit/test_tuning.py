"""Tuning and network axes without VMs: parsers on outputs captured from a real Debian 12 guest
(tests/data/tuning), the studies' wan-16m values, netem arguments, equivalent cells, and the
example labs through the real config loader and planner."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import lab_cli

from lab import axes as axes_table, config, osfacts, plan, tuning, wan
from lab.tuning import parse_offloads
from lab.wan import WanProfile

DATA = Path(__file__).parents[1] / "data" / "tuning"
EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))


def test_wan16m_templates_carry_the_studies_values():
    assert tuning.render("debian", "wan-16m") == {
        "net.core.rmem_max": "16777216",
        "net.core.wmem_max": "16777216",
        "net.ipv4.tcp_rmem": "4096 4194304 16777216",
        "net.ipv4.tcp_wmem": "4096 4194304 16777216",
        "net.ipv4.tcp_moderate_rcvbuf": "1",
        "net.ipv4.tcp_congestion_control": "bbr",
    }
    assert tuning.render("alpine", "wan-16m") == tuning.render("debian", "wan-16m")
    assert tuning.render("freebsd", "wan-16m") == {
        "kern.ipc.maxsockbuf": "16777216",
        "net.inet.tcp.recvspace": "4194304",
        "net.inet.tcp.sendspace": "4194304",
        "net.inet.tcp.recvbuf_auto": "1",
        "net.inet.tcp.sendbuf_auto": "1",
        "net.inet.tcp.recvbuf_max": "16777216",
        "net.inet.tcp.sendbuf_max": "16777216",
        "net.inet.tcp.sendbuf_inc": "65536",
        "net.inet.tcp.functions_default": "bbr",
    }
    assert tuning.render("netbsd", "wan-16m") == {
        "kern.sbmax": "16777216",
        "net.inet.tcp.recvspace": "4194384",
        "net.inet.tcp.sendspace": "4194384",
        "net.inet.tcp.recvbuf_auto": "1",
        "net.inet.tcp.sendbuf_auto": "1",
        "net.inet.tcp.recvbuf_max": "16777216",
        "net.inet.tcp.sendbuf_max": "16777216",
        "net.inet.tcp.recvbuf_inc": "262144",
        "net.inet.tcp.sendbuf_inc": "262144",
        "net.inet.tcp.congctl.selected": "cubic",
    }
    assert tuning.render("openbsd", "wan-16m") is None  # OpenBSD autotunes: the profile is n/a
    assert tuning.render("openbsd", "default") == {}


def test_sysctl_values_read_back_normalised():
    # `sysctl -n` separates the three tcp_rmem numbers with tabs; the record compares by words
    lines = dict(ln.split(" = ", 1) for ln in (DATA / "sysctl-default-debian.txt").read_text().splitlines())
    assert "\t" in lines["net.ipv4.tcp_rmem"]
    assert tuning.normalise(lines["net.ipv4.tcp_rmem"]) == "4096 131072 6291456"
    cc = (DATA / "sysctl-cc-debian.txt").read_text().splitlines()
    assert cc[0] == osfacts.facts("debian").cc_default  # Debian's default is cubic: cc=default == cc=cubic
    assert "bbr" not in cc[1].split() and "bbr" in cc[2].split()  # bbr appears once tcp_bbr is loaded


def test_parse_ethtool_k_virtio_and_e1000():
    virtio = tuning.parse_ethtool_k((DATA / "ethtool-k-virtio.txt").read_text())
    assert virtio["large-receive-offload"] == (False, True)  # off [fixed]: lro=on is n/a on virtio-net
    assert virtio["tcp-segmentation-offload"] == (True, False)
    assert virtio["generic-receive-offload"] == (True, False)
    assert virtio["tx-checksum-ip-generic"] == (True, False)  # indented sub-features are parsed too
    toggled = tuning.parse_ethtool_k((DATA / "ethtool-k-virtio-lro-off-tso-off.txt").read_text())
    assert toggled["tcp-segmentation-offload"] == (False, False)
    assert toggled["generic-receive-offload"] == (False, False)
    e1000 = tuning.parse_ethtool_k((DATA / "ethtool-k-e1000.txt").read_text())
    assert e1000["large-receive-offload"] == (False, True)
    assert e1000["tcp-segmentation-offload"] == (True, False)
    # what `ethtool -K eth0 lro on` says on virtio-net: nothing changes
    assert "rx-lro: off [requested on]" in (DATA / "ethtool-K-lro-on-virtio.txt").read_text()


def test_parse_ifconfig_offloads_freebsd():
    text = (
        "vtnet0: flags=1008843<UP,BROADCAST,RUNNING,SIMPLEX,MULTICAST,LOWER_UP> metric 0 mtu 1500\n"
        "\toptions=4c079b<RXCSUM,TXCSUM,VLAN_MTU,VLAN_HWTAGGING,VLAN_HWCSUM,TSO4,TSO6,LRO,VLAN_HWTSO,"
        "LINKSTATE,TXCSUM_IPV6>\n"
        "\tcapabilities=4c07bb<RXCSUM,TXCSUM,VLAN_MTU,JUMBO_MTU,VLAN_HWTAGGING,VLAN_HWCSUM,TSO4,TSO6,LRO,"
        "VLAN_HWTSO,LINKSTATE,TXCSUM_IPV6>\n"
    )
    assert tuning.parse_ifconfig_offloads(text) == {"lro": (True, False), "tso": (True, False)}
    off = text.replace("TSO4,TSO6,LRO,VLAN_HWTSO,LINKSTATE", "VLAN_HWTSO,LINKSTATE", 1)
    assert tuning.parse_ifconfig_offloads(off) == {"lro": (False, False), "tso": (False, False)}


def test_parse_tc_qdisc_and_netem_in_effect():
    default = wan.parse_tc_qdisc((DATA / "tc-qdisc-show-default.txt").read_text())
    assert [(q.kind, q.parent) for q in default] == [("fq_codel", "root")]
    assert wan.netem_in_effect(default) is None
    full = wan.parse_tc_qdisc((DATA / "tc-qdisc-show-netem.txt").read_text())
    assert wan.netem_in_effect(full) == {"delay_ms": 50.0, "jitter_ms": 5.0, "loss_pct": 1.0, "rate_mbit": 100.0}
    delay = wan.parse_tc_qdisc((DATA / "tc-qdisc-show-netem-delay.txt").read_text())
    assert wan.netem_in_effect(delay) == {"delay_ms": 50.0, "jitter_ms": 0.0, "loss_pct": 0.0, "rate_mbit": 0.0}


def test_netem_args():
    assert wan.netem_args(WanProfile(delay_ms=50, jitter_ms=5, loss_pct=0.5, rate_mbit=100)) == [
        "limit",
        str(wan.NETEM_LIMIT),
        "delay",
        "50ms",
        "5ms",
        "loss",
        "0.5%",
        "rate",
        "100mbit",
    ]
    assert wan.netem_args(WanProfile(delay_ms=150)) == ["limit", str(wan.NETEM_LIMIT), "delay", "150ms"]
    assert WanProfile().is_null and not WanProfile(loss_pct=0.1).is_null


def test_parse_offloads():
    assert parse_offloads("default") == {}
    assert parse_offloads("lro=off, tso=on,gro=off") == {"lro": False, "tso": True, "gro": False}
    for bad in ("lro", "lro=maybe", "lso=off", "lro=on,lro=off"):
        with pytest.raises(ValueError):
            parse_offloads(bad)


def _cfg(matrix: dict, wan_: dict | None = None, **extra):
    return config.parse({"matrix": matrix, "wan": wan_ or {}, **extra})


def test_equivalent_cells_at_plan_time():
    cfg = _cfg(
        {"cc": ["default", "cubic", "bbr"], "wan": ["none", "zero", "rtt50"]}, {"zero": {}, "rtt50": {"delay_ms": 50}}
    )
    cells = plan.cells(cfg)
    by = {(c.cc, c.wan): c.id for c in cells}
    dups = plan.equivalents(cfg, cells)
    # Debian's default is cubic; a wan profile of zeros is no emulation
    assert dups[by[("cubic", "none")]] == by[("default", "none")]
    assert dups[by[("default", "zero")]] == by[("default", "none")]
    assert dups[by[("bbr", "zero")]] == by[("bbr", "none")]
    assert dups[by[("cubic", "rtt50")]] == by[("default", "rtt50")]
    assert by[("bbr", "none")] not in dups and by[("bbr", "rtt50")] not in dups
    assert len(dups) == 5
    # wan-16m sets bbr itself: cc=bbr adds nothing to it, cc=cubic does
    cfg = _cfg({"tuning": ["default", "wan-16m"], "cc": ["default", "bbr", "cubic"]})
    cells = plan.cells(cfg)
    by = {(c.tuning, c.cc): c.id for c in cells}
    assert plan.equivalents(cfg, cells) == {
        by[("default", "cubic")]: by[("default", "default")],
        by[("wan-16m", "bbr")]: by[("wan-16m", "default")],
    }
    # the A/A twin is meant to repeat its cell: never a duplicate
    cfg = _cfg({"nic": ["virtio", "e1000"]}, suite={"noise_floor": True})
    assert plan.equivalents(cfg, plan.units(cfg)) == {}


def test_network_axes_in_labels_only_when_set():
    cfg = _cfg({"offloads": ["default", "lro=off"], "wan": ["rtt50"]}, {"rtt50": {"delay_ms": 50}})
    a, b = plan.cells(cfg)
    assert a.label == "local/debian12/virtio/2c/1024m/virtio/linked/default/wan=rtt50"
    assert b.axes()["offloads"] == "lro=off" and "cc" not in b.axes()
    plain = plan.cells(_cfg({}))[0]
    assert plain.label == "local/debian12/virtio/2c/1024m/virtio/linked/default"


def test_wan_on_a_remote_linux_guest_goes_in_the_guest():
    where, why = wan.place(False, "Proxmox VE", osfacts.facts("debian"))
    assert where == "guest" and "Proxmox VE" in why
    assert wan.place(False, "libvirt/bhyve", osfacts.facts("freebsd"))[0] == ""


def test_lab_plan_reports_duplicates(tmp_path):
    path = tmp_path / "lab.toml"
    path.write_text('[wan.flat]\ndelay_ms = 0\n[matrix]\ncc = ["default", "cubic"]\nwan = ["none", "flat"]\n')
    res = lab_cli("plan", "-c", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "c02 is the same effective configuration as c01" in res.stdout
    assert "c03 is the same effective configuration as c01" in res.stdout
    assert "c04 is the same effective configuration as c01" in res.stdout
    assert "all zeros: same as none" in res.stdout
    assert "creates: 1 VM(s)" in res.stdout  # the three duplicates are not booted


def test_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"nic-shootout", "wan-tcp", "lro", "isolation", "smartos-zones", "explain"}
    assert {p.stem for p in EXAMPLES} >= {"study-start", "study-build", "study-web", "study-wan"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_loads_and_plans(path, tmp_path):
    cfg = config.load(path)
    cells = plan.units(cfg)
    axes = {
        k: {str(c.axes().get(k)) for c in cells if c.kind == "vm"} for k in ("nic", "tuning", "cc", "wan", "offloads")
    }
    if path.stem == "nic-shootout":
        assert axes["nic"] == {"virtio", "e1000"} and axes["tuning"] == {"default", "wan-16m"}
    elif path.stem == "wan-tcp":
        assert axes["cc"] == {"cubic", "bbr"}
        delays = {cfg.wan[w].delay_ms for w in cfg.matrix.wan}
        losses = {cfg.wan[w].loss_pct for w in cfg.matrix.wan}
        assert min(delays) == 50 and max(delays) == 150 and losses == {0.0, 1.0}
    elif path.stem == "lro":
        assert axes["offloads"] == {"lro=on", "lro=off"}
    elif path.stem == "explain":  # only the two corners lab explain starts from
        assert [(str(c.axes()["nic"]), str(c.axes()["cc"])) for c in cells] == [("virtio", "cubic"), ("e1000", "reno")]
    elif path.stem == "isolation":
        assert [(c.id, str(c.isolation), str(c.runtime)) for c in cells] == [
            ("c01", "vm", "podman"),
            ("c03", "container", "podman"),
            ("c04", "container", "docker"),
            ("bm01", "vm", "podman"),
            ("bm02", "container", "podman"),
            ("bm03", "container", "docker"),
        ]
    elif path.stem == "study-start":  # one VM and the host; the study's variants are rows of each
        assert [c.id for c in cells] == ["c01", "bm01"]
        p = cfg.suite.params["container-start"]
        assert (p["runtime"], p["network"], p["store"]) == (
            ["crun", "runc"],
            ["default", "host", "none"],
            ["persistent", "transient"],
        )
    elif path.stem == "study-build":  # podman and docker rows in each cell; FreeBSD's LRO cells on a libvirt host
        assert [(c.id, c.host, str(c.axes()["image"]), str(c.axes()["offloads"])) for c in cells] == [
            ("c01", "local", "debian12", "lro=on"),
            ("c02", "local", "debian12", "lro=off"),
            ("c07", "kvm1", "freebsd14", "lro=on"),
            ("c08", "kvm1", "freebsd14", "lro=off"),
        ]
        assert cfg.suite.params["podman-build"]["engines"] == ["podman", "docker"]
    elif path.stem == "study-web":  # bare metal, a container, a VM, a container in it; a VM on each other host
        assert [(c.id, c.host, str(c.isolation)) for c in cells] == [
            ("c01", "local", "vm"),
            ("c02", "local", "container"),
            ("c03", "pve1", "vm"),
            ("c05", "bsd1", "vm"),
            ("bm01", "local", "vm"),
            ("bm02", "local", "container"),
        ]
    elif path.stem == "study-wan":  # every corner of nic x buffers x cc x loss, scp beside iperf3
        assert len(cells) == 16 and axes["cc"] == {"cubic", "bbr"} and axes["tuning"] == {"default", "wan-16m"}
        assert cfg.suite.workloads == ["iperf3-tcp", "scp"] and {cfg.wan[w].loss_pct for w in cfg.matrix.wan} == {
            0.0,
            1.0,
        }
    elif path.stem == "smartos-zones":  # one zone cell for both NIC models: a zone has none
        assert [(c.id, str(c.isolation), axes_table.applies("nic", c)) for c in cells] == [
            ("c01", "vm", True),
            ("c02", "zone", False),
            ("c03", "vm", True),
        ]
    assert plan.equivalents(cfg, cells) == {}  # every example cell measures something different
    res = lab_cli("plan", "-c", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "lab plan created something"


def test_selecting_cells_by_network_axes():
    from lab import analysis
    from lab.store import CellRow

    def row(cid, **axes):
        return CellRow("r", cid, 1, cid, {"host": "local", "nic": "virtio", **axes}, "done", None, None, {})

    plain, bbr = row("c01"), row("c02", cc="bbr")
    assert analysis.matches(plain, {"cc": "default"}) and not analysis.matches(bbr, {"cc": "default"})
    assert analysis.matches(bbr, {"cc": "bbr"}) and analysis.matches(plain, {"wan": "none"})
