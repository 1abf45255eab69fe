"""Trace names that travel in artifacts, and the pool text round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbatch.engine.config import format_pools, parse_pools
from rlbatch.paths import resolve_trace_ref, trace_ref, traces_dir


def test_trace_ref_is_relative_to_the_traces_folder(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("RLBATCH_TRACES_DIR", str(tmp_path / "traces"))
    (tmp_path / "traces" / "sub").mkdir(parents=True)
    inside = tmp_path / "traces" / "sub" / "t.csv"
    inside.write_text("x")
    assert trace_ref(inside) == "sub/t.csv"
    assert resolve_trace_ref("sub/t.csv") == traces_dir() / "sub" / "t.csv"
    outside = tmp_path / "mine.csv"
    assert trace_ref(outside) == str(outside)
    assert resolve_trace_ref(str(outside)) == outside


def test_shipped_artifact_names_no_machine_path() -> None:
    text = (Path(__file__).resolve().parents[1] / "policies/default/policy.json").read_text()
    assert '"azure_conv_2023.csv"' in text
    assert "/shared/data/traces/" not in text


@pytest.mark.parametrize("text", ["fp16", "fp8", "fp16:1,fp8:1", "fp16:2,fp8:3", "fp8,fp16"])
def test_pools_round_trip(text: str) -> None:
    pools = parse_pools(text)
    assert parse_pools(format_pools(pools)) == pools
