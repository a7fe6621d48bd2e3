"""Every rule of fla/utils/validation.py: the exception type, and a message that names the
argument, the expected value and the value given."""
import re

import pytest
import torch

from fla.utils.validation import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    Dims,
    check_cu_seqlens,
    check_dtype,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_scale,
    check_shape,
    check_tensor,
    check_time_major,
    token_layout,
)

pytestmark = pytest.mark.no_poison


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def m(text: str) -> str:
    """A literal piece of an error message, for ``pytest.raises(match=...)``."""
    return re.escape(text)


# ---------------------------------------------------------------- check_tensor / dtype
def test_check_tensor_accepts_and_returns_the_tensor():
    for dtype in FLOAT_DTYPES:
        x = t(2, 3, dtype=dtype)
        assert check_tensor("q", x, ndim=2) is x
    assert check_tensor("idx", t(4, dtype=torch.int64), dtypes=None) is not None


@pytest.mark.parametrize("value, type_name", [([1.0, 2.0], "list"), (None, "NoneType"),
                                              (3.0, "float")])
def test_check_tensor_refuses_a_non_tensor(value, type_name):
    with pytest.raises(TypeError, match=m("q: expected a torch.Tensor, got " + type_name)):
        check_tensor("q", value)


@pytest.mark.parametrize("dtype, name", [(torch.int32, "int32"), (torch.int64, "int64"),
                                         (torch.float64, "float64")])
def test_check_tensor_refuses_a_dtype_outside_the_allowed_ones(dtype, name):
    with pytest.raises(TypeError, match=m(f"k: expected dtype in (float32, float16, bfloat16), "
                                          f"got {name}")):
        check_tensor("k", t(2, 3, dtype=dtype))


def test_check_dtype_names_a_custom_allowed_set():
    with pytest.raises(TypeError, match=m("g: expected dtype in (float32), got float16")):
        check_dtype("g", t(2, dtype=torch.float16), (torch.float32,))


def test_check_dtype_names_the_tensor_to_match():
    with pytest.raises(TypeError, match=m("k: expected the dtype of q (float16), got float32")):
        check_dtype("k", t(2), (torch.float16,), what="the dtype of q")


def test_check_tensor_refuses_the_wrong_number_of_dims():
    with pytest.raises(ValueError, match=m("v: expected a 4-D tensor, got 3-D with shape "
                                           "(2, 3, 5)")):
        check_tensor("v", t(2, 3, 5), ndim=4)


# ------------------------------------------------------------------------ check_shape
def test_check_shape_binds_letters_and_remembers_their_source():
    dims = Dims()
    check_shape("q", t(2, 7, 3, 16), "B T H K", dims)
    check_shape("v", t(2, 7, 3, 32), "B T H V", dims)
    assert dims == {"B": 2, "T": 7, "H": 3, "K": 16, "V": 32}
    assert dims.source["T"] == "q" and dims.source["V"] == "v"


def test_check_shape_refuses_the_wrong_rank():
    with pytest.raises(ValueError, match=m("k: expected a 4-D tensor of shape [B, T, H, K], "
                                           "got 3-D with shape (2, 7, 16)")):
        check_shape("k", t(2, 7, 16), "B T H K", Dims())


def test_check_shape_letter_mismatch_names_both_arguments_and_both_sizes():
    dims = Dims()
    check_shape("q", t(2, 7, 3, 16), "B T H K", dims)
    with pytest.raises(ValueError) as info:
        check_shape("k", t(2, 9, 3, 16), "B T H K", dims)
    text = str(info.value)
    assert text.startswith("k: ")
    assert "expected shape [B, T, H, K] = [2, 7, 3, 16]" in text
    assert "got (2, 9, 3, 16)" in text
    assert "T is 9 here but 7 in q" in text


def test_check_shape_fixed_digit_size():
    check_shape("beta", t(2, 7, 1), "B T 1", Dims())
    with pytest.raises(ValueError, match=m("beta: expected size 1 at dim 2 of [B, T, 1], got "
                                           "shape (2, 7, 4)")):
        check_shape("beta", t(2, 7, 4), "B T 1", Dims())


def test_check_shape_against_sizes_fixed_by_the_caller():
    dims = Dims(K=64)
    check_shape("q", t(1, 5, 2, 64), "B T H K", dims)
    with pytest.raises(ValueError) as info:
        check_shape("q", t(1, 5, 2, 32), "B T H K", Dims(K=64))
    text = str(info.value)
    assert text.startswith("q: ") and "[B, T, H, K] = [1, 5, 2, 64]" in text
    assert "K is 32 here but 64 in the caller" in text


def test_token_layout_swaps_t_and_h_for_head_first():
    assert token_layout("B T H K", head_first=False) == "B T H K"
    assert token_layout("B T H K", head_first=True) == "B H T K"
    assert token_layout("N H K V", head_first=True) == "N H K V"  # no T: unchanged


# ------------------------------------------------------------------- check_time_major
def test_time_major_refuses_a_head_first_tensor():
    x = t(2, 4, 1024, 64)  # [B, H, T, D] passed as [B, T, H, D]
    with pytest.raises(ValueError) as info:
        check_time_major("q", x, head_first=False)
    text = str(info.value)
    assert text.startswith("q: shape (2, 4, 1024, 64) read as [B, T, H, ...]")
    assert "T = 4 tokens and H = 1024 heads" in text
    assert "head width 64" in text
    assert "looks like a [B, H, T, ...] tensor" in text
    assert "Expected [B, T, H, ...]; pass head_first=True" in text


def test_head_first_refuses_a_time_major_tensor():
    x = t(2, 1024, 4, 64)  # [B, T, H, D] passed as [B, H, T, D]
    with pytest.raises(ValueError) as info:
        check_time_major("k", x, head_first=True)
    text = str(info.value)
    assert text.startswith("k: shape (2, 1024, 4, 64) read as [B, H, T, ...]")
    assert "T = 4 tokens and H = 1024 heads" in text
    assert "looks like a [B, T, H, ...] tensor" in text
    assert "pass head_first=False" in text


@pytest.mark.parametrize("shape", [(8, 1, 32, 128),   # decode: one token, 32 heads
                                   (1, 16, 96, 128),  # short prefill with many heads
                                   (2, 1024, 4, 64),  # ordinary time-major call
                                   (4, 2, 8, 16),     # fewer heads than the head width
                                   (1, 32, 32, 16),   # as many tokens as heads
                                   (1, 4, 64, 64)])   # as many heads as the head width
def test_time_major_accepts_real_shapes(shape):
    check_time_major("q", t(*shape), head_first=False)
    # The same tensors, transposed to head-first and declared so, are accepted too.
    check_time_major("q", t(*shape).transpose(1, 2), head_first=True)


@pytest.mark.parametrize("shape", [(1, 31, 32, 16), (1, 4, 65, 64)])
def test_time_major_refuses_just_past_the_boundary(shape):
    with pytest.raises(ValueError, match=m(f"q: shape {shape} read as [B, T, H, ...]")):
        check_time_major("q", t(*shape), head_first=False)


def test_time_major_three_dim_gate_uses_the_head_dims():
    g = t(1, 1, 32)  # a decode-time gate [B, T, H]: no head width of its own
    with pytest.raises(ValueError, match=m("g: shape (1, 1, 32) read as [B, T, H, ...]")):
        check_time_major("g", g, head_first=False)
    check_time_major("g", g, head_first=False, head_dims=(128,))


# ------------------------------------------------------------------ check_same_device
def test_same_device_returns_it_and_skips_none():
    assert check_same_device(q=t(2), k=t(2), h0=None) == torch.device("cpu")


def test_same_device_names_both_arguments_and_devices():
    with pytest.raises(ValueError, match=m("k: expected device cpu (the device of q), got meta")):
        check_same_device(q=t(2), g=None, k=t(2, device="meta"))


def test_same_device_with_nothing_given():
    with pytest.raises(ValueError, match="no tensor given"):
        check_same_device(q=None)


# --------------------------------------------------------------------- check_head_dim
def test_head_dim_limits():
    check_head_dim("q", 1)
    check_head_dim("q", MAX_HEAD_DIM)
    with pytest.raises(ValueError, match=m(f"q: head dimension K = {MAX_HEAD_DIM + 1} is over "
                                           f"the limit; expected K <= {MAX_HEAD_DIM}")):
        check_head_dim("q", MAX_HEAD_DIM + 1)
    with pytest.raises(ValueError, match=m("v: head dimension V = 100 is over the limit; "
                                           "expected V <= 64")):
        check_head_dim("v", 100, letter="V", limit=64)
    with pytest.raises(ValueError, match=m("v: expected head dimension V >= 1, got 0")):
        check_head_dim("v", 0, letter="V")


# -------------------------------------------------------------- check_positive_length
@pytest.mark.parametrize("shape, letter, what", [((2, 0, 3, 16), "T", "sequence length"),
                                                 ((0, 7, 3, 16), "B", "batch size"),
                                                 ((2, 7, 0, 16), "H", "number of heads")])
def test_positive_length_refuses_empty(shape, letter, what):
    dims = Dims()
    check_shape("q", t(*shape), "B T H K", dims)
    with pytest.raises(ValueError, match=m(f"q: expected {what} {letter} >= 1, got "
                                           f"{letter} = 0")):
        check_positive_length(dims)


def test_positive_length_accepts_nonempty_and_fixed_dims():
    dims = Dims()
    check_shape("q", t(1, 1, 1, 16), "B T H K", dims)
    check_positive_length(dims)
    with pytest.raises(ValueError, match=m("the caller: expected sequence length T >= 1, "
                                           "got T = 0")):
        check_positive_length(Dims(B=1, T=0))


def test_positive_length_checks_only_the_letters_asked_for():
    dims = Dims(b=0, G=0, K=0)
    check_positive_length(dims)  # none of the default letters is bound
    check_positive_length(dims, "T")
    with pytest.raises(ValueError, match=m("expected number of groups G >= 1, got G = 0")):
        check_positive_length(dims, "G")
    with pytest.raises(ValueError, match=m("expected size K >= 1, got K = 0")):
        check_positive_length(dims, "K")


# ------------------------------------------------------------------- check_cu_seqlens
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cu_seqlens_accepted_and_returned_as_host_list(dtype):
    values = check_cu_seqlens(torch.tensor([0, 3, 10, 12], dtype=dtype), T=12, B=1)
    assert values == [0, 3, 10, 12]
    assert type(values) is list and all(type(v) is int for v in values)


def test_cu_seqlens_none_is_none():
    assert check_cu_seqlens(None, T=5, B=3) is None


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"), (torch.int16, "int16")])
def test_cu_seqlens_refuses_other_dtypes(dtype, name):
    with pytest.raises(TypeError, match=m(f"cu_seqlens: expected dtype in (int32, int64), got "
                                          f"{name}")):
        check_cu_seqlens(torch.tensor([0, 4], dtype=dtype), T=4, B=1)


def test_cu_seqlens_refuses_a_list():
    with pytest.raises(TypeError, match=m("cu_seqlens: expected a 1-D torch.Tensor of "
                                          "int32/int64, got list")):
        check_cu_seqlens([0, 4], T=4, B=1)


@pytest.mark.parametrize("value, shape", [([[0, 4]], "(1, 2)"), ([0], "(1,)")])
def test_cu_seqlens_refuses_bad_shapes(value, shape):
    with pytest.raises(ValueError, match=m(f"cu_seqlens: expected a 1-D tensor of N + 1 >= 2 "
                                           f"offsets, got shape {shape}")):
        check_cu_seqlens(torch.tensor(value), T=4, B=1)


def test_cu_seqlens_must_start_at_zero():
    with pytest.raises(ValueError, match=m("cu_seqlens: expected the first offset to be 0, "
                                           "got 2")):
        check_cu_seqlens(torch.tensor([2, 4, 8]), T=8, B=1)


@pytest.mark.parametrize("value, pair, positions", [([0, 4, 4, 8], "4 then 4", "1, 2"),
                                                     ([0, 5, 3, 8], "5 then 3", "1, 2")])
def test_cu_seqlens_must_increase_strictly(value, pair, positions):
    with pytest.raises(ValueError, match=m(f"cu_seqlens: expected strictly increasing offsets, "
                                           f"got {pair} at positions {positions}")):
        check_cu_seqlens(torch.tensor(value), T=8, B=1)


def test_cu_seqlens_must_end_at_t():
    with pytest.raises(ValueError, match=m("cu_seqlens: expected the last offset to equal the "
                                           "packed length T = 10, got 8")):
        check_cu_seqlens(torch.tensor([0, 4, 8]), T=10, B=1)


def test_cu_seqlens_needs_a_single_row():
    with pytest.raises(ValueError, match=m("cu_seqlens: packed sequences need the batch size "
                                           "B == 1 (all sequences concatenated along T), got "
                                           "B = 2")):
        check_cu_seqlens(torch.tensor([0, 4, 8]), T=8, B=2)


def test_cu_seqlens_uses_the_given_name():
    with pytest.raises(ValueError, match=m("offsets: expected the first offset to be 0")):
        check_cu_seqlens(torch.tensor([1, 4]), T=4, B=1, name="offsets")


# ------------------------------------------------------------------------ check_scale
def test_scale_default_and_values():
    assert check_scale(None, 0.125) == 0.125
    assert check_scale(2, 0.125) == 2.0 and type(check_scale(2, 0.125)) is float
    assert check_scale(torch.tensor(0.5), 1.0) == 0.5


@pytest.mark.parametrize("value, type_name", [("0.1", "str"), (True, "bool"),
                                              ([0.1], "list")])
def test_scale_refuses_non_numbers(value, type_name):
    with pytest.raises(TypeError, match=m(f"scale: expected a float, got {type_name}")):
        check_scale(value, 1.0)


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"),
                                          (float("-inf"), "-inf")])
def test_scale_refuses_non_finite(value, shown):
    with pytest.raises(ValueError, match=m(f"scale: expected a finite number, got {shown}")):
        check_scale(value, 1.0)


def test_scale_refuses_a_tensor_of_several_values():
    with pytest.raises(ValueError, match=m("scale: expected a number, got a tensor of shape "
                                           "(2,)")):
        check_scale(torch.tensor([0.1, 0.2]), 1.0)


def test_cu_seqlens_is_read_once_per_tensor_and_again_after_a_change(monkeypatch):
    from fla.utils import validation

    reads = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(1)
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    cu = torch.tensor([0, 3, 10])
    for _ in range(5):
        assert validation.check_cu_seqlens(cu, T=10, B=1) == [0, 3, 10]
    assert len(reads) == 1
    cu[1] = 4                                    # in-place change: read again
    assert validation.check_cu_seqlens(cu, T=10, B=1) == [0, 4, 10]
    assert len(reads) == 2
    cu[2] = 9                                    # and a now-invalid value is still refused
    with pytest.raises(ValueError, match="last offset"):
        validation.check_cu_seqlens(cu, T=10, B=1)
