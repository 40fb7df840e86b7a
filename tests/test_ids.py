"""The id rule (shadecache/ids.py) every batched entry point applies: integers of any integer
type, in 0..n-1; a bool, float or string is refused naming it, and an id out of range is named as
it was given (not as it reads once cast to int64)."""
import numpy as np
import pytest
import torch

from shadecache.ids import check_ids


@pytest.mark.parametrize("ids", [[1, 2], (np.int32(1), np.uint8(2)), np.array([1, 2], np.uint64),
                                 torch.tensor([1, 2]), [[1], [2]]])
def test_integers_of_any_type_and_shape_pass_as_int64(ids):
    a = check_ids(ids, 10)
    assert a.dtype == np.int64 and a.tolist() == [1, 2]


@pytest.mark.parametrize("ids, named", [([1, True], "True"), ((np.True_, 2), "np.True_"),
                                        ([[1, 2], [False, 3]], "False"), ([1, 2.0], "2.0"),
                                        (["3"], "'3'"), (np.array([True]), "True")])
def test_a_bool_float_or_string_is_not_an_id(ids, named):
    with pytest.raises(TypeError, match=f"sample ids must be integers, got {named}"):
        check_ids(ids, 10)


@pytest.mark.parametrize("ids, named", [(np.array([3, 2 ** 63], np.uint64), 2 ** 63),
                                        (np.array([2 ** 64 - 1], np.uint64), 2 ** 64 - 1),
                                        ([2 ** 70], 2 ** 70), ([-2 ** 70], -2 ** 70), ([10], 10),
                                        ([0, -1], -1)])
def test_an_id_out_of_range_is_named_as_given(ids, named):
    with pytest.raises(IndexError, match=f"sample id {named} is out of range 0..9"):
        check_ids(ids, 10)


def test_an_empty_batch_is_an_empty_int64_array():
    for ids in ([], (), np.empty(0, np.float32), torch.empty(0)):
        a = check_ids(ids, 10)
        assert a.dtype == np.int64 and a.size == 0
