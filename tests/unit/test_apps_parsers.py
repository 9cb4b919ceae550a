"""Parsers of the application workloads against captured outputs (tests/data/README.md says where
each came from; `*-constructed-*` files are constructed, the others captured for real)."""

from __future__ import annotations

import pytest
from test_parsers import by_metric, read

from lab.errors import LabError
from lab.model import RawOutput
from lab.workloads import bulk_http, container_start, containers, git_clone, podman_build, scp, toolkit

# ---------------------------------------------------------------------------------------------
# time -p and git clone


def test_time_p_linux_and_freebsd():
    assert containers.parse_time_p(read("git/linux-2.39.5-clone-200x16k.txt"), "x") == pytest.approx(0.16)
    assert containers.parse_time_p(read("git/freebsd-constructed-clone-jail.txt"), "x") == pytest.approx(41.87)
    assert containers.parse_time_p("real 1,50\nuser 0,01\n", "x") == pytest.approx(1.5)  # a comma locale
    with pytest.raises(LabError, match="no 'real <seconds>' line"):
        containers.parse_time_p("fatal: boom\n", "git-clone")


def test_clone_output_linux():
    r = git_clone.parse_clone_output(read("git/linux-2.39.5-clone-200x16k.txt"))
    assert r == {"seconds": 0.16, "pack_bytes": 3287395.0, "mb_s": pytest.approx(3287395 / 1e6 / 0.16)}


def test_clone_output_freebsd_wc_pads_with_spaces():
    r = git_clone.parse_clone_output(read("git/freebsd-constructed-clone-jail.txt"))
    assert r["pack_bytes"] == 32849094 and r["mb_s"] == pytest.approx(32.849094 / 41.87)


def test_clone_faster_than_time_p_or_without_a_pack_measures_no_rate():
    lin = read("git/linux-2.39.5-clone-200x16k.txt")
    r = git_clone.parse_clone_output(lin.replace("real 0.16", "real 0.00"))
    assert "seconds" not in r and "mb_s" not in r and r["pack_bytes"] == 3287395
    assert "0.01 s resolution" in r[toolkit.UNMEASURED]
    r = git_clone.parse_clone_output(lin.replace("pack_bytes 3287395", "pack_bytes 0"))
    assert (
        r["seconds"] == 0.16
        and "mb_s" not in r
        and r[toolkit.UNMEASURED] == "the clone left no pack file to measure its size by"
    )
    raw = RawOutput(
        "git-clone",
        "",
        toolkit.join_segments([("guest", 0, lin.replace("real 0.16", "real 0.00"))]),
        params={},
        extra={"cpu_before.guest": "cpu  0 0 0 100", "cpu_after.guest": "cpu  5 0 0 105"},
    )
    m = by_metric(git_clone.GIT_CLONE.parse(raw))
    assert m["unmeasured_guest"].labels["unmeasured"] == "clone_seconds_guest clone_mb_s_guest"
    assert m["cpu_busy_pct_guest"].labels["flagged"] == 1 and m["cpu_busy_pct"].labels["flagged"] == 1


def test_clone_failure_is_an_error_naming_the_variant():
    text = read("git/linux-2.39.5-clone-missing-repo.txt")
    with pytest.raises(LabError, match="no 'pack_bytes' line"):
        git_clone.parse_clone_output(text)
    raw = RawOutput(
        "git-clone",
        "",
        toolkit.join_segments([("host", 128, text)]),
        returncode=128,
        params={"engine": "podman"},
        extra={},
    )
    with pytest.raises(LabError, match=r"exit status 128\) \[host\]"):
        git_clone.GIT_CLONE.parse(raw)


def test_git_clone_parse_rows_per_place_with_cpu():
    lin = read("git/linux-2.39.5-clone-200x16k.txt")
    segs = [("guest", 0, lin), ("default", 0, lin), ("host-lrooff", 0, lin)]
    extra = {"lro.guest": "off", "lro.default": "off", "lro.host-lrooff": "off"}
    for i, (tag, _, _) in enumerate(segs):
        extra[f"cpu_before.{tag}"] = f"cpu  {100 * i} 0 0 1000"
        extra[f"cpu_after.{tag}"] = f"cpu  {100 * i + 50} 0 0 1050"
    extra["cpu_before"], extra["cpu_after"] = extra["cpu_before.guest"], extra["cpu_after.host-lrooff"]
    raw = RawOutput("git-clone", "", toolkit.join_segments(segs), params={"engine": "podman"}, extra=extra)
    m = by_metric(git_clone.GIT_CLONE.parse(raw))
    for tag in ("guest", "default", "host-lrooff"):
        assert m[f"clone_seconds_{tag}"].value == pytest.approx(0.16)
        assert m[f"clone_mb_s_{tag}"].unit == "MB/s" and m[f"clone_mb_s_{tag}"].higher_is_better
        assert m[f"cpu_busy_pct_{tag}"].value == pytest.approx(50.0)
    assert m["clone_seconds_guest"].labels["engine"] is None
    assert m["clone_seconds_default"].labels == {
        "network": "default",
        "lro": "as-is",
        "lro_effective": "off",
        "engine": "podman",
    }
    assert m["clone_seconds_host-lrooff"].labels["lro"] == "off"


# ---------------------------------------------------------------------------------------------
# curl


def test_curl_json_two_downloads():
    r = bulk_http.parse_curl_json(read("curl/linux-7.88.1-json-2x4m.txt"))
    assert r["transfers"] == 2 and r["bytes"] == 2 * 4194304
    assert r["connects"] == 2  # python's http.server speaks HTTP/1.0: no keep-alive (nginx keeps it)
    assert r["download_mb_s"] == pytest.approx(r["bytes"] / 1e6 / r["seconds"])


def test_curl_json_404_is_an_error():
    with pytest.raises(LabError, match=r"2 of 2 downloads failed \(HTTP 404"):
        bulk_http.parse_curl_json(read("curl/linux-7.88.1-json-404.txt"))


def test_curl_nothing_to_parse():
    with pytest.raises(LabError, match="no curl -w"):
        bulk_http.parse_curl_json("curl: (7) Failed to connect to 10.77.0.10 port 80\n")


# ---------------------------------------------------------------------------------------------
# podman build (stamped lines)


def test_podman_build_steps_from_the_real_stamped_output():
    r = podman_build.parse_build_output(read("podman/linux-4.3.1-build-host-stamped.txt"))
    # each value: the next STEP's (or COMMIT's) stamp minus this STEP's stamp, as printed in the file
    assert r["from_seconds"] == pytest.approx(1795433939.146505 - 1795433938.954495)
    assert r["packages_seconds"] == pytest.approx(1795433969.821242 - 1795433939.146505)
    assert r["clone_seconds"] == pytest.approx(1795433979.441844 - 1795433969.821242)
    assert r["make_seconds"] == pytest.approx(1795433986.204032 - 1795433979.441844)
    assert r["install_seconds"] == pytest.approx(1795433991.546462 - 1795433986.204032)
    assert r["copy_seconds"] == pytest.approx(1795433996.234709 - 1795433991.546462)
    assert r["extra_seconds"] == pytest.approx(1795434003.367891 - 1795433996.234709)
    assert r["commit_seconds"] == pytest.approx(1795434005.950687 - 1795434003.367891)
    assert r["build_seconds"] == pytest.approx(1795434005.950687 - 1795433938.389959)
    assert r["rc"] == 0


def test_docker_legacy_builder_output_times_the_same_steps():
    r = podman_build.parse_build_output(read("podman/docker-constructed-20.10-legacy-build-stamped.txt"))
    assert r["clone_seconds"] == pytest.approx(1795433979.441844 - 1795433969.821242)
    assert r["extra_seconds"] == pytest.approx(1795434003.401220 - 1795433996.234709)  # to "Successfully built"
    assert r["commit_seconds"] == pytest.approx(1795434003.950687 - 1795434003.401220)


def test_docker_build_captured_on_the_golden_image_times_each_step_between_its_stamps():
    # docker.io 20.10.24's legacy builder in the debian12 guest, --network=host (study-build, small)
    r = podman_build.parse_build_output(read("podman/docker-20.10.24-legacy-build-host-stamped.txt"))
    assert r["rc"] == 0 and r["from_seconds"] == pytest.approx(1796388763.644000 - 1796388763.619705)
    assert r["clone_seconds"] == pytest.approx(1796388819.239980 - 1796388811.765221)
    assert r["make_seconds"] == pytest.approx(1796388825.299195 - 1796388819.239980)
    assert r["extra_seconds"] == pytest.approx(1796388837.083790 - 1796388832.416235)  # to "Successfully built"
    assert r["commit_seconds"] == pytest.approx(1796388837.178207 - 1796388837.083790)
    assert r["build_seconds"] == pytest.approx(1796388837.178207 - 1796388761.364549)


def test_freebsd_build_with_whole_second_stamps():
    r = podman_build.parse_build_output(read("podman/freebsd-constructed-podman-build-stamped.txt"))
    assert r["clone_seconds"] == 1795434582 - 1795430021  # the study's crawl: 76 min
    assert r["build_seconds"] == 4604 and r["from_seconds"] == 0


def test_failed_build_is_an_error_with_its_last_lines():
    with pytest.raises(LabError, match=r"exit status 1: .*Error: building at STEP \"RUN git clone"):
        podman_build.parse_build_output(read("podman/linux-constructed-build-failed-stamped.txt"))


def test_build_output_cut_short_or_missing():
    text = read("podman/linux-4.3.1-build-host-stamped.txt")
    with pytest.raises(LabError, match="no exit status line"):
        podman_build.parse_build_output(text.split("@@lab-build-rc")[0].rsplit("\n", 1)[0] + "\n")
    with pytest.raises(LabError, match="no stamped build output"):
        podman_build.parse_build_output("Error: no such image\n")
    with pytest.raises(LabError, match="expected 6 steps"):
        podman_build.parse_build_output(text, podman_build.STEPS[:6])


def test_podman_build_parse_rows_and_na():
    default = read("podman/linux-4.3.1-build-default-stamped.txt")
    host = read("podman/linux-4.3.1-build-host-stamped.txt")
    extra = {
        "cpu_before.podman-default": "cpu  0 0 0 100",
        "cpu_after.podman-default": "cpu  60 0 20 120",
        "cpu_before.podman-host": "cpu  60 0 20 120",
        "cpu_after.podman-host": "cpu  100 0 40 160",
        "cpu_before": "cpu  0 0 0 100",
        "cpu_after": "cpu  100 0 40 160",
        "na.docker-default": "docker is not installed in the guest",
    }
    raw = RawOutput(
        "podman-build",
        "",
        toolkit.join_segments([("podman-default", 0, default), ("podman-host", 0, host)]),
        params={"steps": list(podman_build.STEPS)},
        extra=extra,
    )
    m = by_metric(podman_build.PODMAN_BUILD.parse(raw))
    assert m["build_seconds_podman-host"].value == pytest.approx(67.560728)
    assert m["build_seconds_podman-default"].labels == {"engine": "podman", "network": "default"}
    for step in (*podman_build.STEPS, "commit"):
        assert f"{step}_seconds_podman-default" in m and f"{step}_seconds_podman-host" in m
    assert (
        m["na_docker-default"].value == 1
        and m["na_docker-default"].labels["na"] == "docker is not installed in the guest"
    )
    assert m["cpu_busy_pct_podman-default"].value == pytest.approx(80 / 100 * 100)
    assert m["cpu_busy_pct_podman-host"].value == pytest.approx(60 / 100 * 100)


# ---------------------------------------------------------------------------------------------
# hyperfine


def test_hyperfine_json_from_the_guest():
    r = container_start.parse_hyperfine_json(read("hyperfine/linux-1.15.0-podman-crun-host.json"))
    assert r["mean"] == pytest.approx(3453.906265) and r["min"] == pytest.approx(2622.34271)
    assert r["stddev"] == pytest.approx(1176.0084574561855) and r["runs"] == 2
    assert r["command"] == "podman run --rm --runtime=crun --network=host localhost/lab-base:latest true"


def test_hyperfine_single_run_has_no_stddev():
    # captured: hyperfine 1.15.0 --runs 1 exports "stddev": null (there is no spread of one run)
    r = container_start.parse_hyperfine_json(read("hyperfine/linux-1.15.0-true-1run.json"))
    assert "stddev" not in r and r["runs"] == 1 and r["mean"] == pytest.approx(3.545035)
    assert r[toolkit.UNMEASURED] == "hyperfine reports no standard deviation for 1 run(s)"
    raw = RawOutput(
        "container-start",
        "",
        toolkit.join_segments([("crun-host-persistent", 0, read("hyperfine/linux-1.15.0-true-1run.json"))]),
        extra={
            "cpu_before.crun-host-persistent": "cpu  0 0 0 100",
            "cpu_after.crun-host-persistent": "cpu  30 0 10 160",
        },
    )
    m = by_metric(container_start.CONTAINER_START.parse(raw))
    assert "start_stddev_ms_crun-host-persistent" not in m
    assert m["unmeasured_crun-host-persistent"].labels["unmeasured"] == "start_stddev_ms_crun-host-persistent"
    # the mean of one run is still a measurement: only the row that stands for the stddev is flagged
    assert "flagged" not in m["start_ms_crun-host-persistent"].labels
    assert "flagged" not in m["cpu_busy_pct_crun-host-persistent"].labels


def test_hyperfine_without_a_mean_is_an_error():
    import json

    doc = json.loads(read("hyperfine/linux-1.15.0-true-1run.json"))
    doc["results"][0]["mean"] = None
    with pytest.raises(LabError, match="no mean/min"):
        container_start.parse_hyperfine_json(json.dumps(doc))


def test_hyperfine_failed_runs_and_garbage():
    import json

    doc = json.loads(read("hyperfine/linux-1.15.0-podman-runc-default.json"))
    doc["results"][0]["exit_codes"] = [0, 125]
    with pytest.raises(LabError, match=r"failed in 1 of 2 runs \(exit codes \[0, 125\]\)"):
        container_start.parse_hyperfine_json(json.dumps(doc))
    with pytest.raises(LabError, match="not hyperfine JSON; first line of output: 'Error: Command terminated"):
        container_start.parse_hyperfine_json("Error: Command terminated with non-zero exit code: 125.\n")


def test_container_start_parse_rows():
    host = read("hyperfine/linux-1.15.0-podman-crun-host.json")
    runc = read("hyperfine/linux-1.15.0-podman-runc-default.json")
    extra = {
        "cpu_before.crun-host-persistent": "cpu  0 0 0 100",
        "cpu_after.crun-host-persistent": "cpu  30 0 10 160",
        "cpu_before.runc-default-persistent": "cpu  30 0 10 160",
        "cpu_after.runc-default-persistent": "cpu  90 0 30 200",
        "cpu_before": "cpu  0 0 0 100",
        "cpu_after": "cpu  90 0 30 200",
        "runtime_version.crun-host-persistent": "crun version 1.8.1",
        "na.crun-host-transient": "podman 4.3.1 has no --transient-store (Error: unknown flag: --transient-store)",
    }
    raw = RawOutput(
        "container-start",
        "",
        toolkit.join_segments([("crun-host-persistent", 0, host), ("runc-default-persistent", 0, runc)]),
        extra=extra,
    )
    m = by_metric(container_start.CONTAINER_START.parse(raw))
    assert m["start_ms_runc-default-persistent"].value == pytest.approx(8786.485005)
    assert m["start_ms_crun-host-persistent"].labels == {
        "engine": "podman",
        "runtime": "crun",
        "runtime_version": "crun version 1.8.1",
        "network": "host",
        "store": "persistent",
        "runs": 2,
    }
    assert m["na_crun-host-transient"].labels["store"] == "transient"
    assert m["cpu_busy_pct_crun-host-persistent"].value == pytest.approx(40 / 100 * 100)


# ---------------------------------------------------------------------------------------------
# scp (ssh LogLevel=VERBOSE)


def test_scp_both_directions_from_the_guest_run():
    tx = scp.parse_scp_output(read("scp/linux-openssh-9.2-tx-16m.txt"), 16 * 1048576, "tx")
    assert tx["seconds"] == 1.1 and tx["received"] == 16792332
    assert tx["throughput_mb_s"] == pytest.approx(16 * 1048576 / 1e6 / 1.1)
    rx = scp.parse_scp_output(read("scp/linux-openssh-9.2-rx-16m.txt"), 16 * 1048576, "rx")
    assert rx["seconds"] == 3.2 and rx["sent"] == 16793728


def test_scp_short_transfer_and_failure():
    with pytest.raises(LabError, match="less than the 67108864 bytes file"):
        scp.parse_scp_output(read("scp/linux-openssh-9.2-tx-16m.txt"), 64 * 1048576, "tx")
    with pytest.raises(LabError, match="no 'Transferred:"):
        scp.parse_scp_output("ssh: connect to host 10.77.0.10 port 22: Connection refused\n", 1, "rx")


def test_scp_time_below_ssh_resolution_measures_no_rate():
    text = read("scp/linux-openssh-9.2-tx-16m.txt").replace("in 1.1 seconds", "in 0.0 seconds")
    r = scp.parse_scp_output(text, 16 * 1048576, "tx")
    assert "seconds" not in r and "throughput_mb_s" not in r and "0.1 s resolution" in r[toolkit.UNMEASURED]
    raw = RawOutput(
        "scp",
        "",
        toolkit.join_segments([("tx", 0, text)]),
        params={"file_bytes": 16 * 1048576},
        extra={"cpu_before.tx": "cpu  0 0 0 100", "cpu_after.tx": "cpu  5 0 0 105", "wall_seconds.tx": "2.500"},
    )
    m = by_metric(scp.SCP.parse(raw))
    assert m["unmeasured_tx"].labels["unmeasured"] == "throughput_mb_s_tx seconds_tx"
    assert m["wall_seconds_tx"].value == 2.5 and m["wall_seconds_tx"].labels["flagged"] == 1


def test_curl_empty_downloads_measure_no_rate():
    # captured: two 200 answers of 0 bytes from python's http.server
    r = bulk_http.parse_curl_json(read("curl/linux-7.88.1-json-2x-empty.txt"))
    assert r["transfers"] == 2 and r["bytes"] == 0 and "download_mb_s" not in r
    assert r[toolkit.UNMEASURED].startswith("curl reports 0 bytes in ")
    assert r["first_byte_ms"] > 0


def test_bulk_http_from_nginx_in_the_guest():
    r = bulk_http.parse_curl_json(read("curl/linux-7.88.1-json-2x64m-nginx.txt"))
    assert r["transfers"] == 2 and r["bytes"] == 2 * 67108864 and r["connects"] == 1  # kept alive


def test_container_start_parse_a_docker_row_and_its_na_row():
    # docker's rows end in `docker` where podman's name their store; engine and runtime labelled
    raw = RawOutput(
        "container-start",
        "",
        toolkit.join_segments([("runc-none-docker", 0, read("hyperfine/linux-1.15.0-true-1run.json"))]),
        extra={
            "cpu_before.runc-none-docker": "cpu  0 0 0 100",
            "cpu_after.runc-none-docker": "cpu  30 0 10 160",
            "na.crun-none-docker": "docker has no OCI runtime 'crun' registered (its daemon.json `runtimes`)",
        },
    )
    m = by_metric(container_start.CONTAINER_START.parse(raw))
    row = m["start_ms_runc-none-docker"]
    assert row.value == pytest.approx(3.545035)
    assert (row.labels["engine"], row.labels["runtime"], row.labels["network"]) == ("docker", "runc", "none")
    na = m["na_crun-none-docker"].labels
    assert (na["engine"], na["runtime"]) == ("docker", "crun") and "daemon.json" in na["na"]


def test_container_start_tags_and_docker_runtimes():
    assert container_start.split_tag("crun-host-persistent") == ("podman", "crun", "host", "persistent")
    assert container_start.split_tag("runc-default-docker") == ("docker", "runc", "default", "docker")
    with pytest.raises(LabError, match="not a combination tag"):
        container_start.split_tag("crun-host")
    # captured: `docker info --format '{{json .Runtimes}}'` of the golden image's docker 20.10 (crun registered)
    assert container_start.parse_docker_runtimes(read("docker/debian12-20.10.24-runtimes.json")) == [
        "crun",
        "io.containerd.runc.v2",
        "io.containerd.runtime.v1.linux",
        "runc",
    ]
    assert container_start.parse_docker_runtimes("Cannot connect to the Docker daemon") == []
