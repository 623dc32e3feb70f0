"""cpu_quota: the CPU limit of the process's cgroups (v2 cpu.max, v1 cfs quota / period),
the smallest along its cgroup's path, read through scripted /proc/self/cgroup,
/proc/self/mountinfo and cgroup trees; and ThreadPolicy's counts under a limit."""
import numba
import pytest

from edgellama import machine
from edgellama.machine import ThreadPolicy


@pytest.fixture
def cgroups(tmp_path, monkeypatch):
    """setup(cgroup_lines, mounts, files, raw_mounts): mounts (fstype, root, mount dir under
    tmp_path, super options); files {path under tmp_path: text}; raw_mounts: mountinfo
    lines as they are. Returns cpu_quota()."""
    def setup(cgroup_lines, mounts, files, raw_mounts=()):
        for rel, text in files.items():
            f = tmp_path / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        info = []
        for i, (fstype, root, point, opts) in enumerate(mounts):
            (tmp_path / point).mkdir(parents=True, exist_ok=True)
            where = str(tmp_path / point).replace(" ", "\\040")
            info.append(f"{30 + i} 1 0:{40 + i} {root} {where} rw,nosuid - {fstype} cgroup {opts}")
        (tmp_path / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
        (tmp_path / "mountinfo").write_text("\n".join(list(raw_mounts) + info) + "\n")
        monkeypatch.setattr(machine, "_PROC_CGROUP", str(tmp_path / "cgroup"))
        monkeypatch.setattr(machine, "_MOUNTINFO", str(tmp_path / "mountinfo"))
        return machine.cpu_quota()
    return setup


V2 = [("cgroup2", "/", "cg", "rw,nsdelegate")]


def test_v2_limit_of_the_process_group(cgroups):
    assert cgroups(["0::/kubepods/pod1/app"], V2,
                   {"cg/kubepods/pod1/app/cpu.max": "150000 100000\n",
                    "cg/kubepods/pod1/cpu.max": "max 100000\n"}) == 1.5


def test_v2_smallest_limit_along_the_path(cgroups):
    # a parent's limit binds its children: 1 CPU for the pod beats the container's 4
    assert cgroups(["0::/kubepods/pod1/app"], V2,
                   {"cg/kubepods/pod1/app/cpu.max": "400000 100000\n",
                    "cg/kubepods/pod1/cpu.max": "50000 50000\n",
                    "cg/cpu.max": "max 100000\n"}) == 1.0


def test_v2_no_limit(cgroups):
    assert cgroups(["0::/user.slice"], V2, {"cg/user.slice/cpu.max": "max 100000\n"}) is None
    assert cgroups(["0::/"], V2, {}) is None      # no cpu.max anywhere (the root has none)


def test_v1_cpu_controller_in_a_namespace(cgroups):
    # Docker on cgroup v1: the group is the mount's root, so its files are at the mount
    # point; cpuacct shares the hierarchy; another hierarchy (memory) is not the cpu one
    lines = ["12:memory:/docker/abc", "4:cpu,cpuacct:/docker/abc", "0::/"]
    mounts = [("cgroup", "/docker/abc", "cpu,cpuacct", "rw,cpu,cpuacct"),
              ("cgroup", "/docker/abc", "memory", "rw,memory")]
    files = {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
             "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
             "memory/cpu.cfs_quota_us": "50000\n", "memory/cpu.cfs_period_us": "100000\n"}
    assert cgroups(lines, mounts, files) == 2.0


def test_v1_unlimited_beside_an_empty_v2_hierarchy(cgroups):
    # this test machine's layout: v1 controllers, a cgroup2 mount with none of them
    lines = ["1:cpu:/", "0::/"]
    mounts = [("cgroup", "/", "v1cpu", "rw,cpu"), ("cgroup2", "/", "unified", "rw")]
    assert cgroups(lines, mounts, {"v1cpu/cpu.cfs_quota_us": "-1\n",
                                   "v1cpu/cpu.cfs_period_us": "100000\n"}) is None
    assert cgroups(["1:cpu:/job"], mounts[:1], {"v1cpu/job/cpu.cfs_quota_us": "25000\n",
                                                "v1cpu/job/cpu.cfs_period_us": "100000\n",
                                                "v1cpu/cpu.cfs_quota_us": "-1\n",
                                                "v1cpu/cpu.cfs_period_us": "100000\n"}) == 0.25


def test_a_mount_point_with_a_space(cgroups):
    mounts = [("cgroup2", "/", "my cgroups", "rw")]
    assert cgroups(["0::/a"], mounts, {"my cgroups/a/cpu.max": "300000 100000\n"}) == 3.0


def test_a_path_out_of_the_namespace_reads_the_mount_point_only(cgroups):
    # a process outside the reader's cgroup namespace shows as "/../.."; nothing above
    # the mount point is read
    assert cgroups(["0::/../other"], V2, {"cg/cpu.max": "100000 100000\n",
                                          "other/cpu.max": "1 100000\n"}) == 1.0


@pytest.mark.parametrize("text", ["", "max", "150000", "abc 100000", "100000 0", "-5 100000",
                                  "150000 100000 7"])
def test_odd_cpu_max_is_no_limit(cgroups, text):
    assert cgroups(["0::/a"], V2, {"cg/a/cpu.max": text}) is None


def test_odd_or_missing_proc_files(cgroups, monkeypatch, tmp_path):
    # garbage lines are skipped; no /proc at all (not Linux) is no limit
    raw = ["garbage", "1 2 3 - cgroup2", "1 2 0:3 / /x rw -", ""]
    assert cgroups(["garbage", "7", "0::relative", "0::/a"], V2, {"cg/a/cpu.max": "200000 100000"},
                   raw_mounts=raw) == 2.0
    monkeypatch.setattr(machine, "_PROC_CGROUP", str(tmp_path / "absent"))
    assert machine.cpu_quota() is None


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")
def test_a_fractional_limit_keeps_replies_to_its_whole_cpus(monkeypatch):
    # 1.5 CPUs: a prompt's passes take 2 threads, a reply's (a few rows) 1; -t 2 is 2 for both
    monkeypatch.setattr(machine, "cpu_quota", lambda: 1.5)
    monkeypatch.setattr(machine, "default_threads", lambda: 2)
    monkeypatch.setattr(machine, "_busy_seconds", lambda cpus: None)   # no load to adapt to
    p = ThreadPolicy()
    assert p.quota == 1.5 and p.memory_bound_max == 1
    assert p.apply(512) == 2 and numba.get_num_threads() == 2
    assert p.apply(1) == 1 and numba.get_num_threads() == 1
    assert p.apply(ThreadPolicy.MEMORY_BOUND_ROWS) == 1
    assert p.apply(ThreadPolicy.MEMORY_BOUND_ROWS + 1) == 2
    fixed = ThreadPolicy(2)
    assert fixed.quota is None and fixed.apply(1) == 2
    monkeypatch.setattr(machine, "cpu_quota", lambda: 2.0)   # whole CPUs: no difference
    assert ThreadPolicy().apply(1) == 2
