"""The sharded safetensors layout of distributed checkpoints (`runtime/distributed/shards.py`):
pieces written by some ranks are read back into any other split of the same tensors (what a
resume at another dp does), assembled whole (what export does), and a malformed index or a
region the pieces do not cover is one UserError line."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from safetensors import safe_open

from lengthwise.errors import UserError
from lengthwise.runtime.distributed.shards import Local, PieceReader, read_index, write_pieces


def _rows(tensor: torch.Tensor, parts: int) -> list[tuple[int, torch.Tensor]]:
    """(first row, rows) of `tensor` cut as torch.chunk cuts it (FSDP2's dim-0 shards)."""
    out, start = [], 0
    for piece in torch.chunk(tensor, parts):
        out.append((start, piece))
        start += piece.shape[0]
    return out


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    weights = {"model.w": torch.randn(7, 5, dtype=torch.float64), "model.b": torch.randn(3).to(torch.bfloat16),
               "optim.state.w.step": torch.tensor(4.0)}
    for rank in range(2):
        pieces = [Local(key, rows, (start, *[0] * (t.dim() - 1)), tuple(t.shape))
                  for key, t in weights.items() if t.dim() for start, rows in [_rows(t, 2)[rank]]]
        if rank == 0:
            pieces.append(Local("optim.state.w.step", weights["optim.state.w.step"], (), ()))
        write_pieces(tmp_path, rank, pieces, {"optim.param_groups.w.betas": {"tuple": [0.9, 0.95]}})
    return tmp_path, weights


def test_pieces_of_two_ranks_load_into_three_row_shards_and_a_column_split(saved):
    folder, weights = saved
    index, values = read_index(folder)
    assert values[1] == {"optim.param_groups.w.betas": {"tuple": [0.9, 0.95]}}
    with PieceReader(folder, index) as reader:
        for start, rows in _rows(weights["model.w"], 3):
            target = torch.zeros_like(rows)
            reader.fill("model.w", target, (start, 0), (7, 5))
            assert torch.equal(target, rows)
        columns = torch.zeros(7, 2, dtype=torch.float64)
        reader.fill("model.w", columns, (0, 3), (7, 5))
        assert torch.equal(columns, weights["model.w"][:, 3:])
        assert all(torch.equal(reader.whole(k), t) for k, t in weights.items())


def test_the_files_are_plain_safetensors_and_json(saved):
    folder, weights = saved
    with safe_open(str(folder / "shards-1.safetensors"), framework="pt") as handle:
        assert torch.equal(handle.get_tensor("model.w"), _rows(weights["model.w"], 2)[1][1])
    assert json.loads((folder / "shards-1.json").read_text())["tensors"]["model.w"]["offsets"] == [4, 0]


def test_a_region_no_piece_covers_is_one_line(saved):
    folder, _ = saved
    (folder / "shards-1.json").unlink()
    (folder / "shards-1.safetensors").unlink()
    with PieceReader(folder, read_index(folder)[0]) as reader, pytest.raises(UserError) as caught:
        reader.fill("model.w", torch.zeros(7, 5, dtype=torch.float64), (0, 0), (7, 5))
    assert "cover 20 of the 35 elements" in str(caught.value) and "\n" not in str(caught.value)


def test_another_global_shape_is_refused_by_name(saved):
    folder, _ = saved
    with PieceReader(folder, read_index(folder)[0]) as reader, pytest.raises(UserError, match="model.w of shape"):
        reader.fill("model.w", torch.zeros(8, 5, dtype=torch.float64), (0, 0), (8, 5))


@pytest.mark.parametrize("entry", [{"offsets": [5, 0], "shape": [4, 5], "global_shape": [7, 5], "dtype": "F64"},
                                   {"offsets": "x"}])
def test_a_malformed_index_is_one_line(saved, entry):
    folder, _ = saved
    body = json.loads((folder / "shards-1.json").read_text())
    body["tensors"]["model.w"] = entry
    (folder / "shards-1.json").write_text(json.dumps(body))
    with pytest.raises(UserError) as caught:
        read_index(folder)
    assert "shards-1.json" in str(caught.value) and "\n" not in str(caught.value)


def test_a_file_that_disagrees_with_its_index_is_one_line(saved):
    folder, _ = saved
    body = json.loads((folder / "shards-1.json").read_text())
    body["tensors"]["model.w"]["shape"] = [2, 5]
    (folder / "shards-1.json").write_text(json.dumps(body))
    with PieceReader(folder, read_index(folder)[0]) as reader, pytest.raises(UserError) as caught:
        reader.whole("model.w")
    assert "shards-1.safetensors: cannot read model.w" in str(caught.value)


def test_overlapping_pieces_of_other_splits_are_read_once_each_element(tmp_path):
    """A heterogeneous run: one pipeline writes a parameter whole, another its two TP halves."""
    whole = torch.arange(12.0).reshape(4, 3)
    write_pieces(tmp_path, 0, [Local("model.w", whole, (0, 0), (4, 3))], {})
    write_pieces(tmp_path, 1, [Local("model.w", whole[:, :2].contiguous(), (0, 0), (4, 3)),
                               Local("model.v", whole[:, 2:].contiguous(), (0, 2), (4, 3))], {})
    with PieceReader(tmp_path, read_index(tmp_path)[0]) as reader:
        assert torch.equal(reader.whole("model.w"), whole)
        part = torch.zeros(2, 3)
        reader.fill("model.w", part, (1, 0), (4, 3))
        assert torch.equal(part, whole[1:3])
