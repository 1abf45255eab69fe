"""Reader for vidur's per-layer operator timing CSVs (``data/profiling/compute/*/mlp.csv``).

Each row is one ``(num_tokens, num_tensor_parallel_workers)`` point; ``time_stats.<op>.median``
is in milliseconds; the model shape comes from the row's own columns (``n_head``,
``n_kv_head``, ``n_embd``, ``n_expanded_embd``, ``use_gated_mlp``), never from the file name.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from rlbatch.profiles.roofline import ACTIVATION_BYTES, dense_linear_shapes, linear_op_time_s
from rlbatch.profiles.specs import GpuSpec, ProfileError

__all__ = [
    "ELEMENTWISE_OPS",
    "LINEAR_OPS",
    "SHAPE_COLUMNS",
    "VidurTable",
    "elementwise_bytes",
    "predict_linear_ops",
    "read_vidur_csv",
]

LINEAR_OPS: tuple[str, ...] = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj",
                               "mlp_down_proj")
"""vidur's four GEMMs of a layer: fused QKV, attention output, MLP (gate+)up, MLP down."""

ELEMENTWISE_OPS: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm", "attn_rope",
                                    "mlp_act")
"""Memory-bound kernels used to fit the elementwise efficiency (``add`` and ``emb`` are
left out: vLLM fuses the residual add into the norm, and ``emb`` includes vocab masking)."""

SHAPE_COLUMNS: tuple[str, ...] = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd",
                                  "use_gated_mlp", "num_tokens", "num_tensor_parallel_workers")


@dataclass(frozen=True, slots=True)
class VidurTable:
    """The rows of one vidur CSV as arrays (one entry per row).

    :param path: the file read.
    :param n_head: query heads.
    :param n_kv_head: key/value heads.
    :param n_embd: model width.
    :param n_expanded_embd: MLP width.
    :param gated_mlp: gated (SwiGLU) MLP.
    :param num_tokens: tokens of the measured batch.
    :param tp: tensor-parallel degree.
    :param times_s: op name -> median time in seconds.
    """

    path: Path
    n_head: npt.NDArray[np.int64]
    n_kv_head: npt.NDArray[np.int64]
    n_embd: npt.NDArray[np.int64]
    n_expanded_embd: npt.NDArray[np.int64]
    gated_mlp: npt.NDArray[np.bool_]
    num_tokens: npt.NDArray[np.int64]
    tp: npt.NDArray[np.int64]
    times_s: dict[str, npt.NDArray[np.float64]]

    def __len__(self) -> int:
        return int(self.num_tokens.shape[0])

    def shape_groups(self) -> list[tuple[tuple[int, int, int, int, bool, int],
                                         npt.NDArray[np.intp]]]:
        """Rows grouped by model shape and TP degree.

        Returns ``[((n_head, n_kv_head, n_embd, n_expanded_embd, gated, tp), row_indices)]``.
        """
        keys = np.stack([self.n_head, self.n_kv_head, self.n_embd, self.n_expanded_embd,
                         self.gated_mlp.astype(np.int64), self.tp], axis=1)
        uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
        out: list[tuple[tuple[int, int, int, int, bool, int], npt.NDArray[np.intp]]] = []
        for i, row in enumerate(uniq):
            key = (int(row[0]), int(row[1]), int(row[2]), int(row[3]), bool(row[4]),
                   int(row[5]))
            out.append((key, np.flatnonzero(inverse.ravel() == i)))
        return out


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def read_vidur_csv(path: Path | str, ops: Sequence[str] = LINEAR_OPS) -> VidurTable:
    """Read a vidur operator-timing CSV, checking every needed column.

    :param path: the CSV file.
    :param ops: ops whose ``time_stats.<op>.median`` column is required and read.
    :raises ProfileError: missing file, missing column (named), or unparsable/invalid value
        (file, row and column named).
    """
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such file")
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        needed = [*SHAPE_COLUMNS, *(f"time_stats.{op}.median" for op in ops)]
        missing = [c for c in needed if c not in header]
        if missing:
            raise ProfileError(f"{path}: missing column(s) {', '.join(missing)}")
        ints: dict[str, list[int]] = {c: [] for c in SHAPE_COLUMNS if c != "use_gated_mlp"}
        gated: list[bool] = []
        times: dict[str, list[float]] = {op: [] for op in ops}
        for line_no, row in enumerate(reader, start=2):
            column = ""
            try:
                for column in ints:
                    value = int(float(row[column]))
                    if value < 1:
                        raise ValueError("must be >= 1")
                    ints[column].append(value)
                column = "use_gated_mlp"
                gated.append(_parse_bool(row[column]))
                for op in ops:
                    column = f"time_stats.{op}.median"
                    ms = float(row[column])
                    if not ms > 0.0:
                        raise ValueError("must be > 0")
                    times[op].append(ms * 1e-3)
            except (TypeError, ValueError) as exc:
                raise ProfileError(f"{path}: line {line_no}, column {column!r}: "
                                   f"bad value {row.get(column)!r} ({exc})") from exc
    if not gated:
        raise ProfileError(f"{path}: no data rows")
    return VidurTable(
        path=path,
        n_head=np.array(ints["n_head"], dtype=np.int64),
        n_kv_head=np.array(ints["n_kv_head"], dtype=np.int64),
        n_embd=np.array(ints["n_embd"], dtype=np.int64),
        n_expanded_embd=np.array(ints["n_expanded_embd"], dtype=np.int64),
        gated_mlp=np.array(gated, dtype=np.bool_),
        num_tokens=np.array(ints["num_tokens"], dtype=np.int64),
        tp=np.array(ints["num_tensor_parallel_workers"], dtype=np.int64),
        times_s={op: np.array(v, dtype=np.float64) for op, v in times.items()},
    )


def predict_linear_ops(table: VidurTable, gpu: GpuSpec) -> dict[str, npt.NDArray[np.float64]]:
    """Predicted per-layer time (seconds) of each of :data:`LINEAR_OPS` for every row, with
    the step-time model's own GEMM cost (:func:`linear_op_time_s`, fp16 weights).

    :param table: the measured rows (their shape columns define the GEMMs).
    :param gpu: GPU profile whose peaks and efficiency are used.
    """
    out = {op: np.zeros(len(table), dtype=np.float64) for op in LINEAR_OPS}
    for (heads, kv_heads, hidden, ff, gated, tp), idx in table.shape_groups():
        shapes = dense_linear_shapes(hidden, heads, kv_heads, hidden // heads, ff, gated, tp)
        tokens = table.num_tokens[idx].astype(np.float64)
        for op in LINEAR_OPS:
            in_f, out_f = shapes[op]
            out[op][idx] = linear_op_time_s(tokens, in_f, out_f, gpu, 2.0)
    return out


def elementwise_bytes(table: VidurTable) -> dict[str, npt.NDArray[np.float64]]:
    """Bytes read + written by each of :data:`ELEMENTWISE_OPS` for every row (fp16):
    RMSNorm ``2 * hidden``, rope ``2 * (heads + kv_heads)/tp * head_dim`` (q and k in place),
    activation ``3 * ff/tp`` gated (read gate+up, write) or ``2 * ff/tp``; times tokens.

    :param table: the measured rows.
    """
    tokens = table.num_tokens.astype(np.float64)
    hidden = table.n_embd.astype(np.float64)
    head_dim = table.n_embd // table.n_head
    heads = table.n_head // table.tp
    kv_heads = np.maximum(1, table.n_kv_head // table.tp)
    ff = (table.n_expanded_embd // table.tp).astype(np.float64)
    act_mats = np.where(table.gated_mlp, 3.0, 2.0)
    norm = 2.0 * hidden
    values = {
        "input_layernorm": norm,
        "post_attention_layernorm": norm,
        "attn_rope": 2.0 * ((heads + kv_heads) * head_dim).astype(np.float64),
        "mlp_act": act_mats * ff,
    }
    return {op: tokens * v * ACTIVATION_BYTES for op, v in values.items()}
