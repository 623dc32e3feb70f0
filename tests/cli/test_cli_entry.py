"""The `edgellama` group itself: commands load on demand, so --help imports neither numpy
nor numba (--version does: it names the kernels' threading layer); the listing shows each
command's own help line."""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys

from click.testing import CliRunner

from edgellama.cli import main as main_module


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_imports_neither_numpy_nor_numba_and_version_names_the_threading_layer():
    code = ("import json, sys\n"
            "from edgellama.cli.main import main\n"
            "for args in (['--help'], ['--version']):\n"
            "    try:\n"
            "        main(args, prog_name='edgellama')\n"
            "    except SystemExit:\n"
            "        pass\n"
            "    print(json.dumps([m for m in ('numpy', 'numba') if m in sys.modules]))\n")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    loaded = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("[")]
    assert loaded[0] == [], res.stdout                 # after --help
    assert "Commands:" in res.stdout
    version = next(line for line in res.stdout.splitlines() if line.startswith("edgellama "))
    assert version.startswith(f"edgellama {importlib.metadata.version('edgellama')} (Numba ")
    assert re.search(r"threading layer (omp|tbb|workqueue)(, cgroup CPU limit [0-9.]+)?\)$",
                     version), version


def test_version_names_a_cgroup_cpu_limit(monkeypatch):
    from edgellama import machine
    monkeypatch.setattr(machine, "cpu_quota", lambda: 1.5)
    res = CliRunner().invoke(main_module.main, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0].endswith(", cgroup CPU limit 1.5)"), res.output


def test_workqueue_is_named_with_what_to_install():
    # where only Numba's own layer loads (forced here), --version and every command that
    # runs kernels say so once, with the runtimes to install
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    res = subprocess.run([sys.executable, "-m", "edgellama", "--version"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert re.search(r"threading layer workqueue(, cgroup CPU limit [0-9.]+)?\)$", res.stdout.rstrip())
    assert res.stderr.count("note: ") == 1 and "libgomp" in res.stderr and "tbb" in res.stderr


def test_importing_edgellama_defers_numba_but_kernels_still_use_the_user_cache(tmp_path):
    code = ("import sys, edgellama\n"
            "assert not {'numba', 'numpy', 'huggingface_hub'} & set(sys.modules)\n"
            "assert edgellama.hub.parse_ref('llama3.2:1b')[1] == 'Q4_K_M'\n"
            "import edgellama.kernels.rows as k\n"
            "print(k.rmsnorm._cache._cache_path)\n"
            "print(edgellama.load.__module__, edgellama.SamplingParams.__name__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "EDGELLAMA_CACHE": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    cache_path, api = res.stdout.splitlines()
    assert cache_path.startswith(str(tmp_path / "numba"))
    assert api == "edgellama.llm SamplingParams"


def test_listing_shows_each_commands_own_help_line():
    """The listing reads help lines from the sources; they are what the loaded commands say."""
    listing = CliRunner().invoke(main_module.main, ["--help"]).output
    for name, module in main_module.COMMANDS.items():
        importlib.import_module(f"edgellama.cli.{module}")
        command = main_module.main.commands[name]    # the module registered this very name
        assert command.help, name
        for limit in (30, 45, 300):
            assert main_module._short_help(module, name, limit) == command.get_short_help_str(limit)
        assert f"  {name} " in listing


def test_unknown_command_is_a_usage_error():
    res = CliRunner().invoke(main_module.main, ["frobnicate"])
    assert res.exit_code == 2 and "No such command 'frobnicate'" in res.output
