"""The command-line contract (DESIGN.md): evaluate, simulate, profile-check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlbatch.commands.main import main
from rlbatch.profiles import ProfileError, load_gpu
from rlbatch.profiles.fit import fit_gpu_efficiency, write_fit
from tests.conftest import profiling_dir
from tests.test_profiles import _shipped_json, _write_csv

ROW_FIELDS = {
    "controller", "trace", "rate_scale", "completed", "rejected", "truncated", "goodput_rps",
    "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s",
    "sla_attainment", "preemptions", "kv_overflows", "guard_overrides", "sim_seconds",
    "wall_seconds", "per_bucket",
}
BUCKET_FIELDS = {"completed", "goodput_rps", "sla_attainment", "ttft_p99_s", "tpot_p99_s"}


def test_evaluate_writes_one_row_per_controller_trace_rate(azure_trace: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    out = tmp_path / "rows.json"
    rc = main(["evaluate", "--trace", str(azure_trace), "poisson:rate=2,duration=60,mix=night",
               "--controllers", "static:{4,16},vllm-default", "--rate-scale", "0.5,1",
               "--max-requests", "300", "--json", str(out), "--quiet"])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 3 * 2
    assert {(r["controller"], r["trace"], r["rate_scale"]) for r in rows} == {
        (c, t, s) for c in ("static:4", "static:16", "vllm-default")
        for t in ("azure_conv_2023", "poisson-night_mix") for s in (0.5, 1.0)}
    for row in rows:
        assert row.keys() >= ROW_FIELDS
        assert set(row["per_bucket"]) == {"0-1k", "1k-2k", "2k-4k", "4k+"}
        for bucket in row["per_bucket"].values():
            assert bucket.keys() >= BUCKET_FIELDS
        assert row["completed"] + row["rejected"] + row["unfinished"] == row["submitted"]
    table = capsys.readouterr().out
    assert "goodput/s" in table and "static:16" in table


def test_simulate_one_run(azure_trace: Path, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "row.json"
    rc = main(["simulate", "--trace", str(azure_trace), "--controller", "static:16",
               "--max-requests", "200", "--json", str(out), "--quiet"])
    assert rc == 0
    row = json.loads(out.read_text())
    assert row.keys() >= ROW_FIELDS and row["submitted"] == 200
    assert "bucket" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--controller", "static:x"], "integer batch size"),
    (["--controller", "nope"], "unknown controller"),
    (["--model", "gpt-17"], "gpt-17"),
    (["--pools", "fp4"], "unknown pool"),
])
def test_simulate_bad_arguments_fail_clearly(argv: list[str], message: str, azure_trace: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["simulate", "--trace", str(azure_trace), "--quiet", *argv])
    except SystemExit as exc:  # argparse rejects malformed values itself
        rc = int(exc.code or 0)
    assert rc == 2
    assert message in capsys.readouterr().err


def test_missing_trace_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", str(tmp_path / "nope.csv"), "--quiet"])
    assert rc == 2
    assert "nope.csv" in capsys.readouterr().err


def test_profile_check_contract(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    csv = profiling_dir() / "a100_meta-llama_Llama-2-7b-hf_mlp.csv"
    rc = main(["profile-check", "--gpu", "a100-80g", str(csv), "--json", str(out)])
    assert rc == 0
    (entry,) = json.loads(out.read_text())
    assert {"file", "rows", "median_rel_err", "p90_rel_err"} <= entry.keys()
    assert entry["rows"] == 1044 and entry["median_rel_err"] <= 0.10


def test_module_entry_point_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "rlbatch", "--help"], capture_output=True,
                          text=True, check=True)
    for command in ("evaluate", "simulate", "profile-check"):
        assert command in proc.stdout


def test_profile_check_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.csv"
    _write_csv(path)
    out = tmp_path / "out.json"
    assert main(["profile-check", "--gpu", "a100-80g", str(path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["rows"] == 2 and "median_rel_err" in rows[0]
    assert "tiny.csv" in capsys.readouterr().out
    assert main(["profile-check", "--gpu", "a100-80g", str(path),
                 "--max-median-rel-err", "0.01"]) == 1
    assert main(["profile-check", "--gpu", "nope", str(path)]) == 2
    assert main(["profile-check", "--gpu", "h100-80g", str(path)]) == 0


def test_profile_fit_cli_writes_profile(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.csv"
    _write_csv(path)
    gpu_json = tmp_path / "g.json"
    gpu_json.write_text(json.dumps(_shipped_json("gpus", "a100-80g")))
    assert main(["profile-fit", "--gpu", str(gpu_json), str(path), "--write",
                 str(gpu_json)]) == 0
    assert "eff_compute" in capsys.readouterr().out
    data = json.loads(gpu_json.read_text())
    assert data["fit"]["files"] == ["tiny.csv"] and data["fit"]["rows"] == 2
    fitted, shipped = load_gpu(gpu_json).efficiency, load_gpu("a100-80g").efficiency
    assert fitted.eff_attn_mem == shipped.eff_attn_mem  # unfitted fields kept
    assert fitted.eff_elementwise == shipped.eff_elementwise  # no elementwise columns
    assert "not fitted" in data["fit"]["elementwise"]
    assert main(["profile-fit", "--gpu", "a100-80g", str(tmp_path / "missing.csv")]) == 2
    with pytest.raises(ProfileError):
        write_fit(tmp_path / "tiny.csv", fit_gpu_efficiency("a100-80g", [path]))


# ---------------------------------------------------------------- start-up: lazy imports
_LOADED = ("import sys\nfrom rlbatch.commands.main import main\ntry:\n    main({argv!r})\n"
           "except SystemExit:\n    pass\nprint('MODULES', *sorted(sys.modules))")


def _modules_after(argv: list[str]) -> set[str]:
    """The modules a fresh interpreter holds after ``rlbatch ARGV``."""
    out = subprocess.run([sys.executable, "-c", _LOADED.format(argv=argv)], check=True,
                         capture_output=True, text=True).stdout
    return set(out.rpartition("MODULES")[2].split())


def test_help_imports_no_command() -> None:
    loaded = _modules_after(["--help"])
    assert "rlbatch.commands.catalog" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("numpy", "scipy", "tqdm", "torch")
             or m.startswith(("rlbatch.commands.options", "rlbatch.engine", "rlbatch.serving",
                              "rlbatch.tools"))}
    assert not heavy, sorted(heavy)


def test_a_command_imports_only_what_it_uses() -> None:
    loaded = _modules_after(["simulate", "--help"])
    assert "rlbatch.commands.simulate" in loaded and "rlbatch.engine.sim" in loaded
    others = {"rlbatch.commands.evaluate", "rlbatch.commands.sweep", "rlbatch.commands.fidelity",
              "rlbatch.commands.calibrate", "rlbatch.engine.vllm.engine",
              "rlbatch.engine.vllm.launch", "rlbatch.engine.telemetry", "rlbatch.tools.sweep",
              "rlbatch.tools.calibrate", "rlbatch.sidecar", "scipy", "torch", "ray"}
    assert not loaded & others, sorted(loaded & others)


def test_command_list_is_the_commands_own_help() -> None:
    """The one-line help ``rlbatch --help`` prints without importing the commands is the one
    each command registers."""
    from rlbatch.commands.main import build_parser

    assert build_parser("").format_help() == build_parser().format_help()
