"""default_threads: physical cores in our affinity mask, performance cores only on a
hybrid CPU, no more than the cgroup's CPU limit allows (scripted /proc/cpuinfo,
/sys/devices/cpu_atom/cpus and cpu_quota; cpu_quota itself: test_cpu_quota.py)."""
import pytest

from edgellama import machine


def _cpuinfo(cores: dict[int, int], phys: int = 0, arm: bool = False) -> str:
    # cores: logical CPU -> core id
    blocks = []
    for cpu, core in sorted(cores.items()):
        lines = [f"processor\t: {cpu}"]
        if arm:
            lines.append("BogoMIPS\t: 50.00")
        else:
            lines += ["model name\t: Test CPU", f"physical id\t: {phys}", f"siblings\t: 2",
                      f"core id\t\t: {core}", "cpu cores\t: 4"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


@pytest.fixture
def machine_with(tmp_path, monkeypatch):
    def setup(cores, affinity=None, atom=None, arm=False, quota=None):
        info = tmp_path / "cpuinfo"
        info.write_text(_cpuinfo(cores, arm=arm))
        monkeypatch.setattr(machine, "_CPUINFO", str(info))
        atom_file = tmp_path / "atom_cpus"
        if atom is not None:
            atom_file.write_text(atom)
        monkeypatch.setattr(machine, "_ATOM_CPUS", str(atom_file))
        mask = set(cores) if affinity is None else set(affinity)
        monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: mask, raising=False)
        monkeypatch.setattr(machine, "cpu_quota", lambda: quota)
        return machine.default_threads()
    return setup


def test_smt_siblings_count_once(machine_with):
    # 4 cores, 2 threads each: CPUs c and c + 4 share core c
    assert machine_with({c: c % 4 for c in range(8)}) == 4


def test_a_mask_of_siblings_counts_their_cores(machine_with):
    # taskset 0,1,4,5 on that machine: 2 cores, not 4
    assert machine_with({c: c % 4 for c in range(8)}, affinity=[0, 1, 4, 5]) == 2


def test_hybrid_cpu_counts_performance_cores(machine_with):
    # 8 performance cores with SMT (CPUs 0-15, siblings 2c and 2c + 1) and 8 efficiency
    # cores without (CPUs 16-23), as Linux lists an Alder Lake i9
    cores = {c: c // 2 for c in range(16)} | {16 + i: 8 + i for i in range(8)}
    assert machine_with(cores, atom="16-23\n") == 8
    # a mask of efficiency cores only: those are what there is
    assert machine_with(cores, affinity=range(16, 20), atom="16-23\n") == 4


def test_cpulist_forms():
    assert machine._cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert machine._cpu_list("") == set()


def test_unreadable_or_odd_files_fall_back_to_logical_cpus(machine_with):
    # Arm's cpuinfo names no cores; an unparsable atom list is ignored
    assert machine_with({c: 0 for c in range(6)}, arm=True) == 6
    assert machine_with({c: c % 2 for c in range(4)}, atom="garbage") == 2
    assert machine_with({c: c % 2 for c in range(4)}, atom="") == 2


def test_a_cgroup_cpu_limit_caps_the_count(machine_with):
    # 8 cores, a container limited to 2.5 CPUs: 3 threads (prompts use the fraction's
    # thread; ThreadPolicy keeps a reply's passes to 2), never fewer than 1, and a limit
    # above the cores changes nothing
    cores = {c: c for c in range(8)}
    assert machine_with(cores, quota=2.5) == 3
    assert machine_with(cores, quota=2.0) == 2
    assert machine_with(cores, quota=0.3) == 1
    assert machine_with(cores, quota=16.0) == 8
    assert machine_with(cores, quota=None) == 8
