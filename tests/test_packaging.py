"""What ``pip install rlbatch`` gives: the wheel holds every package, the shipped policies and
the profiles; the commands the README uses run from the installed copy in another folder;
``rlbatch serve`` / ``rlbatch train`` are ``serve.py`` / ``train.py``; shipped policies resolve
by name; the metadata agrees with the build requirement and pins nothing exactly in an extra.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import rlbatch
from policies.ppo import SHIPPED_POLICIES, resolve_policy
from rlbatch.commands.main import main

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlbatch", "envs", "policies")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _source_files() -> set[str]:
    """Every file of the packages in the checkout, as wheel paths."""
    return {p.relative_to(REPO).as_posix() for pkg in PACKAGES for p in (REPO / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel pip builds from a copy of the sources (so the checkout gets no build/), with
    the build requirements of pyproject.toml in an isolated environment, as for a user."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(out), str(src)], check=True, timeout=300)
    (built,) = out.glob("rlbatch-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed into a folder of its own (its dependencies: this environment's)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-compile", "--target", str(target), str(wheel)], check=True,
                   timeout=300)
    return target


def _run_installed(installed: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``rlbatch ARGV`` from the installed copy, in ``cwd`` (not the checkout)."""
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import rlbatch\n"
            "assert rlbatch.__file__.startswith(sys.path[0]), rlbatch.__file__\n"
            "from rlbatch.commands.main import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, str(installed), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


# -------------------------------------------------------------------------------- the wheel
def test_wheel_holds_every_package_file_policies_and_profiles(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = _source_files() - names
    assert not missing, sorted(missing)
    for policy in ("default", "two-pool", "seeds/seed1", "seeds/seed2"):
        for name in ("policy.json", "policy.safetensors", "EVAL.md"):
            assert f"policies/{policy}/{name}" in names
    assert {"rlbatch/profiles/gpus/a100-80g.json", "rlbatch/profiles/models/llama-2-7b.json",
            "policies/default/README.md", "policies/seeds/README.md"} <= names
    # nothing beyond the three packages and the metadata (no tests, runs, scripts)
    tops = {n.split("/")[0] for n in names}
    assert tops == {*PACKAGES, f"rlbatch-{rlbatch.__version__}.dist-info"}, tops


def test_wheel_metadata(wheel: Path) -> None:
    dist = f"rlbatch-{rlbatch.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"{dist}/METADATA").decode()
        entry_points = z.read(f"{dist}/entry_points.txt").decode()
    assert f"\nVersion: {rlbatch.__version__}\n" in meta
    assert "\nLicense-Expression: Apache-2.0\n" in meta
    assert "rlbatch = rlbatch.commands.main:main" in entry_points
    assert "train = policies.training.command:rlbatch_train" in entry_points
    assert "ppo = policies.ppo:ppo_factory" in entry_points


def test_build_requirement_reads_the_license_expression() -> None:
    """An SPDX string in ``license`` needs setuptools >= 77 (PEP 639); older ones refuse it."""
    assert isinstance(PYPROJECT["project"]["license"], str)
    (setuptools,) = [r for d in PYPROJECT["build-system"]["requires"]
                     if (r := Requirement(d)).name == "setuptools"]
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0")


def test_no_exact_pin_in_an_extra() -> None:
    """Exact pins are an application's choice (scripts/setup.sh); a library's extras give
    ranges, or pip cannot install rlbatch beside anything else that needs another release."""
    for extra, deps in PYPROJECT["project"]["optional-dependencies"].items():
        for dep in deps:
            operators = {s.operator for s in Requirement(dep).specifier}
            assert not operators & {"==", "==="}, (extra, dep)


# ----------------------------------------------------------------- the installed commands
def test_installed_commands_run_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    version = _run_installed(installed, tmp_path, "--version")
    assert version.returncode == 0 and version.stdout == f"rlbatch {rlbatch.__version__}\n"
    out = tmp_path / "rows.json"
    done = _run_installed(installed, tmp_path, "evaluate", "--trace",
                          "bursty:rate=2,duration=30", "--controllers",
                          "static:64,ppo:default", "--quiet", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [row["controller"] for row in json.loads(out.read_text())] == [
        "static:64", "ppo:default"]
    for command in ("serve", "simulate"):
        helped = _run_installed(installed, tmp_path, command, "--help")
        assert helped.returncode == 0 and f"usage: rlbatch {command}" in helped.stdout


# ------------------------------------------------------------------ --version, serve, train
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"rlbatch {rlbatch.__version__}\n"
    assert metadata.version("rlbatch") == rlbatch.__version__


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_rlbatch_train_is_train_py(capsys: pytest.CaptureFixture[str]) -> None:
    import train
    from policies.training.command import rlbatch_train

    (entry,) = metadata.entry_points(group="rlbatch.commands", name="train")
    assert entry.load() is rlbatch_train
    assert (_help(["train", "--help"], capsys)
            == train.build_parser("rlbatch train").format_help())
    assert train.build_parser().prog == "train.py"
    assert rlbatch_train(["--episodes", "0"]) == 2
    assert capsys.readouterr().err.startswith("rlbatch train: error: need episodes >= 1")


def test_rlbatch_serve_is_serve_py(capsys: pytest.CaptureFixture[str]) -> None:
    ours = _help(["serve", "--help"], capsys)
    script = subprocess.run([sys.executable, "serve.py", "--help"], cwd=REPO, check=True,
                            capture_output=True, text=True, timeout=120).stdout

    def words(text: str, prog: str) -> str:  # argparse wraps the usage by the prog's length
        return " ".join(text.replace(prog, "PROG").split())

    assert words(ours, "rlbatch serve") == words(script, "serve.py")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--no-such-flag"])
    assert exc.value.code == 2
    assert "usage: rlbatch serve" in capsys.readouterr().err


def test_train_without_its_entry_point_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(metadata, "entry_points", lambda **_: metadata.EntryPoints(()))
    assert main(["train", "--help"]) == 2
    assert "pip install" in capsys.readouterr().err


def test_top_level_help_lists_serve_and_train(capsys: pytest.CaptureFixture[str]) -> None:
    listed = _help(["--help"], capsys)
    assert re.search(r"^\s+serve\s", listed, re.MULTILINE)
    assert re.search(r"^\s+train\s", listed, re.MULTILINE)


# ---------------------------------------------------------------- shipped policy names
@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    yield tmp_path


@pytest.mark.parametrize("ref, folder", [
    ("default", "default"), ("two-pool", "two-pool"), ("seeds/seed1", "seeds/seed1"),
    ("policies/default", "default"),  # the checkout's spelling, as the README writes it
])
def test_shipped_names_resolve_from_any_folder(elsewhere: Path, ref: str, folder: str) -> None:
    assert resolve_policy(ref) == SHIPPED_POLICIES / folder
    assert (resolve_policy(ref) / "policy.safetensors").is_file()


def test_a_path_wins_over_a_shipped_name(elsewhere: Path) -> None:
    (elsewhere / "default").mkdir()
    assert resolve_policy("default") == Path("default")
    assert resolve_policy(str(elsewhere / "x")) == elsewhere / "x"  # missing: unchanged


@pytest.mark.parametrize("ref", ["seeds", "../rlbatch/profiles", "nope", "/etc"])
def test_other_names_are_left_to_the_loader(elsewhere: Path, ref: str) -> None:
    assert resolve_policy(ref) == Path(ref)


def test_ppo_controller_by_shipped_name(elsewhere: Path) -> None:
    from policies.artifact import ArtifactError
    from rlbatch.control.controllers import make_controller

    assert make_controller("ppo:default[order=fifo]").name == "ppo:default[order=fifo]"
    with pytest.raises(ArtifactError, match="not found"):
        make_controller("ppo:no-such-policy")
