"""tapas.sharding.rules: the per-op sharding rules, on hand-made ops (pure: no TensorFlow).

The rules on captured models are exercised by tests/test_patterns.py and checked
numerically by tests/test_pattern_checker.py."""

from __future__ import annotations

from typing import Any

import pytest

from tapas.ir import OpInfo, TensorInfo
from tapas.sharding import rules
from tapas.sharding.rules.shape import reshape_labels
from tapas.sharding.rules.spec import Fresh


def _spec(op_type: str, ins: list[tuple[int, ...] | None], outs: list[tuple[int, ...]],
          attrs: dict[str, Any] | None = None,
          consts: dict[int, Any] | None = None) -> rules.OpSpec | str:
    op = OpInfo("op", op_type, tuple(f"i{k}:0" for k in range(len(ins))),
                tuple(TensorInfo(f"op:{k}", s, "float32") for k, s in enumerate(outs)),
                attrs or {})
    ctx = rules.OpContext(tuple(ins), tuple(outs), lambda i: (consts or {}).get(i))
    return rules.spec_for(op, ctx)


def test_matmul_is_an_einsum_with_a_summed_contraction() -> None:
    spec = _spec("MatMul", [(8, 16), (16, 32)], [(8, 32)])
    assert spec.inputs == (("m", "k"), ("k", "n")) and spec.outputs == (("m", "n"),)
    assert spec.reduce == "sum" and spec.linear == (0, 1) and spec.flops == "contract"
    t = _spec("MatMul", [(16, 8), (32, 16)], [(8, 32)],
              {"transpose_a": True, "transpose_b": True})
    assert t.inputs == (("k", "m"), ("n", "k"))


def test_broadcast_dimensions_get_labels_of_their_own() -> None:
    spec = _spec("AddV2", [(4, 8), (1, 8)], [(4, 8)])
    (a0, a1), (b0, b1) = spec.inputs
    assert spec.outputs[0] == (a0, a1) and b1 == a1 and b0 != a0
    assert spec.linear == "all"


def test_softmax_axis_and_conv_space_are_never_split() -> None:
    sm = _spec("Softmax", [(4, 8)], [(4, 8)])
    assert sm.no_split == {sm.inputs[0][-1]}
    conv = _spec("Conv2D", [(2, 8, 8, 4), (3, 3, 4, 6)], [(2, 6, 6, 6)])
    x, k = conv.inputs
    assert {x[1], x[2], k[0], k[1]} <= conv.no_split and x[0] not in conv.no_split
    assert x[3] == k[2] and conv.reduce == "sum"     # input channels: a partial sum


def test_reshape_keeps_the_leading_factor_of_a_merge() -> None:
    src, dst, no = reshape_labels((4, 8, 6), (32, 6), Fresh())
    assert src[0] == dst[0] and src[0] not in no     # a split of 4 stays a split of 32
    assert src[1] in no and src[2] == dst[1]
    with pytest.raises(ValueError, match="element counts differ"):
        reshape_labels((4, 8), (5, 8), Fresh())


def test_mean_and_gather_need_rewrites() -> None:
    assert _spec("Mean", [(4, 8), None], [(4,)], consts={1: 1}).reduce == "mean"
    assert _spec("GatherV2", [(16, 8), (4,), None], [(4, 8)], consts={2: 0}).reduce == "gather"
    assert _spec("Max", [(4, 8), None], [(4,)], consts={1: [1]}).reduce == "none"


def test_strided_slice_keeps_only_whole_axes() -> None:
    spec = _spec("StridedSlice", [(4, 8, 6), None, None, None], [(4, 6)],
                 {"shrink_axis_mask": 2, "end_mask": 5}, {1: [0, 3, 0], 2: [0, 4, 0], 3: [1, 1, 1]})
    x = spec.inputs[0]
    assert spec.outputs[0] == (x[0], x[2]) and x[1] in spec.no_split


def test_strided_slice_keeps_the_axes_its_ellipsis_covers() -> None:
    # x[..., 96:] of a fused q/k/v projection (Llama-style): batch and sequence are whole
    spec = _spec("StridedSlice", [(4, 16, 128), None, None, None], [(4, 16, 32)],
                 {"ellipsis_mask": 1, "end_mask": 2}, {1: [0, 96], 2: [0, 0], 3: [1, 1]})
    x = spec.inputs[0]
    assert spec.outputs[0][:2] == x[:2] and not {x[0], x[1]} & spec.no_split
    assert x[2] in spec.no_split and spec.outputs[0][2] != x[2]
    # x[..., 1] (TopK's second index): the last axis shrunk, the others kept
    top = _spec("StridedSlice", [(2, 16, 2), None, None, None], [(2, 16)],
                {"ellipsis_mask": 1, "shrink_axis_mask": 2}, {1: [0, 1], 2: [0, 2], 3: [1, 1]})
    t = top.inputs[0]
    assert top.outputs[0] == t[:2] and not {t[0], t[1]} & top.no_split
    # a new axis after the ellipsis takes no input axis: x[..., None]
    new = _spec("StridedSlice", [(4, 8), None, None, None], [(4, 8, 1)],
                {"ellipsis_mask": 1, "new_axis_mask": 2}, {1: [0, 0], 2: [0, 0], 3: [1, 1]})
    n = new.inputs[0]
    assert new.outputs[0][:2] == n and not set(n) & new.no_split


def test_tile_with_multiples_computed_in_the_graph_keeps_axes_of_unchanged_size() -> None:
    # Keras's repeat of the key/value heads (grouped-query attention): multiples from a Pack
    spec = _spec("Tile", [(4, 16, 2, 1, 16), None], [(4, 16, 2, 2, 16)])
    x = spec.inputs[0]
    assert spec.outputs[0][:3] == x[:3] and not set(x[:3]) & spec.no_split
    assert x[3] in spec.no_split
    known = _spec("Tile", [(4, 8), None], [(4, 16)], consts={1: [1, 2]})
    assert known.inputs[0][1] in known.no_split and known.inputs[0][0] not in known.no_split


def test_a_gather_with_batch_dims_has_no_spec() -> None:
    # take_along_axis (DeBERTa's relative positions): split with its indices broadcast,
    # the gradient TensorFlow builds for it does not match the shards (tried 2026-11-29)
    why = _spec("GatherV2", [(4, 16, 32), (4,), None], [(4, 32)], {"batch_dims": 1}, {2: 1})
    assert isinstance(why, str) and "batch_dims" in why


def test_an_image_resize_keeps_batch_and_channels_and_never_splits_space() -> None:
    spec = _spec("ResizeBilinear", [(2, 8, 8, 4), None], [(2, 16, 16, 4)])
    (b, h, w, c), out = spec.inputs[0], spec.outputs[0]
    assert out[0] == b and out[3] == c and {h, w, out[1], out[2]} <= spec.no_split
    assert spec.inputs[1] is None and spec.linear == (0,)


def test_why_an_op_has_no_spec() -> None:
    assert _spec("FooBar", [(4,)], [(4,)]) == "op 'op' has type FooBar, which has no placement rule"
    why = _spec("Transpose", [(4, 8), None], [(8, 4)])
    assert "cannot read its attributes or constants" in why and "permutation" in why


def test_one_table_names_every_rule() -> None:
    """Every rule of the package is reachable from RULES, and the op tables agree with it."""
    assert all(callable(r) for r in rules.RULES.values())
    assert rules.CONTRACTION_OPS <= set(rules.RULES)
    assert {"MatMul", "Reshape", "GatherV2", "FusedBatchNormV3", "Shape"} <= set(rules.RULES)
